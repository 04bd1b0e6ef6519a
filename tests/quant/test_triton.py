"""Triton kernels against the reference, bit for bit: on a CUDA device when there is one (benchmarks/gpu.sh),
else on CPU through TRITON_INTERPRET=1 (see conftest)."""

import inspect
import itertools
import re
from pathlib import Path

import pytest
import torch

from _harness import estimates
from _host import HostReads

pytest.importorskip("triton")

from slimact.quant import QuantConfig, RunningRange, pack, reference, unpack
from slimact.quant import triton as kernels
from slimact.quant.reference import PackMeta, group_layout, group_minmax, scale_params

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    ((1,), QuantConfig(group_dim=None)),
    ((7,), QuantConfig(groups=3)),
    ((5, 13), QuantConfig(groups=4)),
    ((3, 5, 16), QuantConfig(groups=0)),
    ((2, 3, 9, 5), QuantConfig(group_dim=1, groups=0)),
    ((2, 6, 9, 5), QuantConfig(group_dim=1, groups=4)),
    ((1023,), QuantConfig(group_dim=None)),
    # the tilings of quantize/dequantize: channel groups, sub-byte codes packing within a row of 12; per head
    # with rows of 32; rows of 7 (sub-byte: flat tiles); one group along a dim (whole-tensor tiles)
    ((6, 12), QuantConfig(groups=3)),
    ((2, 6, 8, 4), QuantConfig(group_dim=1, groups=4)),
    ((3, 50, 7), QuantConfig(group_dim=1, groups=0)),
    ((9, 10), QuantConfig(groups=1)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("seed", [None, 0, 12345, 2**31 - 2], ids=["nearest", "seed0", "seed12345", "seedmax"])
@pytest.mark.parametrize("shape,cfg", CASES)
def test_triton_equals_reference(shape, cfg, bits, seed, dtype):
    x = (torch.randn(shape) * 4).to(dtype).to(DEVICE)
    layout = group_layout(x.shape, cfg)
    lo, step = scale_params(*group_minmax(x, layout), (1 << bits) - 1)
    ref = reference.quantize(x, layout, lo, step, bits, seed)
    tri = kernels.quantize(x, layout, lo, step, bits, seed)
    assert torch.equal(ref, tri)
    meta = PackMeta(x.shape, dtype, bits, layout, False)
    assert torch.equal(reference.dequantize(ref, meta, lo, step), kernels.dequantize(tri, meta, lo, step))


def test_pack_through_either_backend_gives_the_same_codes():
    x = torch.randn(9, 6, device=DEVICE).t()  # non-contiguous
    cfg = QuantConfig(groups=2)
    ref, tri = pack(x, cfg, backend="reference", share=False), pack(x, cfg, backend="triton", share=False)
    for a, b in zip(ref.tensors, tri.tensors, strict=True):
        assert torch.equal(a, b)


# The range pass: along the channels (inner == 1, several row blocks, a group count that does not divide), along
# inner (per head; a conv's channels), the whole tensor, and a trailing dim of one.
STATS_CASES = [
    *CASES,
    ((130, 70), QuantConfig(groups=8)),
    ((3, 4, 40, 33), QuantConfig(group_dim=1, groups=0)),
    ((2, 6, 5, 7), QuantConfig(group_dim=1, groups=4)),
    ((5000,), QuantConfig(group_dim=None)),
    ((9, 1), QuantConfig(groups=0)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,cfg", STATS_CASES)
def test_one_pass_stats_equal_the_references(shape, cfg, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 4).to(dtype).to(DEVICE)
    layout = group_layout(x.shape, cfg)
    lo, hi, root = kernels.group_stats(x, layout)
    ref_lo, ref_hi, ref_root = reference.group_stats(x, layout)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)
    # fp32 partial sums against the reference's fp64 sum: float rounding of at most 5000 terms
    torch.testing.assert_close(root, ref_root, rtol=5000 * 2**-24, atol=0)
    assert torch.equal(kernels.group_minmax(x, layout)[0], ref_lo)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_mark_their_group_and_keep_the_tensor_exact(bad):
    x = torch.randn(64, 48, device=DEVICE)
    x[10, 7] = bad  # channel 7: group 1 of 8
    layout = group_layout(x.shape, QuantConfig(groups=8))
    lo, hi, _ = kernels.group_stats(x, layout)
    assert torch.isnan(lo[1]) and torch.isnan(hi[1])
    ref_lo, ref_hi, _ = reference.group_stats(x, layout)
    others = torch.arange(8) != 1
    assert torch.equal(lo[others], ref_lo[others]) and torch.equal(hi[others], ref_hi[others])
    packed = pack(x, QuantConfig(groups=8), backend="triton", share=False)
    assert packed.raw
    torch.testing.assert_close(packed.tensors[0], x, rtol=0, atol=0, equal_nan=True)


def test_outliers_decided_from_the_one_pass_stats_give_the_references_pack():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 64, generator=gen)
    x.view(-1)[torch.randperm(x.numel(), generator=gen)[:30]] = 1e4
    x = x.to(DEVICE)
    for cfg in (QuantConfig(groups=8), QuantConfig(group_dim=None), QuantConfig(groups=0)):
        ref, tri = pack(x, cfg, backend="reference", share=False), pack(x, cfg, backend="triton", share=False)
        assert len(tri.tensors) == 5
        for a, b in zip(ref.tensors, tri.tensors, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "bits,seed", [(8, None), (8, 12345), (4, None)], ids=["8-nearest", "8-stochastic", "4-nearest"]
)
@pytest.mark.parametrize("shape,cfg", STATS_CASES)
def test_codes_for_an_estimate_and_the_tensors_own_range_come_from_one_read(shape, cfg, bits, seed, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 4).to(dtype).to(DEVICE)
    layout = group_layout(x.shape, cfg)
    # an estimate narrower than x's range: the codes beyond it saturate
    lo, step = scale_params(*(t * 0.5 for t in group_minmax(x, layout)), (1 << bits) - 1)
    codes, t_lo, t_hi, root = kernels.quantize_stats(x, layout, lo, step, bits, seed)
    assert torch.equal(codes, reference.quantize(x, layout, lo, step, bits, seed))
    ref_lo, ref_hi, ref_root = reference.group_stats(x, layout)
    assert torch.equal(t_lo, ref_lo) and torch.equal(t_hi, ref_hi)
    torch.testing.assert_close(root, ref_root, rtol=5000 * 2**-24, atol=0)


def _estimated(x0: torch.Tensor, cfg: QuantConfig) -> tuple[torch.nn.Module, RunningRange]:
    module = torch.nn.Module()
    state = RunningRange(module, "_x")
    pack(x0, cfg, state, backend="triton", share=False)  # the first tensor initialises the estimate
    return module, state


def test_a_running_pack_on_the_gpu_path_reads_nothing_back_and_folds_the_range_in_place():
    gen = torch.Generator().manual_seed(0)
    cfg = QuantConfig(groups=8, scale="running")
    module, state = _estimated(torch.randn(64, 48, generator=gen).to(DEVICE), cfg)
    buffers = estimates(module)["_x_lo"], estimates(module)["_x_range"]
    est_lo, est_hi = state.estimate(8, torch.device(DEVICE))
    x = torch.randn(64, 48, generator=gen) * 1.5
    x[3, 5] = 1e4  # a heavy outlier in group 0
    x = x.to(DEVICE)
    with HostReads(fail=True):
        packed = pack(x, cfg, state, backend="triton", share=False)
    layout = group_layout(x.shape, cfg)
    lo, step = scale_params(est_lo, est_hi, 255)
    # packed with the estimate it found, the codes beyond it saturated
    assert torch.equal(packed.tensors[1], lo) and torch.equal(packed.tensors[2], step)
    assert torch.equal(packed.tensors[0], reference.quantize(x, layout, lo, step, 8, None))
    # its own range folded in on the device, in place (a captured CUDA graph updates the module's own buffers),
    # clipped to its outlier threshold: the outlier does not drag the estimate out to 1e4
    assert estimates(module)["_x_lo"] is buffers[0] and estimates(module)["_x_range"] is buffers[1]
    t_lo, t_hi, magnitude = reference.group_stats(x, layout)
    limit = reference.outlier_threshold(magnitude, layout, x.numel())
    t_lo, t_hi = torch.maximum(t_lo, -limit), torch.minimum(t_hi, limit)
    torch.testing.assert_close(estimates(module)["_x_lo"], est_lo * 0.9 + t_lo * 0.1)
    torch.testing.assert_close(estimates(module)["_x_range"], (est_hi - est_lo) * 0.9 + (t_hi - t_lo) * 0.1)
    assert estimates(module)["_x_range"][0] < 100
    # (The detector is not vacuous: the pack of a tensor's own range decides outliers on the host.)
    with pytest.raises(AssertionError, match="host sync"), HostReads(fail=True):
        pack(x, QuantConfig(groups=8), backend="triton", share=False)


def test_a_running_pack_on_the_gpu_path_restores_a_non_finite_group_as_nan_and_keeps_its_estimate():
    gen = torch.Generator().manual_seed(1)
    cfg = QuantConfig(groups=8, scale="running", outliers=False)
    module, state = _estimated(torch.randn(64, 48, generator=gen).to(DEVICE), cfg)
    before = estimates(module)["_x_lo"].clone(), estimates(module)["_x_range"].clone()
    x = torch.randn(64, 48, generator=gen).to(DEVICE)
    x[10, 7] = float("nan")  # channel 7: group 1 (channels 6-11)
    with HostReads(fail=True):
        packed = pack(x, cfg, state, backend="triton", share=False)
    out = unpack(packed)
    group = torch.zeros(48, dtype=torch.bool)
    group[6:12] = True
    assert torch.isnan(out[:, group]).all() and torch.isfinite(out[:, ~group]).all()
    lo, rng = estimates(module)["_x_lo"], estimates(module)["_x_range"]
    assert torch.equal(lo[1], before[0][1]) and torch.equal(rng[1], before[1][1])
    assert not torch.equal(estimates(module)["_x_lo"], before[0])  # the other groups moved
    # In eval (training=False) nothing moves.
    after = estimates(module)["_x_lo"].clone()
    with HostReads(fail=True):
        pack(x * 3, cfg, state, training=False, backend="triton", share=False)
    assert torch.equal(estimates(module)["_x_lo"], after)


@pytest.mark.parametrize("layout", ["tokens", "split", "heads"])
def test_attention_packs_by_blocks_of_a_heads_channels_give_the_references_codes(layout):
    # q, k, v at 8 bits are packed as [B, T, H * D] with a group per 16 channels of a head
    # (slimact.functional._heads): a view of [B, T, H, D] memory, of a fused qkv projection's [B, T, 3, H, D]
    # (GPT-2's c_attn split: rows 3x apart), or a copy of a [B, H, T, D]-contiguous tensor.
    from slimact.functional._heads import head_blocks

    gen = torch.Generator().manual_seed(3)
    b, h, t, d = 2, 4, 24, 32
    if layout == "split":
        x = torch.randn(b, t, 3, h, d, generator=gen)[:, :, 1].transpose(1, 2)
    else:
        x = torch.randn(b, t, h, d, generator=gen).transpose(1, 2)
        x = x.contiguous() if layout == "heads" else x
    blocked, cfg = head_blocks(x.to(DEVICE), QuantConfig(group_dim=1, groups=0))
    assert blocked.shape == (b, t, h * d) and (cfg.group_dim, cfg.groups) == (-1, h * d // 16)
    ref, tri = pack(blocked, cfg, backend="reference", share=False), pack(blocked, cfg, backend="triton", share=False)
    for a, c in zip(ref.tensors, tri.tensors, strict=True):
        assert torch.equal(a, c)
    assert torch.equal(unpack(ref), unpack(tri))


def test_attentions_q_k_v_pack_together_with_one_host_sync_and_none_under_running_estimates():
    from slimact.quant import pack_many

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 40, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 2, 40, 16, generator=gen).to(DEVICE) for _ in range(2))  # grouped-query heads
    per_head = QuantConfig(group_dim=1, groups=0)
    with HostReads() as reads:
        alone = [pack(t, per_head, backend="triton", share=False) for t in (q, k, v)]
    assert reads.count == 3
    with HostReads() as reads:
        together = pack_many([(t, per_head, None) for t in (q, k, v)], backend="triton", share=False)
    assert reads.count == 1
    for a, b in zip(alone, together, strict=True):
        for s, t in zip(a.tensors, b.tensors, strict=True):
            assert torch.equal(s, t)
    running = QuantConfig(group_dim=1, groups=0, scale="running")
    module = torch.nn.Module()
    states = [RunningRange(module, f"_{name}") for name in "qkv"]
    pack_many([(t, running, st) for t, st in zip((q, k, v), states, strict=True)], backend="triton", share=False)
    with HostReads(fail=True):
        packs = pack_many([(t * 1.1, running, st) for t, st in zip((q, k, v), states, strict=True)],
                          backend="triton", share=False)
    assert all(len(p.tensors) == 3 and not p.raw for p in packs)


def _grad_times_two(x, g):
    return (g.float() * x.float() * 2).to(g.dtype)


def test_unpack_map_on_the_device_equals_the_eager_consumer():
    # On CUDA (benchmarks/gpu.sh) the loop is a Triton kernel inductor writes; here, its C++ twin.
    from slimact.quant import unpack_map

    gen = torch.Generator().manual_seed(4)
    x, g = (torch.randn(512, 1024, generator=gen).to(DEVICE) for _ in range(2))
    packed = pack(x, QuantConfig(groups=8), share=False)
    torch.testing.assert_close(unpack_map(packed, _grad_times_two, g), _grad_times_two(unpack(packed), g))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device (benchmarks/gpu.sh runs this); what "
                    "they need of the pack, no host read and state updated in place, is asserted above on any device")
def test_a_running_pack_captured_in_a_cuda_graph_replays_as_the_eager_pack():
    gen = torch.Generator().manual_seed(5)
    cfg = QuantConfig(groups=8, scale="running")
    _module, state = _estimated(torch.randn(64, 48, generator=gen).to(DEVICE), cfg)
    static_x = torch.randn(64, 48, generator=gen).to(DEVICE)
    side = torch.cuda.Stream()  # warm-up (kernel compilation) off the capturing stream, as capture requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pack(static_x, cfg, state, backend="triton", share=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pack(static_x, cfg, state, backend="triton", share=False)
    layout = group_layout(static_x.shape, cfg)
    for scale in (1.0, 2.0, 0.5):
        lo, step = scale_params(*state.estimate(8, torch.device(DEVICE)), 255)  # the estimate this replay packs with
        static_x.copy_(torch.randn(64, 48, generator=gen).to(DEVICE) * scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.tensors[1], lo) and torch.equal(captured.tensors[2], step)
        assert torch.equal(captured.tensors[0], reference.quantize(static_x, layout, lo, step, 8, None))
    assert not torch.equal(state.estimate(8, torch.device(DEVICE))[0], lo)  # each replay folded its tensor's range in


def test_each_case_of_the_tests_meets_the_tiling_it_stands_for():
    modes = {
        (shape, bits): kernels._tiling(torch.Size(shape).numel(), group_layout(shape, cfg), bits).mode
        for shape, cfg in CASES
        for bits in (8, 4)
    }
    assert modes[(6, 12), 4] == modes[(6, 12), 8] == kernels._PER_COL
    assert modes[(2, 6, 8, 4), 4] == kernels._PER_ROW and modes[(3, 50, 7), 8] == kernels._PER_ROW
    assert modes[(3, 50, 7), 4] == kernels._PER_ELEMENT  # rows of 7: a byte would straddle two rows
    assert modes[(9, 10), 4] == modes[(1023,), 4] == kernels._WHOLE
    assert not kernels._tiling(2**31 - 4096, group_layout((2**31 - 4096,), QuantConfig(group_dim=None)), 8).wide
    assert kernels._tiling(2**31, group_layout((2**31,), QuantConfig(group_dim=None)), 8).wide


@pytest.mark.parametrize("bits", [8, 4])
def test_a_group_index_past_int32_on_many_channels_and_int64_offsets_give_the_references_codes(bits, monkeypatch):
    # 46342 channels, one group each: channel * groups passes 2**31 (the kernels compute groups in int64)
    x = torch.randn(2, 46342).to(DEVICE)
    layout = group_layout(x.shape, QuantConfig(groups=0))
    lo, step = scale_params(*group_minmax(x, layout), (1 << bits) - 1)
    meta = PackMeta(x.shape, x.dtype, bits, layout, False)
    for limit in (2**31, 1):  # int32 offsets, then int64 everywhere
        monkeypatch.setattr(kernels, "_INT32_OFFSETS", limit)
        codes = kernels.quantize(x, layout, lo, step, bits, 5)
        assert torch.equal(codes, reference.quantize(x, layout, lo, step, bits, 5))
        assert torch.equal(kernels.dequantize(codes, meta, lo, step), reference.dequantize(codes, meta, lo, step))
        t_codes, t_lo, _, _ = kernels.quantize_stats(x, layout, lo, step, bits, 5)
        assert torch.equal(t_codes, codes) and torch.equal(t_lo, group_minmax(x, layout)[0])


def _launches(monkeypatch) -> list[tuple[str, dict]]:
    seen = []
    for name in ("_quantize_kernel", "_dequantize_kernel", "_stats_kernel", "_estimate_kernel", "_fold_kernel"):
        kernel = getattr(kernels, name)
        run = kernel.run

        def spy(*args, _run=run, _name=name, **kwargs):
            seen.append((_name, kwargs))
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", spy)
    return seen


def test_every_kernel_is_launched_without_fp_fusion(monkeypatch):
    # Fused, lo + code * step rounds once where the reference rounds twice: restored values one ulp off on
    # hardware (the interpreter never fuses, so this is asserted on the launches themselves).
    seen = _launches(monkeypatch)
    x = torch.randn(6, 12).to(DEVICE)
    layout = group_layout(x.shape, QuantConfig(groups=3))
    lo, step = scale_params(*group_minmax(x, layout), 15)
    codes = kernels.quantize(x, layout, lo, step, 4, 3)
    kernels.dequantize(codes, PackMeta(x.shape, x.dtype, 4, layout, False), lo, step)
    kernels.group_stats(x, layout)
    kernels.quantize_stats(x, layout, lo, step, 8, 3)
    t_lo, t_hi = group_minmax(x, layout)
    estimate = t_lo.clone(), t_hi - t_lo  # a running estimate's buffers
    lo, step = kernels.scale_estimate(*estimate, 255)
    kernels.quantize_fold(x, layout, lo, step, 8, 3, estimate, 0.9, 1.0, True, True)
    assert {name for name, _ in seen} == {"_quantize_kernel", "_dequantize_kernel", "_stats_kernel",
                                          "_estimate_kernel", "_fold_kernel"}
    assert all(kwargs.get("enable_fp_fusion") is False for _, kwargs in seen)
    # and in the source, every launch in the module (kernels added later included)
    source = Path(kernels.__file__).read_text()
    launches = re.findall(r"\w+\[[^\]\n]*\]\((.*?)\n    \)", source, re.S)
    assert len(launches) >= 3
    assert all("enable_fp_fusion=False" in launch for launch in launches)


def test_codes_divide_and_the_range_pass_takes_roots_correctly_rounded():
    # Triton's fp32 `/` and tl.sqrt are approximate on hardware (the interpreter's are exact): a code off by one
    # next to a rounding boundary. The triton package here and the GPU machine's (3.6) both have these.
    def source(fn):  # without comments
        return re.sub(r"#.*", "", inspect.getsource(fn.fn))

    code = source(kernels._code)
    assert "tl.math.div_rn(x - lo, step)" in code and "/ step" not in code
    stats = source(kernels._stats_kernel)
    assert "tl.math.sqrt_rn(" in stats and "tl.sqrt(" not in stats
    import triton.language as tl

    assert callable(tl.math.div_rn) and callable(tl.math.sqrt_rn)


@pytest.mark.parametrize(
    "shape,cfg",
    [
        ((300, 70), QuantConfig(groups=8)),
        ((3, 4, 40, 33), QuantConfig(group_dim=1, groups=0)),
        ((6000,), QuantConfig(group_dim=None)),
    ],
)
def test_a_grid_past_the_y_and_z_limits_stays_on_the_kernel(shape, cfg, monkeypatch):
    # The old launch put row blocks on grid axis 1 and the grouped dim on axis 2 (65535 each) and fell back to
    # the reference beyond; with limits of 2 there, these shapes exceeded both. Everything runs on axis 0 now.
    monkeypatch.setattr(kernels, "_GRID_MAX", (2**31 - 1, 2, 2))
    x = (torch.randn(shape) * 4).to(DEVICE)
    layout = group_layout(x.shape, cfg)
    ref = reference.group_stats(x, layout)

    def refused(*args):
        raise AssertionError("fell back to the reference")

    monkeypatch.setattr(reference, "group_stats", refused)
    seen = _launches(monkeypatch)
    lo, hi, root = kernels.group_stats(x, layout)
    assert [name for name, _ in seen] == ["_stats_kernel"]
    assert torch.equal(lo, ref[0]) and torch.equal(hi, ref[1])
    torch.testing.assert_close(root, ref[2], rtol=6000 * 2**-24, atol=0)
    step_lo, step = scale_params(ref[0], ref[1], 255)
    codes = kernels.quantize_stats(x, layout, step_lo, step, 8, None)[0]
    assert torch.equal(codes, reference.quantize(x, layout, step_lo, step, 8, None))


def test_the_whole_tensor_range_pass_masks_no_rows(monkeypatch):
    # outer == 1: one row per tile, the tile all along the tensor (it was 4 rows of 1024, 3 of them masked)
    seen = _launches(monkeypatch)
    x = torch.randn(10000).to(DEVICE)
    kernels.group_stats(x, group_layout(x.shape, QuantConfig(group_dim=None)))
    kwargs = seen[0][1]
    assert kwargs["OB"] == 1 and kwargs["B"] == kernels._TILE and kwargs["grid"] == (3,)


def _capturing(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)


def test_under_capture_the_key_comes_from_a_device_counter_each_use_advances(monkeypatch):
    # (The capture branch with a mocked capture: the seed drawn on the host would be frozen into a CUDA graph.)
    monkeypatch.setattr(kernels, "_seed_offsets", {})
    x = (torch.randn(5, 12) * 4).to(DEVICE)
    layout = group_layout(x.shape, QuantConfig(groups=3))
    lo, step = scale_params(*group_minmax(x, layout), 15)
    _capturing(monkeypatch, True)
    with pytest.raises(RuntimeError, match="before the capture"):  # no counter yet: no warm-up pack
        kernels.quantize(x, layout, lo, step, 4, 77)
    _capturing(monkeypatch, False)
    assert torch.equal(kernels.quantize(x, layout, lo, step, 4, 77), reference.quantize(x, layout, lo, step, 4, 77))
    counter = kernels._seed_offsets[x.device]
    assert counter.tolist() == [0, 0, 0, 0]  # outside capture: the host seed alone, no counter moved
    _capturing(monkeypatch, True)
    for n in range(3):  # what a replay runs: key from seed + counter, then the counter advances
        codes = kernels.quantize(x, layout, lo, step, 4, 77)
        assert torch.equal(codes, reference.quantize(x, layout, lo, step, 4, 77 + n))
        assert counter.tolist() == [0, 0, n + 1, 0]
    codes = kernels.quantize_stats(x, layout, lo * 2, step * 2, 8, 2**31 - 1)[0]  # the range pass's codes too
    assert torch.equal(codes, reference.quantize(x, layout, lo * 2, step * 2, 8, 2**31 - 1 + 3))
    assert kernels.quantize(x, layout, lo, step, 4, None).shape == (30,)  # nearest rounding takes no key
    assert counter.tolist() == [0, 0, 4, 0]
    _capturing(monkeypatch, False)
    assert torch.equal(kernels.quantize(x, layout, lo, step, 4, 77), reference.quantize(x, layout, lo, step, 4, 77))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device (benchmarks/gpu.sh runs this); the "
                    "key read from the device counter is asserted above on any device")
def test_a_stochastic_pack_captured_in_a_cuda_graph_draws_new_noise_on_every_replay():
    gen = torch.Generator().manual_seed(6)
    cfg = QuantConfig(groups=8, scale="running", stochastic=True)
    _module, state = _estimated(torch.randn(64, 48, generator=gen).to(DEVICE), cfg)
    static_x = torch.randn(64, 48, generator=gen).to(DEVICE)
    layout = group_layout(static_x.shape, cfg)
    lo4, step4 = scale_params(*group_minmax(static_x, layout), 15)
    side = torch.cuda.Stream()  # warm-up off the capturing stream: compiles, and creates the seed counter
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pack(static_x, cfg, state, training=False, backend="triton", share=False)
        kernels.quantize(static_x, layout, lo4, step4, 4, 7)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pack(static_x, cfg, state, training=False, backend="triton", share=False)  # 8-bit, one read
        codes4 = kernels.quantize(static_x, layout, lo4, step4, 4, 7)
    counter = kernels._seed_offsets[static_x.device]
    lo, step = captured.tensors[1], captured.tensors[2]
    v = (static_x - lo[layout.group_index(static_x.device)]) / step[layout.group_index(static_x.device)]
    replays = []
    for _ in range(3):
        n = int(counter[2])
        graph.replay()
        torch.cuda.synchronize()
        assert int(counter[2]) == n + 2  # one use per stochastic kernel in the graph
        # the second kernel's key is seed 7 + the counter it read: the reference's codes for that seed
        assert torch.equal(codes4, reference.quantize(static_x, layout, lo4, step4, 4, 7 + n + 1))
        codes = captured.tensors[0].clone()
        assert ((codes.float() - v.clamp(0, 255).floor()).abs() <= 1).all()  # x rounded down or up
        replays.append((codes, codes4.clone()))
    for (a, a4), (b, b4) in itertools.pairwise(replays):
        assert not torch.equal(a, b) and not torch.equal(a4, b4)


def test_half_precision_values_near_its_largest_pack_as_the_reference_does():
    # The finishing kernel keeps the plain range where zero-aligned codes would restore fp16 data beyond 65504
    # (reference._past_half), bit for bit with the reference; restored finite.
    x = torch.stack([torch.linspace(-30000.0, 65504.0, 64), torch.linspace(-65504.0, 30000.0, 64),
                     torch.linspace(-3.0, 5.0, 64)]).half().to(DEVICE)  # (the last aligned as before)
    for cfg in (QuantConfig(group_dim=0, groups=0), QuantConfig(group_dim=0, groups=3, bits=4)):  # (a row a group)
        ref, tri = pack(x, cfg, backend="reference", share=False), pack(x, cfg, backend="triton", share=False)
        for a, b in zip(ref.tensors, tri.tensors, strict=True):
            assert torch.equal(a, b)
        assert torch.isfinite(unpack(tri)).all()
