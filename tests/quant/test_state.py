"""Running estimates (``scale="running"``): across moves of the model that holds them, and kept per call site however
the training loop calls the model's modules."""

import contextlib
import copy

import pytest
import torch
from torch import nn

import slimact
from _harness import estimates
from slimact._metrics import cosine


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).train()


def _grads(model: nn.Module, x: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    (model(x) * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("how", ["meta then to_empty", "to_empty in place"])
def test_estimates_keep_their_values_through_to_empty(how):
    # to_empty() gives every buffer fresh, unwritten memory: while the estimates were buffers (non-persistent, so no
    # load_state_dict brought them back) they held whatever it had, and the next pack saturated against it (worst
    # gradient at cosine 0.38 from plain's on a 2-block model). Held apart from the buffers now, they keep theirs.
    x = torch.randn(4, 6, 16) * 10
    slim = slimact.convert(_model(), "mesa")
    _grads(slim, x)
    weights = copy.deepcopy(slim.state_dict())
    before = {n: t.clone() for n, t in estimates(slim).items()}
    if how == "meta then to_empty":
        slim.to("meta")
    slim.to_empty(device="cpu")
    slim.load_state_dict(weights)
    assert before and all(torch.equal(estimates(slim)[n], t) for n, t in before.items())
    plain = _model()
    plain.load_state_dict(weights)
    exact, approx = _grads(plain, x), _grads(slim, x)
    assert min(cosine(exact[n], approx[n]) for n in exact) >= 0.99


def test_estimates_survive_moves_and_stay_fp32():
    slim = slimact.convert(_model(), "mesa")
    _grads(slim, torch.randn(4, 6, 16))
    before = {n: b.clone() for n, b in estimates(slim).items()}
    slim.half().float()
    moved = copy.deepcopy(slim)
    slim.to(torch.float32)
    for model in (slim, moved):
        assert estimates(model).keys() == before.keys()
        for n, b in before.items():
            assert estimates(model)[n].dtype == torch.float32 and torch.equal(estimates(model)[n], b), n


@pytest.mark.parametrize("use_buffers", [False, True])
def test_an_averaged_copy_made_before_the_first_step_pairs_its_buffers_with_the_models(use_buffers):
    # torch.optim.swa_utils.AveragedModel (as timm's ModelEmaV3) pairs model.buffers() with its copy's by position.
    # The estimates were buffers that appear at the first training step, so a copy made before it paired them with
    # the next module's BatchNorm statistics: a shape error here, the estimate copied into the statistics where the
    # shapes agreed (8 channel groups, a BatchNorm over 8 channels), a zip error on GPT-2 (found by a helper's sweep).
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 8))
    slim = slimact.convert(copy.deepcopy(plain), "mesa")
    averaged = {m: AveragedModel(m, use_buffers=use_buffers) for m in (plain, slim)}
    opt = {m: torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, slim)}
    for step in range(3):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        for m in (plain, slim):
            opt[m].zero_grad()
            m(x).square().mean().backward()
            opt[m].step()
            averaged[m].update_parameters(m)
    assert estimates(slim), "no running estimate: the pairing above proved nothing"
    want, got = dict(averaged[plain].module.named_buffers()), dict(averaged[slim].module.named_buffers())
    assert got.keys() == want.keys()
    for n, b in want.items():  # the statistics the averaged copy holds: plain's, within the lossy gradients' effect
        torch.testing.assert_close(got[n].float(), b.float(), rtol=0.05, atol=0.05, msg=n)


# Call sites: the k-th call of a module within one step has its own estimate (slimact.nn._base.begin_call). A step
# begins with a forward of the converted model, and with the first call after a backward: a training loop that calls
# the model's submodules itself, or loops one converted block, never runs the model's forward.

_DIM = 16
#: Round to nearest, running estimates: a pack depends only on its tensor and the estimate it finds, so two runs that
#: keep the same estimates compute the same gradients, bit for bit.
_RUNNING = slimact.Policy(scale="running")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(_DIM, 4 * _DIM), nn.GELU(), nn.Linear(4 * _DIM, _DIM)
        self.ln = nn.LayerNorm(_DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc2(self.act(self.fc1(h))))


class _Net(nn.Module):
    """Two blocks and a head; a training loop may call ``encoder`` and ``head`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = nn.Sequential(_Block(), _Block()), nn.Linear(_DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class _Shared(nn.Module):
    """ALBERT's weight sharing written by hand: one block at every depth, its input's range doubling with depth."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = _Block(), nn.Linear(_DIM, 1)

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        h = x
        for _ in range(depth):
            h = 2 * h + self.block(h)
        return self.head(h)


def _step_grads(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _estimate_names(model: nn.Module) -> list[str]:
    return sorted(n for n in estimates(model) if n.endswith("_lo"))


def _two_converted(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    """Two converted copies (running estimates) of one seeded ``cls()``: one trained through its forward, the other
    through the calls a training loop makes itself."""
    torch.manual_seed(0)
    plain = cls().train()
    return slimact.convert(copy.deepcopy(plain), _RUNNING), slimact.convert(copy.deepcopy(plain), _RUNNING)


def _batches(steps: int):
    """``(step, x, y)`` for ``steps`` fresh batches (the estimates move), from one seeded generator."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        yield step, torch.randn(4, 8, _DIM, generator=gen), torch.randn(4, 8, 1, generator=gen)


def test_submodules_the_training_loop_calls_itself_keep_one_estimate_per_call_site():
    # `model.head(model.encoder(x))` in the training loop: the model's forward never runs, so its pass count never
    # moved, and each step's calls took the next call sites (5 estimates after one step, 80 after 16: each module's
    # calls went to a fresh estimate every step, until the last site, 15, took them all).
    by_forward, by_loop = _two_converted(_Net)
    for step, x, y in _batches(20):  # a fresh batch each step: the estimates move
        expected = _step_grads(by_forward, nn.functional.mse_loss(by_forward(x), y))
        x = x.clone()  # (a tensor of its own: a pack of the batch made by the other model is not this one's to use)
        got = _step_grads(by_loop, nn.functional.mse_loss(by_loop.head(by_loop.encoder(x)), y))
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), step
        # (the first Linear, each block's GELU and LayerNorm: the Linears after them keep their packs)
        assert _estimate_names(by_loop) == [
            "encoder.0.act._slimact_x_lo", "encoder.0.fc1._slimact_x_lo", "encoder.0.ln._slimact_x_lo",
            "encoder.1.act._slimact_x_lo", "encoder.1.ln._slimact_x_lo"], (step, _estimate_names(by_loop))
    assert _estimate_names(by_loop) == _estimate_names(by_forward)
    for (name, a), b in zip(estimates(by_forward).items(), estimates(by_loop).values(), strict=True):
        assert torch.equal(a, b), name


def test_a_block_the_training_loop_calls_at_each_depth_keeps_one_estimate_per_depth():
    # A shared block looped by the training script itself, to a depth drawn each step (layer drop, a loop until
    # convergence): its input's range doubles with depth. Each step's calls took new call sites, and from the third
    # step on all of them the last site (15), one estimate blended over every depth (the first layer's input packed
    # with an estimate 21x its range, the deepest saturating). Keyed by step, the loop keeps the estimates the
    # model's own forward keeps: one per depth, the same gradients bit for bit.
    by_forward, by_loop = _two_converted(_Shared)
    for step, x, y in _batches(12):
        depth = (2, 6, 4, 5, 3, 6)[step % 6]
        expected = _step_grads(by_forward, nn.functional.mse_loss(by_forward(x, depth), y))
        h = x.clone()
        for _ in range(depth):
            h = 2 * h + by_loop.block(h)
        got = _step_grads(by_loop, nn.functional.mse_loss(by_loop.head(h), y))
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), step
    sites = [n for n in _estimate_names(by_loop) if n.startswith("block.fc1.")]
    assert sites == ["block.fc1._slimact_x_1_lo", "block.fc1._slimact_x_2_lo", "block.fc1._slimact_x_3_lo",
                     "block.fc1._slimact_x_4_lo", "block.fc1._slimact_x_5_lo", "block.fc1._slimact_x_lo"], sites
    assert _estimate_names(by_loop) == _estimate_names(by_forward)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_block_the_training_loop_calls_at_each_depth_keeps_one_estimate_per_depth(reentrant):
    # The loop of the test above with each depth under torch.utils.checkpoint. A reentrant checkpoint's forward runs
    # without grad and its recomputes, in the backward, are the calls that pack: they belong to the step being
    # back-propagated, however many backward passes ran slimact Functions since (the head's; each reentrant region
    # runs one of its own). Keyed by the latest backward, each region's recompute began a step of its own and all
    # six depths shared one estimate (site 0; under "mesa", gradients as plain's at cosine 0.995 in the first step, the
    # estimate 17x the shallowest depth's range); keyed by nothing, the sites grew step after step, to 16.
    from torch.utils.checkpoint import checkpoint

    by_forward, by_loop = _two_converted(_Shared)
    for step, x, y in _batches(8):
        expected = _step_grads(by_forward, nn.functional.mse_loss(by_forward(x, 6), y))
        h = x.clone().requires_grad_()  # (a reentrant region passes a gradient on only to inputs that need one)
        for _ in range(6):
            h = 2 * h + checkpoint(by_loop.block, h, use_reentrant=reentrant)
        got = _step_grads(by_loop, nn.functional.mse_loss(by_loop.head(h), y))
        if not reentrant:  # (its recompute packs as its forward did: bit for bit)
            assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), step
        else:  # (the recomputes take the sites in their own order, the last depth first: other estimates)
            assert min(cosine(a, b) for a, b in zip(expected, got, strict=True)) >= 0.99, step
    names = _estimate_names(by_loop)
    for module in ("block.fc1.", "block.act.", "block.ln."):  # (fc2 keeps the GELU's pack where it can)
        assert len([n for n in names if n.startswith(module)]) == 6, names
    assert len([n for n in names if n.startswith("block.fc2.")]) <= 6, names
    if not reentrant:
        assert names == _estimate_names(by_forward)


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_calls_that_pack_nothing_leave_estimates_and_call_sites_alone(how):
    # Evaluation calls between training calls (of the model, of a submodule, on data 100x the training range)
    # neither move an estimate nor take a call site: the next training step computes what it would without them.
    clean, mixed = _two_converted(_Net)
    for step, x, y in _batches(4):
        expected = _step_grads(clean, nn.functional.mse_loss(clean(x), y))
        x = x.clone()
        before = {n: b.clone() for n, b in estimates(mixed).items()}
        context = torch.no_grad() if how == "no_grad" else contextlib.nullcontext()
        mixed.train(how != "eval")
        with context:
            mixed(100 * x)
            mixed.encoder(100 * x)
        mixed.train()
        after = estimates(mixed)
        assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
        h = mixed.encoder(x)
        with context:
            mixed.train(how != "eval")
            mixed.head(100 * h)
            mixed.train()
        got = _step_grads(mixed, nn.functional.mse_loss(mixed.head(h), y))
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), step
    assert _estimate_names(mixed) == _estimate_names(clean)
