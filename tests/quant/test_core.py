"""pack/unpack on the reference backend: error bounds, unbiased stochastic rounding, edge cases."""

import copy
import dataclasses
import math
import weakref

import pytest
import torch
from torch import nn

import slimact
from _harness import estimates
from slimact._metrics import cosine, sqnr_db
from slimact.quant import QuantConfig, RunningRange, pack, reference, unpack
from slimact.quant.reference import _expand

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (shape, cfg) covering every group layout, group counts that do and do not divide, awkward sizes.
LAYOUTS = [
    ((1,), QuantConfig(group_dim=None)),
    ((1,), QuantConfig(group_dim=-1, groups=8, clamp_groups=True)),  # a policy's 8 groups on one channel
    ((7,), QuantConfig(group_dim=-1, groups=3)),
    ((5, 13), QuantConfig(group_dim=-1, groups=4)),  # 4 does not divide 13
    ((3, 5, 16), QuantConfig(group_dim=-1, groups=8)),
    ((3, 5, 16), QuantConfig(group_dim=-1, groups=0)),  # one group per channel
    ((2, 3, 9, 5), QuantConfig(group_dim=1, groups=0)),  # per head of [B, H, T, D]
    ((2, 6, 9, 5), QuantConfig(group_dim=1, groups=4)),  # head groups that do not divide H
    ((4, 3, 11), QuantConfig(group_dim=None)),
]


def _non_contiguous(shape):
    # The same values read through transposed strides.
    x = torch.randn(*reversed(shape)) * 3 + 1
    return x.permute(*reversed(range(len(shape))))


def _step_and_slack(x, packed):
    _, lo, step, *_ = packed.tensors
    meta = packed.meta
    step_e = _expand(step, meta.layout, x.dim())
    lo_e = _expand(lo, meta.layout, x.dim())
    eps32 = torch.finfo(torch.float32).eps
    # fp32 arithmetic of lo + code * step, then the cast to x.dtype: half an ulp of the result, whose
    # magnitude is at most |x| + step (an ulp is absolute below the smallest normal number).
    fi = torch.finfo(x.dtype)
    cast = fi.eps * torch.clamp(x.float().abs() + step_e, min=fi.smallest_normal) / 2
    slack = 4 * eps32 * (lo_e.abs() + 255 * step_e) + cast
    return step_e, slack


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,cfg", LAYOUTS)
@pytest.mark.parametrize("contiguous", [True, False])
def test_nearest_error_at_most_half_step(shape, cfg, dtype, contiguous):
    x = (torch.randn(shape) * 3 + 1 if contiguous else _non_contiguous(shape)).to(dtype)
    packed = pack(x, cfg, backend="reference")
    assert not packed.raw
    assert packed.tensors[0].dtype == torch.uint8
    x_hat = unpack(packed, backend="reference")
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    step, slack = _step_and_slack(x, packed)
    err = (x_hat.float() - x.float()).abs()
    assert (err <= step / 2 + slack).all(), (err - step / 2).max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,cfg", LAYOUTS)
def test_stochastic_error_under_one_step(shape, cfg, dtype):
    cfg = dataclasses.replace(cfg, stochastic=True)
    x = _non_contiguous(shape).to(dtype)
    packed = pack(x, cfg, backend="reference")
    x_hat = unpack(packed, backend="reference")
    step, slack = _step_and_slack(x, packed)
    err = (x_hat.float() - x.float()).abs()
    assert (err < step + slack).all()


@pytest.mark.parametrize("bits", [4, 2])
def test_sub_byte_codes_error_and_size(bits):
    x = torch.randn(7, 9)
    packed = pack(x, QuantConfig(bits=bits, groups=3), backend="reference")
    assert packed.tensors[0].numel() == math.ceil(63 * bits / 8)
    step, slack = _step_and_slack(x, packed)
    assert ((unpack(packed) - x).abs() <= step / 2 + slack).all()


@pytest.mark.parametrize("frac", [0.1, 0.3, 0.5, 0.77, 0.9])
def test_stochastic_rounding_is_unbiased(frac):
    # Range [0, 255] makes the step exactly 1; every other element sits `frac` of a step above a code,
    # where round-to-nearest would be off by min(frac, 1 - frac) on every draw.
    k = torch.arange(1, 254, dtype=torch.float32)
    x = torch.cat([torch.tensor([0.0, 255.0]), k + frac])
    cfg = QuantConfig(group_dim=None, stochastic=True)
    draws = 400
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        total += unpack(pack(x, cfg, share=False)).double() - x.double()
    mean_err = total[2:] / draws
    # Mean over 253 * 400 draws: its standard deviation is <= 0.5 / sqrt(101200) ~ 0.0016 step.
    assert abs(mean_err.mean().item()) < 0.01
    # Per element: each mean has std <= 0.5 / sqrt(400) = 0.025 step; 6 sigma.
    assert mean_err.abs().max().item() < 0.15


def test_stochastic_rounding_reproducible_under_manual_seed():
    x = torch.randn(64, 33)
    cfg = QuantConfig(stochastic=True)
    torch.manual_seed(123)
    a = pack(x, cfg, share=False).tensors[0]
    b = pack(x, cfg, share=False).tensors[0]
    torch.manual_seed(7)
    pack(x, cfg, share=False)
    torch.manual_seed(123)
    c = pack(x, cfg, share=False).tensors[0]
    d = pack(x, cfg, share=False).tensors[0]
    assert torch.equal(a, c) and torch.equal(b, d)
    assert not torch.equal(a, b)


def test_stochastic_rounding_never_advances_torchs_generator():
    x = torch.randn(64, 33)
    torch.manual_seed(3)
    expected = torch.rand(5)
    torch.manual_seed(3)
    pack(x, QuantConfig(stochastic=True), share=False)
    assert torch.equal(torch.rand(5), expected)  # dropout masks after it are the plain model's


def _bytes_allocated_at_most(fn, *args) -> int:
    """The most bytes ``fn(*args)`` had allocated at once on the CPU, above what was allocated before it (the
    allocator's running total in ``torch.profiler``'s memory events)."""
    from torch._C._profiler import _ExtraFields_Allocation
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    totals, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if isinstance(node.extra_fields, _ExtraFields_Allocation):
            totals.append((node.extra_fields.total_allocated, node.extra_fields.alloc_size))
    return max(total for total, _ in totals) - min(total - size for total, size in totals)


def test_stochastic_rounding_temporaries_do_not_grow_with_the_tensor():
    # The hash's bits are made a chunk at a time, in place: what a stochastic quantise has allocated at its most,
    # beyond a round-to-nearest one (the fp32 temporary and the codes), is no more for 2 Mi elements than for
    # 256 Ki, and less than the tensor's own bytes. Made for the whole tensor at once, the hash's int64 temporaries
    # were ~12x its fp32 bytes (under "mesa", 2.5x "int8"'s forward transients on tiny Llama).
    extra, sizes = [], []
    for numel in (1 << 18, 1 << 21):
        x = torch.randn(numel // 512, 512)
        layout = reference.group_layout(x.shape, QuantConfig(groups=8))
        lo, step = reference.scale_params(*reference.group_minmax(x, layout), 255)
        nearest = _bytes_allocated_at_most(reference.quantize, x, layout, lo, step, 8, None)
        assert nearest >= x.nbytes  # (the measure sees the fp32 temporary)
        extra.append(_bytes_allocated_at_most(reference.quantize, x, layout, lo, step, 8, 1234) - nearest)
        sizes.append(x.nbytes)
    assert extra[1] <= extra[0] < sizes[0], (extra, sizes)


def test_stochastic_bits_are_the_hash_of_each_flat_index_across_chunks():
    # Element i's bits are fmix32(i mod 2**32 ^ seed_key(seed)) >> 8, as the Triton kernel's: here from Python ints
    # (seed_key is fmix32 of its argument), at the ends of the chunks the hash is made in and past 2**32; the codes
    # of a tensor of several chunks are those of the whole tensor's bits.
    chunk = reference._HASH_CHUNK
    seed, n = 99, 2 * chunk + 1
    u = reference.hash_uniform(n, seed)

    def bits(i):
        return reference.seed_key((i & 0xFFFFFFFF) ^ reference.seed_key(seed)) >> 8

    for i in (0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk, n - 1):
        assert u[i].item() == bits(i) / (1 << 24), i
    far = reference.hash_uniform(4, seed, start=(1 << 32) - 2)
    assert far.tolist() == [bits(i) / (1 << 24) for i in range((1 << 32) - 2, (1 << 32) + 2)]
    x = torch.randn(n) * 40
    layout = reference.group_layout(x.shape, QuantConfig(group_dim=None))
    lo, step = reference.scale_params(*reference.group_minmax(x, layout), 255)
    expected = ((x - lo) / step + u).clamp(0, 255).to(torch.uint8)
    assert torch.equal(reference.quantize(x, layout, lo, step, 8, seed), expected)


def _module_with_state():
    module = torch.nn.Module()
    return module, RunningRange(module, "_x")


def test_stale_running_estimate_saturates_never_wraps():
    module, state = _module_with_state()
    cfg = QuantConfig(group_dim=None, scale="running")
    state.update(torch.tensor([0.0]), torch.tensor([1.0]), cfg.decay)  # estimate [0, 1]
    x = torch.linspace(-0.2, 1.2, 141)
    x_hat = unpack(pack(x, cfg, state, training=False))
    step = 1.0 / 255
    top = x_hat[x >= 1.0]
    assert (top - 1.0).abs().max() <= step
    assert top.min() > 0.9  # Mesa's uint8 |= int32 wrapped these to near the minimum
    assert (x_hat[x <= 0.0] - 0.0).abs().max() <= step
    assert x_hat.max() <= 1.0 + step and x_hat.min() >= -step
    # The estimate did not move in eval (training=False).
    assert torch.equal(estimates(module)["_x_range"], torch.tensor([1.0]))


def test_running_estimate_ema_and_snapshot():
    module, state = _module_with_state()
    # (Without outliers: in [0, 1], 1 is more than 64 times the magnitude of the rest, and kept apart.)
    cfg = QuantConfig(group_dim=None, scale="running", decay=0.9, outliers=False)
    p1 = pack(torch.tensor([0.0, 1.0]), cfg, state)  # initialises from the first tensor
    assert torch.allclose(estimates(module)["_x_lo"], torch.tensor([0.0]))
    assert torch.allclose(estimates(module)["_x_range"], torch.tensor([1.0]))
    buffers = estimates(module)["_x_lo"], estimates(module)["_x_range"]
    p2 = pack(torch.tensor([-1.0, 3.0]), cfg, state)
    assert torch.allclose(estimates(module)["_x_lo"], torch.tensor([-0.1]))
    assert torch.allclose(estimates(module)["_x_range"], torch.tensor([0.9 + 0.4]))
    # Folded in place: the module's buffers keep their storage (what a captured CUDA graph updates).
    assert estimates(module)["_x_lo"] is buffers[0] and estimates(module)["_x_range"] is buffers[1]
    # p2 was packed with the estimate it found, [0, 1]: it saturates there; its range moves the next pack's.
    torch.testing.assert_close(unpack(p2), torch.tensor([0.0, 1.0]))
    # p1 restores with the scale it was packed with, whatever the state is now.
    torch.testing.assert_close(unpack(p1), torch.tensor([0.0, 1.0]))
    assert p2.tensors[1] is not estimates(module)["_x_lo"]
    # Buffers are non-persistent: state_dict is unaffected.
    assert module.state_dict() == {}


def test_zero_range_groups_are_exact():
    x = torch.tensor([[2.5, 2.5, -1.0, 3.0], [2.5, 2.5, -1.0, 3.0]])  # groups of 2 channels: [2.5, 2.5] constant
    packed = pack(x, QuantConfig(groups=2))
    _, _, step, *_ = packed.tensors
    assert torch.isfinite(step).all() and (step > 0).all()
    x_hat = unpack(packed)
    assert torch.equal(x_hat[:, :2], x[:, :2])
    zeros = torch.zeros(3, 8, dtype=torch.float16)
    assert torch.equal(unpack(pack(zeros, QuantConfig())), zeros)
    one = torch.tensor([0.123])
    assert torch.equal(unpack(pack(one, QuantConfig())), one)


@pytest.mark.parametrize("scale", [1e-3, 1e-5, 1e-7])
def test_tiny_fp16_ranges_have_finite_scale(scale):
    # Mesa cast the scale to fp16: 255 / range overflowed to inf for ranges under ~4e-3.
    x = (torch.randn(4, 64) * scale).half()
    packed = pack(x, QuantConfig(groups=4))
    assert not packed.raw
    step = packed.tensors[2]
    assert step.dtype == torch.float32 and torch.isfinite(step).all() and (step > 0).all()
    x_hat = unpack(packed)
    assert torch.isfinite(x_hat).all()
    s, slack = _step_and_slack(x, packed)
    assert ((x_hat.float() - x.float()).abs() <= s / 2 + slack).all()


def test_denormal_fp32_range_no_division_by_zero():
    x = torch.tensor([0.0, 1e-44, 5e-45])  # step would underflow to 0 in fp32
    packed = pack(x, QuantConfig(group_dim=None))
    assert torch.isfinite(packed.tensors[2]).all() and (packed.tensors[2] > 0).all()
    assert torch.isfinite(unpack(packed)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_kept_uncompressed(bad):
    x = torch.randn(4, 16)
    x[2, 5] = bad
    packed = pack(x, QuantConfig())
    assert packed.raw
    x_hat = unpack(packed)
    torch.testing.assert_close(x_hat, x, equal_nan=True, rtol=0, atol=0)


def test_non_finite_input_does_not_touch_running_estimate():
    module, state = _module_with_state()
    cfg = QuantConfig(group_dim=None, scale="running", outliers=False)  # (see the test above)
    pack(torch.tensor([0.0, 1.0]), cfg, state)
    assert pack(torch.tensor([0.0, float("nan")]), cfg, state).raw
    assert torch.equal(estimates(module)["_x_range"], torch.tensor([1.0]))


def test_range_overflowing_fp32_is_kept_uncompressed():
    x = torch.tensor([-3e38, 3e38, 0.0])
    assert pack(x, QuantConfig(group_dim=None)).raw


@pytest.mark.parametrize("x", [torch.randn(3, 4, dtype=torch.float64), torch.arange(6), torch.ones(3, dtype=torch.bool),
                               torch.empty(0, 5)], ids=["float64", "int64", "bool", "empty"])
def test_other_dtypes_and_empty_pass_through(x):
    packed = pack(x, QuantConfig())
    assert packed.raw and packed.tensors[0] is x
    assert unpack(packed) is x


def test_running_scale_requires_state():
    with pytest.raises(ValueError, match="RunningRange"):
        pack(torch.randn(3), QuantConfig(scale="running"))


@pytest.mark.parametrize("kwargs", [{"bits": 3}, {"groups": -1}, {"scale": "ema"}, {"decay": 1.0}])
def test_bad_config_is_an_error(kwargs):
    with pytest.raises(ValueError):
        QuantConfig(**kwargs)


def _made(*shape: int) -> torch.Tensor:
    """A tensor an op made (it has a ``grad_fn``), as a layer's input in a training step is: outside a converted
    model's forward, only such a tensor's pack is served again (see the test of a refilled input below)."""
    return torch.randn(*shape, requires_grad=True) * 1.0


def test_same_tensor_is_packed_once_while_kept():
    x = _made(8, 16)
    cfg = QuantConfig()
    first = pack(x, cfg)
    again = pack(x, cfg)
    assert all(a is b for a, b in zip(first.tensors, again.tensors, strict=True))
    view = x.view(8, 16)  # another tensor object on the same storage view
    assert pack(view, cfg).tensors[0] is first.tensors[0]
    assert pack(x, QuantConfig(groups=2)).tensors[0] is first.tensors[0]  # any grouping serves
    assert pack(x, QuantConfig(bits=4)).tensors[0] is first.tensors[0]  # as do more bits than asked
    assert pack(x[1:], cfg).tensors[0] is not first.tensors[0]  # another view
    low = pack(torch.randn(8, 16), QuantConfig(bits=4))
    assert low.meta.bits == 4
    y = _made(8, 16)
    coarse = pack(y, QuantConfig(bits=4))
    fine = pack(y, cfg)  # asks for more bits than the cached pack has: packed anew
    assert fine.meta.bits == 8 and fine.tensors[0] is not coarse.tensors[0]


def test_shared_pack_is_refreshed_after_in_place_change_and_released_with_its_source():
    x = _made(8, 16)
    cfg = QuantConfig()
    first = pack(x, cfg)
    x.mul_(2)
    changed = pack(x, cfg)
    assert changed.tensors[0] is not first.tensors[0]
    torch.testing.assert_close(unpack(changed), x, atol=changed.tensors[2].max().item(), rtol=0)
    codes = weakref.ref(changed.tensors[0])
    del first, changed
    # Still shared while x lives, whoever keeps the pack (checkpointing keeps nothing in its first forward,
    # everything in its recomputation: both must share alike).
    assert pack(x, cfg).tensors[0] is codes()
    del x  # the pack goes with its source
    assert codes() is None


def test_a_pack_is_not_served_to_another_tensor_where_its_source_no_longer_lives():
    # Megatron-LM's deallocate_output_tensor (``out.data = torch.empty(1)``) and memcnn's invertible wrapper
    # (``storage().resize_(0)``) release a tensor's memory while the tensor lives on; the allocator then gives that
    # address to the next tensor of the size, whose key (address, offset, shape, strides, dtype, version) is the
    # released one's. Made here without the allocator: another tensor object on the memory x held.
    x = _made(8, 16)
    x.mul_(1.0)  # (version 1, as a tensor made by set_ below starts)
    cfg = QuantConfig()
    first = pack(x, cfg)
    memory = x.untyped_storage()
    x.data = torch.empty(1)
    torch.empty(0).set_(memory, 0, (8, 16), (16, 1)).fill_(3.0)  # the next owner writes its values
    y = torch.empty(0).set_(memory, 0, (8, 16), (16, 1)).requires_grad_().view(8, 16)  # (made by an op, as x)
    assert y._version == 1  # the version x was packed at: only the source's own memory tells them apart
    packed = pack(y, cfg)
    assert packed.tensors[0] is not first.tensors[0]
    torch.testing.assert_close(unpack(packed), torch.full((8, 16), 3.0))


def test_shared_entry_dies_with_its_source():
    from slimact.quant.core import _shared

    x = torch.randn(4, 4)
    kept = pack(x, QuantConfig())
    assert any(e[0]() is x for e in _shared._entries.values())
    del x
    assert not any(e[0]() is None for e in _shared._entries.values())
    del kept


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("lo", [-1e-3, -0.3, -1.0, -5.0, -99.0])
def test_zero_is_restored_exactly_where_a_range_straddles_it(bits, lo):
    # A zeroed token next to others: DeiT's class token at initialisation, a padded row. Any error on it
    # is multiplied by its (possibly large) gradient, so 0 must be a code.
    x = torch.cat([torch.linspace(lo, 1.0, 97), torch.zeros(5)])[torch.randperm(102)]
    cfg = QuantConfig(bits=bits, group_dim=None)
    packed = pack(x, cfg)
    x_hat = unpack(packed)
    assert torch.equal(x_hat[x == 0], torch.zeros(int((x == 0).sum())))
    # The step grew by at most (qmax/2) / (qmax/2 - 1) over the plain range / qmax, and nothing clamps.
    qmax = 2**bits - 1
    step = packed.tensors[2]
    plain = (1.0 - lo) / qmax
    assert plain <= step.item() <= plain * (qmax / 2) / (qmax / 2 - 1) * (1 + 1e-6)
    assert ((x_hat - x).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("shape,group_dim", [((4, 3), -1), ((2, 5, 7), 1), ((6,), 0)])
def test_more_groups_than_channels_is_an_error(shape, group_dim):
    # An explicit config asking for more groups than the grouped dim has indices (a wrong group_dim, most
    # likely) is refused, naming the count and the size; a Policy's configs clamp instead (clamp_groups).
    size = shape[group_dim]
    x = torch.randn(shape)
    with pytest.raises(ValueError, match=rf"asks for {size + 1} groups along dim .* only {size} channels"):
        pack(x, QuantConfig(group_dim=group_dim, groups=size + 1))
    cached = pack(x, QuantConfig(group_dim=group_dim, groups=size))  # now cached: the error must not hide behind it
    with pytest.raises(ValueError, match=rf"{size + 1} groups"):
        pack(x, QuantConfig(group_dim=group_dim, groups=size + 1))
    clamped = pack(x, QuantConfig(group_dim=group_dim, groups=size + 1, clamp_groups=True), share=False)
    assert clamped.meta.layout == cached.meta.layout  # clamped to one group per channel
    assert all(torch.equal(a, b) for a, b in zip(clamped.tensors, cached.tensors, strict=True))


def test_policy_configs_clamp_their_group_count():
    # One channel_groups setting serves layers of every width: the default policy's 8 groups on a 4-feature
    # Linear give 4, and a converted tiny model trains.
    import slimact
    from slimact.policy import PRESETS

    assert PRESETS["int8"].quant_config("linear", 2).clamp_groups
    model = slimact.convert(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GELU(), torch.nn.Linear(4, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, target = torch.randn(16, 3), torch.randn(16, 2)
    losses = []
    for _ in range(20):
        loss = (model(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def _heavy(shape, count, gen):
    # normal data with `count` values at 1e4 times the median magnitude
    x = torch.randn(shape, generator=gen)
    where = torch.randperm(x.numel(), generator=gen)[:count]
    x.view(-1)[where] = 1e4 * x.abs().median() * torch.sign(torch.randn(count, generator=gen))
    return x, where


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", [QuantConfig(group_dim=None), QuantConfig(group_dim=-1, groups=8),
                                 QuantConfig(group_dim=1, groups=0, stochastic=True)], ids=["whole", "groups", "heads"])
def test_outliers_are_kept_apart_exactly_and_the_rest_keeps_its_own_step(cfg, dtype):
    gen = torch.Generator().manual_seed(0)
    x, where = _heavy((4, 8, 64, 64), 40, gen)
    x = x.to(dtype)
    packed = pack(x, cfg, share=False)
    codes, lo, step, index, values = packed.tensors
    assert torch.equal(values, x.view(-1)[index.long()])
    assert sorted(index.tolist()) == sorted(where.tolist()) and index.dtype == torch.int32
    x_hat = unpack(packed)
    assert torch.equal(x_hat.view(-1)[where], x.view(-1)[where])
    # The others within half (stochastic: one) of a step set by their own range, not the outliers'.
    rest = torch.ones(x.numel(), dtype=torch.bool)
    rest[where] = False
    rest = rest.view(x.shape)
    assert step.max() < 2 * 8 / 255  # normal values reach ~5: a range of ~10, not 2e4
    bound, slack = _step_and_slack(x, packed)
    assert ((x_hat.float() - x.float()).abs()[rest] <= (2 * bound + slack)[rest]).all()
    # Bytes: the codes and scales plus 4 + 2..4 bytes per outlier.
    assert packed.nbytes == codes.nbytes + lo.nbytes + step.nbytes + 40 * (4 + x.element_size())


def test_outliers_keep_a_weight_gradient_above_the_floor_where_one_range_did_not():
    # A Linear's weight gradient g^T x with x holding a few values at 1e4x: one range over them rounded every
    # ordinary value to 0 (26 dB); kept apart, the gradient is at the codes' resolution.
    gen = torch.Generator().manual_seed(0)
    x, _ = _heavy((4096, 256), 10, gen)
    g = torch.randn(4096, 64, generator=gen)
    exact = g.t() @ x
    sqnr = {}
    for outliers in (False, True):
        x_hat = unpack(pack(x, QuantConfig(group_dim=None, outliers=outliers), share=False))
        sqnr[outliers] = sqnr_db(exact, g.t() @ x_hat)
    assert sqnr[False] < 30 <= 40 <= sqnr[True], sqnr


def test_several_outliers_in_one_small_group_are_all_kept_apart():
    # Three values at 1e4x among 37 (a column of per-channel groups): a plain mean magnitude, 8% outliers, hides
    # them (each is under 32x the mean of the others); the typical magnitude (mean sqrt|x|)**2 does not.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 15, generator=gen)
    rows = torch.tensor([4, 20, 33])
    x[rows, 7] = 6500.0
    others = x[:, 7].abs().sum() - 6500.0
    assert 6500.0 < 32 * others / 36  # the plain mean's criterion, leave-one-out, would keep none of them
    packed = pack(x, QuantConfig(group_dim=-1, groups=0), share=False)
    _, _, step, index, values = packed.tensors
    assert sorted(index.tolist()) == sorted((rows * 15 + 7).tolist()) and torch.equal(values, x[rows, 7])
    assert step.max() < 8 / 255  # column 7's step is set by its ordinary values
    x_hat = unpack(packed)
    assert (x_hat - x).abs().max() < step.max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_outliers_never_cost_more_than_the_original(dtype):
    # The worst case: k equal nonzero values among zeros. At most 1 + (n - 1) / sqrt(64) of n are kept apart, so
    # codes plus outliers (4-byte index and value) stay under the original's bytes, for any k.
    n = 4096
    for k in (1, 64, 256, 512, 513, 600, 2048):
        x = torch.zeros(n, dtype=dtype)
        x[torch.randperm(n, generator=torch.Generator().manual_seed(k))[:k]] = 3.0
        packed = pack(x, QuantConfig(group_dim=None), share=False)
        kept = packed.tensors[3].numel() if len(packed.tensors) == 5 else 0
        assert kept < 1 + (n - 1) / 8, k
        assert kept == (k if k <= 512 else 0), k
        assert packed.nbytes < x.nbytes, k
        torch.testing.assert_close(unpack(packed), x, rtol=0, atol=0)


@pytest.mark.parametrize("dist", ["normal", "laplace", "uniform"])
def test_ordinary_data_keeps_no_outliers(dist):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 22, generator=gen)
    if dist == "laplace":
        x = torch.distributions.Laplace(0.0, 1.0).sample((1 << 22,))
    elif dist == "uniform":
        x = torch.rand(1 << 22, generator=gen) + 3.0  # off-centre: the threshold is on |x|
    assert len(pack(x, QuantConfig(group_dim=None), share=False).tensors) == 3


def test_outliers_can_be_switched_off_and_a_running_estimate_tracks_the_rest():
    gen = torch.Generator().manual_seed(0)
    x, _ = _heavy((64, 32), 3, gen)
    assert len(pack(x, QuantConfig(group_dim=None, outliers=False), share=False).tensors) == 3
    module = torch.nn.Module()
    state = RunningRange(module, "_x")
    packed = pack(x, QuantConfig(group_dim=None, scale="running"), state, share=False)
    assert len(packed.tensors) == 5
    assert estimates(module)["_x_range"].item() < 12  # the estimate of the ordinary values' range, not of the outliers'


def _many_items(gen):
    """A mix for pack_many: outliers, stochastic rounding, NaN, an int tensor, a lossless slot, a running estimate."""
    heavy, _ = _heavy((32, 40), 5, gen)
    nan = torch.randn(16, 24, generator=gen)
    nan[3, 4] = float("nan")
    module = torch.nn.Module()
    state = RunningRange(module, "_x")
    running = QuantConfig(groups=4, scale="running", stochastic=True)
    pack(torch.randn(8, 20, generator=gen), running, state, share=False)  # an estimate to pack with
    return [
        (heavy, QuantConfig(groups=8), None),
        (torch.randn(2, 3, 7, 5, generator=gen).to(torch.bfloat16), QuantConfig(group_dim=1, groups=0,
                                                                                stochastic=True), None),
        (nan, QuantConfig(groups=2), None),
        (torch.arange(6), QuantConfig(), None),
        (torch.randn(9, generator=gen), None, None),
        (torch.randn(8, 20, generator=gen) * 3, running, state),
        (torch.randn(50, generator=gen), QuantConfig(group_dim=None, bits=4, stochastic=True), None),
    ], module


@pytest.mark.parametrize("backend", ["reference", "inductor"])
def test_pack_many_gives_each_pack_as_pack_does_with_one_host_sync(backend):
    from _host import HostReads
    from slimact.quant import pack_many

    def run(packs):
        # Each run in a forward's seed stream of its own, as in a converted model: the same seeds for both.
        reference.begin_stream(7)
        try:
            items, module = _many_items(torch.Generator().manual_seed(0))
            with HostReads() as reads:
                return packs(items), module, reads.count
        finally:
            reference.end_stream()

    alone, module, reads = run(lambda items: [pack(*item, backend=backend, share=False) for item in items])
    alone_estimate = estimates(module)["_x_lo"].clone(), estimates(module)["_x_range"].clone()
    # one decision per tensor quantised on the host's word (five), and the gather of the outliers (their count)
    assert reads == 6
    together, module, reads = run(lambda items: pack_many(items, backend=backend, share=False))
    assert reads == 2
    for a, b in zip(alone, together, strict=True):
        assert a.meta == b.meta and len(a.tensors) == len(b.tensors)
        for s, t in zip(a.tensors, b.tensors, strict=True):
            torch.testing.assert_close(s, t, rtol=0, atol=0, equal_nan=True)
    assert together[2].raw and len(together[0].tensors) == 5  # NaN kept exact; outliers kept apart
    assert torch.equal(estimates(module)["_x_lo"], alone_estimate[0])
    assert torch.equal(estimates(module)["_x_range"], alone_estimate[1])


def test_pack_many_packs_a_tensor_given_twice_once():
    from slimact.quant import pack_many

    x = torch.randn(12, 16)
    cfg = QuantConfig(groups=4)
    a, b, c = pack_many([(x, cfg, None), (x, cfg, None), (x, QuantConfig(groups=2), None)], share=False)
    assert a is b and c is not a


def test_a_clipped_range_saturates_beyond_the_clip_and_still_sees_nan():
    x = torch.linspace(-3, 3, 601)
    x[::50] *= 100  # beyond the clip
    cfg = QuantConfig(group_dim=None, clip=4.0, outliers=False)
    packed = pack(x, cfg, share=False)
    assert packed.meta.clipped
    x_hat = unpack(packed)
    step = packed.tensors[2].item()
    inside = x.abs() <= 4
    assert (x_hat[inside] - x[inside]).abs().max() <= step / 2 + 1e-6
    # Beyond: an end code, whose value lies beyond the clip by at most the code range's slack (zero being a code,
    # the range grows by up to 0.8%: about two steps here)
    slack = 255 * step - 8
    torch.testing.assert_close(x_hat[~inside], x[~inside].clamp(-4, 4), rtol=0, atol=slack + 1e-6)
    assert step <= 8 / 255 * 1.01  # the scale is the clip's, not the far values'
    # Nothing beyond: an ordinary pack, shared with the next consumer of x.
    small = _made(64, 8)
    p = pack(small, QuantConfig(clip=50.0))
    assert not p.meta.clipped and pack(small, QuantConfig()) is p
    # A clipped pack is not: it does not stand for x.
    assert not pack(x, QuantConfig(group_dim=None)).meta.clipped
    # NaN/inf are still seen: x is kept exact.
    x[7] = float("inf")
    assert pack(x, cfg, share=False).raw
    with pytest.raises(ValueError, match="clip must be positive"):
        QuantConfig(clip=0.0)


def _twice_plus(x, y):
    return (x.float() * 2 + y.float()).to(y.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unpack_map_restores_inside_the_consumers_loop(dtype, monkeypatch):
    from slimact.quant import inductor, unpack_map

    fused = []
    original = inductor.dequantize_map
    monkeypatch.setattr(inductor, "dequantize_map", lambda *a: fused.append(r := original(*a)) or r)
    gen = torch.Generator().manual_seed(0)
    cfg = QuantConfig(groups=8)
    for shape, expect_fused in (((512, 1024), True), ((16, 24), False)):  # below inductor.MIN_NUMEL: eager
        fused.clear()
        x = torch.randn(shape, generator=gen).to(dtype)
        y = torch.randn(shape, generator=gen).to(dtype)
        packed = pack(x, cfg, share=False)
        out = unpack_map(packed, _twice_plus, y)
        assert (bool(fused) and fused[0] is not None) == expect_fused
        # The same math in one loop. Inductor keeps the restored x in fp32 rather than rounding it to fp16/bf16
        # first, so the two differ by at most that rounding (half an ulp of x, doubled by the consumer) and one
        # rounding of the result.
        x_hat = unpack(packed)
        ref = _twice_plus(x_hat, y)
        eps = torch.finfo(dtype).eps
        bound = eps * (x_hat.float().abs() + ref.float().abs())
        assert ((out.float() - ref.float()).abs() <= bound).all()
    # A strided argument: the eager path.
    fused.clear()
    x = torch.randn(1024, 512, generator=gen).to(dtype)
    y = torch.randn(512, 1024, generator=gen).to(dtype).t()
    packed = pack(x, cfg, share=False)
    assert torch.equal(unpack_map(packed, _twice_plus, y), _twice_plus(unpack(packed), y))
    assert fused == [None]


class _Tripwire:
    """Stands for the Triton kernels module: records every call and fails it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        def kernel(*args, **kwargs):
            self.calls.append(name)
            raise AssertionError(f"Triton's {name} called")

        return kernel


def _force_triton(monkeypatch) -> _Tripwire:
    from slimact.quant import core

    tripwire = _Tripwire()
    real = core._kernels
    monkeypatch.setattr(core, "backend_for", lambda x: "triton")
    monkeypatch.setattr(core, "_kernels", lambda backend: tripwire if backend == "triton" else real(backend))
    return tripwire


def _gelu_grad(x, g):  # module level: unpack_map's fn
    return g * torch.sigmoid(1.702 * x)


@pytest.mark.parametrize("numel", [4096, 1 << 18])  # under and over the compiled loops' size
def test_unpack_under_torch_compile_never_calls_the_triton_kernels(monkeypatch, numel):
    # A compiled backward traces unpack / unpack_map: a raw Triton kernel there is opaque to dynamo. With the
    # "triton" backend forced for a CPU tensor, the kernels are called eagerly (the tripwire fires) and not while
    # compiling, where the reference restores the very same values.
    from slimact.quant import core, unpack_map

    x = torch.randn(numel // 64, 64)
    g = torch.randn_like(x)
    packed = pack(x, QuantConfig(groups=4), backend="reference", share=False)
    expected = reference.dequantize(packed.tensors[0], packed.meta, *packed.tensors[1:3])
    tripwire = _force_triton(monkeypatch)
    with pytest.raises(AssertionError, match="Triton's dequantize"):
        core.unpack(packed)
    assert tripwire.calls == ["dequantize"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(core.unpack(packed), expected, rtol=0, atol=0)
    torch.testing.assert_close(unpack_map(packed, _gelu_grad, g), _gelu_grad(expected, g), rtol=0, atol=0)
    assert tripwire.calls == ["dequantize"]


def test_unpack_traced_by_dynamo_never_calls_the_triton_kernels(monkeypatch):
    # The same through dynamo itself (the eager backend: no compiler needed): a full graph, no Triton call.
    from slimact.quant import core

    x = torch.randn(64, 32)
    packed = pack(x, QuantConfig(groups=4), backend="reference", share=False)
    expected = reference.dequantize(packed.tensors[0], packed.meta, *packed.tensors[1:3])
    tripwire = _force_triton(monkeypatch)
    torch._dynamo.reset()
    restored = torch.compile(lambda p: core.unpack(p) * 2, backend="eager", fullgraph=True)(packed)
    torch.testing.assert_close(restored, expected * 2, rtol=0, atol=0)
    assert tripwire.calls == []


def _weight_gradients_follow(x: torch.Tensor, change) -> None:
    """A slimact Linear used on its own and a plain one with its weights, fed ``x`` for two steps, ``change()``
    writing new values into ``x`` between them without moving its version: the weight gradients agree each step."""
    import slimact.nn as snn

    torch.manual_seed(0)
    slim = snn.Linear(16, 8, policy="int8")
    plain = torch.nn.Linear(16, 8)
    plain.load_state_dict(slim.state_dict())
    for step in range(2):
        grads = []
        for layer in (slim, plain):
            layer.zero_grad()
            layer(x).square().sum().backward()
            grads.append(layer.weight.grad)
        assert cosine(grads[0], grads[1]) >= 0.999, step
        change()


def test_a_parameter_changed_through_data_is_packed_afresh_outside_a_forward():
    # A slimact Linear used on its own, fed a parameter (learned queries, latents) that is updated through .data
    # (weight clipping, an EMA, a custom optimizer): no version moves, and the pack kept from the previous step
    # gave this step's weight gradient the old values (cosine -1 after a sign flip).
    latents = torch.nn.Parameter(torch.randn(5, 16, generator=torch.Generator().manual_seed(0)))
    _weight_gradients_follow(latents, lambda: latents.data.mul_(-3.0))


def test_an_input_refilled_in_place_without_a_version_bump_is_packed_afresh_outside_a_forward():
    # A slimact Linear used on its own, fed a batch that shares memory with a numpy array the loop refills in place
    # (no version counter moves): the pack of the previous batch was served again, and the weight gradient was
    # the previous batch's (cosine -0.01).
    import numpy as np

    buf = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)

    def refill():
        buf[:] = -3.0 * buf[::-1]

    _weight_gradients_follow(torch.from_numpy(buf), refill)


@pytest.mark.parametrize("ends", [(-30000.0, 65504.0), (-65504.0, 30000.0), (-65504.0, 65504.0), (-1.0, 65500.0)])
def test_half_precision_values_near_its_largest_are_restored_finite(ends):
    # Zero alignment (lo = -z * step) can put the top code up to a step above the group's maximum: for fp16 data
    # within a step of 65504 the restore was inf (lo -30000, step 375: the top code 65625), and an fp16 Linear fed
    # such inputs had every weight gradient non-finite where plain's are finite. Such groups keep the plain range.
    x = torch.linspace(*ends, 4099).half()
    for bits in (8, 4):
        x_hat = unpack(pack(x, QuantConfig(bits=bits, group_dim=None)))
        assert torch.isfinite(x_hat).all()
        qmax = 2**bits - 1
        step = (ends[1] - ends[0]) / qmax * (qmax / 2) / (qmax / 2 - 1)  # (the aligned step's most)
        assert ((x_hat.float() - x.float()).abs() <= step / 2 + 32).all()  # (+ fp16's own spacing there)
    torch.manual_seed(0)
    lin = nn.Linear(4099, 8).half()
    slim = slimact.convert(copy.deepcopy(lin).train(), "int8")
    for m in (lin, slim):
        (m(x[None].clone().requires_grad_()).float() * 1e-4).sum().backward()
    assert torch.isfinite(lin.weight.grad).all() and torch.isfinite(slim.weight.grad).all()


def test_a_tensor_kept_uncompressed_for_its_inf_dies_with_its_step():
    # A tensor holding an inf is kept as it is (a raw pack, the tensor itself); the shared-pack cache held that pack,
    # so the entry's weak reference to the tensor never died: its full size leaked per step (found by a review).
    model = slimact.convert(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), "int8")
    x = torch.randn(256, 64)
    x[3, 5] = math.inf
    h = model[0](x.requires_grad_())
    gone = weakref.ref(h)
    model[1](h).sum().backward()
    del h
    assert gone() is None


def test_a_tensor_autograd_keeps_in_full_is_packed_as_it_is():
    # The output of an op whose backward saves its result (sigmoid, tanh, exp, softmax, relu), or a view of it, is
    # kept by autograd in full whatever slimact does: its codes were a second copy beside it (sigmoid attention
    # written in model code kept 1.02-1.09x plain's bytes). pack keeps it as it is: the same storage, exact.
    cfg = QuantConfig(bits=8)
    x = torch.randn(64, 32, requires_grad=True)
    for y in (torch.sigmoid(x), torch.tanh(x), torch.exp(x), x.softmax(-1), torch.relu(x), torch.sigmoid(x).t()):
        packed = pack(y, cfg)
        assert packed.meta.raw and packed.tensors[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        assert torch.equal(unpack(packed), y)
    for y in (x * 2, torch.nn.functional.gelu(x), x.detach().sigmoid()):  # (their results are not saved)
        assert not pack(y, cfg).meta.raw
