"""What every slimact autograd Function must do alike, checked on each of them through one table of calls.

* no backward with ``create_graph=True`` (a clear error, never a wrong second-order gradient);
* an output that is no view and takes an in-place op (wav2vec2's ``hidden_states[mask] = ...``);
* zero-element inputs as PyTorch handles them;
* strided inputs and inputs that do not all require grad, against the plain op.

A Function added to slimact without a row in ``CASES`` fails ``test_every_function_is_in_the_table``.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import slimact
from _emulated_attention import emulated_fused_attention
from _harness import upstream_loss
from slimact import functional as sf
from slimact._metrics import sqnr_db
from slimact.functional._saving import SlimFunction
from slimact.functional.activation import FORMS, reference
from slimact.functional.clamped_glu import GateForm, clamped_glu
from slimact.functional.gather import gather
from slimact.functional.grouped_mm import grouped_mm
from slimact.functional.matmul import baddbmm, einsum
from slimact.functional.product import broadcast_product, product
from slimact.quant import QuantConfig

ROWS = QuantConfig(groups=8, clamp_groups=True)  # as the default policy builds a Linear's config
HEADS = QuantConfig(group_dim=1, groups=0)  # per head (attention tensors)
CHANNELS = QuantConfig(group_dim=1)  # per channel group along dim 1 (convolution, batch norm)
BATCHED = QuantConfig(group_dim=0, groups=0)  # per [B * H] index of a rank-3 attention operand
GPT_OSS_GATE = GateForm(interleaved=True, limit=1.0, alpha=1.702, offset=1.0)  # (a limit the randn inputs cross)


class Case(NamedTuple):
    name: str
    slim: object  # (*inputs) -> Tensor
    plain: object  # the same with PyTorch's ops
    shapes: tuple  # input shapes as functions of the batch size n
    lossless: bool


def _act(form, cfg):
    return Case(f"activation-{form}-{'exact' if cfg is None else '8bit'}",
                lambda x: sf.activation(x, form, cfg), lambda x: reference(form, x),
                (lambda n: (n, 3, 8),), cfg is None or form == "relu")


def _cases() -> list[Case]:
    out = [
        Case("linear", lambda x, w, b: sf.linear(x, w, b, ROWS), F.linear,
             (lambda n: (n, 3, 8), lambda n: (5, 8), lambda n: (5,)), False),
        Case("linear-conv1d", lambda x, w, b: sf.linear(x, w, b, ROWS, transposed=True),
             lambda x, w, b: F.linear(x, w.t(), b), (lambda n: (n, 3, 8), lambda n: (8, 5), lambda n: (5,)), False),
        Case("matmul", lambda a, b: sf.matmul(a, b, HEADS, HEADS), torch.matmul,
             (lambda n: (n, 2, 3, 4), lambda n: (n, 2, 4, 5)), False),
        Case("softmax", lambda x: sf.softmax(x, -1, HEADS), lambda x: torch.softmax(x, -1),
             (lambda n: (n, 2, 3, 4),), False),
        Case("conv", lambda x, w, b: sf.conv(x, w, b, (1, 1), (1, 1), (1, 1), 1, CHANNELS),
             lambda x, w, b: F.conv2d(x, w, b, 1, 1), (lambda n: (n, 3, 6, 6), lambda n: (4, 3, 3, 3), lambda n: (4,)),
             False),
        Case("batchnorm", lambda x, w, b: sf.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, 0.1, 1e-5, CHANNELS),
             lambda x, w, b: F.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, True, 0.1, 1e-5),
             (lambda n: (n, 3, 5, 5), lambda n: (3,), lambda n: (3,)), False),
        # p > 0 so that the Function runs; the same seed draws the same mask as F.dropout
        Case("dropout", lambda x: sf.dropout(x, 0.25), lambda x: F.dropout(x, 0.25), (lambda n: (n, 3, 8),), True),
        Case("lm-loss", lambda h, w, b: sf.linear_cross_entropy(h.flatten(0, 1), w, b, _targets(h), reduction="sum"),
             lambda h, w, b: F.cross_entropy(F.linear(h.flatten(0, 1), w, b), _targets(h), reduction="sum"),
             (lambda n: (n, 3, 8), lambda n: (5, 8), lambda n: (5,)), True),
    ]
    out += [
        Case("baddbmm", lambda x, a, b: baddbmm(x, a, b, BATCHED, BATCHED, beta=0.5, alpha=2.0),
             lambda x, a, b: torch.baddbmm(x, a, b, beta=0.5, alpha=2.0),
             (lambda n: (n, 3, 5), lambda n: (n, 3, 4), lambda n: (n, 4, 5)), False),
        Case("einsum", lambda a, b: einsum("bhtd,bhsd->bhts", a, b, HEADS, HEADS),
             lambda a, b: torch.einsum("bhtd,bhsd->bhts", a, b), (lambda n: (n, 2, 3, 4), lambda n: (n, 2, 5, 4)),
             False),
        Case("gather", lambda x: gather(x, 2, _index(x)), lambda x: torch.gather(x, 2, _index(x)),
             (lambda n: (n, 3, 8),), True),
        Case("product", lambda a, b: product(a, b, ROWS), torch.mul, (lambda n: (n, 3, 8), lambda n: (n, 3, 8)),
             False),
        # (a mixture-of-experts layer's product: [S, K] tokens sorted by expert by [E, K, N] weights, two experts;
        # torch._grouped_mm takes strides of 16 bytes)
        Case("grouped-mm", lambda x, w: grouped_mm(x, w, _offsets(x), ROWS, torch._grouped_mm),
             lambda x, w: torch._grouped_mm(x, w, offs=_offsets(x)), (lambda n: (4 * n, 8), lambda n: (2, 8, 8)),
             False),
        # (gpt-oss's clamped gated unit of its experts: [..., 2I] -> [..., I]; the form is PyTorch's ops)
        Case("clamped-glu", lambda x: clamped_glu(x, GPT_OSS_GATE, ROWS), GPT_OSS_GATE, (lambda n: (n, 3, 8),), False),
        # (adaLN's modulation: a [B, T, C] factor by a [B, 1, C] one, the small one kept exact)
        Case("product-broadcast", lambda a, b: broadcast_product(a, b, ROWS), torch.mul,
             (lambda n: (n, 3, 8), lambda n: (n, 1, 8)), False),
    ]
    out += [_act(form, cfg) for form in FORMS for cfg in (ROWS, None)]
    for cfg in (ROWS, None):
        tag = "exact" if cfg is None else "8bit"
        out += [
            Case(f"layernorm-{tag}", lambda x, w, b, cfg=cfg: sf.norm(x, w, b, 1e-5, cfg),
                 lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5),
                 (lambda n: (n, 3, 8), lambda n: (8,), lambda n: (8,)), cfg is None),
            Case(f"rmsnorm-{tag}", lambda x, w, cfg=cfg: sf.norm(x, w, None, 1e-5, cfg, centered=False),
                 lambda x, w: F.rms_norm(x, (8,), w, 1e-5), (lambda n: (n, 3, 8), lambda n: (8,)), cfg is None),
            Case(f"groupnorm-{tag}", lambda x, w, b, cfg=cfg: sf.group_norm(x, 2, w, b, 1e-5, cfg),
                 lambda x, w, b: F.group_norm(x, 2, w, b, 1e-5),
                 (lambda n: (n, 4, 3, 5), lambda n: (4,), lambda n: (4,)), cfg is None),
            Case(f"gated-mlp-{tag}", lambda g, u, w, b, cfg=cfg: sf.gated_mlp(g, u, w, b, "silu", cfg),
                 lambda g, u, w, b: F.linear(F.silu(g) * u, w, b),
                 (lambda n: (n, 3, 8), lambda n: (n, 3, 8), lambda n: (4, 8), lambda n: (4,)), cfg is None),
            Case(f"softmax-dropout-matmul-{tag}", lambda s, v, cfg=cfg: sf.softmax_dropout_matmul(s, v, 0.0, cfg, cfg),
                 lambda s, v: torch.softmax(s, -1) @ v, (lambda n: (n, 2, 3, 5), lambda n: (n, 2, 5, 4)), cfg is None),
            Case(f"attention-flash-{tag}", lambda q, k, v, cfg=cfg: sf.scaled_dot_product_attention(q, k, v, cfg=cfg),
                 F.scaled_dot_product_attention,
                 (lambda n: (n, 2, 3, 4), lambda n: (n, 2, 5, 4), lambda n: (n, 2, 5, 4)), cfg is None),
            # PyTorch's fused CUDA kernels, emulated on the CPU (tests/_emulated_attention.py; _context)
            Case(f"attention-fused-{tag}", lambda q, k, v, cfg=cfg: sf.scaled_dot_product_attention(q, k, v, cfg=cfg),
                 F.scaled_dot_product_attention,
                 (lambda n: (n, 2, 3, 8), lambda n: (n, 2, 5, 8), lambda n: (n, 2, 5, 8)), cfg is None),
            # a learned additive mask (a position bias) takes the chunked path
            Case(f"attention-chunked-{tag}",
                 lambda q, k, v, m, cfg=cfg: sf.scaled_dot_product_attention(q, k, v, m, cfg=cfg),
                 lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m),
                 (lambda n: (n, 2, 3, 4), lambda n: (n, 2, 5, 4), lambda n: (n, 2, 5, 4), lambda n: (1, 1, 3, 5)),
                 cfg is None),
        ]
    return out


def _index(x: torch.Tensor) -> torch.Tensor:
    return (torch.arange(x.shape[0] * x.shape[1] * 4) % x.shape[2]).reshape(x.shape[0], x.shape[1], 4)


def _offsets(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([x.shape[0] // 4, x.shape[0]], dtype=torch.int32)  # expert 0: a quarter of the tokens


def _targets(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[0] * h.shape[1]) % 5


CASES = _cases()
IDS = [c.name for c in CASES]
# Functions whose output is no tensor of values the checks below can run on, with the same checks where they are:
# _Lazy makes a LazyLogits (no data; any op computes the logits outside it).
TESTED_ELSEWHERE = {"_Lazy": "tests/nn/test_lm_loss.py::test_a_custom_function_given_the_lazy_logits_*"}


def _inputs(case: Case, n: int, *, strided: bool = False, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in case.shapes:
        t = torch.randn(shape(n), generator=gen)
        if strided and t.dim() >= 2:
            t = t.mT.contiguous().mT  # the same values through transposed strides
        out.append(t)
    return out


def _run(fn, inputs, needs, *, inplace=False, seed=1):
    xs = [t.detach().clone().requires_grad_(r) for t, r in zip(inputs, needs, strict=True)]
    # the clone keeps the strides of a strided input (clone preserves them)
    torch.manual_seed(seed)
    y = fn(*xs)
    if inplace:
        y.add_(1.0)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1))
    loss, y = upstream_loss(y, upstream), y.detach()
    loss.backward()
    return y, [x.grad for x in xs]


def _context(case: Case):
    """Where ``case`` runs: the fused attention cases with the CUDA kernels emulated on the CPU."""
    return emulated_fused_attention() if case.name.startswith("attention-fused") else contextlib.nullcontext()


@pytest.fixture(autouse=True)
def _case_context(request):
    case = getattr(getattr(request.node, "callspec", None), "params", {}).get("case")
    with _context(case) if isinstance(case, Case) else contextlib.nullcontext():
        yield


def _function_of(case: Case) -> type:
    xs = [t.requires_grad_() for t in _inputs(case, 2)]
    with _context(case):
        return type(case.slim(*xs).grad_fn)._forward_cls


def test_every_function_is_in_the_table():
    for info in pkgutil.walk_packages(slimact.__path__, "slimact."):
        if not info.name.endswith("__main__"):  # (that one runs the command line)
            importlib.import_module(info.name)
    found, todo = set(), [torch.autograd.Function]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("slimact.") and sub is not SlimFunction:
                found.add(sub)
    assert found, "no slimact Function found"
    not_slim = sorted(c.__qualname__ for c in found if not issubclass(c, SlimFunction))
    assert not not_slim, f"not SlimFunction subclasses (no double-backward guard, views): {not_slim}"
    covered = {_function_of(c) for c in CASES}
    missing = sorted(c.__qualname__ for c in found - covered if c.__qualname__ not in TESTED_ELSEWHERE)
    assert not missing, f"Functions without a row in CASES: {missing}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_backward_with_create_graph_raises_a_clear_error(case):
    xs = [t.requires_grad_() for t in _inputs(case, 2)]
    y = case.slim(*xs)
    name = type(y.grad_fn)._forward_cls.__name__
    with pytest.raises(RuntimeError, match=f"cannot be differentiated twice.*{name}|{name}.*differentiated twice"):
        torch.autograd.grad(y.sum(), xs, create_graph=True, allow_unused=True)
    # the same graph, first order, still runs
    assert any(g is not None for g in torch.autograd.grad(y.sum(), xs, allow_unused=True))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_output_is_no_view_and_takes_an_in_place_op(case):
    inputs = _inputs(case, 2)
    needs = [True] * len(inputs)
    xs = [t.clone().requires_grad_() for t in inputs]
    y = case.slim(*xs)
    assert not y._is_view()
    if any(t is not None and t.data_ptr() == y.data_ptr() for t in y.grad_fn.saved_tensors):
        # A Function that keeps its output (Tempo's in-place GELU, a norm, exact attention) cannot have it
        # overwritten, as PyTorch's own ops that keep theirs (sigmoid, softmax): the backward says so.
        y.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        return
    y0, g0 = _run(case.slim, inputs, needs)
    y1, g1 = _run(case.slim, inputs, needs, inplace=True)  # adding a constant leaves every gradient as it was
    torch.testing.assert_close(y1, y0 + 1)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_zero_element_input_runs_as_in_pytorch(case):
    inputs = _inputs(case, 0)
    needs = [True] * len(inputs)
    y0, g0 = _run(case.plain, inputs, needs)
    y1, g1 = _run(case.slim, inputs, needs)
    assert y1.shape == y0.shape and y1.dtype == y0.dtype
    torch.testing.assert_close(y1, y0, equal_nan=True)
    for x, a, b in zip(inputs, g0, g1, strict=True):
        # PyTorch leaves a mask broadcast over an empty batch without a gradient: slimact's attention over an empty
        # batch is PyTorch's own call (its CPU flash kernel dies of SIGFPE there), which does the same
        if a is None:
            assert b is None or not b.any()
            continue
        assert b is not None and b.shape == x.shape
        torch.testing.assert_close(b, a)


# (case, whether its first input needs a gradient): a one-input Function only with it
MATCHES = [pytest.param(c, first, id=f"{c.name}-{'all-need-grad' if first else 'first-frozen'}")
           for c in CASES for first in (True, False) if first or len(c.shapes) > 1]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize(("case", "first_needs_grad"), MATCHES)
def test_a_function_matches_pytorch(case, first_needs_grad, strided):
    inputs = _inputs(case, 2, strided=strided)
    needs = [first_needs_grad] + [True] * (len(inputs) - 1)
    y0, g0 = _run(case.plain, inputs, needs)
    y1, g1 = _run(case.slim, inputs, needs)
    torch.testing.assert_close(y1, y0)  # the forward is PyTorch's own op (fused attention: its own kernel)
    for i, (a, b) in enumerate(zip(g0, g1, strict=True)):
        assert (a is None) == (b is None), f"input {i}"
        if a is None:
            continue
        if case.lossless:
            torch.testing.assert_close(b, a, msg=f"input {i}")
        else:
            assert sqnr_db(a, b) >= 30, f"input {i}: {sqnr_db(a, b):.1f} dB"
