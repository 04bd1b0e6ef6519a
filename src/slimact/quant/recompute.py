"""Activation checkpointing's recompute packs what the forward packed (``torch.utils.checkpoint``, non-reentrant,
selective checkpointing included).

A checkpointed region runs its forward twice: once in the forward pass (what it saves is dropped) and again in the
backward, whose saved tensors are the ones used. With running estimates (``scale = "running"``) and stochastic
rounding (the ``"mesa"`` preset), the recompute packed otherwise than the forward: each of its calls counted as a
further call site of the step (a second estimate per module, started from the recomputed tensor:
``_slimact_x_1_lo``), its rounding seeds came from another stream, and a whole checkpointed model counted
each step twice and folded each tensor into its estimate twice. The gradients then differed from the same model's
without checkpointing by 0.5-2% relative: not what the forward's packs give.

Here the forward of a checkpointed region notes, per call, its call site (:func:`slimact.nn._base.begin_call`) and
the estimate it found (:class:`~slimact.quant.state.RunningRange`: a copy of its two tensors, a few floats per
group), and where its first rounding seed came from (:func:`~slimact.quant.reference.draw_seed`); the recompute (the
same calls, in the same order) takes the same call site, packs with that estimate (folding its tensor into a copy:
the forward has updated the live one, once per step) and draws the same seeds: its packs are the forward's, bit for
bit. The region is recognised from PyTorch's own saved-tensors hooks (the forward's ``_checkpoint_hook``, the
recompute's ``_recomputation_hook``, both holding the region's frame); with hooks that look otherwise (another
PyTorch) the recompute packs as it did before (rounded alike, not identically). A reentrant checkpoint runs its
forward without grad, where nothing is packed and no call site is taken: its recompute is the step's only pack (its
estimate folded once, at the call sites the model without checkpointing has, taken in the recompute's order, the last
region first; its seeds not those of the model without checkpointing). Checkpoints nested in a checkpointed region are
recomputed with fresh seeds and call sites, as before.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode

try:  # (private classes of selective checkpointing: a PyTorch without them has none of its modes to set aside)
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    _SELECTIVE_MODES: tuple[type, ...] = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
except ImportError:
    _SELECTIVE_MODES = ()

__all__ = ["checkpoint_frame", "copies", "note", "note_seed", "replayed", "replayed_seed",
           "unseen_by_selective_checkpointing"]


class _Record:
    """What the forward of one checkpointed region did: per key (a module's call site, an estimate) what it noted,
    in order; the position ``(key, number)`` of its first rounding seed; per recompute (graph task) how far it has
    replayed."""

    __slots__ = ("notes", "replays", "seed")

    def __init__(self) -> None:
        self.notes: dict[Any, list[Any]] = {}
        self.seed: tuple[int, int] | None = None
        self.replays: dict[Any, dict[str, Any]] = {}


_records: weakref.WeakKeyDictionary[object, _Record] = weakref.WeakKeyDictionary()


def checkpoint_frame() -> tuple[object, Any] | None:
    """``(frame, None)`` inside the forward of a non-reentrant checkpointed region, ``(frame, graph task)`` inside
    its recompute, ``None`` elsewhere (or where PyTorch's checkpoint hooks are not recognised)."""
    if torch.compiler.is_compiling():
        return None
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # (private: absent, not recognised)
    hooks = None if top is None else top(True)
    if hooks is None:
        return None
    pack = hooks[0]
    pack = getattr(pack, "__wrapped__", pack)  # (the recompute's hook is wrapped by torch._dynamo.disable)
    code = getattr(pack, "__code__", None)
    if code is None or code.co_name != "pack_hook" or getattr(pack, "__module__", None) != "torch.utils.checkpoint":
        return None
    cells = dict(zip(code.co_freevars, pack.__closure__ or (), strict=False))
    try:
        if pack.__qualname__.startswith("_checkpoint_hook.") and "frame" in cells:
            return cells["frame"].cell_contents, None
        if pack.__qualname__.startswith("_recomputation_hook.") and "target_frame_ref" in cells and "gid" in cells:
            frame = cells["target_frame_ref"].cell_contents()
            return None if frame is None else (frame, cells["gid"].cell_contents)
    except (ValueError, TypeError):  # an empty cell, a frame that takes no weak reference
        return None
    return None


def _record(frame: object, create: bool) -> _Record | None:
    try:
        record = _records.get(frame)
        if record is None and create:
            record = _records[frame] = _Record()
        return record
    except TypeError:  # not weakly referenceable
        return None


def _replay(frame: object, gid: Any) -> tuple[_Record, dict[str, Any]] | None:
    record = _record(frame, create=False)
    if record is None:
        return None
    return record, record.replays.setdefault(gid, {"notes": {}, "seed": None})


def note(frame: object, key: Any, value: Any) -> None:
    """In a checkpointed region's forward: ``value`` for ``key`` (a module's call site; the estimate of one of its
    running estimates, as the call found it), one per call, in order."""
    record = _record(frame, create=True)
    if record is not None:
        record.notes.setdefault(key, []).append(value)


def replayed(frame: object, gid: Any, key: Any) -> Any:
    """In a recompute: what the forward noted for ``key`` at this call (the calls in order), or ``None``."""
    found = _replay(frame, gid)
    if found is None:
        return None
    record, replay = found
    values = record.notes.get(key, ())
    i = replay["notes"].get(key, 0)
    if i >= len(values):
        return None
    replay["notes"][key] = i + 1
    return values[i]


def copies(tensors: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """Copies of ``tensors``, made where selective checkpointing does not see them (they are not the model's ops:
    the forward and its recompute must run the same ones)."""
    with torch.no_grad(), unseen_by_selective_checkpointing():
        return {n: None if t is None else t.clone() for n, t in tensors.items()}


def note_seed(frame: object, key: int, number: int) -> None:
    """In a checkpointed region's forward: a seed drawn as ``digest(key, number)``; the first one is noted."""
    record = _record(frame, create=True)
    if record is not None and record.seed is None:
        record.seed = (key, number)


def replayed_seed(frame: object, gid: Any) -> tuple[int, int] | None:
    """In a recompute: ``(key, number)`` of the seed the forward drew at this point, or ``None``."""
    found = _replay(frame, gid)
    if found is None:
        return None
    record, replay = found
    if replay["seed"] is None:
        if record.seed is None:
            return None
        replay["seed"] = list(record.seed)
    position = replay["seed"]
    key, number = position
    position[1] += 1
    return key, number


@contextlib.contextmanager
def unseen_by_selective_checkpointing() -> Iterator[None]:
    """Run slimact's own ops (a pack: its statistics, its rounding, its estimate's fold) where selective activation
    checkpointing does not see them: its dispatch modes, where they are innermost, are set aside meanwhile.

    A selective checkpointing policy picks the model's ops to keep or recompute; applied to a pack's ops it broke the
    pack: a kept ``view``/``slice`` of the stochastic-rounding temporary (which the pack then updates in place) handed
    the recompute the forward's finished tensor, so the noise went there and the recompute's own codes were truncated
    with none (a Linear's weight gradient biased by -4% of its magnitude on average, silently: PyTorch's check for
    mutated cached tensors did not fire), a kept ``arange`` the forward's hashed values. A pack is a function of its
    tensor, its seed and its estimate, which the recompute replays (:func:`replayed_seed`, :func:`replayed`):
    recomputing it gives the forward's codes. Other dispatch modes (a FLOP counter, fake tensors) still see it."""
    popped = []
    if _SELECTIVE_MODES and not torch.compiler.is_compiling():
        while torch._C._len_torch_dispatch_stack() and isinstance(_get_current_dispatch_mode(), _SELECTIVE_MODES):
            popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)
