import dataclasses

import pytest
import torch
from torch import nn

import slimact.functional as sf
from _harness import FLOAT_DTYPES, check_against_plain, non_contiguous, saved_ratio, upstream_loss
from slimact._metrics import sqnr_db
from slimact.functional.softmax import pack_probabilities
from slimact.quant import QuantConfig, pack, unpack


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 1, 9), (2, 3, 5, 7), (2, 5, 17, 17), "non-contiguous"], ids=str)
def test_softmax_matches_torch(shape, dtype):
    x = non_contiguous(2, 3, 9, 9) if shape == "non-contiguous" else torch.randn(shape)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    check_against_plain(_SoftmaxIntoProduct(g).to(dtype), (x * 2).to(dtype))


class _SoftmaxIntoProduct(nn.Module):
    """An ``nn.Softmax`` whose output goes on into a product inside the model, as attention's does: one the model
    returned would be held for its backward and used exactly (``keep_exact``), leaving its codes untested."""

    def __init__(self, g: torch.Tensor) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)
        self.register_buffer("g", g)

    def forward(self, x):
        return (self.softmax(x) * self.g).sum(-1)


def test_softmax_keeps_at_most_0_27x():
    assert saved_ratio(nn.Softmax(dim=-1), torch.randn(4, 4, 64, 64)) <= 0.27


def _softmax_x_grad_sqnr(y: torch.Tensor, g: torch.Tensor, y_hat: torch.Tensor) -> float:
    exact = torch._softmax_backward_data(g, y, -1, torch.float32)
    return sqnr_db(exact, torch._softmax_backward_data(g, y_hat, -1, torch.float32))


@pytest.mark.parametrize("keys", [512, 2048])
def test_long_rows_keep_the_floor_with_one_scale_per_head(keys):
    # A row's probabilities are ~1/keys while the head's scale is set by its largest one: linear codes of y gave
    # every element the same error and fell below the floor with the row length; codes of sqrt(y) do not.
    torch.manual_seed(0)
    scores = torch.randn(1, 2, 256, keys, requires_grad=True)
    g = torch.randn(1, 2, 256, keys)
    cfg = QuantConfig(group_dim=1, groups=0)
    y = sf.softmax(scores, -1, cfg)
    loss, y = upstream_loss(y, g), y.detach()  # (from the codes: nothing else keeps y, as in attention)
    loss.backward()
    exact = torch._softmax_backward_data(g, y, -1, torch.float32)
    assert sqnr_db(exact, scores.grad) >= 30.0
    # The counterfactual: Mesa's linear codes of y (no outliers kept apart either: the largest probabilities of a
    # row can be 64x the others' typical magnitude, and kept exactly they take back a few dB)
    linear = unpack(pack(y.detach(), dataclasses.replace(cfg, outliers=False), share=False))
    assert _softmax_x_grad_sqnr(y.detach(), g, linear) < 30.0


def test_the_probabilities_pack_is_the_next_matmuls():
    # The softmax keeps codes of sqrt(y); the MatMul reading y (probs @ v) reuses that pack, restored as y.
    torch.manual_seed(0)
    cfg = QuantConfig(group_dim=1, groups=0)
    y = sf.softmax(torch.randn(1, 2, 8, 8, requires_grad=True), -1, cfg)
    packed = pack(y, cfg)
    assert packed.meta.derive == "square"
    restored = unpack(packed)
    assert restored.dtype == y.dtype and sqnr_db(y.detach(), restored) >= 40.0
    assert torch.equal(restored, unpack(pack_probabilities(y.detach(), cfg)))


def test_non_finite_probabilities_are_kept_exactly():
    y = torch.softmax(torch.tensor([[0.0, 1.0, float("nan")]]), -1)
    packed = pack_probabilities(y, QuantConfig())
    assert packed.meta.raw and packed.meta.derive is None
    torch.testing.assert_close(unpack(packed), y, equal_nan=True, rtol=0, atol=0)


def test_the_8bit_input_gradient_rows_sum_to_zero_as_softmaxs_do():
    # softmax(x + c) = softmax(x) for a row's constant c: the input gradient's rows sum to zero, and with them
    # the gradient of anything adding one value to a whole row of scores (an attention key's bias: q . b_k).
    # Restored 8-bit probabilities do not sum to 1: the backward at them gave rows summing to 2e-3 of the
    # gradient (VideoPrism's temporal key biases, whose exact gradient is ~0, got 3x it in error).
    torch.manual_seed(0)
    scores = (torch.randn(2, 4, 16, 16) * 2).requires_grad_(True)
    g = torch.randn(2, 4, 16, 16)
    exact = torch.autograd.grad(torch.softmax(scores, -1), scores, g)[0]
    cfg = QuantConfig(group_dim=1, groups=0)
    approx = torch.autograd.grad(upstream_loss(sf.softmax(scores, -1, cfg), g), scores)[0]
    assert exact.sum(-1).abs().max() <= 1e-6 * exact.abs().max()  # (float rounding)
    assert approx.sum(-1).abs().max() <= 1e-6 * exact.abs().max()
    assert sqnr_db(exact, approx) >= 30.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_restored_probabilities_are_rescaled_in_place(dtype):
    # The rescale to row sums of 1 (above) made a new [B, H, T, S] quotient and a where of it (and, in bf16, an fp32
    # quotient and its cast): 8.7 ms where the softmax backward itself took ~4-8 ms ([4, 12, 256, 256] fp32, one
    # CPU thread). Scaled in place, the same values (a row of zeros stays zeros), with no tensor of the map's size.
    from torch.utils._python_dispatch import TorchDispatchMode

    from slimact.functional.softmax import normalized

    class _Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.pointers = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == y.numel():
                self.pointers.append(out.data_ptr())
            return out

    torch.manual_seed(0)
    y = unpack(pack_probabilities(torch.softmax(torch.randn(2, 3, 8, 16) * 2, -1).to(dtype), QuantConfig()))
    y[0, 1, 2] = 0.0
    total = y.sum(-1, keepdim=True, dtype=torch.float32)
    want = torch.where(total > 0, y / total, y).to(dtype)
    with _Allocations() as seen:
        got = normalized(y, -1)
    assert torch.equal(got, want) and got.data_ptr() == y.data_ptr()
    assert seen.pointers and all(ptr == y.data_ptr() for ptr in seen.pointers)



def _peaked_scores() -> torch.Tensor:
    # Scores whose smallest probabilities are ~1e-9 (peaked attention): where 8-bit codes of sqrt(y) restore 0 or a
    # value far from y, so that a gradient growing as 1 / y (a log of the probabilities) is far off from them.
    return (torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(0)) * 6).requires_grad_(True)


def _log_grad(fn, scores: torch.Tensor, hold: bool = False) -> torch.Tensor:
    """The gradient of ``sum(t * log(y + 1e-30))`` for ``y = fn(scores)``, ``y`` held by the caller through the
    backward or not (as in a model: what the graph keeps only; ``log`` releases its own copy before the softmax's
    backward runs)."""
    y = fn(scores)
    t = torch.rand(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    loss = (t * torch.log(y + 1e-30)).sum()
    held = y if hold else None
    del y
    grad = torch.autograd.grad(loss, scores)[0]
    del held
    return grad


def test_the_backward_uses_the_probabilities_themselves_while_they_are_held():
    cfg = QuantConfig(group_dim=1, groups=0)
    scores = _peaked_scores()
    exact = _log_grad(lambda s: torch.softmax(s, -1), scores)
    torch.testing.assert_close(_log_grad(lambda s: sf.softmax(s, -1, cfg), scores, hold=True), exact)
    # The counterfactual: nothing holds y, its codes serve the backward, and the 1 / y gradient is far from exact
    # (the limit a loss dividing by probabilities that are not returned meets: docs/robustness.md).
    assert sqnr_db(exact, _log_grad(lambda s: sf.softmax(s, -1, cfg), scores)) < 20.0


def test_probabilities_changed_or_released_since_are_not_read():
    # The backward reads the softmax's output only where it still holds what the softmax computed: not after an
    # in-place op (its version), nor after `y.data = t` (which moves no version counter: a stash of the probabilities
    # given other data had them read, a gradient at cosine 0.06), nor where its memory was released (memcnn's
    # resize_(0)): the codes serve then.
    cfg = QuantConfig(group_dim=1, groups=0)
    scores = _peaked_scores()
    g = torch.randn(scores.shape, generator=torch.Generator().manual_seed(2))
    from_codes = torch.autograd.grad(upstream_loss(sf.softmax(scores, -1, cfg), g), scores)[0]
    exact = torch.autograd.grad(upstream_loss(torch.softmax(scores, -1), g), scores)[0]
    assert not torch.equal(from_codes, exact)  # (else this test proves nothing)
    for change in (lambda y: y.mul_(1.0), lambda y: setattr(y, "data", torch.rand_like(y)),
                   lambda y: y.untyped_storage().resize_(0)):
        y = sf.softmax(scores, -1, cfg)
        loss = upstream_loss(y, g)
        with torch.no_grad():
            change(y)
        torch.testing.assert_close(torch.autograd.grad(loss, scores)[0], from_codes, rtol=0, atol=0)


def test_keep_exact_holds_the_probabilities_through_a_view_and_a_dropout():
    # What a model returns (its attention maps, a view or a dropout of them) is held for the softmax's backward,
    # while the softmax's output is still there when the model returns (the routing's note of a dropout holds it).
    from slimact.functional.softmax import keep_exact

    cfg = QuantConfig(group_dim=1, groups=0)
    scores = _peaked_scores()
    exact = _log_grad(lambda s: torch.softmax(s, -1).transpose(1, 2), scores)

    def returned(s):
        y = sf.softmax(s, -1, cfg)
        out = sf.dropout(y.transpose(1, 2), 0.0, True)
        assert keep_exact(out)
        return out

    torch.testing.assert_close(_log_grad(returned, scores), exact)
    # Released with the backward (a graph kept past it, a logged loss, had held every step's maps).
    y = sf.softmax(scores, -1, cfg)
    node, loss = y.grad_fn, y.sum()
    assert keep_exact(y) and node.exact.held is not None
    del y
    loss.backward()
    assert node.exact is None
    assert not keep_exact(sf.softmax(scores, -1, cfg) * scores)  # (a product with a tensor needing a gradient)
    assert not keep_exact(sf.softmax(scores, -1, None))  # (lossless: its output is what it keeps)
