"""``Policy``: what ``convert`` replaces and how each replaced layer keeps its tensors.

A policy is a frozen dataclass; presets are named instances; files (TOML or JSON) hold the same fields,
optionally on top of a preset (``preset = "mesa"``). Unknown keys and bad values are errors that name
the file and the key: a policy that silently does nothing is worse than none.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slimact.quant.reference import QuantConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["KINDS", "PRESETS", "Policy", "PolicyError"]

#: Layer kinds slimact can convert. Later layer families add their kind here.
KINDS: tuple[str, ...] = ("linear",)


class PolicyError(ValueError):
    """A policy (or policy file) that cannot be used as written."""


@dataclass(frozen=True)
class Policy:
    """How ``slimact.convert`` treats a model.

    Attributes:
        name: a label shown by ``summary``.
        bits: code width of compressed tensors (8; 4 and 2 where a layer supports them).
        scale: ``"dynamic"`` (each tensor's own per-group range) or ``"running"`` (Mesa's EMA estimate).
        ema_decay: decay of the running estimate.
        stochastic: stochastic (unbiased) rounding instead of round-to-nearest.
        channel_groups: scale groups along the channel (last) dim of ``[..., C]`` tensors; need not
            divide ``C``.
        quantize: ``False`` keeps every tensor exact (only lossless techniques; the ``"tempo"`` preset).
        kinds: layer kinds to convert (see :data:`KINDS`).
        include: ``fnmatch`` patterns on qualified module names; if given, only matching modules convert.
        exclude: patterns whose matches are left alone.
    """

    name: str = "custom"
    bits: int = 8
    scale: Literal["dynamic", "running"] = "dynamic"
    ema_decay: float = 0.9
    stochastic: bool = False
    channel_groups: int = 8
    quantize: bool = True
    kinds: tuple[str, ...] = KINDS
    include: tuple[str, ...] = field(default=())
    exclude: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("kinds", "include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise PolicyError(f"Policy.{name} must be a sequence of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown:
            raise PolicyError(f"unknown layer kind(s) {unknown}; known: {list(KINDS)}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise PolicyError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.channel_groups < 1:
            raise PolicyError(f"channel_groups must be >= 1, got {self.channel_groups}")
        try:
            self.quant_config("linear")
        except ValueError as e:
            raise PolicyError(str(e)) from None

    def quant_config(self, kind: str) -> QuantConfig:
        """The compression of tensors saved by layers of ``kind`` (channel-grouped ``[..., C]`` tensors)."""
        return QuantConfig(
            bits=self.bits,
            group_dim=-1,
            groups=self.channel_groups,
            scale=self.scale,
            decay=self.ema_decay,
            stochastic=self.stochastic,
        )

    def skip_reason(self, kind: str, qualified_name: str) -> str | None:
        """Why a module of ``kind`` named ``qualified_name`` is left alone, or ``None`` to convert it."""
        if kind not in self.kinds:
            return f"kind {kind!r} not enabled by policy {self.name!r}"
        if self.include and not any(fnmatch.fnmatchcase(qualified_name, p) for p in self.include):
            return "not matched by policy include patterns"
        if any(fnmatch.fnmatchcase(qualified_name, p) for p in self.exclude):
            return "matched by policy exclude patterns"
        if not self.quantize and kind == "linear":
            return "policy is lossless; a Linear has no lossless saving (its input is kept exact)"
        return None

    def replace(self, **changes: Any) -> Policy:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Policy:
        """Read a policy from a TOML or JSON file: the fields of :class:`Policy`, plus ``preset`` as a base."""
        path = Path(path)
        if not path.is_file():
            raise PolicyError(f"policy file {str(path)!r} does not exist")
        text = path.read_text()
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            elif path.suffix.lower() == ".toml":
                data = tomllib.loads(text)
            else:
                raise PolicyError(f"{path}: unknown policy file type {path.suffix!r} (use .toml or .json)")
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise PolicyError(f"{path}: {e}") from None
        if not isinstance(data, dict):
            raise PolicyError(f"{path}: a policy file holds a table of fields")
        return cls._from_mapping(data, source=str(path))

    @classmethod
    def _from_mapping(cls, data: dict[str, Any], source: str) -> Policy:
        data = dict(data)
        base = resolve(data.pop("preset", "int8"))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key not in fields:
                raise PolicyError(f"{source}: unknown key {key!r}; known: preset, {', '.join(fields)}")
            expected = type(getattr(base, key))
            if expected is tuple and isinstance(value, list):
                data[key] = value = tuple(value)
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                data[key] = value = float(value)
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise PolicyError(f"{source}: key {key!r} must be {expected.__name__}, got {value!r}")
        data.setdefault("name", Path(source).stem)
        try:
            return base.replace(**data)
        except PolicyError as e:
            raise PolicyError(f"{source}: {e}") from None


PRESETS: dict[str, Policy] = {
    # Lossless techniques only: gradients equal the exact ones up to float rounding.
    "tempo": Policy(name="tempo", quantize=False),
    # Mesa as published: 8-bit, running estimates (decay 0.9), stochastic rounding, one scale per layer
    # outside attention.
    "mesa": Policy(name="mesa", scale="running", ema_decay=0.9, stochastic=True, channel_groups=1),
    # Default: 8-bit with each tensor's own per-channel-group range, round to nearest.
    "int8": Policy(name="int8"),
}


def resolve(policy: str | os.PathLike[str] | Policy) -> Policy:
    """A :class:`Policy` from a preset name, a policy file path, or a policy."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in PRESETS:
        return PRESETS[policy]
    if isinstance(policy, os.PathLike) or (isinstance(policy, str) and Path(policy).suffix):
        return Policy.from_file(policy)
    raise PolicyError(f"unknown policy {policy!r}: use one of {sorted(PRESETS)}, a Policy, or a file path")
