"""``profile``: the bytes autograd keeps for the backward pass, per op kind and per module.

How it counts: one training forward runs under ``torch.autograd.graph.saved_tensors_hooks``, whose pack hook sees
every tensor any op saves for backward, PyTorch's built-in ops and slimact's Functions alike (slimact saves only
through ``ctx.save_for_backward``). Each saved tensor still held for the backward when the forward ends is charged
the full size of its storage, once per unique storage (a view saved by two ops is counted once, by the first of them
still held: a view saved by a graph the forward drops hides no kept tensor of its storage), and never if the storage
belongs to a parameter or buffer; one saved by a graph the forward itself frees (a local graph in a Function's
forward) is not. It is attributed to the innermost module whose forward was running when it was saved, and to that
module's kind (:func:`slimact._kinds.kind_of`); tensors the loss function saves go to ``"(loss)"``. A pack slimact's
shared-pack cache holds after the forward that no saved tensor has (a non-reentrant checkpoint's region input,
packed by the region's first layer in the forward whose saves the checkpoint drops, held for its recompute) counts
too, to the module that made it. A pack of a tensor that is itself kept in full too (an op slimact leaves as written
saved it: a product, a pooling, an embedding bag, a sigmoid attention's probabilities in model code) is marked a copy
of it (``Report.twice``): counted, it saves nothing. The backward then runs, and the model is left as it was found:
its training mode, gradients, buffers (BatchNorm statistics), running estimates and the RNG state.

On CUDA the report also carries ``torch.cuda.max_memory_allocated`` over the step, minus what was
allocated before it (``cuda_peak_bytes``).

The step's peak (``profile(..., peak=True)``, and :func:`peak_bytes`, which runs the same measurement without the
saved-tensor hooks): the step runs under ``torch.profiler`` with its memory events, each allocation and free the
allocator makes (CPU, or the CUDA caching allocator, in its block sizes, for a model on a GPU), with its address
and the allocator's total after it. Pairing each free with the allocation at its address (events in the allocator's
order: :func:`_in_allocator_order`) gives the lifetime of each block the step allocated; the bytes alive after an
event are those of the step's blocks not yet freed. So the parameters, the inputs and whatever else was allocated
before the step are in no figure, even where the forward saves them, and neither is the free of such a block during
the step: CPU's reporter sees one only where an earlier profiled step allocated the block (with its size, perhaps
stale), so counting it made the figure depend on what the process had profiled before and on when its garbage
collector ran (in CI, one of ``fit``'s probes fell 20% off the line through the others). The highest in the
forward (the loss included) and in the backward are the two high-water marks. At each, what was alive, by what it
was: a storage saved for the backward
(the block alive at its address when the backward begins) is ``kept`` or, if saved as a gradient computed ahead,
``gradients_ahead``; a block that is a parameter's ``.grad`` when the backward ends is ``parameter_gradients``;
the rest (layer outputs not yet read, tensors being packed or restored, the model's logits, the loss's chunks,
gradients of activations, the allocator's rounding on CUDA) is ``transients``. On CUDA the overall peak is also the
allocator's own ``max_memory_allocated`` (equal on an H200 with torch 2.11: GPT-2, Llama, plain and converted,
measured while the marks still counted the allocator's total; where a step frees a block from before it, the
allocator's own peak is the lower of the two by that block's size).
Unpack buffers that would go on huge pages go through the allocator while it is measured (the profiler would not
see them).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from slimact._kinds import kind_of
from slimact.convert import _held_tensors
from slimact.functional._saving import is_gradient, is_parameter_gradient, marking_saved, observer, saved_by_slimact
from slimact.functional.activation import build_tables
from slimact.nn._base import StepCounter
from slimact.quant.core import watching_shared_packs
from slimact.quant.state import ESTIMATES_ATTR

__all__ = ["Live", "Report", "SavedTensor", "peak_bytes", "profile"]

ROOT = "(model)"
LOSS = "(loss)"
_AHEAD = "+ gradients computed ahead"
_KEPT = "kept for the backward"
_TWICE = "of which kept twice"
_BACKWARD = "slimact.profile: backward"


@dataclass(frozen=True)
class SavedTensor:
    """One unique storage kept for the backward pass."""

    module: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    #: A gradient computed ahead (see the module docstring), not an activation.
    gradient: bool = False
    #: For slimact's compressed copy of a tensor that is kept in full too (an op slimact leaves as written saved it):
    #: the module charged with the full tensor. The copy saves nothing (:attr:`Report.twice`).
    copy_of: str | None = None
    #: Kept by one of slimact's Functions (its codes, masks, scales, a tensor it keeps as it is), not by an op slimact
    #: left as written (a ``tanh`` or a learned temperature in attention's model code, which keeps its ``[T, S]``
    #: input in full inside a converted module: ``summary``'s coverage counts it as not covered).
    slimact: bool = False


def _mib(n: float) -> str:
    return f"{n / 2**20:10.2f} MiB"


def _sum_by(entries: list[SavedTensor], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        k = getattr(e, key)
        out[k] = out.get(k, 0) + e.nbytes
    return out


@dataclass(frozen=True)
class Live:
    """Bytes alive at one high-water mark of a step, allocated by the step (what was allocated before it, such as
    parameters and inputs, is in none of them), by what they are (module docstring)."""

    #: Storages saved for the backward (activations, packed or not).
    kept: int = 0
    #: Activations' gradients computed in the forward and saved for the backward (the LM loss's gradient of its
    #: input; with the parameters' ones below, :attr:`Report.gradient_bytes`).
    gradients_ahead: int = 0
    #: Parameters' gradients: their ``.grad`` as the backward leaves them, and those computed ahead in the forward
    #: (the LM loss's weight gradient of the head, which becomes that ``.grad``).
    parameter_gradients: int = 0
    #: Everything else: outputs not yet read, restored tensors, logits, the loss's chunks, activation gradients.
    transients: int = 0

    @property
    def total(self) -> int:
        return self.kept + self.gradients_ahead + self.parameter_gradients + self.transients

    def _parts(self) -> tuple[int, int, int, int]:
        return self.kept, self.gradients_ahead, self.parameter_gradients, self.transients


_PARTS = ("kept", "gradients ahead", "parameter gradients", "transients")
_SHORT = ("kept", "grads ahead", "param grads", "transients")


@dataclass
class Report:
    """What one training step keeps for its backward pass; with ``profile(..., peak=True)`` also its peak."""

    entries: list[SavedTensor] = field(default_factory=list)
    cuda_peak_bytes: int | None = None
    #: What was alive at the forward's high-water mark (the loss included); ``None`` unless the peak was measured.
    forward_peak: Live | None = None
    #: What was alive at the backward's high-water mark; ``None`` unless the peak was measured.
    backward_peak: Live | None = None
    #: The highest of (bytes alive - parameter gradients alive) over the step; ``None`` unless measured.
    peak_less_parameter_gradients: int | None = None

    @property
    def peak_bytes(self) -> int | None:
        """The step's peak above what was allocated before it: the higher of the forward's and the backward's
        high-water marks; on CUDA the allocator's ``max_memory_allocated`` (:attr:`cuda_peak_bytes`, measured even
        without ``peak=True``). ``None`` where not measured."""
        if self.cuda_peak_bytes is not None:
            return self.cuda_peak_bytes
        marks = [m.total for m in (self.forward_peak, self.backward_peak) if m is not None]
        return max(marks) if marks else None

    @property
    def kept_bytes(self) -> int:
        """Everything the forward leaves for the backward: :attr:`activation_bytes` + :attr:`gradient_bytes`."""
        return sum(e.nbytes for e in self.entries)

    @property
    def activation_bytes(self) -> int:
        """Total bytes autograd keeps for backward (unique storages, parameters and buffers excluded), not
        counting gradients computed ahead (:attr:`gradient_bytes`)."""
        return sum(e.nbytes for e in self._activations)

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradients computed in the forward and kept for the backward to hand on (module docstring)."""
        return sum(e.nbytes for e in self.entries if e.gradient)

    @property
    def _activations(self) -> list[SavedTensor]:
        return [e for e in self.entries if not e.gradient]

    @property
    def by_kind(self) -> dict[str, int]:
        """Activation bytes per op kind: ``{"linear": ..., "attention": ..., "layernorm": ...}``."""
        return _sum_by(self._activations, "kind")

    @property
    def by_module(self) -> dict[str, int]:
        """Activation bytes per qualified module name (the innermost module running when the tensor was saved)."""
        return _sum_by(self._activations, "module")

    @property
    def twice(self) -> dict[str, int]:
        """Bytes of slimact's compressed copies of tensors that are kept in full too, per module that made them: an op
        slimact leaves as written (a product, an embedding bag, a pooling in model code) saved the very tensor a
        converted layer packed, so both forms are kept where plain PyTorch keeps one. Counted in the totals; the
        copies save nothing (module docstring)."""
        return _sum_by([e for e in self._activations if e.copy_of is not None], "module")

    @property
    def as_written(self) -> dict[str, int]:
        """Activation bytes per module kept by ops slimact leaves as written (PyTorch's own saves), not by slimact's
        Functions: in a plain model, all of them; in a converted one, what model code keeps around the converted layers
        (:attr:`SavedTensor.slimact`)."""
        return _sum_by([e for e in self._activations if not e.slimact], "module")

    def _rows(self, by: str) -> dict[str, int]:
        if by not in ("kind", "module"):
            raise ValueError(f"by must be 'kind' or 'module', got {by!r}")
        return self.by_kind if by == "kind" else self.by_module

    def table(self, by: str = "kind", top: int | None = None) -> str:
        """A readable table of bytes per kind (or per module), largest first; ``top`` limits the rows."""
        rows = sorted(self._rows(by).items(), key=lambda kv: (-kv[1], kv[0]))
        total = self.activation_bytes
        width = max([len(by), *(len(k) for k, _ in rows), len(_AHEAD) if self.gradient_bytes else 0, len(_TWICE)]) + 2
        lines = [f"{by:<{width}}{'bytes kept':>14}{'share':>8}"]
        shown = rows if top is None else rows[:top]
        for name, n in shown:
            lines.append(f"{name:<{width}}{_mib(n):>14}{n / max(total, 1):>8.1%}")
        if len(shown) < len(rows):
            rest = sum(n for _, n in rows[len(shown) :])
            lines.append(f"{f'({len(rows) - len(shown)} more)':<{width}}{_mib(rest):>14}{rest / max(total, 1):>8.1%}")
        lines.append(f"{'total':<{width}}{_mib(total):>14}{'100.0%':>8}")
        twice = sum(self.twice.values())
        if twice:
            lines.append(f"{_TWICE:<{width}}{_mib(twice):>14}{twice / max(total, 1):>8.1%}")
        if self.gradient_bytes:
            lines.append(f"{_AHEAD:<{width}}{_mib(self.gradient_bytes):>14}")
            lines.append(f"{_KEPT:<{width}}{_mib(self.kept_bytes):>14}")
        if self.cuda_peak_bytes is not None:
            lines.append(f"{'cuda peak':<{width}}{_mib(self.cuda_peak_bytes):>14}")
        if self.forward_peak is not None:
            lines += ["", self._peak_table()]
        return "\n".join(lines)

    def _peak_table(self) -> str:
        head = "step peak, above what was allocated before it"
        width = len(head) + 2
        lines = [f"{head:<{width}}{'total':>14}" + "".join(f"{p:>14}" for p in _SHORT)]
        for name, mark in (("forward high-water mark", self.forward_peak), ("backward high-water mark",
                                                                             self.backward_peak)):
            lines.append(f"{name:<{width}}{_mib(mark.total):>14}" + "".join(f"{_mib(n):>14}" for n in mark._parts()))
        lines.append(f"{'peak':<{width}}{_mib(self.peak_bytes):>14}")
        lines.append(f"{'peak less parameter gradients':<{width}}{_mib(self.peak_less_parameter_gradients):>14}")
        return "\n".join(lines)

    def compare(self, other: Report, by: str = "kind") -> str:
        """This report (the baseline) against ``other`` (e.g. the converted model), row by row, with ratios."""
        mine, theirs = self._rows(by), other._rows(by)
        names = sorted(set(mine) | set(theirs), key=lambda k: (-max(mine.get(k, 0), theirs.get(k, 0)), k))
        ahead = self.gradient_bytes or other.gradient_bytes
        peaks = self.forward_peak is not None and other.forward_peak is not None
        width = max([len(by), *(len(k) for k in names), len(_AHEAD) if ahead else 0, 29 if peaks else 0]) + 2

        def row(name: str, a: int, b: int) -> str:
            ratio = f"{b / a:>7.3f}x" if a else f"{'-':>8}"
            return f"{name:<{width}}{_mib(a):>14}{_mib(b):>14}{ratio:>9}"

        lines = [f"{by:<{width}}{'baseline':>14}{'converted':>14}{'ratio':>9}"]
        lines += [row(k, mine.get(k, 0), theirs.get(k, 0)) for k in names]
        lines.append(row("total", self.activation_bytes, other.activation_bytes))
        if ahead:
            lines.append(row(_AHEAD, self.gradient_bytes, other.gradient_bytes))
            lines.append(row(_KEPT, self.kept_bytes, other.kept_bytes))
        if peaks:
            lines.append("")
            lines.append(row("step peak", self.peak_bytes, other.peak_bytes))
            lines.append(row("peak less parameter gradients", self.peak_less_parameter_gradients,
                             other.peak_less_parameter_gradients))
            for phase in ("forward", "backward"):
                a, b = getattr(self, f"{phase}_peak"), getattr(other, f"{phase}_peak")
                lines.append(row(f"{phase} high-water mark", a.total, b.total))
                lines += [row(f"  {p}", x, y) for p, x, y in zip(_PARTS, a._parts(), b._parts(), strict=True)]
        return "\n".join(lines)


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _default_loss(output: Any) -> Tensor:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, Tensor):
        return loss
    if isinstance(output, Tensor):
        return output.float().sum()
    if isinstance(output, dict):
        output = list(output.values())
    items = output if isinstance(output, (tuple, list)) else ()
    tensors = [t for t in items if isinstance(t, Tensor) and t.requires_grad]
    if not tensors:
        raise TypeError(f"cannot derive a loss from a {type(output).__name__}; pass loss_fn=")
    return sum(t.float().sum() for t in tensors)


def _storage_key(t: Tensor) -> tuple[str, int] | None:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without a storage (some subclasses)
        return None


class _ModuleStack:
    """Forward hooks that keep the qualified name of the innermost running module."""

    def __init__(self, model: nn.Module) -> None:
        self.names: list[str] = []
        self.modules: list[nn.Module] = []
        self.handles = []
        for name, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                # (it takes no hooks: what its compiled code saves is charged to the module calling it)
                continue
            self.handles.append(module.register_forward_pre_hook(self._push(name or ROOT, module)))
            self.handles.append(module.register_forward_hook(self._pop, always_call=True))

    def _push(self, name: str, module: nn.Module):
        def hook(mod, args):
            self.names.append(name)
            self.modules.append(module)

        return hook

    def _pop(self, mod, args, output):
        if self.modules and self.modules[-1] is mod:
            self.names.pop()
            self.modules.pop()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _restoring(model: nn.Module):
    """Leave ``model`` as found: mode, grads, buffers, RNG state, and slimact's state for the steps that follow (its
    running estimates' values in the very tensors it holds, which a captured CUDA graph updates in place, and its
    step counts: the stochastic-rounding seeds of a step are keyed by them). Before, the step count moved on: a
    profile between two steps changed the training that followed."""
    was_training = {m: m.training for m in model.modules()}
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None  # the backward below must not accumulate into the caller's gradients
    buffers = {(m, n): None if b is None else (b, b.clone()) for m in model.modules() for n, b in m._buffers.items()}
    # (by items(): a TorchScript module's buffer table iterates otherwise)
    buffer_names = {m: {n for n, _ in m._buffers.items()} for m in model.modules()}
    estimates = {m: {n: (t, t.clone()) for n, t in m.__dict__[ESTIMATES_ATTR].items()}
                 for m in model.modules() if ESTIMATES_ATTR in m.__dict__}
    counters = {id(c): (c, c.value) for m in model.modules()
                if isinstance(c := m.__dict__.get("_slimact_steps"), StepCounter)}
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            for m, mode in was_training.items():
                m.training = mode
            for p, g in grads.items():
                p.grad = g
            for (m, n), kept in buffers.items():
                if kept is None:
                    m._buffers[n] = None
                    continue
                b, values = kept
                try:
                    with torch.no_grad():
                        if b.shape != values.shape:  # (resized by the step: torch.ao's observers at their first call)
                            b.resize_(values.shape)
                        b.copy_(values)  # (in place: the tensor itself, as recorded)
                except RuntimeError:  # (one it cannot resize: the values, in their own tensor)
                    b = values
                m._buffers[n] = b
            for m, names in buffer_names.items():  # buffers the step created (a module's own lazy ones)
                for n in {n for n, _ in m._buffers.items()} - names:
                    del m._buffers[n]
                    m._non_persistent_buffers_set.discard(n)
            for m in model.modules():  # running estimates: the values in the very tensors, none the step created
                if m not in estimates:
                    m.__dict__.pop(ESTIMATES_ATTR, None)
                    continue
                with torch.no_grad():
                    for t, values in estimates[m].values():
                        t.copy_(values)
                m.__dict__[ESTIMATES_ATTR] = {n: t for n, (t, _) in estimates[m].items()}
            for counter, value in counters.values():
                counter.value = value


_quiet = False


def quiet_profiler() -> None:
    """From now on the profiler's start and stop write nothing to stderr (:func:`_profiler_quiet`): the command
    line's choice. Not the library's default: it would silence another thread's stderr meanwhile."""
    global _quiet
    _quiet = True


@contextlib.contextmanager
def _profiler_quiet():
    """File descriptor 2 to ``/dev/null`` while the profiler starts or stops, after :func:`quiet_profiler`:
    torch 2.13's Kineto writes a "USDT: ... profiler_start" and a "profiler_stop" line to the process's stderr at
    each, whatever its log level, so a ``slimact fit`` printed dozens."""
    if not _quiet:
        yield
        return
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def profiled(**kwargs: Any) -> Iterator[Any]:
    """``torch.profiler.profile(**kwargs)``, started and stopped quietly after :func:`quiet_profiler`."""
    from torch.profiler import profile as torch_profile

    prof = torch_profile(**kwargs)
    with _profiler_quiet():
        prof.__enter__()
    try:
        yield prof
    finally:
        with _profiler_quiet():
            prof.__exit__(None, None, None)


class _Meter:
    """The step's allocations and frees from ``torch.profiler``'s memory events (module docstring); on CUDA also the
    allocator's own peak. Use as a context around the step, with :meth:`backward` around its backward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.cuda_peak: int | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _Meter:
        from torch.profiler import ProfilerActivity

        from slimact.quant import _hugepages

        self._stack.enter_context(_hugepages.off())
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        # CPU activity suffices: the allocators (the CUDA caching one too) report to the profiler from the host.
        self.prof = self._stack.enter_context(profiled(activities=[ProfilerActivity.CPU], profile_memory=True))
        return self

    def backward(self) -> contextlib.AbstractContextManager:
        """Marks the backward's start in the event stream."""
        return torch.profiler.record_function(_BACKWARD)

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.cuda_peak = torch.cuda.max_memory_allocated(self.device) - self._base
        self._stack.close()

    def _events(self) -> tuple[list[tuple[int, int, int, int]], float]:
        """``(time, address, bytes, bytes allocated after it)`` of this device's allocations (``bytes > 0``) and
        frees, in the order the allocator made them (:func:`_in_allocator_order`), and the time the backward began
        (infinity if it did not)."""
        from torch._C._profiler import _ExtraFields_Allocation

        events, backward = [], math.inf
        nodes = list(self.prof.profiler.kineto_results.experimental_event_tree())
        while nodes:
            node = nodes.pop()
            nodes.extend(node.children)
            f = node.extra_fields
            if isinstance(f, _ExtraFields_Allocation):
                if f.device.type == self.device.type and (not self.cuda or f.device.index == self.device.index):
                    events.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated))
            elif node.name == _BACKWARD:
                backward = min(backward, node.start_time_ns)
        return _in_allocator_order(events), backward

    def marks(self, saved: dict[int, int], grads: set[int]) -> tuple[Live, Live, int]:
        """The forward's and the backward's high-water marks, with what was alive at each, and the highest of
        (alive - parameter gradients alive). ``saved``: address -> what it is (0 kept, 1 a gradient computed
        ahead, 2 a parameter's gradient computed ahead), of each storage saved for the backward; ``grads``:
        addresses of the parameters' gradients after the step.

        The bytes alive after an event are those of the blocks the step allocated and had not freed by then; kept,
        gradients ahead and parameter gradients are the blocks identified as such, transients the rest."""
        events, t_backward = self._events()
        if not events:
            return Live(), Live(), 0
        first_backward = next((i for i, e in enumerate(events) if e[0] >= t_backward), len(events))
        # Every block the step allocated, [start, end) in event indices (end None: alive at the end), paired by
        # address; a block whose free was not seen ends where its address is allocated again.
        blocks: list[list] = []  # [start, end, address, bytes, part]: 0 kept, 1 gradients ahead, 2 parameter
        # gradients, 3 transients
        changes: list[list] = [[] for _ in events]  # per event: (block, +1 or -1)
        open_at: dict[int, list] = {}
        for i, (_, ptr, n, _) in enumerate(events):
            if n > 0:
                old = open_at.get(ptr)
                if old is not None:
                    old[1] = i
                    changes[i].append((old, -1))
                open_at[ptr] = block = [i, None, ptr, n, 3]
                blocks.append(block)
                changes[i].append((block, 1))
            elif ptr in open_at:  # else a block allocated before the step
                block = open_at.pop(ptr)
                block[1] = i
                changes[i].append((block, -1))
        for block in blocks:
            start, end, ptr = block[0], block[1], block[2]
            if ptr in saved and start < first_backward and (end is None or end >= first_backward):
                block[4] = saved[ptr]
            elif ptr in grads and end is None:
                block[4] = 2
        parts = [0, 0, 0, 0]
        best = [(-math.inf, Live()), (-math.inf, Live())]  # forward, backward: (bytes alive, Live) at its highest
        less = 0
        for i, (_, _, n, _) in enumerate(events):
            for block, sign in changes[i]:
                parts[block[4]] += sign * block[3]
            if n <= 0:
                continue
            alive = sum(parts)  # the step's own blocks: a free of an older one is not the step's (module docstring)
            kept, ahead, param = parts[:3]
            phase = int(i >= first_backward)
            if alive > best[phase][0]:
                best[phase] = (alive, Live(kept, ahead, param, alive - kept - ahead - param))
            less = max(less, alive - param)
        return best[0][1], best[1][1], less


def _in_allocator_order(events: list[tuple[int, int, int, int]], window: int = 32) -> list[tuple[int, int, int, int]]:
    """``(time, address, bytes, total after)`` events in the order the allocator made them.

    By time, but the threads' clocks do not order events of different threads exactly (on CUDA the backward runs
    on autograd's device thread: a time-sorted H200 step had 18 events out of order in 267), and a coarse clock
    gives ties. The allocator's own total after each event fixes the order: the next event is the first, among
    the next ``window`` in time order, whose total before it (``total - bytes``) is the running total (the first
    in time, frees first among equal times, where none is)."""
    pending = sorted(events, key=lambda e: (e[0], e[2] > 0))
    out: list[tuple[int, int, int, int]] = []
    head: list[tuple[int, int, int, int]] = []
    nxt = 0
    while head or nxt < len(pending):
        while len(head) < window and nxt < len(pending):
            head.append(pending[nxt])
            nxt += 1
        if out:
            k = next((k for k, e in enumerate(head) if e[3] - e[2] == out[-1][3]), 0)
        else:  # the first in time; among ties, one that none of them leads to
            ties = [e for e in head if e[0] == head[0][0]]
            k = next((k for k, e in enumerate(ties) if e[3] - e[2] not in {t[3] for t in ties}), 0)
        out.append(head.pop(k))
    return out


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _train(model: nn.Module) -> None:
    """Training mode as training runs it: ``model.train()`` where the model is in eval mode; a model in training
    mode already keeps the modes of its modules (a BatchNorm the user froze for fine-tuning with ``bn.eval()``:
    ``model.train()`` had trained it, and profile and check measured another step than training's)."""
    if not model.training:
        model.train()


def _call_counted(model: nn.Module, inputs: Any) -> Any:
    """:func:`_call` under profile's counting hooks, PyTorch's refusal of them said as profile's own error: a forward
    calling ``torch.func.grad`` (titans-pytorch's test-time-training memory) or ``vjp``, ``jacrev``, ``hessian``
    raises where saved-tensor hooks are on, and profile counts what autograd keeps through those hooks."""
    try:
        return _call(model, inputs)
    except RuntimeError as e:
        if "don't yet support saved tensor hooks" not in str(e):
            raise
        raise RuntimeError(
            "slimact.profile counts what autograd keeps through saved-tensor hooks, and this model's forward calls a "
            "torch.func transform (grad, vjp, jacrev, hessian) that refuses them: profile cannot count this model "
            "(training, slimact.check and slimact.profile.peak_bytes do not need the hooks)") from e


def profile(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[[Any], Tensor] | None = None,
    peak: bool = False,
) -> Report:
    """Measure what one training forward of ``model`` keeps for the backward, then run the backward.

    Args:
        model: any module (converted or not); run in training mode, then restored to its mode. A compiled model
            (``torch.compile``, ``module.compile()``) is profiled as its eager forward (what its graphs keep is
            their partitioner's choice: :func:`peak_bytes` measures the compiled step).
        inputs: a dict (``model(**inputs)``), a tuple (``model(*inputs)``) or a tensor (``model(inputs)``).
        loss_fn: ``loss_fn(output) -> scalar``; default: ``output.loss`` if present, else the sum of the output.
        peak: also measure the step's peak (:attr:`Report.peak_bytes`, :attr:`Report.forward_peak`,
            :attr:`Report.backward_peak`; module docstring). The step then runs under ``torch.profiler``: slower,
            so off by default.
    """
    return _step(model, inputs, loss_fn, keep=True, peak=peak)


def _step(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], Tensor] | None, *, keep: bool,
          peak: bool) -> Report:
    """One training step of ``model``: with ``keep``, under the saved-tensor hooks that count what is kept; with
    ``peak``, under the :class:`_Meter`."""
    # (and tensors the model holds as plain attributes: a rotary table a forward slices, whose storage a saved slice
    # shares, is no activation; counted whole, diffusers' QwenImage read 46% covered; a sweep, 2026-12-07)
    held = (t for m in model.modules() for k, v in vars(m).items() for _, t in _held_tensors(k, v))
    excluded = {_storage_key(t) for t in (*model.parameters(), *model.buffers(), *held)}
    # storage key -> per tensor saved with that storage, in order: (the entry, a weak reference to the tensor
    # saved, what it is: 0 kept, 1 a gradient computed ahead, 2 a parameter's gradient computed ahead; None off the
    # model's device). A tensor saved by a graph the forward also frees (a local graph inside a Function's forward:
    # the LM loss's soft cap, per chunk; a side computation the forward drops) is not kept, and its address may be
    # reused; the storage counts (once, as the first of its tensors still alive) while any of them is alive: a view
    # saved by a dropped graph does not hide the base a kept one saved.
    seen: dict[tuple[str, int], list[tuple[SavedTensor, weakref.ref, int | None]]] = {}
    device = _device_of(model)
    stack = _ModuleStack(model) if keep else None

    def pack_hook(t: Tensor) -> Tensor:
        # (a nested tensor, jagged or strided, is counted by the buffer holding its components: it has no sizes of its
        # own, and a jagged one no storage; profile raised on the first one saved)
        held = t.values() if t.is_nested else t
        key = _storage_key(held)
        if key is None or key in excluded:
            return t
        saved_here = seen.setdefault(key, [])
        if any(ref() is t for _, ref, _ in saved_here):
            return t  # (the very tensor again)
        if not any(ref() is not None for _, ref, _ in saved_here):
            saved_here.clear()  # all freed: the address may hold another storage now
        name = stack.names[-1] if stack.names else LOSS
        kind = kind_of(stack.modules[-1]) if stack.modules else "loss"
        gradient = is_gradient(t)
        entry = SavedTensor(name, kind, tuple(held.shape), t.dtype, held.untyped_storage().nbytes(), gradient,
                            slimact=saved_by_slimact(t))
        what = (2 if is_parameter_gradient(t) else 1) if gradient else 0
        saved_here.append((entry, weakref.ref(t), what if t.device == device else None))
        return t

    # Packs made for sharing (module docstring): (module, kind, the pack's id, weak references to its tensors; held
    # weakly, so that the count keeps nothing alive the step would have freed).
    shared: list[tuple[str, str, int, list[weakref.ref]]] = []
    # storage key of a pack's tensor -> (its storage, weakly; {storage key: storage, weakly} of the tensors it stands
    # for: a GELU input's codes stand for its output too, a copy only where each of them is kept in full). Weakly
    # held storages, so that an address a freed storage leaves to another is not taken for it.
    copies: dict[tuple[str, int], tuple[StorageWeakRef, dict[tuple[str, int], StorageWeakRef]]] = {}
    profiling = threading.get_ident()

    def shared_pack(x: Tensor, packed: Any) -> None:
        if threading.get_ident() != profiling:  # (another thread's model: its packs are not this step's)
            return
        name = stack.names[-1] if stack.names else LOSS
        kind = kind_of(stack.modules[-1]) if stack.modules else "loss"
        shared.append((name, kind, id(packed), [weakref.ref(t) for t in packed.tensors]))
        source = _storage_key(x)
        for t in packed.tensors if source is not None else ():
            key = _storage_key(t)
            if key is None or key == source:
                continue
            if key not in copies or copies[key][0].expired():
                copies[key] = (StorageWeakRef(t.untyped_storage()), {})
            copies[key][1][source] = StorageWeakRef(x.untyped_storage())

    use_cuda = torch.cuda.is_available() and device.type == "cuda"
    hooks = (torch.autograd.graph.saved_tensors_hooks(observer(pack_hook), observer(_as_saved)) if keep
             else contextlib.nullcontext())
    watching = watching_shared_packs(shared_pack) if keep else contextlib.nullcontext(set)
    meter = _Meter(device) if peak else None
    if peak or use_cuda:
        build_tables(device)  # (slimact's own once-per-process tables: not the step's bytes)
    # A compiled model (torch.compile(model), module.compile()) is profiled as its eager forward: dynamo would trace
    # the counting hooks into the graph (a converted model's step raised dynamo's internal errors), and what a compiled
    # graph keeps is its partitioner's choice, which peak_bytes measures.
    eager = torch.compiler.set_stance("force_eager") if keep and _compiled(model) else contextlib.nullcontext()
    with _restoring(model), eager:
        if use_cuda and not peak:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with meter or contextlib.nullcontext():
            _train(model)
            try:
                with hooks, watching as held, marking_saved() if keep else contextlib.nullcontext():
                    output = _call_counted(model, inputs)
                    if stack is not None:
                        stack.names.clear()
                        stack.modules.clear()
                    loss = (loss_fn or _default_loss)(output)
            finally:
                if stack is not None:
                    stack.remove()
            # What the forward left: the saved tensors still alive with its output (autograd holds what pack_hook
            # returned; a branch of the output the loss does not use counts, as a training step holds the output).
            alive = [next(((key, entry, what) for entry, ref, what in saved_here if ref() is not None), None)
                     for key, saved_here in seen.items()]
            alive = [a for a in alive if a is not None]
            alive += _held_packs(shared, held(), {key for key, _, _ in alive} | excluded, device)
            alive = _copies_marked(alive, copies)
            entries = [entry for _, entry, _ in alive]
            # address -> what it is, of this device's saved storages
            saved = {key[1]: what for key, _, what in alive if what is not None}
            seen.clear()
            del output
            if loss.requires_grad:  # nothing needs a gradient (frozen model, integer inputs): nothing was kept
                with meter.backward() if meter else contextlib.nullcontext():
                    loss.backward()
            # (a sharded parameter's gradient, a DTensor under FSDP2, has no storage of its own: its local shard's; a
            # sparse one, nn.Embedding(sparse=True)'s, its values')
            grads = {_dense_part(getattr(p.grad, "_local_tensor", p.grad)).untyped_storage().data_ptr()
                     for p in model.parameters() if p.grad is not None}
        if meter is not None:
            forward, backward, less = meter.marks(saved, grads)
            return Report(entries, meter.cuda_peak, forward, backward, less)
        return Report(entries, torch.cuda.max_memory_allocated() - base if use_cuda else None)


def _dense_part(t: Tensor) -> Tensor:
    """The strided tensor holding ``t``'s data: itself, or a sparse COO tensor's values."""
    return t._values() if t.is_sparse else t


def _compiled(model: nn.Module) -> bool:
    """Whether ``model`` is, or holds, a module ``torch.compile`` wraps (an ``OptimizedModule``, a module compiled in
    place by ``module.compile()``, one whose ``forward`` is a compiled function: ``m.forward = torch.compile(...)``).
    Without dynamo imported nothing is (``torch._dynamo`` is not imported here: a second of start-up each profile)."""
    if "torch._dynamo" not in sys.modules:
        return False
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               or getattr(m, "_compiled_call_impl", None) is not None
               or hasattr(m.__dict__.get("forward"), "_torchdynamo_orig_callable") for m in model.modules())


def _as_saved(t: Tensor) -> Tensor:
    """profile's unpack hook: each tensor as it was saved (an observer: :func:`slimact.quant.core.kept_whole` reads
    a result saved through it as one autograd keeps as it is, as in training)."""
    return t


def _held_packs(shared: list[tuple[str, str, int, list[weakref.ref]]], held: set[int], counted: set,
                device: torch.device) -> list:
    """``(storage key, entry, what)`` of the storages of the packs slimact's shared-pack cache still holds after the
    forward that no saved tensor has: a non-reentrant checkpoint's region input packed by its first layer, held for
    the recompute (a checkpointed ``Sequential`` starting with a Linear: its input's codes, 64 KiB of 398 KiB held,
    had gone uncounted)."""
    out = []
    for name, kind, packed, tensors in shared:
        if packed not in held:
            continue
        for ref in tensors:
            t = ref()
            key = None if t is None else _storage_key(t)
            if key is None or key in counted:
                continue
            counted.add(key)
            entry = SavedTensor(name, kind, tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), slimact=True)
            out.append((key, entry, 0 if t.device == device else None))
    return out


def _copies_marked(alive: list, copies: dict) -> list:
    """``alive`` with each entry of a pack's tensor whose source is kept in full too marked as a copy of it
    (:attr:`SavedTensor.copy_of`: the module charged with the full tensor)."""
    full = {key: entry for key, entry, _ in alive if key not in copies}
    out = []
    for key, entry, what in alive:
        pack, sources = copies.get(key, (None, {}))
        kept = [None if ref.expired() else full.get(source) for source, ref in sources.items()]
        if pack is not None and not pack.expired() and kept and all(kept):
            entry = replace(entry, copy_of=kept[0].module)
        out.append((key, entry, what))
    return out


def peak_bytes(model: nn.Module, inputs: Any, *, loss_fn: Callable[[Any], Tensor] | None = None) -> int:
    """Peak bytes allocated during one training forward and backward of ``model`` (inputs and loss as
    :func:`profile` takes them), above what was allocated before it: :attr:`Report.peak_bytes` of
    ``profile(..., peak=True)``, measured the same way but without the saved-tensor hooks (so it also measures
    compiled models, whose graphs the hooks would change). Unlike the bytes kept it sees every temporary (the logits
    a model's head produces, a loss's chunks, the parameter gradients the backward allocates), so it is the number
    a memory budget is about. The model is left as found, as by :func:`profile`."""
    return _step(model, inputs, loss_fn, keep=False, peak=True).peak_bytes
