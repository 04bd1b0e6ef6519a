"""slimact's mutable per-model state, saved and restored with a checkpoint.

A converted model trains with state that ``model.state_dict()`` does not hold (its keys stay exactly the plain
model's, so checkpoints load both ways):

* the running estimates of every call site (``scale = "running"``, the ``"mesa"`` preset): tensors
  ``_slimact_*`` held by the converted modules and the tagged attention modules, not among their buffers
  (:data:`slimact.quant.state.ESTIMATES_ATTR`);
* the model's step count, which keys each forward's stochastic-rounding seeds
  (:func:`slimact.quant.reference.begin_stream`).

Without them a run resumed from a checkpoint starts its estimates and seed stream afresh, and its losses leave
those of the uninterrupted run. :func:`state_dict` / :func:`load_state_dict` carry them; with the model's and the
optimizer's state and PyTorch's RNG state, a resumed run computes exactly what the uninterrupted one does.
Everything else slimact keeps while training is per model or per thread: two models may train at once in two
threads.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from slimact.convert import _HOOK_ATTR, _conversion_policies
from slimact.nn._base import SlimModule, StepCounter
from slimact.policy import _running
from slimact.quant.state import ESTIMATES_ATTR

__all__ = ["LoadResult", "load_state_dict", "state_dict"]

_FORMAT = 1
_PREFIX = "_slimact_"


class LoadResult(NamedTuple):
    """What :func:`load_state_dict` could not match (as ``nn.Module.load_state_dict`` reports it).

    ``missing_keys``: estimates the model had that the state lacks (dropped: they start again from the next
    tensor, as they had when the state was taken). ``unexpected_keys``: entries of the state naming no module
    of the model that slimact converted (or ``"step"``, for a model without a step counter).
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def _counter(model: nn.Module) -> StepCounter | None:
    return model.__dict__.get(_HOOK_ATTR, (None, None))[1]


def _holds_state(module: nn.Module) -> bool:
    """Whether slimact works in ``module``: a converted one, or one it tagged (attention routed through it)."""
    return isinstance(module, SlimModule) or any(k.startswith(_PREFIX) for k in module.__dict__)


def _key(name: str, buffer: str) -> str:
    return f"{name}.{buffer}" if name else buffer


def _estimates(model: nn.Module) -> dict[str, tuple[nn.Module, str, Tensor]]:
    return {
        _key(name, buffer): (module, buffer, t)
        for name, module in model.named_modules()
        for buffer, t in module.__dict__.get(ESTIMATES_ATTR, {}).items()
    }


def state_dict(model: nn.Module) -> dict[str, Any]:
    """slimact's state of ``model`` (the model :func:`slimact.convert` was called on), to save beside
    ``model.state_dict()`` and the optimizer's.

    Returns ``{"format": 1, "step": int | None, "estimates": {"<module>.<buffer>": Tensor}}``: the step count
    (``None`` for a model holding slimact modules but never passed to ``convert``) and a copy of every running
    estimate, keyed by qualified module name and buffer name (fp32 tensors on the module's device; ``torch.save``
    and ``torch.load(..., weights_only=True)`` take it as it is). Raises ``ValueError`` for a model slimact has
    not converted.
    """
    steps = _counter(model)
    if steps is None and not any(_holds_state(m) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} was not converted by slimact.convert: it has no slimact state")
    return {
        "format": _FORMAT,
        "step": None if steps is None else steps.value,
        "estimates": {key: t.detach().to(_device(module, model, t.device), copy=True)
                      for key, (module, _, t) in _estimates(model).items()},
    }


def _device(module: nn.Module, model: nn.Module, default: torch.device) -> torch.device:
    """Where ``module``'s estimates belong: with its own parameters (or plain buffers), else the model's."""
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return t.device
    return next((p.device for p in model.parameters()), default)


def _checked(state: Any) -> tuple[int | None, Mapping[str, Tensor]]:
    if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
        raise ValueError(f"not a slimact state (a dict of format {_FORMAT} from slimact.state_dict): {type(state)}")
    step, estimates = state.get("step"), state.get("estimates")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"slimact state: step must be an int >= 0 or None, got {step!r}")
    if not isinstance(estimates, Mapping) or not all(
        isinstance(k, str) and isinstance(t, Tensor) for k, t in estimates.items()
    ):
        raise ValueError("slimact state: estimates must be a dict of names to tensors")
    meta = [k for k, t in estimates.items() if t.is_meta]
    if meta:
        raise ValueError(f"slimact state: estimates on the meta device hold no values: {meta}")
    return step, estimates


def load_state_dict(model: nn.Module, state: Mapping[str, Any], strict: bool = True) -> LoadResult:
    """Restore slimact's state of ``model`` from :func:`state_dict` (in place; returns what did not match).

    The state replaces the model's: its step count is set, its running estimates are those of ``state``
    (created where the model has not made them yet, so a state can be loaded before the first forward;
    estimates the model has and ``state`` lacks are dropped), each as fp32 on its module's device (that of
    the module's parameters, else the model's). Call it after ``slimact.convert`` (converting again with
    another policy drops the estimates). ``strict``: an entry naming no module of ``model`` that slimact
    converted raises ``KeyError`` (otherwise it is skipped and reported in ``unexpected_keys``).
    """
    step, estimates = _checked(state)
    steps = _counter(model)
    modules = dict(model.named_modules())
    unexpected, placed = [], []
    for key, t in estimates.items():
        name, _, buffer = key.rpartition(".")
        module = modules.get(name)
        if module is None or not buffer.startswith(_PREFIX) or not _holds_state(module):
            unexpected.append(key)
        else:
            placed.append((module, buffer, t))
    if step is not None and steps is None:
        unexpected.append("step")
    if strict and unexpected:
        raise KeyError(f"slimact state entries match no module slimact converted in {type(model).__name__}: "
                       f"{unexpected}")
    missing = [key for key in _estimates(model) if key not in estimates]
    for module in modules.values():
        module.__dict__.pop(ESTIMATES_ATTR, None)
    for module, buffer, t in placed:
        value = t.detach().to(_device(module, model, t.device), torch.float32, copy=True)
        module.__dict__.setdefault(ESTIMATES_ATTR, {})[buffer] = value
    for module in modules.values():
        # A call site is found by comparing the module's last step with the counter: start counting afresh.
        module.__dict__.pop("_slimact_step", None)
    if steps is not None and step is not None:
        steps.value = step
    if step and not estimates and any(map(_running, _conversion_policies(model))):
        warnings.warn(
            f"slimact.load_state_dict: the state is of step {step} but holds no running estimates, and this model "
            "packs with them: they start afresh from the next tensor. A loader that fills only the keys of the dict "
            "it is given (torch.distributed.checkpoint) finds none in slimact.state_dict(model) of a model that has "
            "not trained yet: run one training step (forward and backward) before taking the dict to load into, or "
            "save and load the state with torch.save / torch.load", stacklevel=2)
    return LoadResult(missing, unexpected)
