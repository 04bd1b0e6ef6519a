"""Pure-PyTorch compression core: the oracle every fast kernel is tested against, and the CPU path.

A float tensor ``x`` (fp32, fp16 or bf16) becomes ``b``-bit integer codes with one affine map per group::

    step_g = (hi_g - lo_g) / (2**b - 1)              # fp32, computed in fp64 so it never overflows
    code   = clamp(round((x - lo_g) / step_g), 0, 2**b - 1)
    x_hat  = lo_g + code * step_g                     # restored in fp32, then cast to x.dtype

Groups (``QuantConfig.group_dim`` / ``groups``):

* per channel group, ``[..., C]`` with ``group_dim=-1``: channel ``c`` belongs to group ``c * G // C``, so a
  group count that does not divide ``C`` is fine (groups differ in size by at most one channel);
* per head, ``[B, H, T, D]`` with ``group_dim=1, groups=0`` (0 = one group per index of that dim);
* whole tensor, ``group_dim=None``.

``lo``/``hi`` are either this tensor's own per-group min and max (``scale="dynamic"``) or a running estimate
(``scale="running"``, see :mod:`slimact.quant.state`); a value outside a stale estimate saturates at 0 or
``2**b - 1``: it never wraps.

Rounding is to nearest (``floor(v + 0.5)``) or stochastic (``floor(v + u)``, ``u`` uniform in [0, 1)).
The stochastic bits come from a counter-based hash of ``(seed, flat element index)``; seeds come from
:func:`draw_seed` (streams derived from PyTorch's generator state without ever advancing it), so results are
reproducible under ``torch.manual_seed`` and dropout masks stay the plain model's, and the Triton kernel
(:mod:`slimact.quant.triton`) reproduces the same codes bit for bit without storing any noise.

Outliers (``QuantConfig.outliers``, on by default): an element more than ``OUTLIER_RATIO`` (64) times the
typical magnitude of the other elements of its group is kept exactly, apart from the codes (its flat index and
value), and left out of the group's range; the restore writes it back. One value in a hundred at 1e4 times the
rest (LLMs' "massive activations" look like that) stretched an 8-bit step over ~80 times the typical value, so
that every ordinary value rounded to 0 and a Linear's weight gradient fell to ~29 dB; apart, the rest keep their
own fine step. "Typical magnitude" is the power mean of order 1/2, ``(mean sqrt|x|)**2``: a plain mean is
dominated by the outliers themselves once they are more than ``1/K`` of a group (three at 1e4 in a group of 37
hid each other, and a product of two such tensors lost its cosine floor), while a mean of square roots is
dominated only past ``1/sqrt(K)``. It is that of the group's *other* elements, so that small groups have outliers
too. Normal data never has one (its largest value is ~8.4x its typical magnitude at 1e8 elements; Laplace data
~24x); fewer than ``1 + (n - 1) / sqrt(64)`` of a group's ``n`` elements can be outliers, so the codes and the
outliers together stay under the original's bytes (at worst ``1 + 8/8`` bytes per element for fp32, ``1 + 6/8``
for bf16 and fp16 in large groups; 0.06-0.08 for 1% outliers). Deciding needs the groups' sums of square roots
(:func:`group_stats`, taken in the range's own pass on the fast paths) and shares the pack's one host sync.

Error bound per element, measured before the cast back to ``x.dtype``: at most ``step/2`` with nearest
rounding, under ``step`` with stochastic rounding (which is unbiased); the cast adds at most half an ulp
of the output dtype.

Bytes kept per element: ``b/8`` for the codes, plus 8 bytes per group for ``lo`` and ``step``, plus 6-12 bytes
per outlier.

Defined edge cases:

* zero-range group (``hi == lo``, including one-element groups): ``step = 1``, every code 0, restored
  exactly as ``lo``; no division by zero;
* tiny ranges (fp16 ranges down to denormals): the scale is fp32, computed in fp64, never inf or 0;
* NaN or inf anywhere in ``x``, a range that overflows fp32, an empty tensor, or a dtype other than
  fp32/fp16/bf16 (float64 included): the tensor is kept uncompressed (``Packed.raw``), so the backward
  sees exactly what PyTorch's would.
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from slimact.quant.packing import pack_bits, unpack_bits
from slimact.quant.recompute import checkpoint_frame, note_seed, replayed_seed

__all__ = [
    "COMPRESSIBLE_DTYPES",
    "OUTLIER_RATIO",
    "GroupLayout",
    "PackMeta",
    "Packed",
    "QuantConfig",
    "begin_stream",
    "current_stream",
    "dequantize",
    "draw_seed",
    "end_stream",
    "group_counts",
    "group_layout",
    "group_magnitude",
    "group_minmax",
    "group_stats",
    "hash_uniform",
    "in_order",
    "memory_order",
    "memory_permutation",
    "outlier_threshold",
    "quantize",
    "range_decisions",
    "restore_outliers",
    "scale_params",
    "seed_key",
    "split_outliers",
    "threshold_of",
]

COMPRESSIBLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: An element more than this many times the typical magnitude ``(mean sqrt|x|)**2`` of its group's other elements
#: is an outlier (``QuantConfig.outliers``). Normal data has none: its largest value is ~8.4x that at 1e8 elements.
OUTLIER_RATIO = 64.0
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class QuantConfig:
    """How one saved tensor is compressed.

    Attributes:
        bits: code width, 8, 4 or 2.
        group_dim: the dim whose indices are grouped (``-1`` channels, ``1`` heads); ``None`` = whole tensor.
        groups: number of groups along ``group_dim``; ``0`` means one group per index (per head). Need not
            divide the dim's size; more groups than the dim has indices is an error (``pack`` raises), unless
            ``clamp_groups``.
        scale: ``"dynamic"`` (this tensor's own range) or ``"running"`` (Mesa's EMA estimate).
        decay: EMA decay of the running estimate.
        stochastic: stochastic rounding (unbiased) instead of round-to-nearest.
        outliers: keep elements beyond ``OUTLIER_RATIO`` times their group's typical magnitude exactly, apart
            from the codes, and leave them out of the group's range (see the module docstring).
        clamp_groups: ``groups`` is an upper bound, clamped to the dim's size. What a :class:`slimact.Policy`
            builds: its one ``channel_groups`` setting serves layers of every width (8 groups on a 4-feature
            Linear give 4). An explicit config asking for more groups than channels is more likely a mistake
            (a wrong ``group_dim``), so by default it is refused rather than silently changed.
        clip: values beyond ``+-clip`` may be restored as ``+-clip`` (the input of an activation whose derivative
            is constant out there): the range is clipped to it and what lies beyond saturates, so large values
            cost no resolution. NaN/inf are still seen (the tensor is kept exact). ``None``: no clipping.
    """

    bits: int = 8
    group_dim: int | None = -1
    groups: int = 1
    scale: Literal["dynamic", "running"] = "dynamic"
    decay: float = 0.9
    stochastic: bool = False
    outliers: bool = True
    clamp_groups: bool = False
    clip: float | None = None

    def __post_init__(self) -> None:
        if self.bits not in (8, 4, 2):
            raise ValueError(f"bits must be 8, 4 or 2, got {self.bits}")
        if self.groups < 0:
            raise ValueError(f"groups must be >= 0 (0 = one per index), got {self.groups}")
        if self.scale not in ("dynamic", "running"):
            raise ValueError(f"scale must be 'dynamic' or 'running', got {self.scale!r}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be positive, got {self.clip}")

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1


class GroupLayout(NamedTuple):
    """Where the groups of a tensor are: along ``dim`` (size ``size``) in ``groups`` contiguous runs.

    ``inner`` is the number of elements after ``dim`` in a contiguous tensor, so the flat index ``i`` of an
    element lies at index ``(i // inner) % size`` of ``dim`` and in group ``that * groups // size``.
    ``dim is None`` is the whole-tensor layout (``size = groups = 1``, ``inner = numel``).
    """

    dim: int | None
    size: int
    groups: int
    inner: int

    def broadcast_shape(self, ndim: int) -> tuple[int, ...]:
        """Shape that broadcasts a per-index vector of length ``size`` against the tensor."""
        if self.dim is None:
            return (1,) * ndim
        return tuple(self.size if d == self.dim else 1 for d in range(ndim))

    def group_index(self, device: torch.device) -> Tensor:
        """``[size]`` int64: the group of each index along ``dim``."""
        return torch.arange(self.size, device=device) * self.groups // self.size


def group_layout(shape: torch.Size | tuple[int, ...], cfg: QuantConfig) -> GroupLayout:
    numel = 1
    for s in shape:
        numel *= s
    if cfg.group_dim is None or len(shape) == 0:
        return GroupLayout(None, 1, 1, max(numel, 1))
    dim = cfg.group_dim % len(shape)
    size = shape[dim]
    if cfg.groups > size > 0 and not cfg.clamp_groups:
        raise ValueError(
            f"QuantConfig asks for {cfg.groups} groups along dim {dim} of a tensor of shape {tuple(shape)}, which "
            f"has only {size} channels there: use at most {size} groups (0 = one per channel), or "
            "clamp_groups=True to clamp the count"
        )
    groups = size if cfg.groups == 0 else min(cfg.groups, size)
    inner = 1
    for s in shape[dim + 1 :]:
        inner *= s
    return GroupLayout(dim, size, max(groups, 1), inner)


def _group_reduce(per_index: Tensor, layout: GroupLayout, reduce: Literal["amin", "amax", "sum"]) -> Tensor:
    # per_index: [size] -> [groups]
    if layout.groups == layout.size:
        return per_index
    if layout.size % layout.groups == 0:
        view = per_index.view(layout.groups, -1)
        return getattr(view, reduce)(1)
    out = per_index.new_zeros(layout.groups) if reduce == "sum" else per_index.new_empty(layout.groups)
    return out.scatter_reduce_(0, layout.group_index(per_index.device), per_index, reduce, include_self=False)


def group_minmax(x: Tensor, layout: GroupLayout) -> tuple[Tensor, Tensor]:
    """Per-group min and max of ``x`` as fp32 ``[groups]`` tensors. NaN propagates into its group."""
    if layout.dim is None:
        lo, hi = torch.aminmax(x)
        return lo.float().reshape(1), hi.float().reshape(1)
    others = tuple(d for d in range(x.dim()) if d != layout.dim)
    lo = x.amin(dim=others) if others else x
    hi = x.amax(dim=others) if others else x
    return _group_reduce(lo.float(), layout, "amin"), _group_reduce(hi.float(), layout, "amax")


def group_magnitude(x: Tensor, layout: GroupLayout) -> Tensor:
    """Per-group sum of ``sqrt|x|``, fp32 ``[groups]`` (one pass, no temporary; summed in fp64, whose square
    does not overflow for the largest fp32 values)."""
    if layout.dim is None:
        return torch.linalg.vector_norm(x, 0.5, dtype=torch.float64).sqrt().float().reshape(1)
    others = tuple(d for d in range(x.dim()) if d != layout.dim)
    if others:
        per_index = torch.linalg.vector_norm(x, 0.5, dim=others, dtype=torch.float64).sqrt().float()
    else:
        per_index = x.abs().float().sqrt()
    return _group_reduce(per_index, layout, "sum")


def group_stats(x: Tensor, layout: GroupLayout) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`group_minmax` and :func:`group_magnitude` (what a pack that keeps outliers apart needs)."""
    return (*group_minmax(x, layout), group_magnitude(x, layout))


def outlier_threshold(magnitude: Tensor, layout: GroupLayout, numel: int) -> Tensor:
    """Per group, fp32 ``[groups]``, from its :func:`group_magnitude` ``Q`` (the sum of ``sqrt|x|``) over ``n``
    elements: the magnitude beyond which an element is more than ``OUTLIER_RATIO`` (``K``) times the typical
    magnitude ``(mean sqrt|x|)**2`` of the group's other elements. With ``r = sqrt|x|``:
    ``r > sqrt(K) (Q - r) / (n - 1)``, that is ``r > sqrt(K) Q / (n - 1 + sqrt(K))``; squared, in fp64 (inf where
    it passes fp32's largest value: then no element is beyond it). Leaving the element out of its own mean lets
    small groups have outliers too (a group of two: 1e4 against 0.8)."""
    return threshold_of(magnitude, group_counts(layout, numel, magnitude.device))


_ROOT = math.sqrt(OUTLIER_RATIO)


def threshold_of(magnitude: Tensor, counts: Tensor | float) -> Tensor:
    """:func:`outlier_threshold` from the groups' element counts ``n`` (:func:`group_counts`: int64 ``[groups]``,
    or a Python float for the whole tensor): ``(Q sqrt(K) / (n - 1 + sqrt(K)))**2``, the denominator in fp32 per
    group (fp64 for the whole tensor), the rest in fp64. PyTorch ops only: the compiled CPU pack
    (:func:`slimact.quant.inductor.pack8`) runs it too."""
    return (magnitude.double() * _ROOT / (counts - 1 + _ROOT)).square().float()


def group_counts(layout: GroupLayout, numel: int, device: torch.device) -> Tensor | float:
    """The elements ``n`` of each group: int64 ``[groups]``, or a Python float for the whole tensor (its one
    group's ``n`` is ``numel``)."""
    if layout.dim is None:
        return float(numel)
    # Elements per group: the indices i of dim with i * groups // size == g, i.e. ceil(g size / groups) <= i <
    # ceil((g + 1) size / groups), times the elements per index. Computed on the device (no bincount: on
    # CUDA it reads its input's max back to the host).
    g = torch.arange(layout.groups + 1, device=device)
    starts = (g * layout.size + layout.groups - 1) // layout.groups  # [groups + 1]
    return (starts[1:] - starts[:-1]) * (numel // max(layout.size, 1))


def range_decisions(
    lo: Tensor, hi: Tensor, clip: float | None, threshold: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """What a pack decides from a tensor's per-group range ``(lo, hi)`` (fp32 ``[groups]``): ``(lo, hi, bad,
    clipped, heavy)``, the range clipped to ``[-clip, clip]`` (NaN stays NaN) and three 0-d bool flags: NaN/inf in
    the tensor (they propagate into ``lo``/``hi``; a range overflowing fp32 shows as inf in ``hi - lo``: the
    tensor is kept exact), values beyond the clip (``None`` without one), and, with an outlier ``threshold``
    (:func:`outlier_threshold`), a clipped bound beyond it (``None`` without one). PyTorch ops only, so the same
    function runs eagerly and inside a compiled pack (:func:`slimact.quant.inductor.pack8`)."""
    bad = (~torch.isfinite(lo) | ~torch.isfinite(hi - lo)).any()
    clipped = None
    if clip is not None:
        clipped = ((lo < -clip) | (hi > clip)).any()
        lo, hi = lo.clamp(-clip, clip), hi.clamp(-clip, clip)
    heavy = None if threshold is None else (torch.maximum(lo.abs(), hi.abs()) > threshold).any()
    return lo, hi, bad, clipped, heavy


def memory_order(x: Tensor, layout: GroupLayout) -> tuple[Tensor, GroupLayout, list[int] | None]:
    """``x`` with its dims permuted into memory order, contiguous, its layout in that order, and the permutation
    that takes them back (``None``: ``x`` as given, contiguous or not a permuted contiguous tensor). Attention's
    ``q``, ``k``, ``v`` are ``[B, T, H, D]`` memory seen as ``[B, H, T, D]``: one scale per head is then runs of
    ``D`` elements, ``H`` groups, ``B * T`` of them, read as they lie (no contiguous copy of ``x``). For 8-bit
    codes (one per element), whose order :func:`in_order` then restores; sub-byte codes are packed along the
    flat index of the caller's order."""
    found = memory_permutation(x)
    if found is None:
        return x, layout, None
    perm, back = found
    permuted = x.permute(perm)
    if layout.dim is not None:
        at = perm.index(layout.dim)
        inner = 1
        for s in permuted.shape[at + 1 :]:
            inner *= s
        layout = layout._replace(dim=at, inner=inner)
    return permuted, layout, back


def memory_permutation(x: Tensor) -> tuple[list[int], list[int]] | None:
    """Where ``x`` is a permuted view of contiguous memory and not contiguous itself: the permutation of its dims
    that lays them out as in memory (``x.permute(perm)`` is contiguous) and the one that takes them back; else
    ``None``."""
    if x.is_contiguous():
        return None
    perm = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
    if not x.permute(perm).is_contiguous():
        return None
    return perm, sorted(range(x.dim()), key=perm.__getitem__)



def in_order(codes: Tensor, order: list[int] | None) -> Tensor:
    """8-bit ``codes`` of :func:`memory_order`'s view, in the caller's dim order, contiguous (a copy of one byte per
    element, where the fp32 input's contiguous copy would have moved eight)."""
    return codes if order is None else codes.permute(order).contiguous()


def split_outliers(x: Tensor, layout: GroupLayout, threshold: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The elements of ``x`` beyond their group's ``threshold`` in magnitude (:func:`outlier_threshold`), kept
    apart: ``(lo, hi, index, values)``, the per-group range of the other elements (fp32 ``[groups]``), the
    outliers' flat row-major indices (int32, int64 from 2**31 elements) and their values (``x.dtype``).

    Fewer than ``1 + (n - 1) / sqrt(OUTLIER_RATIO)`` of a group's ``n`` elements can be outliers (one, in groups
    of up to 9), so every group of two or more keeps elements to set its range, and the outliers of large groups
    cost at most ``(4 + 4) / 8`` bytes per element (1% of them: 0.06-0.08).
    """
    mask = x.abs() > _expand(threshold, layout, x.dim())
    index = mask.reshape(-1).nonzero().squeeze(1)  # row-major, the order x[mask] gathers in
    values = x[mask]
    lo = group_minmax(x.masked_fill(mask, torch.inf), layout)[0]
    hi = group_minmax(x.masked_fill(mask, -torch.inf), layout)[1]
    return lo, hi, index.to(torch.int32 if x.numel() < 2**31 else torch.int64), values


def restore_outliers(out: Tensor, index: Tensor, values: Tensor) -> Tensor:
    """Write the kept outliers back into a restored (contiguous) tensor, in place."""
    out.view(-1).index_copy_(0, index.long(), values)
    return out


def scale_params(lo: Tensor, hi: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """fp32 ``(lo, step)`` per group from fp32 bounds.

    The step is computed in fp64 so that neither ``hi - lo`` nor the division over/underflows, and rounded up to
    fp32 so that ``[lo, hi]`` stays inside the code range; a group with no positive range (or one so small that
    its fp32 step would be 0) gets ``step = 1`` and codes 0.

    Zero is a code: where a range straddles 0 (``lo < 0 < hi``) with 4 or more bits, ``lo`` becomes
    ``-z * step`` for an integer ``z``, so an exact 0 (a zeroed token, a padded row, a masked feature) is
    restored as 0, not as a fraction of a step that a large gradient would multiply. ``z`` and the step are
    chosen so that ``[lo, hi]`` stays inside the code range (no clamping): the step grows by at most
    ``(qmax / 2) / (qmax / 2 - 1)`` (0.8% at 8 bits, 15% at 4 bits). Two-bit codes keep the plain range,
    where the same guarantee would cost up to 1.5x the step, and so does a group within fp16's range whose aligned
    codes would reach past it (:func:`_past_half`: fp16 data restored as inf).
    """
    lo64, hi64 = lo.double(), hi.double()
    rng = hi64 - lo64
    step64 = rng / qmax
    if qmax >= 15:
        z_star = -lo64 / rng.clamp(min=torch.finfo(torch.float64).tiny) * qmax
        best = None
        for z in (z_star.floor(), z_star.ceil()):
            z = z.clamp(1, qmax - 1)
            cand = torch.maximum(-lo64 / z, hi64 / (qmax - z))
            best = (z, cand) if best is None else (torch.where(cand < best[1], z, best[0]), best[1].minimum(cand))
        z, zero_step = best
        straddles = (lo64 < 0) & (hi64 > 0) & ~_past_half(z, zero_step, lo64, hi64, qmax)
        step64 = torch.where(straddles, zero_step, step64)
    step = step64.float()
    # Rounded up, never down: a step a hair short of range / qmax would clamp the top of the range, by up to qmax
    # times the rounding; that is 255 subnormal spacings where fp32 steps are themselves subnormal (denormal data).
    step = torch.where(step.double() < step64, torch.nextafter(step, torch.full_like(step, torch.inf)), step)
    ok = (rng > 0) & (step > 0)
    if qmax >= 15:
        # -z * step in fp32: the reference restores code z as lo + z * step = 0 exactly.
        lo = torch.where(straddles & ok, -(z.float() * step), lo.float())
    return lo.float(), torch.where(ok, step, torch.ones_like(step))


#: Elements per chunk of the stochastic-rounding bits (:func:`quantize`): the hash's temporaries are two int64 buffers
#: of at most this many elements and one fp32 one (1.25 MiB), whatever the size of the tensor packed. Made for the
#: whole tensor at once, they were ~6 int64 tensors of its size alive together, 12x its fp32 bytes: under ``"mesa"``
#: the forward's transients were 2.5x ``"int8"``'s on tiny Llama (docs/mesa.md, "Memory during the forward").
_HASH_CHUNK = 1 << 16
_FMIX1 = 0x85EBCA6B
_FMIX2 = 0xC2B2AE35


def _mul32_(h: Tensor, c: int, scratch: Tensor) -> None:
    # h <- (h * c) mod 2**32, in place, on int64 without overflowing int64: split c into 16-bit halves.
    torch.mul(h, c >> 16, out=scratch).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    h.mul_(c & 0xFFFF).add_(scratch).bitwise_and_(_MASK32)


def _fmix32_(h: Tensor, scratch: Tensor) -> None:
    # MurmurHash3's finaliser on uint32 values held in int64, in place (scratch: an int64 tensor of h's shape).
    h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=scratch))
    _mul32_(h, _FMIX1, scratch)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 13, out=scratch))
    _mul32_(h, _FMIX2, scratch)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 16, out=scratch))


def seed_key(seed: int) -> int:
    """The 32-bit key both implementations mix into each element index for a given seed."""
    h = seed & _MASK32
    h ^= h >> 16
    h = (h * _FMIX1) & _MASK32
    h ^= h >> 13
    h = (h * _FMIX2) & _MASK32
    return h ^ (h >> 16)


def hash_uniform(numel: int, seed: int, device: torch.device | str = "cpu", start: int = 0) -> Tensor:
    """``[numel]`` fp32 in [0, 1): 24 bits of ``fmix32(index ^ seed_key(seed))`` per element, for the flat indices
    ``start`` to ``start + numel - 1``. Two int64 temporaries of ``numel`` elements, updated in place."""
    h = torch.arange(start, start + numel, dtype=torch.int64, device=device).bitwise_and_(_MASK32)
    _fmix32_(h.bitwise_xor_(seed_key(seed)), torch.empty_like(h))
    return h.bitwise_right_shift_(8).float().mul_(1.0 / (1 << 24))


def _digest(*values: int | bytes) -> int:
    """A 63-bit digest of ``values`` (ints and bytes), the same in every process: Python's ``hash`` of bytes
    (and so of a tuple holding them) is salted per process (``PYTHONHASHSEED``), which made stochastic rounding
    differ between two runs seeded alike."""
    h = hashlib.blake2b(digest_size=8)
    for v in values:
        # A tag per value (its type and length) so that (b"ab", b"c") and (b"a", b"bc") differ.
        data = v if isinstance(v, bytes) else v.to_bytes(16, "little", signed=True)
        h.update(b"b" if isinstance(v, bytes) else b"i")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return int.from_bytes(h.digest(), "little") >> 1


class _Streams(threading.local):
    """The seed streams of one thread: two models trained in two threads draw as they would one after the
    other (a stack shared by the threads handed one thread's draws from the other's forward)."""

    def __init__(self) -> None:
        self.forward: list[list[int]] = []  # [key, count] per converted-model forward in progress
        self.initial: int | None = None  # the counter stream outside one: its generator-state key ...
        self.count = 0  # ... and its next number


_streams = _Streams()


def begin_stream(step: int) -> None:
    """Start the seed stream of one forward pass of a converted model (called by ``convert``'s hook).

    Its key is a digest of PyTorch's CPU generator state (read, never advanced) and the model's step count:
    runs seeded alike draw alike (even twice in one process, and in any two processes), every step draws
    afresh, and PyTorch's own random stream, hence every dropout mask, is exactly the plain model's. Streams
    belong to the calling thread (nested forwards each have their own, the innermost drawing).
    """
    # (under a torch.func transform the state is a wrapper with no storage; under FakeTensorMode a fake tensor)
    with torch._C._DisableFuncTorch(), _disable_current_modes():
        state = torch.get_rng_state().numpy().tobytes()
    _streams.forward.append([_digest(state, step), 0])


def current_stream() -> object | None:
    """The calling thread's innermost forward stream (an opaque object, compared by identity), or ``None``
    outside a converted model's forward."""
    return _streams.forward[-1] if _streams.forward else None


def end_stream() -> int:
    """End the calling thread's innermost stream (:func:`begin_stream`); the seeds it drew."""
    return _streams.forward.pop()[1] if _streams.forward else 0


def draw_seed() -> int:
    """The next 31-bit stochastic-rounding seed.

    Inside a converted model's forward (in this thread): the pack's number in that forward's stream
    (:func:`begin_stream`). Elsewhere: this thread's counter stream keyed by PyTorch's CPU generator state,
    restarting whenever that state has moved (``torch.manual_seed``, any random draw) since the last seed drawn.
    Neither draws from (or advances) PyTorch's generator. In activation checkpointing's recompute, the seeds the
    forward of the region drew, in order (:mod:`slimact.quant.recompute`).
    """
    # In activation checkpointing's recompute: the seed the forward drew at this point (slimact.quant.recompute).
    frame = checkpoint_frame()
    if frame is not None and frame[1] is not None:
        replayed = replayed_seed(*frame)
        if replayed is not None:
            return _digest(*replayed) & 0x7FFFFFFF
    streams = _streams
    if streams.forward:
        stream = streams.forward[-1]
        stream[1] += 1
        key, n = stream
    else:
        # Keyed by the generator's state, not torch.initial_seed(): seeding with another seed, or drawing, restarts it
        # (a reseed to the state the last pack saw cannot be told from none: docs/quant.md).
        key = _digest(torch.get_rng_state().numpy().tobytes(), 0)
        if streams.initial != key:
            streams.initial, streams.count = key, 0
        n = streams.count
        streams.count = n + 1
    if frame is not None and frame[1] is None:  # a checkpointed region's forward: where its seeds began
        note_seed(frame[0], key, n)
    return _digest(key, n) & 0x7FFFFFFF


class PackMeta(NamedTuple):
    """Non-tensor description of a packed tensor (lives on ``ctx``; tensors go to ``save_for_backward``)."""

    shape: torch.Size
    dtype: torch.dtype
    bits: int
    layout: GroupLayout
    raw: bool
    #: A registered function the restored tensor is passed through (:func:`slimact.quant.core.share_derived`):
    #: the pack of ``x`` standing for ``f(x)``.
    derive: str | None = None
    #: Whether values beyond ``QuantConfig.clip`` were (or, where no host sync decided it, may have been)
    #: restored as the clip: then the pack does not stand for the tensor itself (no sharing).
    clipped: bool = False


class Packed(NamedTuple):
    """A compressed tensor: ``tensors`` is ``(codes, lo, step)``, plus ``(index, values)`` when outliers are
    kept apart, or ``(x,)`` when kept uncompressed."""

    tensors: tuple[Tensor, ...]
    meta: PackMeta

    @property
    def raw(self) -> bool:
        return self.meta.raw

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _expand(v: Tensor, layout: GroupLayout, ndim: int) -> Tensor:
    # [groups] -> broadcastable against the tensor
    if layout.dim is not None and layout.groups != layout.size:
        v = v[layout.group_index(v.device)]
    return v.reshape(layout.broadcast_shape(ndim))


def quantize(
    x: Tensor, layout: GroupLayout, lo: Tensor, step: Tensor, bits: int, seed: int | None, noise: Tensor | None = None
) -> Tensor:
    """Codes of ``x`` for the given per-group ``lo``/``step``: uint8, bit-packed when ``bits < 8``.

    ``seed=None`` rounds to nearest; otherwise stochastic rounding with :func:`hash_uniform` bits. ``noise``
    (uniform in [0, 1), ``x``'s shape) rounds stochastically with those bits instead (under ``torch.compile``,
    where the seed stream cannot be traced).
    """
    # One fp32 temporary, updated in place: (x - lo) / step + (0.5 or u), clamped to [0, qmax]; there the cast
    # to uint8 truncates, which is floor for values >= 0: clamp(floor(w), 0, qmax) == trunc(clamp(w, 0, qmax)).
    # The stochastic bits u are added a chunk at a time (_HASH_CHUNK), so their temporaries stay small.
    v = torch.sub(x, _expand(lo, layout, x.dim()), out=torch.empty(x.shape, dtype=torch.float32, device=x.device))
    v.div_(_expand(step, layout, x.dim()))
    if noise is not None:
        v.add_(noise)
    elif seed is None:
        v.add_(0.5)
    else:
        flat = v.view(-1)  # (a fresh contiguous tensor)
        for at in range(0, flat.numel(), _HASH_CHUNK):
            part = flat[at : at + _HASH_CHUNK]
            part.add_(hash_uniform(part.numel(), seed, x.device, start=at))
    codes = v.clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return codes if bits == 8 else pack_bits(codes.reshape(-1), bits)


#: fp16's largest finite value (an integer: a module-level float is an input of the graph under
#: torch.compile(dynamic=True), which fails to trace where two autograd.Functions read it).
HALF_MAX = 65504


def _past_half(z: Tensor, step: Tensor, lo: Tensor, hi: Tensor, qmax: int) -> Tensor:
    """Where zero-aligned codes (``lo = -z * step``, fp64) would restore beyond fp16's largest finite value (the top
    code up to a step above ``hi``, the bottom one below ``lo``) while the group itself lies within it: fp16 data
    there was restored as inf (an fp16 Linear's weight gradient all non-finite). Those groups keep the plain
    range, whose codes restore within it."""
    return (((qmax - z) * step > HALF_MAX) & (hi <= HALF_MAX)) | ((z * step > HALF_MAX) & (-lo <= HALF_MAX))


def dequantize(codes: Tensor, meta: PackMeta, lo: Tensor, step: Tensor) -> Tensor:
    """Reference restore: ``lo + code * step`` in fp32, cast to the original dtype and shape."""
    numel = 1
    for s in meta.shape:
        numel *= s
    if meta.bits != 8:
        codes = unpack_bits(codes, meta.bits, numel)
    codes = codes.reshape(meta.shape)
    ndim = len(meta.shape)
    out = codes.float().mul_(_expand(step, meta.layout, ndim)).add_(_expand(lo, meta.layout, ndim))
    return out.to(meta.dtype)
