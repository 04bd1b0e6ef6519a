"""Running-estimate state (Mesa's ``scale="running"``): an EMA of each group's min and range.

Held by the caller in two non-persistent buffers of its module (so ``state_dict`` is unchanged and
checkpoints load both ways), named ``<prefix>_lo`` and ``<prefix>_range``, ``[groups]`` fp32 each::

    lo    <- decay * lo    + (1 - decay) * min(x_g)
    range <- decay * range + (1 - decay) * (max(x_g) - min(x_g))

initialised from the first tensor seen (or re-initialised when the group count changes), updated only
when asked (training mode). A tensor is packed with the estimate as it finds it, and its own range is folded
in afterwards: so the pack's codes need only the estimate, and on the GPU the range and the codes come from
one read of the tensor, the estimate's scale and the fold from one small kernel each
(:func:`slimact.quant.triton.scale_estimate`, :func:`slimact.quant.triton.quantize_fold`, with :meth:`fold`'s
float operations). The fold is in place (the buffers keep
their storage: a captured CUDA graph updates the very tensors the module holds). ``slimact.state_dict`` /
``slimact.load_state_dict`` save and restore the buffers with a checkpoint. The estimate a tensor is
packed with is a fresh copy, never a view of the buffers, snapshotted with the pack: a second call of the
same module that moves the estimate cannot change how the first call's codes are restored.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from slimact.quant.recompute import checkpoint_frame, copies, note, replayed

__all__ = ["WRITTEN_ATTR", "RunningRange", "backward_key", "folded", "note_backward"]

#: ``module.__dict__`` entry: ``{buffer name: the tensor slimact last wrote there}``. Moving a module replaces its
#: buffers: ``.to(dtype or device)``, ``.half()``, ``.cuda()`` carry the values over, ``to_empty()`` does not (a fresh
#: ``torch.empty``: whatever the memory held); nothing else tells the two apart, so a replaced estimate is compared
#: with the tensor written before (once per move, one host read) and kept only where it holds its values.
WRITTEN_ATTR = "_slimact_written"


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


def _still_written(module: nn.Module, name: str, buffer: Tensor) -> bool:
    """Whether ``buffer`` (``module``'s buffer ``name``) holds what slimact last wrote there (adopted as such if so)."""
    written = module.__dict__.get(WRITTEN_ATTR)
    before = written.get(name) if written is not None else None
    if before is None or before is buffer or torch.compiler.is_compiling():
        return True  # (none recorded: set by slimact.load_state_dict, or made before this record existed)
    # (Within bf16's rounding: a move through a narrower dtype and back rounds the values, a fresh buffer is
    # another tensor altogether.)
    same = not buffer.is_meta and not before.is_meta and torch.allclose(
        buffer.float(), before.to(buffer.device).float(), rtol=1e-2, atol=1e-6, equal_nan=True)
    if same:
        written[name] = buffer
    return same


def folded(old_lo: Tensor, old_rng: Tensor, lo: Tensor, rng: Tensor, decay: float) -> tuple[Tensor, Tensor]:
    """The estimate ``(lo, range)`` after folding in a tensor's per-group ``lo`` and ``rng = hi - lo`` (fp32
    ``[groups]`` each): ``old * decay + new * (1 - decay)`` in fp32. PyTorch ops only: :meth:`RunningRange.fold`
    runs them eagerly, the compiled CPU pack (:func:`slimact.quant.inductor.pack8`) inside its loop, with the
    same values bit for bit."""
    return old_lo * decay + lo * (1.0 - decay), old_rng * decay + rng * (1.0 - decay)


class RunningRange:
    """Accessor for the running-estimate buffers ``<prefix>_lo`` / ``<prefix>_range`` of ``module``."""

    def __init__(self, module: nn.Module, prefix: str) -> None:
        self.lo_name = f"{prefix}_lo"
        self.range_name = f"{prefix}_range"
        frame = checkpoint_frame()
        if frame is not None:  # activation checkpointing: its recompute packs with the estimate the forward found
            key = ("estimate", module, prefix)
            if frame[1] is None:
                note(frame[0], key, copies({n: module._buffers.get(n) for n in (self.lo_name, self.range_name)}))
            else:
                found = replayed(*frame, key)
                if found is not None:  # (folded into a copy: the forward has updated the module's estimate)
                    module = nn.Module()
                    module._buffers.update(copies(found))
                    module._non_persistent_buffers_set.update(found)
        self.module = module
        if torch.compiler.is_compiling():
            # (A compiled pack uses no running estimate, docs/integrations.md; a buffer registered while dynamo traced
            # was a guard that failed at the next call, which then compiled everything again.)
            return
        for name in (self.lo_name, self.range_name):
            if name not in module._buffers:
                module.register_buffer(name, None, persistent=False)

    def _buffers(self, groups: int) -> tuple[Tensor, Tensor] | None:
        lo, rng = self.module._buffers[self.lo_name], self.module._buffers[self.range_name]
        if lo is None or rng is None or lo.shape != (groups,) or rng.shape != (groups,):
            return None
        if not (_still_written(self.module, self.lo_name, lo) and _still_written(self.module, self.range_name, rng)):
            # Replaced by something that did not carry the values over (model.to("meta") then to_empty(): memory
            # never written, any values): the estimate starts again from the next tensor, as after convert.
            self.module._buffers[self.lo_name] = self.module._buffers[self.range_name] = None
            return None
        if lo.dtype != torch.float32 or rng.dtype != torch.float32:  # after model.half(): back to fp32, once
            lo, rng = self._set(lo, rng)
        return lo, rng

    def _set(self, lo: Tensor, rng: Tensor) -> tuple[Tensor, Tensor]:
        lo, rng = lo.detach().float().clone(), rng.detach().float().clone()
        self.module._buffers[self.lo_name] = lo
        self.module._buffers[self.range_name] = rng
        written = self.module.__dict__.setdefault(WRITTEN_ATTR, {})
        written[self.lo_name], written[self.range_name] = lo, rng
        return lo, rng

    def buffers(self, groups: int) -> tuple[Tensor, Tensor] | None:
        """The live buffers ``(lo, range)``, fp32 ``[groups]`` (the module's own tensors: a kernel that reads
        them or folds into them in place, as :meth:`fold` does, works on the module's state); ``None`` before the
        first tensor of ``groups`` groups has been seen."""
        return self._buffers(groups)

    def estimate(self, groups: int) -> tuple[Tensor, Tensor] | None:
        """The estimate ``(lo, hi)``, fp32 ``[groups]``, fresh tensors; ``None`` before the first tensor of
        ``groups`` groups has been seen."""
        buffers = self._buffers(groups)
        if buffers is None:
            return None
        lo, rng = buffers
        return lo.clone(), lo + rng

    def fold(self, lo: Tensor, hi: Tensor, decay: float, skip: Tensor | None = None) -> None:
        """Fold a tensor's per-group ``(lo, hi)`` into the estimate, in place; groups where ``skip`` is True
        (a range that is not finite) keep theirs. Initialises the estimate when there is none."""
        buffers = self._buffers(lo.numel())
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
        found = self.estimate(lo.numel())
        if found is None:
            self.fold(lo, hi, decay)
            return lo.detach().float().clone(), hi.detach().float().clone()
        if training:
            self.fold(lo, hi, decay)
        return found
