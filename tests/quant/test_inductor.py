"""The compiled CPU pack (slimact.quant.inductor) against the reference: bit for bit, where it applies."""

import warnings

import pytest
import torch

from slimact.quant import QuantConfig, inductor, pack, reference, unpack
from slimact.quant.core import backend_for
from slimact.quant.reference import group_layout, scale_params

# [rows, 768] channel groups (8 divide 768), [B, H, T, D] per head, the whole tensor; each >= MIN_NUMEL.
CASES = {
    "channels": ((344, 768), QuantConfig(groups=8)),
    "per-channel": ((344, 768), QuantConfig(groups=0)),  # runs of one element: eager range, compiled codes
    "heads": ((2, 4, 256, 128), QuantConfig(group_dim=1, groups=0)),
    "whole": ((300, 1000), QuantConfig(group_dim=None)),
    "single-row": ((1, 300_000), QuantConfig(groups=4)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_pack_equals_the_reference_bit_for_bit(case, dtype):
    shape, cfg = CASES[case]
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.linspace(0.1, 5, shape[-1])).to(dtype)
    x.view(-1)[::1000] = 0.0
    assert x.numel() >= inductor.MIN_NUMEL and backend_for(x) == "inductor"
    layout = group_layout(x.shape, cfg)
    assert inductor._applies(x, layout) is not None  # the compiled loops are what runs
    ref = pack(x, cfg, backend="reference", share=False)
    fast = pack(x, cfg, backend="inductor", share=False)
    for a, b in zip(ref.tensors, fast.tensors, strict=True):
        assert torch.equal(a, b)
    assert ref.meta == fast.meta
    restored = unpack(fast, backend="inductor")
    assert restored.dtype == dtype and torch.equal(restored, unpack(ref, backend="reference"))


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_stats_and_outliers_equal_the_references(case):
    # The range bit for bit; the magnitude (a sum, in another order) to float rounding; the outliers it decides,
    # and so the whole pack, the same.
    from slimact.quant import reference

    shape, cfg = CASES[case]
    torch.manual_seed(0)
    x = torch.randn(shape)
    x.view(-1)[::997] = 1e4
    layout = group_layout(x.shape, cfg)
    lo, hi, magnitude = inductor.group_stats(x, layout)
    ref_lo, ref_hi, ref_magnitude = reference.group_stats(x, layout)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)
    # fp32 sums of up to 3e5 terms, in two orders: both to float rounding of the float64 sum
    others = [d for d in range(x.dim()) if d != layout.dim] if layout.dim is not None else list(range(x.dim()))
    per_index = x.double().abs().sqrt().sum(others).reshape(-1)
    exact = per_index if layout.dim is None else per_index.view(layout.groups, -1).sum(1)
    torch.testing.assert_close(magnitude.double(), exact, rtol=1e-4, atol=0)
    torch.testing.assert_close(ref_magnitude.double(), exact, rtol=1e-4, atol=0)
    ref = pack(x, cfg, backend="reference", share=False)
    fast = pack(x, cfg, backend="inductor", share=False)
    assert len(fast.tensors) == 5
    for a, b in zip(ref.tensors, fast.tensors, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_reach_the_range_and_keep_the_tensor_raw(bad):
    x = torch.randn(512, 768)
    x[100, 5] = bad
    packed = pack(x, QuantConfig(groups=8), backend="inductor", share=False)
    assert packed.raw and torch.equal(torch.nan_to_num(packed.tensors[0]), torch.nan_to_num(x))


@pytest.mark.parametrize(
    "shape, cfg",
    [
        ((512, 768), QuantConfig(bits=4, groups=8)),  # sub-byte codes
        ((512, 768), QuantConfig(groups=8, stochastic=True)),  # stochastic rounding
        ((512, 770), QuantConfig(groups=8)),  # 8 groups do not divide 770
        ((16, 16), QuantConfig(groups=8)),  # small
    ],
    ids=["4-bit", "stochastic", "uneven-groups", "small"],
)
def test_what_the_compiled_loops_do_not_take_goes_to_the_reference(shape, cfg):
    from slimact.quant import reference
    from slimact.quant.reference import PackMeta, scale_params

    torch.manual_seed(0)
    x = torch.randn(shape)
    layout = group_layout(x.shape, cfg)
    lo, hi = inductor.group_minmax(x, layout)
    assert all(torch.equal(a, b) for a, b in zip((lo, hi), reference.group_minmax(x, layout), strict=True))
    lo, step = scale_params(lo, hi, cfg.qmax)
    seed = 1234 if cfg.stochastic else None
    codes = inductor.quantize(x, layout, lo, step, cfg.bits, seed)
    assert torch.equal(codes, reference.quantize(x, layout, lo, step, cfg.bits, seed))
    meta = PackMeta(x.shape, x.dtype, cfg.bits, layout, False)
    assert torch.equal(inductor.dequantize(codes, meta, lo, step), reference.dequantize(codes, meta, lo, step))


def test_strided_tensors_go_to_the_reference():
    x = torch.randn(768, 512).t()
    assert inductor._applies(x, group_layout(x.shape, QuantConfig(groups=8))) is None
    a = pack(x, QuantConfig(groups=8), backend="reference", share=False)
    b = pack(x, QuantConfig(groups=8), backend="inductor", share=False)
    assert all(torch.equal(t, u) for t, u in zip(a.tensors, b.tensors, strict=True))


def test_reference_backend_can_be_forced(monkeypatch):
    monkeypatch.setenv("SLIMACT_BACKEND", "reference")
    assert backend_for(torch.randn(4)) == "reference"


def test_a_converted_model_compiles_each_loop_once_not_at_every_step():
    # The routing TorchFunctionMode is active while a converted model runs; traced by dynamo, its LM-loss
    # tracker (which follows tensors by identity) made the compiled loops guard on the very tensor packed, and
    # recompile at every call until the recompile limit.
    from torch._dynamo.utils import counters

    import slimact
    from slimact import zoo

    model = slimact.convert(zoo.build("gpt2", tiny=True).train())
    inputs = zoo.example_inputs(model, 32, 128)  # [4096, 64] hidden states: MIN_NUMEL

    graphs = counters["stats"]["unique_graphs"]
    model(**inputs).loss.backward()
    first = counters["stats"]["unique_graphs"] - graphs
    for _ in range(3):
        model(**inputs).loss.backward()
    # Range, quantise, dequantise and the GELU backward's restore-in-its-loop, each with at most two shape
    # variants (channel groups and one whole-tensor or single-run view), all in the first step; with the bug,
    # 8 recompiles of the quantise alone in the first step, and more at every step.
    assert first <= 8
    assert counters["stats"]["unique_graphs"] - graphs == first


def test_a_strided_tensor_is_packed_through_the_compiled_loops_from_a_contiguous_copy(monkeypatch):
    # Attention's q, k, v: [B, T, H, D] memory seen as [B, H, T, D], one scale per head.
    torch.manual_seed(1)
    x = torch.randn(2, 256, 4, 128).transpose(1, 2)
    x[0, 1, 7, 3] = 300.0  # an outlier, kept apart at its logical index
    cfg = QuantConfig(group_dim=1, groups=0)
    assert not x.is_contiguous() and x.numel() >= inductor.MIN_NUMEL
    ran = []
    original = inductor.quantize
    monkeypatch.setattr(inductor, "quantize", lambda data, *a: ran.append(data.is_contiguous()) or original(data, *a))
    fast = pack(x, cfg, backend="inductor", share=False)
    assert ran == [True]  # the compiled loop got the contiguous copy
    ref = pack(x, cfg, backend="reference", share=False)
    assert len(ref.tensors) == len(fast.tensors) > 3  # the outlier went apart in both
    for a, b in zip(ref.tensors, fast.tensors, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(unpack(fast), unpack(ref))


def _backend_failed(inner: Exception) -> Exception:
    from torch._dynamo.exc import BackendCompilerFailed

    try:
        e = BackendCompilerFailed(lambda *a: None, inner, None)
    except TypeError:  # older signature: (backend_fn, inner_exception)
        e = BackendCompilerFailed(lambda *a: None, inner)
    e.__cause__ = inner
    return e


def _no_compiler() -> Exception:
    from torch._inductor.exc import InvalidCxxCompiler

    return InvalidCxxCompiler()


def _broken(error):
    def compiled(*args):
        raise error

    return compiled


@pytest.mark.parametrize("make", [_no_compiler, lambda: _backend_failed(_no_compiler()),
                                  lambda: _backend_failed(RuntimeError("a failure in lowering"))],
                         ids=["InvalidCxxCompiler", "BackendCompilerFailed(InvalidCxxCompiler)",
                              "BackendCompilerFailed(RuntimeError)"])
def test_a_missing_compiler_warns_falls_back_and_turns_off_that_loop_only(monkeypatch, make):
    # One loop that cannot be compiled (no C++ compiler) runs as the reference from then on, with a warning; the
    # other compiled loops are still tried (one failure switched every compiled path off for the process).
    from slimact.quant import inductor

    monkeypatch.setattr(inductor, "_failed", {})
    broken = _broken(make())
    calls = []

    def working(*args):
        calls.append(args)
        return inductor._codes(*args)

    monkeypatch.setattr(inductor, "_compiled", lambda fn, key: broken if fn is inductor._minmax else working)
    x = torch.randn(inductor.MIN_NUMEL // 64, 64)
    layout = group_layout(x.shape, QuantConfig(groups=4))
    with pytest.warns(RuntimeWarning, match="compiled loop is unavailable"):
        lo, hi = inductor.group_minmax(x, layout)
    assert list(inductor._failed) == [broken]
    ref_lo, ref_hi = reference.group_minmax(x, layout)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the failed loop is not tried again
        inductor.group_minmax(x, layout)
        lo, step = scale_params(ref_lo, ref_hi, 255)
        codes = inductor.quantize(x, layout, lo, step, 8, None)
    assert len(calls) == 1  # the quantise loop, still compiled
    assert torch.equal(codes, reference.quantize(x, layout, lo, step, 8, None))


@pytest.mark.parametrize("make", [lambda: RuntimeError("a bug in the loop"), lambda: TypeError("a bug in the call")],
                         ids=["RuntimeError", "TypeError"])
def test_an_error_raised_by_running_the_loop_is_raised_not_hidden(monkeypatch, make):
    # Only what the compiler raises (no compiler; the backend failing on the graph, as torch 2.11's inductor does
    # on CUDA) falls back: an error raised by running the code is a bug.
    from slimact.quant import inductor

    monkeypatch.setattr(inductor, "_failed", {})
    monkeypatch.setattr(inductor, "_compiled", lambda fn, key: _broken(make()))
    x = torch.randn(inductor.MIN_NUMEL // 64, 64)
    with pytest.raises(Exception, match="a bug in"):
        inductor.group_minmax(x, group_layout(x.shape, QuantConfig(groups=4)))
    assert not inductor._failed


@pytest.mark.parametrize(("name", "loops"), [
    # the norm backward (its offset), the in-place GELU's (its table's left end and spacing), the 8-bit GELU
    # gradient's restore-in-its-loop (math.pi and the tanh form's constants)
    ("gpt2", {"_backward", "_inplace_gradient", "_restore_map"}),
    # RMSNorm with offset 1.0, the gated MLP's backward
    ("gemma", {"_backward", "_elementwise_backward_eager"}),
])
def test_python_floats_are_constants_of_the_compiled_loops_not_symbolic_inputs(monkeypatch, name, loops):
    # With dynamic=True, dynamo made every Python float a loop reads (a norm's offset, the in-place GELU table's
    # left end, module globals such as math.pi in the GELU gradient) a symbolic input of the graph; torch 2.11's
    # inductor then failed in tensorify_python_scalars on CUDA (BackendCompilerFailed, an H200 run), and the loops
    # fell back to eager ops. Recorded here through a backend that keeps each traced graph's inputs.
    import functools

    import slimact
    from slimact import zoo

    traced = {}

    def recording(gm, example_inputs):
        inputs = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                arg = node.meta.get("grapharg")
                value = node.meta.get("example_value")
                inputs.append((node.name, type(value).__name__, bool(getattr(arg, "pass_arg_as_tensor", False))))
        traced[gm.forward.__code__.co_filename + str(len(traced))] = inputs
        return gm.forward

    names = set()
    original = inductor._compiled.__wrapped__

    @functools.cache
    def compiled(fn, key):
        names.add(fn.__name__)
        return original(fn, key)

    monkeypatch.setattr(inductor, "_BACKEND", recording)
    monkeypatch.setattr(inductor, "_compiled", compiled)
    monkeypatch.setattr(inductor, "_failed", {})
    for policy in ("tempo", "int8"):
        model = slimact.convert(zoo.build(name, tiny=True).train(), policy=policy)
        model(**zoo.example_inputs(model, 32, 128)).loss.backward()  # 4096 tokens: MIN_NUMEL
    assert traced
    for inputs in traced.values():
        floats = [n for n, kind, as_tensor in inputs if as_tensor or kind in ("SymFloat", "float")]
        assert not floats, inputs
    assert loops <= names  # the loops that read floats were among those traced
