"""``profile``: the bytes autograd keeps for the backward pass, per op kind and per module.

How it counts: one training forward runs under ``torch.autograd.graph.saved_tensors_hooks``, whose pack
hook sees every tensor any op saves for backward, PyTorch's built-in ops and slimact's Functions alike
(slimact saves only through ``ctx.save_for_backward``). Each saved tensor is charged the full size of its
storage, once per unique storage (a view saved by two ops is counted once, by the first), and never if the
storage belongs to a parameter or buffer. It is attributed to the innermost module whose forward was
running when it was saved, and to that module's kind (:func:`slimact._kinds.kind_of`); tensors the loss
function saves go to ``"(loss)"``. The backward then runs, and the model is left as it was found: its
training mode, gradients, buffers (running estimates, BatchNorm statistics) and the RNG state.

On CUDA the report also carries ``torch.cuda.max_memory_allocated`` over the step, minus what was
allocated before it (``cuda_peak_bytes``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from slimact._kinds import kind_of
from slimact.functional._saving import is_gradient

__all__ = ["Report", "SavedTensor", "peak_bytes", "profile"]

ROOT = "(model)"
LOSS = "(loss)"
_AHEAD = "+ gradients computed ahead"


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


def _mib(n: float) -> str:
    return f"{n / 2**20:10.2f} MiB"


def _sum_by(entries: list[SavedTensor], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries:
        k = getattr(e, key)
        out[k] = out.get(k, 0) + e.nbytes
    return out


@dataclass
class Report:
    """What one training step keeps for its backward pass."""

    entries: list[SavedTensor] = field(default_factory=list)
    cuda_peak_bytes: int | None = None

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

    def _rows(self, by: str) -> dict[str, int]:
        if by not in ("kind", "module"):
            raise ValueError(f"by must be 'kind' or 'module', got {by!r}")
        return self.by_kind if by == "kind" else self.by_module

    def table(self, by: str = "kind", top: int | None = None) -> str:
        """A readable table of bytes per kind (or per module), largest first; ``top`` limits the rows."""
        rows = sorted(self._rows(by).items(), key=lambda kv: (-kv[1], kv[0]))
        total = self.activation_bytes
        width = max([len(by), *(len(k) for k, _ in rows), len(_AHEAD) if self.gradient_bytes else 0]) + 2
        lines = [f"{by:<{width}}{'bytes kept':>14}{'share':>8}"]
        shown = rows if top is None else rows[:top]
        for name, n in shown:
            lines.append(f"{name:<{width}}{_mib(n):>14}{n / max(total, 1):>8.1%}")
        if len(shown) < len(rows):
            rest = sum(n for _, n in rows[len(shown) :])
            lines.append(f"{f'({len(rows) - len(shown)} more)':<{width}}{_mib(rest):>14}{rest / max(total, 1):>8.1%}")
        lines.append(f"{'total':<{width}}{_mib(total):>14}{'100.0%':>8}")
        if self.gradient_bytes:
            lines.append(f"{_AHEAD:<{width}}{_mib(self.gradient_bytes):>14}")
        if self.cuda_peak_bytes is not None:
            lines.append(f"{'cuda peak':<{width}}{_mib(self.cuda_peak_bytes):>14}")
        return "\n".join(lines)

    def compare(self, other: Report, by: str = "kind") -> str:
        """This report (the baseline) against ``other`` (e.g. the converted model), row by row, with ratios."""
        mine, theirs = self._rows(by), other._rows(by)
        names = sorted(set(mine) | set(theirs), key=lambda k: (-max(mine.get(k, 0), theirs.get(k, 0)), k))
        ahead = self.gradient_bytes or other.gradient_bytes
        width = max([len(by), *(len(k) for k in names), len(_AHEAD) if ahead else 0]) + 2

        def row(name: str, a: int, b: int) -> str:
            ratio = f"{b / a:>7.3f}x" if a else f"{'-':>8}"
            return f"{name:<{width}}{_mib(a):>14}{_mib(b):>14}{ratio:>9}"

        lines = [f"{by:<{width}}{'baseline':>14}{'converted':>14}{'ratio':>9}"]
        lines += [row(k, mine.get(k, 0), theirs.get(k, 0)) for k in names]
        lines.append(row("total", self.activation_bytes, other.activation_bytes))
        if ahead:
            lines.append(row(_AHEAD, self.gradient_bytes, other.gradient_bytes))
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
    """Leave ``model`` as found: mode, grads, buffers, RNG state."""
    was_training = {m: m.training for m in model.modules()}
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None  # the backward below must not accumulate into the caller's gradients
    buffers = {(m, n): None if b is None else b.clone() for m in model.modules() for n, b in m._buffers.items()}
    buffer_names = {m: set(m._buffers) for m in model.modules()}
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            for m, mode in was_training.items():
                m.training = mode
            for p, g in grads.items():
                p.grad = g
            for (m, n), b in buffers.items():
                m._buffers[n] = b
            for m, names in buffer_names.items():  # buffers the step created (running estimates)
                for n in set(m._buffers) - names:
                    del m._buffers[n]
                    m._non_persistent_buffers_set.discard(n)


def profile(
    model: nn.Module,
    inputs: Any,
    *,
    loss_fn: Callable[[Any], Tensor] | None = None,
) -> Report:
    """Measure what one training forward of ``model`` keeps for the backward, then run the backward.

    Args:
        model: any module (converted or not); run in training mode, then restored to its mode.
        inputs: a dict (``model(**inputs)``), a tuple (``model(*inputs)``) or a tensor (``model(inputs)``).
        loss_fn: ``loss_fn(output) -> scalar``; default: ``output.loss`` if present, else the sum of the output.
    """
    excluded = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    seen: set[tuple[str, int]] = set()
    entries: list[SavedTensor] = []
    stack = _ModuleStack(model)

    def pack_hook(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key is None or key in excluded or key in seen:
            return t
        seen.add(key)
        name = stack.names[-1] if stack.names else LOSS
        kind = kind_of(stack.modules[-1]) if stack.modules else "loss"
        entries.append(
            SavedTensor(name, kind, tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), is_gradient(t))
        )
        return t

    use_cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    with _restoring(model):
        if use_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        model.train()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
                output = _call(model, inputs)
                stack.names.clear()
                stack.modules.clear()
                loss = (loss_fn or _default_loss)(output)
        finally:
            stack.remove()
        del output
        if loss.requires_grad:  # nothing needs a gradient (frozen model, integer inputs): nothing was kept
            loss.backward()
        peak = torch.cuda.max_memory_allocated() - base if use_cuda else None
    return Report(entries, peak)


def peak_bytes(model: nn.Module, inputs: Any, *, loss_fn: Callable[[Any], Tensor] | None = None) -> int:
    """Peak bytes allocated during one training forward and backward of ``model`` (inputs and loss as
    :func:`profile` takes them), above what was allocated before it: on CPU the running sum of the allocations
    and frees ``torch.profiler`` records, at its highest; on CUDA ``torch.cuda.max_memory_allocated``. Unlike
    :func:`profile` it sees every temporary (the logits a model's head produces, a loss's chunks, the
    parameter gradients the backward allocates), so it is the number a memory budget is about. (Large unpacks go
    through the allocator here, not onto huge pages, which the profiler would not see.) The model is left as
    found, as by :func:`profile`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from slimact.quant import _hugepages

    def step() -> None:
        model.train()
        loss = (loss_fn or _default_loss)(_call(model, inputs))
        if loss.requires_grad:
            loss.backward()

    with _restoring(model):
        if any(p.is_cuda for p in model.parameters()):  # the allocator's own peak
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        with _hugepages.off(), torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak
