"""Running-estimate state (Mesa's ``scale="running"``): an EMA of each group's min and range.

Held for the caller in a table of its module (:data:`ESTIMATES_ATTR`; not in ``state_dict``, so checkpoints load
both ways; not among its buffers either, for EMA copies), named ``<prefix>_lo`` and ``<prefix>_range``, ``[groups]``
fp32 each::

    lo    <- decay * lo    + (1 - decay) * min(x_g)
    range <- decay * range + (1 - decay) * (max(x_g) - min(x_g))

initialised from the first tensor seen (or re-initialised when the group count changes), updated only
when asked (training mode). A tensor is packed with the estimate as it finds it, and its own range is folded
in afterwards: so the pack's codes need only the estimate, and on the GPU the range and the codes come from
one read of the tensor, the estimate's scale and the fold from one small kernel each
(:func:`slimact.quant.triton.scale_estimate`, :func:`slimact.quant.triton.quantize_fold`, with :meth:`fold`'s
float operations). The fold is in place (the tensors keep
their storage: a captured CUDA graph updates the very tensors the module holds). ``slimact.state_dict`` /
``slimact.load_state_dict`` save and restore the estimates with a checkpoint. The estimate a tensor is
packed with is a fresh copy, never a view of the table's, snapshotted with the pack: a second call of the
same module that moves the estimate cannot change how the first call's codes are restored.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimact.quant.recompute import checkpoint_frame, copies, note, replayed

__all__ = ["ESTIMATES_ATTR", "FEW_ROWS", "RunningRange", "backward_key", "few_rows", "folded", "note_backward"]

#: ``module.__dict__`` entry: the module's running estimates, ``{"<prefix>_lo" | "<prefix>_range": fp32 [groups]}``.
#: Not buffers: ``model.buffers()`` is what EMA and SWA copies (``torch.optim.swa_utils.AveragedModel``, timm's
#: ``ModelEmaV3``) pair by position with their own, and an estimate appears at its call site's first training pack,
#: so a copy made before the first step paired slimact's estimates with the next module's BatchNorm statistics
#: (copied into them where the shapes agreed, a shape error or a ``zip`` error elsewhere). A table moves with the
#: module only where slimact reads it: to the device of the tensor it packs, once (:meth:`RunningRange.buffers`);
#: ``model.half()`` leaves it fp32, ``to_empty()`` leaves its values; ``copy.deepcopy`` and pickling copy it.
ESTIMATES_ATTR = "_slimact_estimates"


class _Backward:
    """``last``: the graph task (``torch._C._current_graph_task_id()``) of the last backward that ran a slimact
    Function; ``forward``: ``last`` as the latest call made outside a backward found it."""

    last = -1
    forward = -1


def note_backward() -> None:
    """Called by every slimact Function's backward: a backward pass is under way, so the calls made after it belong
    to another training step (:func:`backward_key`). Not while dynamo traces (a compiled backward uses no running
    estimate, and the graph task is no tensor its graph could hold)."""
    if not torch.compiler.is_compiling():
        _Backward.last = _graph_task()


def backward_key() -> int:
    """Which backward pass the calls made now follow: the graph task of the last backward that ran a slimact Function
    (``-1`` before any). Inside a backward (a checkpoint's recompute) the key the forward's calls had, as the latest
    call made outside a backward found it: the recompute is the step it recomputes, however many backward passes
    (the current one, a reentrant checkpoint's own) have run slimact Functions since.

    With the model's pass count it keys a module's call sites (:func:`slimact.nn._base.begin_call`): calls made
    outside any forward of the converted model (a training loop that calls ``model.encoder(x)`` and then
    ``model.head(h)``, or loops a converted block itself) take the sites of one step until a backward runs, not new
    ones step after step. Global, not per model or thread: a CUDA backward runs in the engine's own threads (so any
    backward that runs a slimact Function, another model's or another thread's, starts a step for the calls made
    outside a forward of a converted model; such a forward keys its calls by the backward it began after)."""
    if _graph_task() != -1:
        return _Backward.forward
    _Backward.forward = _Backward.last
    return _Backward.last


_graph_task = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def folded(old_lo: Tensor, old_rng: Tensor, lo: Tensor, rng: Tensor, decay: float) -> tuple[Tensor, Tensor]:
    """The estimate ``(lo, range)`` after folding in a tensor's per-group ``lo`` and ``rng = hi - lo`` (fp32
    ``[groups]`` each): ``old * decay + new * (1 - decay)`` in fp32. PyTorch ops only: :meth:`RunningRange.fold`
    runs them eagerly, the compiled CPU pack (:func:`slimact.quant.inductor.pack8`) inside its loop, with the
    same values bit for bit."""
    return old_lo * decay + lo * (1.0 - decay), old_rng * decay + rng * (1.0 - decay)


#: Rows per channel below which a layer packs with its tensor's own range under a running-estimate policy.
FEW_ROWS = 16


def few_rows(numel: int, channels: int) -> bool:
    """Whether a tensor of ``numel`` elements over ``channels`` channels has fewer than :data:`FEW_ROWS` rows a channel:
    one batch's range then says little of the next one's, and an estimate made on other batches' few rows clips this
    one's, which training moves further from it (a pooled classifier head's norm, one row a sample: Perceiver's
    weight gradient at cosine 0.50 after 4 Adam steps; a diffusion model's timestep MLP at batch 2: 0.80-0.94). Such a
    tensor is packed with its own range: the same bytes."""
    return numel < FEW_ROWS * channels


class RunningRange:
    """Accessor for the running estimate ``<prefix>_lo`` / ``<prefix>_range`` of ``module`` (in its
    :data:`ESTIMATES_ATTR` table)."""

    def __init__(self, module: nn.Module, prefix: str) -> None:
        self.lo_name = f"{prefix}_lo"
        self.range_name = f"{prefix}_range"
        frame = checkpoint_frame()
        if frame is not None:  # activation checkpointing: its recompute packs with the estimate the forward found
            key = ("estimate", module, prefix)
            if frame[1] is None:
                table = module.__dict__.get(ESTIMATES_ATTR, {})
                note(frame[0], key, copies({n: table.get(n) for n in (self.lo_name, self.range_name)}))
            else:
                found = replayed(*frame, key)
                if found is not None:  # (folded into a copy: the forward has updated the module's estimate)
                    module = nn.Module()
                    module.__dict__[ESTIMATES_ATTR] = {n: t for n, t in copies(found).items() if t is not None}
        self.module = module

    def _set(self, lo: Tensor, rng: Tensor) -> tuple[Tensor, Tensor]:
        lo, rng = lo.detach().float().clone(), rng.detach().float().clone()
        table = self.module.__dict__.setdefault(ESTIMATES_ATTR, {})
        table[self.lo_name], table[self.range_name] = lo, rng
        return lo, rng

    def live(self, groups: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
        """The live estimate ``(lo, range)``, fp32 ``[groups]`` on ``device`` (moved there once if the model
        moved), the module's own tensors: a kernel that reads them or folds into them in place, as :meth:`fold`
        does, works on the module's state; ``None`` before the first tensor of ``groups`` groups has been seen."""
        table = self.module.__dict__.get(ESTIMATES_ATTR)
        lo, rng = (table.get(self.lo_name), table.get(self.range_name)) if table is not None else (None, None)
        if lo is None or rng is None or lo.shape != (groups,) or rng.shape != (groups,):
            return None
        if lo.device != device or rng.device != device:  # the model moved (model.to, .cuda): the estimate follows
            lo, rng = self._set(lo.to(device), rng.to(device))
        return lo, rng

    def estimate(self, groups: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
        """The estimate ``(lo, hi)``, fp32 ``[groups]``, fresh tensors; ``None`` before the first tensor of
        ``groups`` groups has been seen."""
        buffers = self.live(groups, device)
        if buffers is None:
            return None
        lo, rng = buffers
        return lo.clone(), lo + rng

    def fold(self, lo: Tensor, hi: Tensor, decay: float, skip: Tensor | None = None) -> None:
        """Fold a tensor's per-group ``(lo, hi)`` into the estimate, in place; groups where ``skip`` is True
        (a range that is not finite) keep theirs. Initialises the estimate when there is none."""
        buffers = self.live(lo.numel(), lo.device)
        lo, rng = lo.detach().float(), (hi - lo).detach().float()
        if buffers is None:
            self._set(lo, rng)
            return
        old_lo, old_rng = buffers
        new_lo, new_rng = folded(old_lo, old_rng, lo, rng, decay)
        if skip is not None:
            new_lo, new_rng = torch.where(skip, old_lo, new_lo), torch.where(skip, old_rng, new_rng)
        old_lo.copy_(new_lo)
        old_rng.copy_(new_rng)

    def update(self, lo: Tensor, hi: Tensor, decay: float, training: bool = True) -> tuple[Tensor, Tensor]:
        """The estimate to pack a tensor of per-group range ``(lo, hi)`` with: the one it finds (initialised from
        ``(lo, hi)`` when there is none yet); when ``training``, ``(lo, hi)`` is then folded in (:meth:`fold`)."""
        found = self.estimate(lo.numel(), lo.device)
        if found is None:
            self.fold(lo, hi, decay)
            return lo.detach().float().clone(), hi.detach().float().clone()
        if training:
            self.fold(lo, hi, decay)
        return found
