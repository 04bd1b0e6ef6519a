"""What every slimact module shares: how it is attached to (and detached from) a torch module.

A slimact module is the torch module it replaces with its class swapped for a subclass (``slimact.nn.Linear``
is an ``nn.Linear``): the object, its parameters and its ``state_dict`` stay the very same. What slimact adds
lives in plain attributes (the compression config, the original class) and in non-persistent buffers (the
running estimate), so checkpoints load both ways with ``strict=True``.
"""

from __future__ import annotations

from torch import nn

from slimact.quant import QuantConfig, RunningRange

__all__ = ["SlimModule", "attach", "detach", "slim_class"]

_CLASS_CACHE: dict[tuple[type, type], type] = {}


class SlimModule:
    """Mixin of every slimact module (``isinstance(m, SlimModule)`` tells a converted module)."""

    _slimact_cfg: QuantConfig
    _slimact_state: RunningRange | None
    _slimact_orig_cls: type[nn.Module]

    def _slimact_active(self) -> bool:
        # Compression only where a backward will need it: never in eval mode.
        return self.training  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        cfg = self._slimact_cfg
        rounding = "stochastic" if cfg.stochastic else "nearest"
        slim = f"slimact: int{cfg.bits}, {cfg.scale} scale, {cfg.groups} groups, {rounding}"
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base}, {slim}" if base else slim


def slim_class(mixin: type, cls: type[nn.Module]) -> type[nn.Module]:
    """The slimact subclass of ``cls`` that adds ``mixin``'s forward (one class per pair, cached)."""
    key = (mixin, cls)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(cls.__name__, (mixin, cls), {"__module__": mixin.__module__})
    return _CLASS_CACHE[key]


def attach(module: nn.Module, slim_cls: type[nn.Module], cfg: QuantConfig) -> nn.Module:
    """Turn ``module`` into an instance of ``slim_cls`` in place (idempotent: re-attaching updates ``cfg``)."""
    if not isinstance(module, SlimModule):
        module._slimact_orig_cls = type(module)
        module.__class__ = slim_cls
    module._slimact_cfg = cfg
    state = module.__dict__.get("_slimact_state")
    if cfg.scale == "running":
        if state is None:
            module._slimact_state = RunningRange(module, "_slimact_x")
    else:
        if state is not None:
            state.clear()
        module._slimact_state = None
    return module


def detach(module: nn.Module) -> nn.Module:
    """Undo :func:`attach`: the original class again, slimact's attributes and buffers gone."""
    if not isinstance(module, SlimModule):
        return module
    if module._slimact_state is not None:
        module._slimact_state.clear()
    module.__class__ = module._slimact_orig_cls
    for name in ("_slimact_cfg", "_slimact_state", "_slimact_orig_cls"):
        module.__dict__.pop(name, None)
    return module
