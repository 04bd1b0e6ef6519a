"""The triton backend's pack decides and scales on the device: range pass, one finishing kernel, quantise (about
three launches a tensor) and one host read per ``pack_many``, with the packs of the path it replaced (the
reference's, bit for bit). On a CUDA device when there is one, else on CPU through TRITON_INTERPRET=1 (see
conftest), the triton backend forced on CPU tensors."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _host import HostReads

pytest.importorskip("triton")

from triton.runtime.jit import KernelInterface

from slimact.quant import QuantConfig, RunningRange, pack, pack_many, reference
from slimact.quant import triton as kernels
from slimact.quant.reference import Packed, PackMeta, group_layout, outlier_threshold, scale_params

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (The interpreter computes in numpy, which warns where the fp64 zero-point search overflows to inf, as the
# reference's does silently on a zero range.)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# Allocations, views and metadata queries: no kernel on a device.
_FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "is_same_size", "sym_size",
         "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous", "is_non_overlapping_and_dense",
         "_local_scalar_dense", "lift_fresh"}


class Launches(TorchDispatchMode):
    """Counts what a pack would launch on a device: every Triton kernel of :mod:`slimact.quant.triton` (its
    launches wrapped) and every PyTorch op dispatched outside those launches but views, metadata and empty
    allocations (the Triton interpreter's own copies, made inside a launch, are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.kernels: list[str] = []
        self._inside = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        for name in dir(kernels):
            fn = getattr(kernels, name)
            if isinstance(fn, KernelInterface) and "run" not in vars(fn):
                self._stack.enter_context(_wrapped(fn, self))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if not self._inside and not func.is_view and packet not in _FREE and not _host_copy(packet, args, out):
            self.ops.append(packet)
        return out

    @property
    def count(self) -> int:
        return len(self.ops) + len(self.kernels)


def _host_copy(packet: str, args: tuple, out: object) -> bool:
    # The host read itself (``flags.tolist()`` copies a CUDA tensor to the CPU: one more op on a GPU than on the
    # CPU, where tolist reads in place): counted by HostReads, not as a launch. (Seen on an H200: one pack
    # counted 5.)
    if packet not in ("_to_copy", "copy_") or not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return False
    return any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)


@contextlib.contextmanager
def _wrapped(fn, counter: Launches):
    run = fn.run

    def counted(*args, **kwargs):
        counter.kernels.append(fn.__name__)
        counter._inside += 1
        try:
            return run(*args, **kwargs)
        finally:
            counter._inside -= 1

    fn.run = counted
    try:
        yield
    finally:
        del fn.run


def _qkv(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    # attention's q, k, v as a projection leaves them: [B, T, H, D] memory seen as [B, H, T, D] (strided)
    q = torch.randn(2, 40, 8, 16, generator=gen).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(2, 40, 2, 16, generator=gen).to(DEVICE).transpose(1, 2) for _ in range(2))
    return q, k, v


def test_a_pack_many_of_q_k_v_is_three_launches_a_tensor_and_one_host_read():
    q, k, v = _qkv(torch.Generator().manual_seed(0))
    per_head = QuantConfig(group_dim=1, groups=0)
    pack_many([(t, per_head, None) for t in (q, k, v)], backend="triton", share=False)  # compile (on a GPU)
    with Launches() as launches, HostReads() as reads:
        packs = pack_many([(t, per_head, None) for t in (q, k, v)], backend="triton", share=False)
    assert all(not p.raw and len(p.tensors) == 3 for p in packs)
    assert reads.count == 1
    # per tensor: one contiguous copy (strided q, k, v; item 9: the range pass and the quantise share it), the
    # range pass, the finishing kernel, the quantise; per call: the zeroed flags
    copies = [op for op in launches.ops if op.rstrip("_") in ("copy", "clone")]
    assert len(copies) == 3, launches.ops
    assert launches.count <= 4 * 3 + 2, (launches.ops, launches.kernels)
    # each tensor's values read once by a Triton kernel for its range and once for its codes
    assert launches.kernels.count("_stats_kernel") == 3 and launches.kernels.count("_quantize_kernel") == 3


@pytest.mark.parametrize("cfg", [QuantConfig(groups=4), QuantConfig(groups=4, clip=1.0, outliers=False),
                                 QuantConfig(group_dim=None)], ids=["channels", "clip", "whole"])
def test_one_pack_is_about_three_launches_and_one_host_read(cfg):
    x = torch.randn(64, 48, device=DEVICE)
    pack(x, cfg, backend="triton", share=False)
    with Launches() as launches, HostReads() as reads:
        packed = pack(x, cfg, backend="triton", share=False)
    assert not packed.raw and reads.count == 1
    assert launches.count <= 4, (launches.ops, launches.kernels)


def test_a_running_pack_has_no_host_read():
    q, k, v = _qkv(torch.Generator().manual_seed(1))
    running = QuantConfig(group_dim=1, groups=0, scale="running")
    module = torch.nn.Module()
    states = [RunningRange(module, f"_{name}") for name in "qkv"]
    pack_many([(t, running, st) for t, st in zip((q, k, v), states, strict=True)], backend="triton", share=False)
    with Launches(), HostReads(fail=True) as reads:
        pack_many([(t * 1.1, running, st) for t, st in zip((q, k, v), states, strict=True)], backend="triton",
                  share=False)
    assert reads.count == 0


# ---- the same packs as the path it replaced (the reference's: the same min/max, flags and float operations) ----

LAYOUTS = [
    ((1,), QuantConfig(group_dim=None)),  # one element
    ((7,), QuantConfig(groups=0)),  # one element per group
    ((1, 7), QuantConfig(groups=0)),
    ((5, 13), QuantConfig(groups=4)),  # 4 does not divide 13
    ((130, 70), QuantConfig(groups=8)),  # several row blocks of partials
    ((3, 5, 16), QuantConfig(groups=0)),
    ((2, 3, 9, 5), QuantConfig(group_dim=1, groups=0)),  # per head
    ((2, 6, 9, 5), QuantConfig(group_dim=1, groups=4)),
    ((4, 3, 11), QuantConfig(group_dim=None)),  # whole tensor
    ((5000,), QuantConfig(group_dim=None)),  # several partials
]


def _assert_same_pack(a, b):
    assert a.meta == b.meta and len(a.tensors) == len(b.tensors)
    for s, t in zip(a.tensors, b.tensors, strict=True):
        assert s.dtype == t.dtype and s.shape == t.shape
        torch.testing.assert_close(s, t, rtol=0, atol=0, equal_nan=True)


def _replaced_pack(x, cfg):
    """The pack as the replaced path made it: the range pass's partials reduced by PyTorch ops
    (``kernels.group_stats``), then the flags, threshold and scale by PyTorch ops, decided on the host."""
    layout = group_layout(x.shape, cfg)
    data = x.contiguous()
    lo, hi, magnitude = kernels.group_stats(data, layout)
    threshold = outlier_threshold(magnitude, layout, x.numel()) if cfg.outliers else None
    if not (torch.isfinite(lo) & torch.isfinite(hi - lo)).all():
        return Packed((x,), PackMeta(x.shape, x.dtype, 0, reference.GroupLayout(None, 1, 1, x.numel()), True))
    clipped = False
    if cfg.clip is not None:
        clipped = bool(((lo < -cfg.clip) | (hi > cfg.clip)).any())
        lo, hi = lo.clamp(-cfg.clip, cfg.clip), hi.clamp(-cfg.clip, cfg.clip)
    kept = ()
    if threshold is not None and (torch.maximum(lo.abs(), hi.abs()) > threshold).any():
        lo, hi, *kept = reference.split_outliers(data, layout, threshold)
        if cfg.clip is not None:
            lo, hi = lo.clamp(-cfg.clip, cfg.clip), hi.clamp(-cfg.clip, cfg.clip)
    lo, step = scale_params(lo, hi, cfg.qmax)
    codes = kernels.quantize(data, layout, lo, step, cfg.bits, None)
    return Packed((codes, lo, step, *kept), PackMeta(x.shape, x.dtype, cfg.bits, layout, False, clipped=clipped))


def _packs(x, cfg):
    """The new pack, checked against the replaced path's and returned with the reference's."""
    tri = pack(x, cfg, backend="triton", share=False)
    _assert_same_pack(_replaced_pack(x, cfg), tri)
    return pack(x, cfg, backend="reference", share=False), tri


def _knife_edge(x, cfg):
    # One-element groups keeping outliers: the threshold is (sqrt|x|)**2, |x| itself up to rounding, so whether
    # the element is its own outlier rests on the last bit of a square root, the reference's fp64 one or the range
    # pass's fp32 one (which the replaced path had too). Only the replaced path's pack is compared there.
    layout = group_layout(x.shape, cfg)
    return cfg.outliers and x.numel() // layout.groups == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("outliers", [True, False], ids=["outliers", "no-outliers"])
@pytest.mark.parametrize("clip", [None, 1.5], ids=["no-clip", "clip"])
@pytest.mark.parametrize("shape,cfg", LAYOUTS)
def test_the_device_decided_pack_equals_the_references(shape, cfg, clip, outliers, dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen) * 2 + 0.3
    if outliers and x.numel() > 8:
        x.view(-1)[torch.randperm(x.numel(), generator=gen)[: max(1, x.numel() // 100)]] = 3e3
    x = x.to(dtype).to(DEVICE)
    for bits in (8, 4, 2) if dtype == torch.float32 else (8,):  # (the code width only matters to the scale)
        c = QuantConfig(**{**cfg.__dict__, "bits": bits, "outliers": outliers, "clip": clip})
        ref, tri = _packs(x, c)
        if not _knife_edge(x, c):
            _assert_same_pack(ref, tri)
        assert not tri.raw
        # the decisions were the device's: outliers kept apart where there were (within the clip, none), the clip
        # seen where it cut
        if bits == 8 and x.numel() > 8:
            assert (len(tri.tensors) == 5) == (outliers and clip is None)
            assert tri.meta.clipped == (clip is not None and bool((x.float().abs() > clip).any()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "overflow"])
@pytest.mark.parametrize("shape,cfg", [((64, 48), QuantConfig(groups=8)), ((2, 3, 9, 5), QuantConfig(group_dim=1,
                         groups=0)), ((5000,), QuantConfig(group_dim=None)), ((64, 48), QuantConfig(groups=8, clip=1.0,
                         outliers=False))])
def test_a_non_finite_tensor_is_kept_exact_as_the_reference_keeps_it(shape, cfg, bad):
    x = torch.randn(shape)
    if bad == "overflow":  # each value finite, the range not (fp32's hi - lo is inf)
        x.view(-1)[3], x.view(-1)[4] = 3e38, -3e38
    else:
        x.view(-1)[3] = bad
    x = x.to(DEVICE)
    ref, tri = _packs(x, cfg)
    assert tri.raw and tri.tensors[0] is x
    _assert_same_pack(ref, tri)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("values", ["constant", "zero", "tiny", "denormal", "one-sided", "clip-edge"])
def test_degenerate_groups_give_the_references_pack(values, dtype):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 10, generator=gen)
    if values == "constant":
        x[:, :5] = 2.5  # groups 0 and 1 of 4: zero range
    elif values == "zero":
        x[:, :5] = 0.0
    elif values == "tiny":
        x = x * 1e-4
    elif values == "denormal":
        x = x * (1e-40 if dtype == torch.float32 else 1e-7)
    elif values == "one-sided":
        x = x.abs() + 1.0
    else:  # the largest value is the clip rounded to fp32: not beyond it, as PyTorch compares
        x[2, 3] = torch.tensor(0.1, dtype=torch.float32).to(dtype).float()
        x = x.clamp(-0.05, x[2, 3].item())
    x = x.to(dtype).to(DEVICE)
    for cfg in (QuantConfig(groups=4), QuantConfig(groups=0, bits=4), QuantConfig(group_dim=None, bits=2),
                QuantConfig(groups=4, clip=0.1)):
        ref, tri = _packs(x, cfg)
        _assert_same_pack(ref, tri)
        assert not tri.raw


# Every (levels, clip) pair on one whole-tensor group; on 512 groups (an interpreted program each, 4 s a case on the
# CPU) each level and each clip once.
_FINISH_CASES = [pytest.param(qmax, clip, True, id=f"whole-{qmax}-{clip}") for qmax in (255, 15, 3)
                 for clip in (None, 0.1, 7.0)] + [
    pytest.param(qmax, clip, False, id=f"groups-{qmax}-{clip}") for qmax, clip in ((255, None), (15, 0.1), (3, 7.0))]


@pytest.mark.parametrize("qmax,clip,whole", _FINISH_CASES)
def test_the_finishing_kernel_reproduces_scale_params_and_outlier_threshold_bit_for_bit(qmax, clip, whole):
    # Partials made up to reach every corner of the two formulas: ranges from denormal to fp32's largest,
    # straddling zero or not, zero and one-sided; group sizes past 2**24 elements (fp32 counts round).
    gen = torch.Generator().manual_seed(5)
    n = 512  # groups (one interpreted program each)
    mag = torch.exp2(torch.randint(-149, 127, (2, n), generator=gen).float()) * torch.rand(2, n, generator=gen)
    sign = torch.randint(0, 3, (2, n), generator=gen).float() - 1  # -1, 0, 1
    pair = (mag * sign).float()
    lo, hi = pair.amin(0), pair.amax(0)
    lo[:16], hi[:16] = 0.0, 0.0
    lo[16:32] = hi[16:32]  # zero range
    lo[32:48] = -hi[32:48].abs()  # straddling
    root = torch.rand(n, generator=gen) * torch.exp2(torch.randint(-20, 60, (n,), generator=gen).float())
    if whole:
        lo, hi, root = lo[:1], hi[:1], root[:1]
        layout = group_layout((2**27 + 5,), QuantConfig(group_dim=None))
        numel = 2**27 + 5
    else:
        layout = reference.GroupLayout(0, n, n, 2**25 + 3)  # [n, 2**25 + 3], a group per index
        numel = n * (2**25 + 3)
    part = torch.stack([lo, hi, root, torch.zeros_like(lo)])[:, None, :].contiguous().to(DEVICE)  # [4, 1, n]
    flags = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    out_lo, out_step, aux = kernels._finish(part, layout, numel, qmax, clip, flags)
    t_lo, t_hi = part[0, 0], part[1, 0]
    finite = torch.isfinite(t_hi - t_lo)  # (ranges overflowing fp32 make the pack raw: their scale is unused)
    if clip is not None:
        assert flags[1].item() == int(((t_lo < -clip) | (t_hi > clip)).any())
        t_lo, t_hi = t_lo.clamp(-clip, clip), t_hi.clamp(-clip, clip)
    assert torch.equal(aux[0], t_lo) and torch.equal(aux[1], t_hi)
    ref_lo, ref_step = scale_params(t_lo, t_hi, qmax)
    assert torch.equal(out_lo[finite], ref_lo[finite]) and torch.equal(out_step[finite], ref_step[finite])
    assert torch.equal(aux[2], part[2, 0])  # one partial: its sum is itself
    threshold = outlier_threshold(aux[2], layout, numel)
    assert torch.equal(aux[3], threshold)
    assert flags[0].item() == int((~finite).any())
    assert flags[2].item() == int((torch.maximum(t_lo.abs(), t_hi.abs()) > threshold).any())


def test_the_sum_of_square_roots_is_the_references_up_to_float_rounding():
    # (the one quantity not reproduced bit for bit: the replaced path summed the partials in PyTorch's reduction
    # order; both are within float rounding of the reference's fp64 sum)
    gen = torch.Generator().manual_seed(6)
    for shape, cfg in LAYOUTS:
        x = (torch.randn(shape, generator=gen) * 4).to(DEVICE)
        layout = group_layout(x.shape, cfg)
        flags = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        _, _, aux = kernels.decide(x, layout, 255, None, flags)
        torch.testing.assert_close(aux[2], reference.group_magnitude(x, layout), rtol=5000 * 2**-24, atol=0)


def test_a_strided_tensor_is_copied_once_for_its_range_and_its_codes():
    x = torch.randn(48, 64, device=DEVICE).t()
    with Launches() as launches:
        packed = pack(x, QuantConfig(groups=4), backend="triton", share=False)
    assert [op for op in launches.ops if op.rstrip("_") in ("copy", "clone", "contiguous")] == ["clone"]
    _assert_same_pack(pack(x, QuantConfig(groups=4), backend="reference", share=False), packed)


@pytest.mark.skipif(DEVICE != "cuda", reason="sizes the interpreter would take minutes over (benchmarks/gpu.sh runs "
                    "this); the same equalities on small tensors are asserted above on any device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_on_the_gpu_model_sized_packs_equal_the_references(dtype):
    gen = torch.Generator().manual_seed(7)
    cases = [
        ((8, 512, 4096), QuantConfig(groups=8)),
        ((4, 32, 512, 128), QuantConfig(group_dim=1, groups=0)),
        ((4, 8, 512, 128), QuantConfig(group_dim=1, groups=3)),
        ((3_000_000,), QuantConfig(group_dim=None)),
        ((8, 512, 4096), QuantConfig(groups=8, clip=3.0, outliers=False)),
    ]
    for shape, cfg in cases:
        x = torch.randn(shape, generator=gen)
        x.view(-1)[torch.randperm(x.numel(), generator=gen)[:50]] = 1e4
        x = x.to(dtype).to(DEVICE)
        ref, tri = _packs(x, cfg)
        _assert_same_pack(ref, tri)
        ref, tri = _packs(x.transpose(-1, -2) if x.dim() > 1 else x, cfg)
        _assert_same_pack(ref, tri)


# ---- the running pack (scale="running") on the device: a kernel before the pass over x, one after ----


@pytest.mark.parametrize("bits,stochastic", [(8, False), (8, True), (4, False)], ids=["8", "8-stochastic", "4"])
def test_a_running_pack_is_three_launches_and_no_host_read(bits, stochastic):
    # (Before: the estimate's scale and the fold were PyTorch ops, 100 launches for this pack.)
    x = torch.randn(256, 768, device=DEVICE)
    cfg = QuantConfig(groups=4, scale="running", bits=bits, stochastic=stochastic)
    state = RunningRange(torch.nn.Module(), "_x")
    for _ in range(2):  # the first sets the estimate (on the host path), the second compiles (on a GPU)
        pack_many([(x, cfg, state)], backend="triton", share=False)
    # (A stochastic pack's seed is drawn from the CPU generator's state, which the detector sees as a read of a
    # tensor: a host one, not the device's.)
    with Launches() as launches, HostReads(fail=not stochastic) as reads:
        packed = pack_many([(x * 1.1, cfg, state)], backend="triton", share=False)[0]
    assert (stochastic or reads.count == 0) and not packed.raw
    # x * 1.1 (the test's own op) aside: the estimate's scale, the range pass (with the 8-bit codes), the fold
    assert launches.ops == ["mul"], launches.ops
    quantize = ["_quantize_kernel"] if bits != 8 else []
    assert launches.kernels == ["_estimate_kernel", "_stats_kernel", *quantize, "_fold_kernel"], launches.kernels


def _estimate_copy(state, groups):
    module = torch.nn.Module()
    copy = RunningRange(module, "_x")
    lo, rng = state.live(groups, torch.device(DEVICE))
    copy._set(lo, rng)
    return copy


def _replaced_running_pack(x, cfg, state, training, exact_sum):
    """The running pack as the replaced path made it (PyTorch ops around ``kernels.quantize_stats``); with
    ``exact_sum``, the sum of ``sqrt|x|`` from the range pass's partials summed in fp64 (exact for these few
    partials: the new path's fixed-order fp64 sum rounds to the same fp32), else PyTorch's fp32 sum as before."""
    layout = group_layout(x.shape, cfg)
    data = x.contiguous()
    lo, step = scale_params(*state.estimate(layout.groups, x.device), cfg.qmax)
    codes, t_lo, t_hi, magnitude = kernels.quantize_stats(data, layout, lo, step, cfg.bits, None)
    if exact_sum:
        part = kernels._stats(data, layout, partials=True)[0]
        magnitude = reference._group_reduce(part[2].double().sum(0), layout, "sum").float()
    bad = ~torch.isfinite(t_lo) | ~torch.isfinite(t_hi - t_lo)
    if training:
        if cfg.clip is not None:
            t_lo, t_hi = t_lo.clamp(-cfg.clip, cfg.clip), t_hi.clamp(-cfg.clip, cfg.clip)
        if cfg.outliers:
            limit = outlier_threshold(magnitude, layout, x.numel())
            t_lo, t_hi = torch.maximum(t_lo, -limit), torch.minimum(t_hi, limit)
        state.fold(t_lo, t_hi, cfg.decay, skip=bad)
    step = step.masked_fill(bad, float("nan"))
    meta = PackMeta(x.shape, x.dtype, cfg.bits, layout, False, clipped=cfg.clip is not None)
    return Packed((codes, lo, step), meta)


def _running_packs_agree(x, cfg, state, training):
    """The new running pack of ``x`` (no host read) against the replaced path's, on copies of the estimate: the
    same pack and the same buffers after the fold, bit for bit (up to the fp32 sum of roots, within rounding)."""
    groups, device = group_layout(x.shape, cfg).groups, x.device
    exact, summed = _estimate_copy(state, groups), _estimate_copy(state, groups)
    before = [t.clone() for t in state.live(groups, device)]
    with HostReads(fail=True):
        new = pack(x, cfg, state, training=training, backend="triton", share=False)
    _assert_same_pack(_replaced_running_pack(x, cfg, exact, training, exact_sum=True), new)
    _assert_same_pack(_replaced_running_pack(x, cfg, summed, training, exact_sum=False), new)
    for got, want, near, old in zip(state.live(groups, device), exact.live(groups, device),
                                    summed.live(groups, device), before, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, near, rtol=2**-20, atol=0)
        if not cfg.outliers:
            assert torch.equal(got, near)
        if not training:  # eval never moves the estimate
            assert torch.equal(got, old)
    return new


# (A one-element group whose element is its own outlier gets lo = inf, range = -inf from the first pack's host
# path, as before; its estimate's hi, inf + -inf, is NaN, which the interpreter's numpy warns about.)
# fp32 with and without a clip and outliers (at 8 bits; sub-byte widths, which only change how the codes are
# written, once); bf16, which only changes the dtype read, with both.
_RUNNING_CASES = [pytest.param(clip, outliers, torch.float32, id=f"{clip}-{outliers}-fp32")
                  for clip in (None, 1.5) for outliers in (True, False)] + [
    pytest.param(1.5, True, torch.bfloat16, id="1.5-True-bf16")]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("clip,outliers,dtype", _RUNNING_CASES)
@pytest.mark.parametrize("shape,cfg", LAYOUTS)
def test_the_device_running_pack_equals_the_replaced_paths(shape, cfg, clip, outliers, dtype):
    gen = torch.Generator().manual_seed(8)
    xs = [(torch.randn(shape, generator=gen) * (1 + n) + 0.3 * n).to(dtype).to(DEVICE) for n in range(4)]
    if xs[1].numel() > 8:  # heavy tails: the fold cuts them at the outlier threshold
        xs[1].view(-1)[torch.randperm(xs[1].numel(), generator=gen)[: max(1, xs[1].numel() // 100)]] = 3e3
    sub_byte = dtype == torch.float32 and clip is None and outliers
    for bits in (8, 4, 2) if sub_byte else (8,):  # (8: codes from the range pass's read)
        c = QuantConfig(**{**cfg.__dict__, "bits": bits, "outliers": outliers, "clip": clip, "scale": "running"})
        state = RunningRange(torch.nn.Module(), "_x")
        # the first pack (no estimate yet) sets it on the host path, as before
        first = pack(xs[0], c, state, backend="triton", share=False)
        assert not first.raw and state.live(group_layout(shape, c).groups, torch.device(DEVICE)) is not None
        for n, x in enumerate(xs[1:]):
            _running_packs_agree(x, c, state, training=n != 1)  # the second later pack in eval


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "overflow"])
@pytest.mark.parametrize("shape,cfg", [((64, 48), QuantConfig(groups=8)), ((2, 3, 9, 5), QuantConfig(group_dim=1,
                         groups=0)), ((5000,), QuantConfig(group_dim=None)), ((64, 48), QuantConfig(groups=8, clip=1.0,
                         outliers=False))])
def test_a_non_finite_group_of_a_device_running_pack_is_the_replaced_paths(shape, cfg, bad, training):
    gen = torch.Generator().manual_seed(9)
    cfg = QuantConfig(**{**cfg.__dict__, "scale": "running"})
    state = RunningRange(torch.nn.Module(), "_x")
    pack(torch.randn(shape, generator=gen).to(DEVICE), cfg, state, backend="triton", share=False)
    x = torch.randn(shape, generator=gen)
    if bad == "overflow":  # each value finite, the range not (fp32's hi - lo is inf)
        x.view(-1)[3], x.view(-1)[4] = 3e38, -3e38
    else:
        x.view(-1)[3] = bad
    new = _running_packs_agree(x.to(DEVICE), cfg, state, training)
    step = new.tensors[2]  # the group holding it restored as NaN, the others not
    assert torch.isnan(step).sum() == 1


@pytest.mark.parametrize("running", [False, True], ids=["dynamic", "running"])
def test_a_permuted_q_k_or_v_is_read_as_it_lies_and_only_its_codes_are_copied(running):
    # Attention's q, k, v: [B, T, H, D] memory seen as [B, H, T, D], one scale per head. Before, the kernels took a
    # contiguous copy of the fp32 tensor (read and written: 8 bytes an element); now they read it as [B * T, H, D]
    # where it lies, and only the 1-byte codes are copied into the [B, H, T, D] order the restore gives. The same
    # launches (the copy is of the codes), the same pack as the reference's, bit for bit.
    class Copies(TorchDispatchMode):  # every copy's dtype and size (the interpreter's own move bytes, as uint8)
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("clone", "copy_", "contiguous"):
                self.dtypes.append((args[0].dtype, args[0].numel()))
            return func(*args, **(kwargs or {}))

    cfg = QuantConfig(group_dim=1, groups=0, scale="running" if running else "dynamic")
    gen = torch.Generator().manual_seed(4)
    states = [RunningRange(torch.nn.Module(), "_x") if running else None for _ in range(2)]
    for step in range(3):  # (under a running estimate: the first sets it, then the device's running pack)
        x = torch.randn(2, 16, 4, 32, generator=gen).to(DEVICE).transpose(1, 2)
        outlier = step == 1 and not running
        if outlier:
            x[0, 1, 3, 5] = 400.0  # kept apart at its logical index (the rare path: a copy of a bool mask)
        with Launches() as launches, Copies() as copies:
            fast = pack(x, cfg, states[0], backend="triton", share=False)
        assert (x.dtype, x.numel()) not in copies.dtypes, copies.dtypes  # (a running estimate's [groups] clones)
        if step and not outlier:  # (the first running pack also sets the estimate: clones of [groups] tensors)
            copied = [op for op in launches.ops if op.rstrip("_") in ("copy", "clone", "contiguous")]
            assert copied == ["clone"], launches.ops
        ref = pack(x, cfg, states[1], backend="reference", share=False)
        _assert_same_pack(ref, fast)
        assert len(fast.tensors) == (5 if outlier else 3)
