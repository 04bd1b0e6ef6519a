"""The compiled CPU pack (slimact.quant.inductor) against the reference: bit for bit, where it applies."""

import warnings

import pytest
import torch

from _harness import estimates
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
# Below MIN_NUMEL, from PACK_MIN_NUMEL: the whole pack is one compiled call (inductor.pack8); the other loops eager.
SMALL = {
    "small-channels": ((12, 768), QuantConfig(groups=8)),
    "small-per-channel": ((128, 64), QuantConfig(groups=0)),
    "small-heads": ((2, 4, 16, 64), QuantConfig(group_dim=1, groups=0)),
    "small-whole": ((50, 100), QuantConfig(group_dim=None)),
    "small-outliers": ((1, 64, 768), QuantConfig(groups=0, outliers=True)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [*CASES, *SMALL])
def test_compiled_pack_equals_the_reference_bit_for_bit(case, dtype, monkeypatch):
    shape, cfg = {**CASES, **SMALL}[case]
    torch.manual_seed(0)
    x = (torch.randn(shape) * torch.linspace(0.1, 5, shape[-1])).to(dtype)
    x.view(-1)[::1000] = 0.0
    assert (x.numel() >= inductor.MIN_NUMEL) == (case in CASES) and x.numel() >= inductor.PACK_MIN_NUMEL
    assert backend_for(x) == "inductor"
    layout = group_layout(x.shape, cfg)
    assert inductor._applies(x, layout, inductor.PACK_MIN_NUMEL) is not None  # the compiled pack is what runs
    taken = []  # whether each call of the one-call compiled pack took the tensor
    original = inductor.pack8
    monkeypatch.setattr(inductor, "pack8", lambda *a: (out := original(*a), taken.append(out is not None))[0])
    ref = pack(x, cfg, backend="reference", share=False)
    assert not taken
    fast = pack(x, cfg, backend="inductor", share=False)
    assert taken == [True]
    for a, b in zip(ref.tensors, fast.tensors, strict=True):
        assert torch.equal(a, b)
    assert ref.meta == fast.meta
    restored = unpack(fast, backend="inductor")
    assert restored.dtype == dtype and torch.equal(restored, unpack(ref, backend="reference"))


@pytest.mark.parametrize("case", [*CASES, *SMALL])
def test_compiled_stats_and_outliers_equal_the_references(case):
    # The range bit for bit; the magnitude (a sum, in another order) to float rounding; the outliers it decides,
    # and so the whole pack, the same.
    from slimact.quant import reference

    shape, cfg = {**CASES, **SMALL}[case]
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
        ((64, 768), QuantConfig(groups=8)),  # below MIN_NUMEL: the pack's own loops (not pack8) are eager
    ],
    ids=["4-bit", "stochastic", "uneven-groups", "small", "below-min-numel"],
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
    from torch._dynamo.utils import counters, guard_failures

    import slimact
    from slimact import zoo

    model = slimact.convert(zoo.build("gpt2", tiny=True).train())
    inputs = zoo.example_inputs(model, 32, 128)  # [4096, 64] hidden states: MIN_NUMEL

    # From empty caches: what other tests of this process compiled before (other shapes of the same loops, whose
    # cache entries then fail this model's guards) made it count recompiles that are not this model's.
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    failures = {code: len(reasons) for code, reasons in guard_failures.items()}
    model(**inputs).loss.backward()
    first = counters["stats"]["unique_graphs"] - graphs
    for _ in range(3):
        model(**inputs).loss.backward()
    # Each compiled loop (the pack, the restore, the fused backward rows, ...) with at most two shape variants
    # (channel groups and one whole-tensor or single-run view): at most one recompile of any of them, all in the
    # first step; with the bug, 8 recompiles of the quantise alone in the first step, and more at every step.
    recompiles = {code.co_name: len(reasons) - failures.get(code, 0) for code, reasons in guard_failures.items()}
    assert first > 0 and all(n <= 1 for n in recompiles.values()), recompiles
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
    from torch._inductor.exc import InvalidCxxCompiler

    from slimact.quant import inductor

    monkeypatch.setattr(inductor, "_failed", {})
    monkeypatch.setattr(inductor, "_failed_somewhere", set())
    broken = _broken(make())
    calls = []

    def working(*args):
        calls.append(args)
        return inductor._codes(*args)

    monkeypatch.setattr(inductor, "_compiled",
                        lambda fn, key, serial=False: broken if fn is inductor._minmax else working)
    x = torch.randn(inductor.MIN_NUMEL // 64, 64)
    layout = group_layout(x.shape, QuantConfig(groups=4))
    with pytest.warns(RuntimeWarning, match="compiled loop is unavailable"):
        lo, hi = inductor.group_minmax(x, layout)
    # No compiler: the loop is off for every shape; the backend failing on a graph: for that graph's
    # specialisation (its sizes 0, 1 or more), as the next test shows.
    no_compiler = "InvalidCxxCompiler" in repr(make()) or isinstance(make().__cause__, InvalidCxxCompiler)
    assert list(inductor._failed) == [broken if no_compiler else (broken, inductor._signature((x.view(-1, 4, 16),)))]
    ref_lo, ref_hi = reference.group_minmax(x, layout)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the failed loop is not tried again
        inductor.group_minmax(x, layout)
        lo, step = scale_params(ref_lo, ref_hi, 255)
        codes = inductor.quantize(x, layout, lo, step, 8, None)
    assert len(calls) == 1  # the quantise loop, still compiled
    assert torch.equal(codes, reference.quantize(x, layout, lo, step, 8, None))


def test_a_graph_the_backend_fails_on_turns_off_that_specialisation_of_the_loop_only(monkeypatch):
    # Dynamic sizes are specialised on 0 and 1: torch 2.13's CPU codegen fails on the attention rows' in-place loop
    # for [1, 1, rows, S] blocks only. A loop whose graph failed for one specialisation stays compiled for the
    # others (one failure had turned it off for every shape, for the process), and the failed one is not retried.
    from slimact.quant import inductor

    monkeypatch.setattr(inductor, "_failed", {})
    monkeypatch.setattr(inductor, "_failed_somewhere", set())
    ran = []

    def loop(x3, lo, step):
        ran.append(x3.shape)
        if x3.shape[0] == 1:
            raise _backend_failed(KeyError("buf1"))
        return inductor._codes(x3, lo, step)

    monkeypatch.setattr(inductor, "_compiled", lambda fn, key, serial=False: loop)
    cfg = QuantConfig(group_dim=1, groups=0)  # a group per head: runs [B, H, T * D], B the loop's outer size
    warned = []
    for batch in (1, 2, 1, 2):
        x = torch.randn(batch, 4, inductor.MIN_NUMEL // 256, 64)
        layout = group_layout(x.shape, cfg)
        lo, step = scale_params(*reference.group_minmax(x, layout), 255)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            codes = inductor.quantize(x, layout, lo, step, 8, None)
        assert torch.equal(codes, reference.quantize(x, layout, lo, step, 8, None))
        warned.append(sum("compiled loop is unavailable" in str(w.message) for w in caught))
    assert [shape[0] for shape in ran] == [1, 2, 2]  # the outer-1 graph tried once; the other run both times
    assert warned == [1, 0, 0, 0]


@pytest.mark.parametrize("make", [lambda: RuntimeError("a bug in the loop"), lambda: TypeError("a bug in the call")],
                         ids=["RuntimeError", "TypeError"])
def test_an_error_raised_by_running_the_loop_is_raised_not_hidden(monkeypatch, make):
    # Only what the compiler raises (no compiler; the backend failing on the graph, as torch 2.11's inductor does
    # on CUDA) falls back: an error raised by running the code is a bug.
    from slimact.quant import inductor

    monkeypatch.setattr(inductor, "_failed", {})
    monkeypatch.setattr(inductor, "_compiled", lambda fn, key, serial=False: _broken(make()))
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
    def compiled(fn, key, serial=False):
        names.add(fn.__name__)
        return original(fn, key, serial)

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


def _aten_ops(fn) -> int:
    # The PyTorch ops (aten::*) a call dispatches, those inside them included; a compiled loop's own code is not one.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


@pytest.mark.parametrize("case", ["channels", "heads", "whole"])
def test_a_pack_is_one_compiled_call_with_no_eager_passes_or_small_ops_around_it(case, monkeypatch):
    # Before, a default 8-bit pack of a large CPU tensor was the range's compiled loop, then 225+ PyTorch ops on
    # [groups] tensors (the outer reduction of the runs' partials, the outlier threshold, the NaN/clip/outlier flags,
    # the fp64 scale) and the codes' compiled loop. Now all of it is inductor.pack8's one compiled call, and the host
    # reads its flags (a stack of the 0-d flags and the read) once.
    shape, cfg = CASES[case]
    torch.manual_seed(0)
    x = torch.randn(shape)
    calls = []
    original = inductor.pack8
    monkeypatch.setattr(inductor, "pack8", lambda *a: calls.append(a[0].shape) or original(*a))
    for name in ("quantize", "group_stats", "group_minmax"):  # the separate loops it replaces are not run
        monkeypatch.setattr(inductor, name, lambda *a, name=name: pytest.fail(f"inductor.{name} ran"))
    packed = pack(x, cfg, share=False)  # (compiles on first use)
    assert calls == [x.shape]
    assert _aten_ops(lambda: pack(x, cfg, share=False)) <= 12
    ref = pack(x, cfg, backend="reference", share=False)
    assert all(torch.equal(a, b) for a, b in zip(ref.tensors, packed.tensors, strict=True)) and ref.meta == packed.meta


@pytest.mark.parametrize("clip", [None, 2.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("case", ["channels", "heads", "whole", "small-channels", "small-heads", "small-whole"])
def test_a_running_estimate_pack_equals_the_references_codes_scale_and_estimate_at_every_step(case, clip):
    # The compiled pack quantises with the estimate's scale and folds the tensor's own (clipped) range into the
    # estimate in the same call (one read of x for the range, one for the codes; the fold's values copied into the
    # module's buffers). The reference packs with the estimate it finds, then folds: the same codes, scale and
    # buffers, bit for bit, step after step, in training (the fold) and in eval (none), with outliers kept apart
    # (their range folded in instead) and a tensor holding NaN (kept exact, the estimate unchanged).
    from slimact.quant import RunningRange

    shape, base = {**CASES, **SMALL}[case]
    cfg = QuantConfig(group_dim=base.group_dim, groups=base.groups, scale="running", decay=0.8, clip=clip)
    gen = torch.Generator().manual_seed(3)
    states = {b: RunningRange(torch.nn.Module(), "_x") for b in ("reference", "inductor")}
    for step, training in enumerate([True, True, False, True, True, True]):
        x = torch.randn(shape, generator=gen) * (1 + step) + step * 0.3
        if step == 4:
            x.view(-1)[::4999] = 1e4  # outliers, kept apart
        if step == 5:
            x.view(-1)[17] = float("nan")
        packs = {b: pack(x, cfg, states[b], training=training, backend=b, share=False) for b in states}
        ref, fast = packs["reference"], packs["inductor"]
        assert ref.meta == fast.meta and len(ref.tensors) == len(fast.tensors)
        # (under the clip, outliers saturate: the clipped range has none beyond the threshold)
        assert (len(fast.tensors) > 3) == (step == 4 and clip is None) and fast.meta.raw == (step == 5)
        for a, b in zip(ref.tensors, fast.tensors, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        for name in ("_x_lo", "_x_range"):
            assert torch.equal(estimates(states["reference"].module)[name], estimates(states["inductor"].module)[name])


def test_a_running_estimate_shared_by_two_tensors_of_one_call_is_moved_by_the_first_before_the_second():
    # pack_many packs in the items' order: the second tensor of the same state finds the estimate after the
    # first's fold, as with two pack() calls (the compiled pack reads the estimate for the first only).
    from slimact.quant import RunningRange, pack_many

    cfg = QuantConfig(groups=8, scale="running")
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(344, 768, generator=gen) * s for s in (1.0, 1.0, 4.0, 0.5)]
    states = [RunningRange(torch.nn.Module(), "_x") for _ in range(2)]
    alone = [pack(x, cfg, states[0], share=False) for x in xs[:2]]
    alone += [pack(xs[2], cfg, states[0], share=False), pack(xs[3], cfg, states[0], share=False)]
    pack_many([(x, cfg, states[1]) for x in xs[:2]], share=False)
    together = pack_many([(x, cfg, states[1]) for x in xs[2:]], share=False)
    for a, b in zip(alone[2:], together, strict=True):
        assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors, strict=True))
    assert torch.equal(estimates(states[0].module)["_x_lo"], estimates(states[1].module)["_x_lo"])
    assert torch.equal(estimates(states[0].module)["_x_range"], estimates(states[1].module)["_x_range"])


@pytest.mark.parametrize("running", [False, True], ids=["dynamic", "running"])
def test_a_strided_tensor_is_packed_by_the_one_compiled_call_from_its_contiguous_copy(running, monkeypatch):
    # Attention's q, k, v ([B, T, H, D] memory seen as [B, H, T, D]) and a slice of a fused projection: the one-call
    # pack (inductor.pack8) takes the contiguous copy (made once). Reading a permuted tensor in its memory order
    # instead was measured slower on the CPU (7.6x a copy's time against 3.8x, [4, 12, 256, 64]).
    from slimact.quant import RunningRange

    cfg = QuantConfig(group_dim=1, groups=0, scale="running" if running else "dynamic")
    gen = torch.Generator().manual_seed(2)
    views = {
        "permuted": lambda: torch.randn(2, 256, 4, 128, generator=gen).transpose(1, 2),
        "sliced": lambda: torch.randn(2, 256, 3, 4, 128, generator=gen)[:, :, 1].transpose(1, 2),
    }
    seen = []
    original = inductor.pack8
    monkeypatch.setattr(inductor, "pack8", lambda x, *a: seen.append(x.is_contiguous()) or original(x, *a))
    for make in views.values():
        states = [RunningRange(torch.nn.Module(), "_x") if running else None for _ in range(2)]
        for _ in range(2):  # (the first sets a running estimate, the second packs with it)
            x = make()
            seen.clear()
            fast = pack(x, cfg, states[0], share=False)
            assert seen == [False, True]  # x (not taken), then its contiguous copy
            ref = pack(x, cfg, states[1], backend="reference", share=False)
            assert all(torch.equal(a, b) for a, b in zip(ref.tensors, fast.tensors, strict=True))
    permuted = views["permuted"]()
    clones = _aten_ops_named(lambda: pack(permuted, QuantConfig(group_dim=1, groups=0), share=False), "aten::clone")
    assert clones == 1  # the one contiguous copy, made once for the pack


def _aten_ops_named(fn, name: str) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == name)


def test_a_pack_below_min_numel_is_compiled_to_run_on_one_thread(monkeypatch):
    # With dynamic sizes inductor's C++ opens an OpenMP team at every call, whatever the size; below MIN_NUMEL the
    # pack's loops run on one thread (as PyTorch's own ops do below 32 Ki elements), so that a busy machine's
    # descheduled thread cannot stall a small pack at the team's barrier.
    asked = []
    original = inductor._compiled
    monkeypatch.setattr(inductor, "_compiled", lambda fn, key, serial=False: asked.append((fn.__name__, serial))
                        or original(fn, key, serial))
    cfg = QuantConfig(groups=8)
    for rows in (16, inductor.MIN_NUMEL // 768 + 1):
        x = torch.randn(rows, 768)
        codes = pack(x, cfg, share=False).tensors[0]
        assert torch.equal(codes, pack(x, cfg, backend="reference", share=False).tensors[0])
    assert asked == [("_pack8", True), ("_pack8", False)]

    options = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: options.append(kw.get("options")) or fn)
    key = object()  # an entry of its own in the cache of compiled copies
    original(inductor._pack8, key, True)
    original(inductor._pack8, key, False)
    assert options == [{"cpp.threads": 1}, None]


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "vit-b16"])
def test_a_converted_models_step_with_small_compiled_packs_equals_the_references(name, monkeypatch):
    # At 4 x 32 tokens of width 64 the activations (8 Ki elements and up) are below MIN_NUMEL: each is packed by
    # the one compiled call (on one thread), every other loop eager. Loss and every gradient are the reference
    # backend's bit for bit.
    import copy

    import slimact
    from slimact import zoo

    base = zoo.build(name, tiny=True).train()
    inputs = zoo.example_inputs(base, 4, 32)
    taken = []
    original = inductor.pack8
    monkeypatch.setattr(inductor, "pack8", lambda *a: (out := original(*a), taken.append(out is not None))[0])
    results = []
    for backend in ("inductor", "reference"):
        if backend == "reference":
            monkeypatch.setenv("SLIMACT_BACKEND", "reference")
        model = slimact.convert(copy.deepcopy(base), policy="int8")
        torch.manual_seed(0)
        loss = zoo.projection_loss(model(**inputs))
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
        if backend == "inductor":
            assert sum(taken) >= 10  # the compiled packs of one step (a strided q, k or v: of its copy, second)
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
