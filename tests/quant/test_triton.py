"""Triton kernels against the reference, bit for bit: on a CUDA device when there is one (benchmarks/gpu.sh),
else on CPU through TRITON_INTERPRET=1 (see conftest)."""

import pytest
import torch

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
    buffers = module._x_lo, module._x_range
    est_lo, est_hi = state.estimate(8)
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
    assert module._x_lo is buffers[0] and module._x_range is buffers[1]
    t_lo, t_hi, magnitude = reference.group_stats(x, layout)
    limit = reference.outlier_threshold(magnitude, layout, x.numel())
    t_lo, t_hi = torch.maximum(t_lo, -limit), torch.minimum(t_hi, limit)
    torch.testing.assert_close(module._x_lo, est_lo * 0.9 + t_lo * 0.1)
    torch.testing.assert_close(module._x_range, (est_hi - est_lo) * 0.9 + (t_hi - t_lo) * 0.1)
    assert module._x_range[0] < 100
    # (The detector is not vacuous: the pack of a tensor's own range decides outliers on the host.)
    with pytest.raises(AssertionError, match="host sync"), HostReads(fail=True):
        pack(x, QuantConfig(groups=8), backend="triton", share=False)


def test_a_running_pack_on_the_gpu_path_restores_a_non_finite_group_as_nan_and_keeps_its_estimate():
    gen = torch.Generator().manual_seed(1)
    cfg = QuantConfig(groups=8, scale="running", outliers=False)
    module, state = _estimated(torch.randn(64, 48, generator=gen).to(DEVICE), cfg)
    before = module._x_lo.clone(), module._x_range.clone()
    x = torch.randn(64, 48, generator=gen).to(DEVICE)
    x[10, 7] = float("nan")  # channel 7: group 1 (channels 6-11)
    with HostReads(fail=True):
        packed = pack(x, cfg, state, backend="triton", share=False)
    out = unpack(packed)
    group = torch.zeros(48, dtype=torch.bool)
    group[6:12] = True
    assert torch.isnan(out[:, group]).all() and torch.isfinite(out[:, ~group]).all()
    assert torch.equal(module._x_lo[1], before[0][1]) and torch.equal(module._x_range[1], before[1][1])
    assert not torch.equal(module._x_lo, before[0])  # the other groups moved
    # In eval (training=False) nothing moves.
    after = module._x_lo.clone()
    with HostReads(fail=True):
        pack(x * 3, cfg, state, training=False, backend="triton", share=False)
    assert torch.equal(module._x_lo, after)


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
        lo, step = scale_params(*state.estimate(8), 255)  # the estimate this replay packs with
        static_x.copy_(torch.randn(64, 48, generator=gen).to(DEVICE) * scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.tensors[1], lo) and torch.equal(captured.tensors[2], step)
        assert torch.equal(captured.tensors[0], reference.quantize(static_x, layout, lo, step, 8, None))
    assert not torch.equal(state.estimate(8)[0], lo)  # each replay folded its tensor's range in
