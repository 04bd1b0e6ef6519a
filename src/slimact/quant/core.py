"""``pack`` / ``unpack``: the one entry point every slimact Function uses to keep a tensor small.

The steps shared by every backend live here: per-group range (this tensor's own), the NaN/inf check, the clip
and the outlier decision (one host sync; a non-finite tensor is kept uncompressed), the running-estimate update
(a tensor is packed with the estimate it finds, then its range is folded in), the scale snapshot. The passes
over the tensor (per-group range, quantise, dequantise) are dispatched: to the Triton kernels for CUDA tensors
when Triton is installed, to ``torch.compile``d loops for large CPU tensors (:mod:`slimact.quant.inductor`,
bit-identical to the reference), else to the pure-PyTorch reference. ``SLIMACT_BACKEND=reference`` forces the
reference everywhere. A strided tensor is copied once, contiguous, for the range pass and the quantise both,
unless its dims are a permutation of contiguous memory (attention's ``q``, ``k``, ``v``): the Triton kernels
then read it as it lies and copy only its 8-bit codes into its order
(:func:`slimact.quant.reference.memory_order`).

On the inductor backend (large CPU tensors, 8-bit nearest codes) a pack is one compiled call
(:func:`slimact.quant.inductor.pack8`): the range, the decisions, the scale (the tensor's own, or the running
estimate's, with the fold's new buffer values) and the codes, with no PyTorch op in between (before: 235 ops per
pack, 14 now); the host then reads its three flags and, where they say so (NaN/inf, outliers apart from a
dynamic range), discards its codes for the slow path.

On the Triton backend the decisions are made on the device (:func:`slimact.quant.triton.decide`): the range
pass writes per-tile partials and one small kernel per tensor reduces them per group and computes, with the
reference's float operations in the reference's order, the NaN/inf flag, the clip, the outlier threshold and
flag, and :func:`slimact.quant.reference.scale_params`' ``lo``/``step`` (the same values bit for bit; the sum
of ``sqrt|x|`` the threshold starts from is summed in fp64 in a fixed order, within float rounding of the
reference's, as PyTorch's reduction of the partials was); it or-s the flags into an int32 buffer shared by the
tensors of the call. A pack is then three launches (range pass, finish, quantise) and the host reads the flags
once per :func:`pack_many` call. Where they say "outliers present" (or a running estimate is first set) the
rare slow path keeps them apart and rescales with PyTorch ops, as the other backends do for every pack
(their decisions are PyTorch ops on the per-group range, stacked and read at once). Under a running estimate
on the GPU the pack has no host sync at all (:func:`_pack_running`) and is three launches: the estimate's scale,
one read of the tensor that gives its codes and its range, and the fold of that range into the estimate's
buffers, in place.
:func:`pack_many` packs several tensors with one host sync for all (attention's ``q``, ``k``, ``v``).

Nothing is stored twice: when two consumers pack the same tensor in one step (the query, key and value
projections all reading one hidden state; a LayerNorm's output that the next Linear also keeps), the
second gets the first's :class:`Packed`, so both keep the very same storages. A pack is reused whatever
its grouping, as long as it has at least the requested bits (the first consumer's layout serves both).
The cache is keyed by the tensor's storage view, holds only weak references (to the source tensor, so its
storage address cannot be reused while an entry is valid, and to the codes, so it never keeps them
alive), and is checked against the source's version counter, so an in-place change in between forces a
fresh pack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from slimact._cache import dropping, storage_key
from slimact.quant import reference
from slimact.quant.recompute import checkpoint_frame, unseen_by_selective_checkpointing
from slimact.quant.reference import (
    COMPRESSIBLE_DTYPES,
    GroupLayout,
    Packed,
    PackMeta,
    QuantConfig,
    group_layout,
    scale_params,
)
from slimact.quant.state import RunningRange

__all__ = [
    "Backend", "backend_for", "kept_whole", "pack", "pack_many", "register_derivation", "share_derived", "unpack",
    "unpack_map",
]

Backend = Literal["reference", "triton", "inductor"]


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_for(x: Tensor) -> Backend:
    """The backend :func:`pack` uses for ``x`` unless told otherwise."""
    if os.environ.get("SLIMACT_BACKEND") == "reference":
        return "reference"
    if x.is_cuda:
        return "triton" if _triton_available() else "reference"
    return "inductor" if x.device.type == "cpu" else "reference"


def _kernels(backend: Backend):
    if backend == "triton":
        from slimact.quant import triton as kernels

        return kernels
    if backend == "inductor":
        from slimact.quant import inductor

        return inductor
    return reference


def _raw(x: Tensor) -> Packed:
    return Packed((x,), PackMeta(x.shape, x.dtype, 0, GroupLayout(None, 1, 1, x.numel()), True))


@functools.cache
def _saves_its_result(node_type: type) -> bool:
    return hasattr(node_type, "_saved_result")  # (on the class: a descriptor, nothing unpacked)


def kept_whole(x: Tensor) -> bool:
    """Whether autograd keeps ``x`` itself, in full, whatever slimact does: ``x`` is the output of an op whose backward
    saves its result (``sigmoid``, ``tanh``, ``exp``, an unrouted ``softmax``: its node has a ``_saved_result``), so a
    pack of it would be a second copy beside it (x-transformers' sigmoid attention kept its fp32 probabilities and
    their 8-bit codes: 1.02-1.09x plain's bytes for the attention), or a view of such an output (``k.transpose(-2,
    -1)``: on its storage). :func:`pack` keeps such a tensor as it is: no byte added (the same storage), no error.
    Only where that node keeps the result as it is: not through saved-tensor hooks (a non-reentrant checkpoint's,
    which drop it for the recompute; ``save_on_cpu``'s), bar slimact's own observers (profile's count); there a
    full copy cost 72 KiB where the codes cost 24 (a review). Not under torch.compile (no graph to read)."""
    if torch.compiler.is_compiling():
        return False
    node = (x._base if x._is_view() else x).grad_fn
    if node is None or not _saves_its_result(type(node)):
        return False
    try:
        hook = node._raw_saved_result.unpack_hook
    except RuntimeError:  # (released: a backward through it ran)
        return False
    return hook is None or getattr(hook, "_slimact_observer", False)


def _recomputing() -> bool:
    """Whether a non-reentrant checkpoint's recompute is running (:func:`checkpoint_frame` with its graph task)."""
    frame = checkpoint_frame()
    return frame is not None and frame[1] is not None


class _SharedPacks:
    """Cache of the packs of live tensors, so that a tensor two layers keep is packed (and kept) once.

    An entry holds its pack for as long as the packed tensor itself is alive (it dies with it), not only
    while autograd keeps the pack: whether the next layer shares a pack must not depend on who keeps it.
    Under ``torch.utils.checkpoint`` the first forward keeps nothing, and its recomputation keeps
    everything; with a weakly held pack the two made different choices and saved differently shaped tensors,
    which checkpointing rejects. The pack costs about a quarter (fp32) or half (fp16, bf16) of the tensor it was
    made from, plus 8 bytes per scale group, only while that tensor is alive anyway.

    An entry made in a converted model's forward (its seed stream, :func:`slimact.quant.reference.current_stream`)
    serves only that forward: a batch fed to two models, or to one model at two steps, is packed afresh by each,
    with that model's running estimate and that step's seeds (a global cache handed one model's codes to the
    next, so a run's losses depended on what ran before it in the process, or in another thread). Outside
    any forward (a checkpointed block recomputed in the backward, a slimact module used on its own) every live
    entry serves, so a recomputation shares what its forward shared; a parameter packed there is not kept
    (:meth:`put`).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}
        #: Called with ``(x, packed)`` at each :meth:`put` (:func:`watching_shared_packs`: slimact.profile's count).
        self.watchers: list[Callable[[Tensor, Packed], None]] = []

    def get(self, x: Tensor, cfg: QuantConfig) -> Packed | None:
        key = storage_key(x)
        entry = self._entries.get(key)
        if entry is None:
            return None
        source, version, packed, stream, _ = entry
        packed_from = source()
        if packed_from is None or version != x._version or packed.meta.bits < cfg.bits:
            return None
        if packed_from is not x and storage_key(packed_from) != key:
            # The packed tensor lives on but its memory was released or swapped (memcnn's invertible wrapper:
            # ``storage().resize_(0)``; Megatron-LM's ``out.data = torch.empty(1)``), and the allocator gave the
            # address to ``x``: another tensor, whose values the pack does not hold (a Linear's weight gradient at
            # cosine -0.04, silently).
            return None
        scope = reference.current_stream()
        if scope is None and stream is None and x.grad_fn is None and not _recomputing():
            # Made and asked for outside any forward (slimact modules used on their own) for a tensor no op made
            # (an input, a buffer): it outlives the step and can change without its version moving (a numpy array
            # it shares memory with, refilled for the next batch; a write through .data), so a pack of an earlier
            # call may hold old values (a weight gradient at cosine -0.01). Packed afresh. Not in a checkpoint's
            # recompute, whose tensors its own ops made (seen here without a grad_fn where a layer packs the tensor
            # a view of it views: nn.MultiheadAttention's batch-first input): there the forward shared the pack,
            # and packing afresh saved other shapes, which checkpoint rejects (a norm-first
            # nn.TransformerEncoderLayer checkpointed under "int8": CheckpointError where PyTorch trains).
            return None
        if scope is not None and stream is not scope:
            return None
        return packed

    def owes_seed(self, x: Tensor) -> bool:
        """Whether a recompute reusing the pack of ``x`` (:meth:`get`) owes the seed stream the draw the forward of its
        checkpointed region made for it: the region's own input (alive outside it) was packed there, and reused
        here, so that the region's later packs would each take their predecessor's seed (a checkpointed block
        ending in a Linear head under ``"mesa"``: the head's weight gradient 2e-3 off the same model's without
        checkpointing; equally close to plain's). Once per recompute (graph task)."""
        entry = self._entries.get(storage_key(x))
        region = None if entry is None else entry[4]
        if region is None:
            return False
        frame = checkpoint_frame()
        if frame is None or frame[1] is None or frame[0] is not region[0]() or frame[1] in region[1]:
            return False
        region[1].add(frame[1])
        return True

    def put(self, x: Tensor, packed: Packed, seeded: bool = False) -> None:
        if isinstance(x, torch.nn.Parameter) and reference.current_stream() is None:
            # Outside any forward (a slimact module used on its own): a parameter outlives the step and can change
            # without its version moving (a write through .data: weight clipping, an EMA, a custom optimizer); a
            # pack of it kept for later calls gave them the old values (a weight gradient at cosine -1). Packed
            # afresh on each call instead. (In a forward the entry serves that forward only.)
            return
        key = storage_key(x)
        entries = self._entries
        # The entry dies with its source tensor (whose storage address may then be reused).
        source = dropping(x, entries, key)
        frame = checkpoint_frame() if seeded else None
        # Made in a checkpointed region's forward with a stochastic-rounding seed (``seeded``): what its recomputes
        # owe the seed stream where they reuse it (owes_seed)
        region = (weakref.ref(frame[0]), set()) if frame is not None and frame[1] is None else None
        entries[key] = (source, x._version, packed, reference.current_stream(), region)
        for watch in tuple(self.watchers):
            watch(x, packed)

    def holds(self) -> set[int]:
        """The ``id`` of every pack an entry holds alive now (its source tensor alive)."""
        return {id(entry[2]) for entry in self._entries.values() if entry[0]() is not None}

    def forget_storage(self, x: Tensor) -> None:
        """Drop the packs of every tensor on the storage of ``x`` (``x`` itself, its views)."""
        device, ptr = x.device, x.untyped_storage().data_ptr()
        for key in [k for k in self._entries if k[0] == device and k[1] == ptr]:
            del self._entries[key]


_shared = _SharedPacks()


@contextlib.contextmanager
def watching_shared_packs(watch: Callable[[Tensor, Packed], None]) -> Iterator[Callable[[], set[int]]]:
    """Call ``watch(x, packed)`` for each pack made for sharing in the block; yields a function giving the ``id`` of
    the packs the cache holds alive (:meth:`_SharedPacks.holds`). A pack made in a non-reentrant checkpoint's first
    forward is held for the recompute while its source lives (the region's input): bytes no saved-tensor hook
    sees, which :func:`slimact.profile` counts through this."""
    _shared.watchers.append(watch)
    try:
        yield _shared.holds
    finally:
        _shared.watchers.remove(watch)


def note_kept_for(x: Tensor, tensors: tuple[Tensor, ...]) -> None:
    """Tell the watchers of shared packs (:func:`watching_shared_packs`: slimact.profile) that ``tensors`` are kept
    in place of ``x`` without being a pack the cache serves: a ReLU's 1-bit mask of its output, a second copy where
    a layer after it (a conv or Linear left as written) keeps that output in full."""
    if _shared.watchers and not torch.compiler.is_compiling():
        kept = _KeptFor(tensors)
        for watch in tuple(_shared.watchers):
            watch(x, kept)


@dataclasses.dataclass(frozen=True)
class _KeptFor:
    tensors: tuple[Tensor, ...]


def forget_shared_packs(x: Tensor) -> None:
    """Forget the shared packs (:class:`_SharedPacks`) of ``x`` and its views: ``x`` was changed in place with its
    version counter set back afterwards (``functional._saving.copy_on_write``), which a pack's version check
    cannot see."""
    _shared.forget_storage(x)


def is_shared(x: Tensor, cfg: QuantConfig | None) -> bool:
    """Whether :func:`pack` of ``x`` with ``cfg`` would reuse a pack another consumer made of it (the softmax's of
    its probabilities, for the product with ``v``): for a caller that packs ``x`` in a layout of its own only where
    there is no such pack to share. Never with ``cfg`` ``None`` (``x`` kept as it is: a product's running sum,
    which a Linear packed too, raised AttributeError)."""
    return cfg is not None and not torch.compiler.is_compiling() and _shared.get(x, cfg) is not None


@torch.no_grad()
def pack(
    x: Tensor,
    cfg: QuantConfig | None,
    state: RunningRange | None = None,
    *,
    training: bool = True,
    backend: Backend | None = None,
    share: bool = True,
    reuse: bool = True,
) -> Packed:
    """Compress ``x`` for a backward pass.

    Args:
        x: fp32/fp16/bf16 tensor, any strides. Other dtypes, empty tensors and tensors holding NaN/inf are
            returned uncompressed (``Packed.raw``), exactly as given.
        cfg: bits, grouping, scale mode and rounding; ``None`` keeps ``x`` exact (lossless policies).
        state: the running estimate, used when ``cfg.scale == "running"``.
        training: whether the running estimate may be updated.
        backend: ``"reference"``, ``"triton"`` or ``"inductor"``; default :func:`backend_for`.
        share: reuse a pack of the same tensor (same storage view, unchanged since, at least ``cfg.bits``)
            while that tensor is alive (see :class:`_SharedPacks`).
        reuse: with ``share``, whether a pack made already may serve; ``False`` packs ``x`` with ``cfg`` whatever
            the cache holds (a consumer whose error bound needs its own layout and range: BatchNorm's one scale per
            channel from this batch), and still offers the pack to later consumers.
    """
    return pack_many([(x, cfg, state)], training=training, backend=backend, share=share, reuse=reuse)[0]


@torch.no_grad()
def pack_many(
    items: Sequence[tuple[Tensor, QuantConfig | None, RunningRange | None]],
    *,
    training: bool = True,
    backend: Backend | None = None,
    share: bool = True,
    reuse: bool = True,
) -> list[Packed]:
    """:func:`pack` of several tensors at once (attention's ``q``, ``k`` and ``v``): the same packs, the same
    stochastic-rounding seeds in the same order, with one host sync for all of them instead of one each (on
    a GPU each sync drains the stream) and their scales computed in one go (on the Triton backend, each by its
    own finishing kernel before the sync). A tensor given twice (``k is v``) is packed once. Arguments as
    :func:`pack`, per item ``(x, cfg, state)``."""
    if torch.compiler.is_compiling() or not torch._C._len_torch_dispatch_stack():  # (no dispatch mode: the common case)
        return _pack_many(items, training, backend, share, reuse)
    with unseen_by_selective_checkpointing():  # (slimact.quant.recompute: the recompute packs alike by itself)
        return _pack_many(items, training, backend, share, reuse)


def _pack_many(
    items: Sequence[tuple[Tensor, QuantConfig | None, RunningRange | None]],
    training: bool,
    backend: Backend | None,
    share: bool,
    reuse: bool = True,
) -> list[Packed]:
    compiling = torch.compiler.is_compiling()
    # Dynamo does not trace the weakly keyed cache reliably (an internal KeyError, seen once in the suite):
    # compiled graphs keep their own packs.
    share = share and not compiling
    out: list[Packed | None] = [None] * len(items)
    owed: list[int] = []  # reused packs whose seed a recompute draws where the forward drew it (owes_seed)
    jobs: list[_Job] = []
    batch: dict[tuple, _Job] = {}  # the same tensor twice in this call
    for i, (x, cfg, state) in enumerate(items):
        if cfg is None or x.dtype not in COMPRESSIBLE_DTYPES or x.numel() == 0 or kept_whole(x):
            out[i] = _raw(x)
            continue
        layout = group_layout(x.shape, cfg)  # before the cache, so that a bad group count is refused every time
        if cfg.scale == "running" and state is None:
            raise ValueError("scale='running' needs a RunningRange state")
        if share and reuse:
            hit = _shared.get(x, cfg)
            if hit is not None:
                out[i] = hit
                if _shared.owes_seed(x):
                    owed.append(i)
                continue
        if compiling:
            if cfg.scale == "running":
                _note_running_estimates_traced()
            out[i] = _pack_traced(x, cfg, layout)
            continue
        key = (storage_key(x), x._version, cfg)
        if key in batch:
            batch[key].aliases.append(i)
            continue
        chosen = backend or backend_for(x)
        estimate = None  # on the triton backend, the (lo, step) of the running estimate as this item finds it
        if cfg.scale == "running" and chosen == "triton":
            buffers = state.live(layout.groups, x.device)
            if buffers is not None:  # (else the first tensor sets it, on the host path)
                estimate = _kernels(chosen).scale_estimate(*buffers, cfg.qmax)
        job = _Job(i, x, cfg, layout, state, chosen, estimate)
        batch[key] = job
        jobs.append(job)
    _decide([job for job in jobs if job.estimate is None], training)
    for job in jobs:  # in the items' order, so that the seeds are drawn as by one pack() each
        while owed and owed[0] < job.index:
            reference.draw_seed()
            owed.pop(0)
        if job.estimate is not None:
            packed = _pack_running(job.x, job.view, job.cfg, job.layout, job.state, job.estimate, training)
        elif job.raw:
            packed = _raw(job.x)
        else:
            packed = job.finish()
        for i in (job.index, *job.aliases):
            out[i] = packed
        # (a raw pack is the tensor itself: shared, it saves nothing, and the entry holding it kept its source alive,
        # so the entry never died: a tensor with an inf leaked its full size per step)
        if share and not packed.meta.clipped and not packed.meta.raw:
            _shared.put(job.x, packed, seeded=job.cfg.stochastic)
    for _ in owed:
        reference.draw_seed()
    return out  # type: ignore[return-value]


class _Job:
    """One tensor's way through :func:`pack_many`'s eager path (range, host decisions, running estimate,
    scale, codes)."""

    def __init__(self, index: int, x: Tensor, cfg: QuantConfig, layout: GroupLayout, state: RunningRange | None,
                 backend: Backend, estimate: tuple[Tensor, Tensor] | None) -> None:
        self.index, self.x, self.cfg, self.layout, self.state = index, x, cfg, layout, state
        self.backend, self.kernels, self.estimate = backend, _kernels(backend), estimate
        self._data: Tensor | None = None
        self._view: tuple[Tensor, GroupLayout, list[int] | None] | None = None
        self.aliases: list[int] = []
        self.raw = False
        self.outliers: tuple[Tensor, ...] = ()
        self.lo = self.hi = self.step = self.threshold = None
        self.scaled: tuple[Tensor, Tensor] | None = None  # (lo, step) of (lo, hi) decided on the device
        self.clipped = False
        self.fused = None  # the inductor backend's one-call pack (inductor.pack8), where it applies
        self.codes: Tensor | None = None  # codes made before finish() (by that pack)

    @property
    def data(self) -> Tensor:
        """What the kernels read: a strided tensor the compiled CPU loops and the Triton kernels take as a
        contiguous copy (one pass at copy bandwidth, transient), made once (on first use) for the range pass and
        the quantise both, where the reference would take several passes and an fp64 reduction (attention's q,
        k, v are [B, T, H, D] memory seen as [B, H, T, D]). The same values: the same codes. (The Triton pack reads
        a permuted tensor as it lies instead: :attr:`view`.)"""
        if self._data is None:
            x = self.x
            self._data = x
            if not x.is_contiguous() and (
                self.backend == "triton" or (self.backend == "inductor" and x.numel() >= self.kernels.PACK_MIN_NUMEL)
            ):
                self._data = x.contiguous()
        return self._data

    @property
    def view(self) -> tuple[Tensor, GroupLayout, list[int] | None]:
        """What the Triton kernels read, its layout and the order its 8-bit codes are put back in
        (:func:`_kernel_view`), made once."""
        if self._view is None:
            self._view = _kernel_view(self.x, self.layout, self.cfg.bits)
        return self._view

    def _take_fused(self, heavy: bool, training: bool) -> bool:
        """Whether the codes and scale of the compiled pack (:attr:`fused`) are this job's, once the host has
        read its decisions; if so, also updates the running estimate. They are, unless outliers present
        (``heavy``) change the range the scale comes from: never under a running estimate, whose scale is that of
        the estimate; with its own range, whenever they are kept apart. Under a running estimate the pack's range
        (``lo``/``hi``, outliers apart) is then folded in when ``training``, as :meth:`RunningRange.update` does:
        from the compiled pack's folded buffers, copied into place, unless outliers changed the range."""
        fused = self.fused
        state = self.state
        if self.cfg.scale == "running":
            if fused.folded is None:  # no estimate was read: the first tensor sets it (or the same state twice)
                if heavy or state.live(self.layout.groups, self.x.device) is not None:
                    return False  # (the host path updates the estimate, scales and quantises, as elsewhere)
                state.update(self.lo, self.hi, self.cfg.decay, training)  # sets it to this range: this scale
            elif training and heavy:
                state.fold(self.lo, self.hi, self.cfg.decay)
            elif training:
                for buffer, value in zip(state.live(self.layout.groups, self.x.device), fused.folded, strict=True):
                    buffer.copy_(value)
        elif heavy:
            return False
        self.lo, self.step, self.codes = fused.lo, fused.step, fused.codes
        return True

    def finish(self) -> Packed:
        x, cfg = self.x, self.cfg
        codes = self.codes
        if codes is None:
            seed = reference.draw_seed() if cfg.stochastic else None
            if self.backend == "triton":
                view, layout, order = self.view  # (codes in the view's order, then in x's)
                codes = self.kernels.quantize(view, layout, self.lo, self.step, cfg.bits, seed)
                codes = reference.in_order(codes, order)
            else:
                codes = self.kernels.quantize(self.data, self.layout, self.lo, self.step, cfg.bits, seed)
        meta = PackMeta(x.shape, x.dtype, cfg.bits, self.layout, False, clipped=self.clipped)
        return Packed((codes, self.lo, self.step, *self.outliers), meta)


def _clip(lo: Tensor, hi: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    # A range clipped to [-clip, clip] (QuantConfig.clip); NaN stays NaN.
    return lo.clamp(-clip, clip), hi.clamp(-clip, clip)


def _decide(jobs: list[_Job], training: bool) -> None:
    """Range, NaN/inf, clip and outlier decisions (one host read per device for all the jobs), running estimates,
    and scales.

    On the triton backend the range pass and one finishing kernel per job (:func:`slimact.quant.triton.decide`)
    give the job's scale and its three flags in an int32 buffer shared by the jobs of a device; elsewhere (and
    where the range pass's grid would exceed the launch limits) PyTorch ops on the per-group range give 0-d flags.
    The host reads each device's flags at once. A job whose flags say "outliers present" (or that has a running
    estimate to update) is scaled on the host afterwards, as before: the rare, slower path.
    """
    if not jobs:
        return
    members: dict[torch.device, list[_Job]] = {}
    for job in jobs:
        if job.backend == "triton":
            members.setdefault(job.x.device, []).append(job)
    buffers: dict[torch.device, Tensor] = {}  # per device: [3 * its triton jobs] int32 flags, zeroed, or-ed into
    slots: dict[int, int] = {}  # id(job) -> where its three flags start in its device's buffer
    for device, device_jobs in members.items():
        flags = buffers[device] = torch.zeros(3 * len(device_jobs), dtype=torch.int32, device=device)
        for n, job in enumerate(device_jobs):
            view, layout, _ = job.view
            decided = job.kernels.decide(view, layout, job.cfg.qmax, job.cfg.clip, flags[3 * n : 3 * n + 3])
            if decided is not None:
                lo, step, aux = decided  # aux: [4, groups] (clipped lo, clipped hi, sum sqrt|x|, threshold)
                job.lo, job.hi, job.scaled = aux[0], aux[1], (lo, step)
                job.threshold = aux[3] if job.cfg.outliers else None
                slots[id(job)] = 3 * n
    loose: dict[torch.device, list[Tensor]] = {}  # per device: 0-d bool flags of the jobs decided by PyTorch ops
    where: dict[int, list[int | None]] = {}  # id(job) -> its flags' places there (not finite, clipped, outliers)
    estimated: set[int] = set()  # the states whose estimate a compiled pack of this call has read
    for job in jobs:
        if id(job) in slots:
            continue
        layout, cfg = job.layout, job.cfg
        if job.backend == "inductor":
            # One compiled call: range, decisions, scale and codes (inductor.pack8). Under a running estimate,
            # with the estimate's scale, unless an earlier job of this call folds into the same state (it would
            # move the estimate this one must find).
            estimate = None
            if cfg.scale == "running" and id(job.state) not in estimated:
                estimate = job.state.live(layout.groups, job.x.device)
                estimated.add(id(job.state))
            job.fused = job.kernels.pack8(job.x, layout, cfg, estimate)
            if job.fused is None and job.data is not job.x:  # strided, not a permutation of contiguous memory
                job.fused = job.kernels.pack8(job.data, layout, cfg, estimate)
        if job.fused is not None:
            fused = job.fused
            job.lo, job.hi, job.threshold = fused.range_lo, fused.range_hi, fused.threshold
            decided = (fused.bad, fused.clipped, fused.heavy)
        else:
            x = job.data
            if cfg.outliers:
                job.lo, job.hi, magnitude = job.kernels.group_stats(x, layout)
                job.threshold = reference.outlier_threshold(magnitude, layout, x.numel())
            else:
                job.lo, job.hi = job.kernels.group_minmax(x, layout)
            job.lo, job.hi, *decided = reference.range_decisions(job.lo, job.hi, cfg.clip, job.threshold)
        flags = loose.setdefault(job.x.device, [])
        places: list[int | None] = []
        for flag in decided:
            places.append(None if flag is None else len(flags))
            if flag is not None:
                flags.append(flag)
        where[id(job)] = places
    read: dict[torch.device, list] = {}
    for device in {*buffers, *loose}:
        parts = [buffers[device]] if device in buffers else []
        if device in loose:
            parts.append(torch.stack(loose[device]))
        read[device] = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()  # the one host read per device
    scaled: list[_Job] = []
    for job in jobs:
        device = job.x.device
        if id(job) in slots:
            at = slots[id(job)]
            is_bad, clipped, heavy = read[device][at : at + 3]
        else:
            shift = len(buffers[device]) if device in buffers else 0
            is_bad, clipped, heavy = (False if p is None else read[device][shift + p] for p in where[id(job)])
        job.clipped = bool(clipped) if job.cfg.clip is not None else False
        if is_bad:
            job.raw = True
            continue
        heavy = bool(heavy) and job.threshold is not None
        if heavy:
            job.scaled = None
            # (the caller's x: the outliers' indices are flat indices of its order; the rare path)
            job.lo, job.hi, *job.outliers = reference.split_outliers(job.x, job.layout, job.threshold)
            if job.cfg.clip is not None:
                job.lo, job.hi = _clip(job.lo, job.hi, job.cfg.clip)
        if job.fused is not None and job._take_fused(heavy, training):
            continue
        if job.cfg.scale == "running":
            job.scaled = None
            job.lo, job.hi = job.state.update(job.lo, job.hi, job.cfg.decay, training)
        if job.scaled is not None:
            job.lo, job.step = job.scaled
        else:
            scaled.append(job)
    _scale(scaled)


def _scale(jobs: list[_Job]) -> None:
    """Every job's ``(lo, step)`` from its ``(lo, hi)``: one :func:`scale_params` per code width and device."""
    by: dict[tuple, list[_Job]] = {}
    for job in jobs:
        by.setdefault((job.cfg.qmax, job.lo.device), []).append(job)
    for (qmax, _), group in by.items():
        sizes = [job.lo.numel() for job in group]
        lo, step = scale_params(torch.cat([job.lo for job in group]), torch.cat([job.hi for job in group]), qmax)
        for job, lo_j, step_j in zip(group, lo.split(sizes), step.split(sizes), strict=True):
            job.lo, job.step = lo_j, step_j


def _note_running_estimates_traced() -> bool:
    """Warn that a traced pack leaves running estimates aside (:func:`_pack_traced`). Run while dynamo traces, once
    per compilation, not in the compiled graph: its result is a constant to the trace (marked below as
    ``torch.compiler.assume_constant_result`` marks it; calling that would import dynamo, and Triton, with slimact),
    so the warning adds no graph break (``fullgraph=True`` compiles) and costs nothing at run time."""
    warnings.warn(
        "slimact: under torch.compile, running estimates (policy \"mesa\", scale='running') are neither used nor "
        "updated: each tensor is packed with its own range, rounded to nearest, as under \"int8\". The estimates "
        "keep the values they had before compiling; an eager run or slimact.state_dict(model) afterwards carries "
        "those. Run \"mesa\" eagerly for Mesa's method, or convert with \"int8\" to compile.",
        stacklevel=2,
    )
    return True


_note_running_estimates_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _pack_traced(x: Tensor, cfg: QuantConfig, layout: GroupLayout) -> Packed:
    """The pack while dynamo traces: the reference's ops, which inductor fuses into the model's graph. No host
    sync (it would break the graph): a group whose range is not finite is restored as NaN, whole, instead of
    the tensor being kept exact; outliers are not kept apart (their count is data-dependent); running
    estimates are neither used nor moved (a module buffer assigned inside an autograd Function's traced
    forward is a side effect dynamo cannot keep: each tensor's own range serves, as with ``"dynamic"``); and
    stochastic rounding rounds to nearest: slimact's seed stream is host state dynamo cannot trace, and noise the
    graph drew would come from PyTorch's generator (its draws moved every later dropout mask: a compiled "mesa"
    model's forward 0.64 off compiled plain's, its update at cosine 0.42; a sweep, 2026-12-07)."""
    lo, hi = reference.group_minmax(x, layout)
    bad = ~torch.isfinite(lo) | ~torch.isfinite(hi - lo)  # [groups]
    if cfg.clip is not None:
        lo, hi = _clip(lo, hi, cfg.clip)
    lo, step = scale_params(lo.masked_fill(bad, 0.0), hi.masked_fill(bad, 0.0), cfg.qmax)
    step = step.masked_fill(bad, float("nan"))
    codes = reference.quantize(x, layout, lo, step, cfg.bits, None, None)
    meta = PackMeta(x.shape, x.dtype, cfg.bits, layout, False, clipped=cfg.clip is not None)
    return Packed((codes, lo, step), meta)


def _kernel_view(x: Tensor, layout: GroupLayout, bits: int) -> tuple[Tensor, GroupLayout, list[int] | None]:
    """What the Triton kernels read for ``x`` (contiguous memory), its layout, and the dim order its 8-bit codes
    are put back in (:func:`slimact.quant.reference.in_order`; ``None``: already in ``x``'s). A tensor whose
    dims are a permutation of contiguous memory (attention's ``q``, ``k``, ``v``) is read as it lies, 8-bit codes
    permuted back afterwards (1 byte per element copied instead of the input's 4 or 2, read and written); other
    strided tensors (and sub-byte codes, packed along the caller's order) as a contiguous copy."""
    if bits == 8:
        view, view_layout, order = reference.memory_order(x, layout)
        if view.is_contiguous():
            return view, view_layout, order
    return x.contiguous(), layout, None


def _pack_running(
    x: Tensor, view: tuple[Tensor, GroupLayout, list[int] | None], cfg: QuantConfig, layout: GroupLayout,
    state: RunningRange, scaled: tuple[Tensor, Tensor], training: bool,
) -> Packed:
    """The pack under a running estimate on the GPU, with no host sync and three launches: the estimate's
    ``lo``/``step`` (``scaled``, made by :func:`slimact.quant.triton.scale_estimate` from the state's estimate when
    :func:`pack_many` took the item: one small kernel, :func:`slimact.quant.reference.scale_params` bit for bit),
    then one read of ``x`` that gives its codes for that estimate and per-tile partials of its own range, then one
    small kernel, a program per group, that reduces the partials and folds the range into the state's buffers in
    place (:func:`slimact.quant.triton.quantize_fold`). Nothing is decided on the host and nothing is allocated
    but the outputs, so it runs ahead of the GPU and can be captured in a CUDA graph (the buffers the graph
    updates are the module's own). What the sync would have decided is decided per group instead:

    * a group holding NaN/inf is restored as NaN, whole (its step is NaN), and leaves its estimate unchanged;
    * values beyond the estimate saturate (outliers are not kept apart: their number is known only after the
      pass); with ``cfg.outliers``, the range folded in is clipped to the outlier threshold of the tensor's own
      typical magnitude, so heavy tails do not drag the estimate out to them.

    The values are those of PyTorch ops on :func:`slimact.quant.triton.quantize_stats` (kept below for a range
    pass whose grid would exceed the launch limits): the same codes, ``lo``, ``step`` and folded buffers, but for
    the sum of ``sqrt|x|`` the outlier threshold starts from, summed in fp64 in a fixed order as in
    :func:`slimact.quant.triton.decide` (the ops' fp32 sum in PyTorch's order is within float rounding of it).
    """
    lo, step = scaled
    seed = reference.draw_seed() if cfg.stochastic else None
    from slimact.quant import triton as kernels

    buffers = state.live(layout.groups, x.device)
    data, data_layout, order = view  # (x as the kernels read it: see _kernel_view)
    codes = None
    if buffers is not None:
        codes = kernels.quantize_fold(data, data_layout, lo, step, cfg.bits, seed, buffers, cfg.decay, cfg.clip,
                                      cfg.outliers, training)
    if codes is None:  # the PyTorch ops on the range
        codes, t_lo, t_hi, magnitude = kernels.quantize_stats(data, data_layout, lo, step, cfg.bits, seed)
        bad = ~torch.isfinite(t_lo) | ~torch.isfinite(t_hi - t_lo)  # [groups]
        if training:
            if cfg.clip is not None:
                t_lo, t_hi = _clip(t_lo, t_hi, cfg.clip)
            if cfg.outliers:
                limit = reference.outlier_threshold(magnitude, layout, x.numel())
                t_lo, t_hi = torch.maximum(t_lo, -limit), torch.minimum(t_hi, limit)
            state.fold(t_lo, t_hi, cfg.decay, skip=bad)
        step = step.masked_fill(bad, float("nan"))
    codes = reference.in_order(codes, order)
    # (Whether anything lay beyond the clip is not known without a sync: assumed.)
    return Packed((codes, lo, step), PackMeta(x.shape, x.dtype, cfg.bits, layout, False, clipped=cfg.clip is not None))


@torch.no_grad()
def unpack(packed: Packed, *, backend: Backend | None = None) -> Tensor:
    """Restore a :class:`Packed` to its original shape and dtype (contiguous; raw tensors as kept)."""
    meta = packed.meta
    if meta.derive is not None:
        return _DERIVATIONS[meta.derive](unpack(Packed(packed.tensors, meta._replace(derive=None)), backend=backend))
    if meta.raw:
        return packed.tensors[0]
    codes, lo, step, *outliers = packed.tensors
    # While dynamo traces (a compiled backward), the reference's ops, which inductor fuses, as the pack does
    # (_pack_traced): a raw Triton kernel is opaque to the trace.
    kernels = reference if torch.compiler.is_compiling() else _kernels(backend or backend_for(codes))
    out = kernels.dequantize(codes, meta, lo, step)
    return reference.restore_outliers(out, *outliers) if outliers else out


@torch.no_grad()
def unpack_map(packed: Packed | Sequence[Packed], fn: Callable[..., Any], *args: Tensor,
               otherwise: Callable[..., Any] | None = None) -> Any:
    """``fn(unpack(packed), *args)`` for an elementwise ``fn`` (an activation's backward: ``grad * y'(x)``),
    with the restore fused into ``fn``'s loop where it can be: one compiled loop reads the codes and ``args``
    and writes ``fn``'s result, and the restored tensor is never written to memory
    (:func:`slimact.quant.inductor.dequantize_map`: ``torch.compile``, so C++ loops on CPU and a Triton kernel
    on CUDA). ``packed`` may be several packs of one shape and layout (a gated MLP's gate and up projections,
    each restored to its own dtype): ``fn(*restored, *args)``, all restored in the one loop. ``fn`` must be a hashable,
    module-level callable (one compiled loop per ``fn``, dtype and count of packs), returning a tensor or a tuple
    of tensors, and ``args`` tensors of the packed shape. Elsewhere (small, strided, sub-byte, raw, derived or
    outlier-carrying packs): ``fn(*restored, *args)``, or ``otherwise(*restored, *args)`` where given."""
    packs = (packed,) if isinstance(packed, Packed) else tuple(packed)
    meta = packs[0].meta
    fusable = all(
        not p.meta.raw and p.meta.derive is None and len(p.tensors) == 3  # (no outliers to put back)
        and (p.meta.shape, p.meta.bits, p.meta.layout) == (meta.shape, meta.bits, meta.layout)
        for p in packs
    )
    # Under torch.compile, fn(unpack(...)) with the reference's restore: inductor fuses both into the graph.
    if fusable and not torch.compiler.is_compiling() and backend_for(packs[0].tensors[0]) != "reference":
        from slimact.quant import inductor

        out = inductor.dequantize_map([p.tensors for p in packs], [p.meta.dtype for p in packs], meta, fn, args)
        if out is not None:
            return out
    return (otherwise or fn)(*(unpack(p) for p in packs), *args)


#: Elementwise functions a pack may stand behind (see :func:`share_derived`), by name.
_DERIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {}


def register_derivation(name: str, fn: Callable[[Tensor], Tensor]) -> None:
    """Name ``fn`` (elementwise, shape- and dtype-preserving) for :func:`share_derived`."""
    _DERIVATIONS[name] = fn


def share_derived(y: Tensor, packed: Packed, derive: str) -> None:
    """Let a later ``pack(y)`` reuse ``packed``, the pack of ``x`` with ``y = derive(x)``: restored, it is
    ``derive(x_hat)``. A GELU keeps its 8-bit input; the next Linear needs the GELU's output for its weight
    gradient and gets it from the same codes, so the ``[tokens, 4 x hidden]`` tensor is kept once, not twice.
    The error is the input's, carried through ``derive``: ``|y - y_hat| <= max|derive'| * step / 2``.

    ``packed`` may itself stand behind a function of its codes (a derived pack: the input of a second activation
    right after a first, or after a softmax, is the first's output, whose pack it reused): ``y`` is then ``derive``
    of that function's result, and the pack shared for it restores both, in order. Naming ``derive`` alone there
    rebuilt ``y`` from the first's input, skipping the first function (GELU then SiLU: the next Linear's weight
    gradient at cosine 0.956)."""
    if packed.meta.raw or packed.meta.clipped or derive not in _DERIVATIONS or y.shape != packed.meta.shape:
        return
    if packed.meta.derive is not None:
        derive = _composed(packed.meta.derive, derive)
    _shared.put(y, Packed(packed.tensors, packed.meta._replace(derive=derive, dtype=y.dtype)))


def _composed(first: str, then: str) -> str:
    """The registered name of ``then(first(x))`` (registered at its first use)."""
    name = f"{first} > {then}"
    if name not in _DERIVATIONS:
        inner, outer = _DERIVATIONS[first], _DERIVATIONS[then]
        _DERIVATIONS[name] = lambda t: outer(inner(t))
    return name
