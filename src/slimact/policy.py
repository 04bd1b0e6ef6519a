"""``Policy``: what ``convert`` replaces and how each replaced layer keeps its tensors.

A policy is a frozen dataclass; presets are named instances; files hold the same fields: TOML or JSON
(optionally on top of a preset, ``preset = "mesa"``), or Mesa's own text format (``on gelu:`` sections of
``by_index:`` / ``enable:`` / ``level:`` / ``ema_decay:`` lines), so Mesa users can bring their files.
Unknown keys and bad values are errors that name the file, the line where known, and the key: a policy
that silently does nothing is worse than none (Mesa quietly disabled itself when its file was missing).

Layouts of the scale groups, by kind (see :meth:`Policy.quant_config`):

* attention tensors (``matmul`` operands and ``softmax`` outputs of rank 4, ``[B, H, T, D]``): per head
  (``head_groups = 0``) or ``head_groups`` groups of heads;
* ``conv`` and ``batchnorm`` inputs ``[N, C, ...]``: ``channel_groups`` groups along dim 1;
* everything else ``[..., C]``: ``channel_groups`` groups along the last dim.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slimact.quant.reference import QuantConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["KINDS", "LOSSLESS_KINDS", "PRESETS", "Policy", "PolicyError"]

#: Layer kinds slimact can convert.
KINDS: tuple[str, ...] = (
    "linear", "conv", "batchnorm", "layernorm", "rmsnorm", "matmul", "softmax", "gelu", "silu", "relu", "dropout",
    "mlp", "lmloss", "attention",
)
#: Kinds whose slimact form is exact when nothing is quantised (bit masks; outputs kept instead of inputs):
#: the ones a lossless policy (``quantize=False``, the ``"tempo"`` preset) converts.
LOSSLESS_KINDS: tuple[str, ...] = (
    "relu", "dropout", "layernorm", "rmsnorm", "gelu", "silu", "mlp", "lmloss", "attention",
)
_HEADWISE_KINDS = ("matmul", "softmax", "attention")
_CHANNEL_FIRST_KINDS = ("conv", "batchnorm")


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
        channel_groups: scale groups along the channel dim (need not divide the channel count).
        head_groups: scale groups along the head dim of ``[B, H, T, D]`` attention tensors; 0 = one per head.
        quantize: ``False`` keeps every tensor exact (only lossless techniques; the ``"tempo"`` preset).
        kinds: layer kinds to convert (see :data:`KINDS`).
        include: ``fnmatch`` patterns on qualified module names; if given, only matching modules convert.
        exclude: patterns whose matches are left alone.
        exclude_index: ``"kind:i"`` entries leaving alone the ``i``-th module of that kind (counted from 0
            in ``model.named_modules()`` order, as Mesa's ``by_index`` does).
    """

    name: str = "custom"
    bits: int = 8
    scale: Literal["dynamic", "running"] = "dynamic"
    ema_decay: float = 0.9
    stochastic: bool = False
    channel_groups: int = 8
    head_groups: int = 0
    quantize: bool = True
    kinds: tuple[str, ...] = KINDS
    include: tuple[str, ...] = field(default=())
    exclude: tuple[str, ...] = field(default=())
    exclude_index: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("kinds", "include", "exclude", "exclude_index"):
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
        if self.head_groups < 0:
            raise PolicyError(f"head_groups must be >= 0 (0 = one per head), got {self.head_groups}")
        for entry in self.exclude_index:
            if not re.fullmatch(r"[a-z]+:\d+", entry) or entry.split(":")[0] not in KINDS:
                raise PolicyError(f"exclude_index entries are 'kind:index' with a known kind, got {entry!r}")
        try:
            _quant_config(self, "linear", 2)
        except ValueError as e:
            raise PolicyError(str(e)) from None

    def quant_config(self, kind: str, ndim: int) -> QuantConfig | None:
        """The compression of a rank-``ndim`` tensor saved by a layer of ``kind``; ``None``: keep it exact."""
        return _quant_config(self, kind, ndim) if self.quantize else None

    def skip_reason(self, kind: str, qualified_name: str, index: int = -1) -> str | None:
        """Why a module of ``kind`` named ``qualified_name`` (the ``index``-th of its kind) is left alone.

        ``None`` means: convert it.
        """
        if kind not in self.kinds:
            return f"kind {kind!r} not enabled by policy {self.name!r}"
        if self.include and not any(fnmatch.fnmatchcase(qualified_name, p) for p in self.include):
            return "not matched by policy include patterns"
        if any(fnmatch.fnmatchcase(qualified_name, p) for p in self.exclude):
            return "matched by policy exclude patterns"
        if f"{kind}:{index}" in self.exclude_index:
            return f"excluded by index ({kind}:{index})"
        if not self.quantize and kind not in LOSSLESS_KINDS:
            return f"policy {self.name!r} is lossless and a {kind} has no lossless saving yet"
        return None

    def replace(self, **changes: Any) -> Policy:
        return dataclasses.replace(self, **changes)

    def to_file(self, path: str | os.PathLike[str]) -> Path:
        """Write this policy as TOML (every field), readable by :meth:`from_file`."""
        lines = [f"# slimact policy {self.name!r}", ""]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (int, float)):
                text = repr(value)
            elif isinstance(value, str):
                text = json.dumps(value)
            else:
                text = "[" + ", ".join(json.dumps(v) for v in value) + "]"
            lines.append(f"{f.name} = {text}")
        path = Path(path)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Policy:
        """Read a policy file: TOML or JSON (the fields of :class:`Policy`, plus ``preset`` as a base), or
        Mesa's text format (``.txt``, or any file whose first statement is an ``on <tag>:`` line)."""
        path = Path(path)
        if not path.is_file():
            raise PolicyError(f"policy file {str(path)!r} does not exist")
        text = path.read_text()
        if path.suffix.lower() == ".txt" or _looks_like_mesa(text):
            return _from_mesa_text(text, str(path))
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


@functools.lru_cache(maxsize=256)
def _quant_config(policy: Policy, kind: str, ndim: int) -> QuantConfig:
    if kind in _HEADWISE_KINDS and ndim == 4:
        group_dim, groups = 1, policy.head_groups
    elif kind in _CHANNEL_FIRST_KINDS and ndim >= 2:
        group_dim, groups = 1, policy.channel_groups
    else:
        group_dim, groups = -1, policy.channel_groups
    return QuantConfig(
        bits=policy.bits,
        group_dim=group_dim,
        groups=groups,
        scale=policy.scale,
        decay=policy.ema_decay,
        stochastic=policy.stochastic,
    )


# Mesa's layer tags and the slimact kinds they name.
_MESA_TAGS = {
    "fc": "linear", "conv": "conv", "bn": "batchnorm", "layernorm": "layernorm", "matmul": "matmul",
    "softmax": "softmax", "gelu": "gelu", "relu": "relu",
}
_MESA_LEVELS = {256: 8, 16: 4, 4: 2}


def _looks_like_mesa(text: str) -> bool:
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return bool(re.match(r"on\s+\w+\s*:", line))
    return False


def _from_mesa_text(text: str, source: str) -> Policy:
    """Mesa's policy format: per tag, blocks of ``by_index`` (``all`` or indices) then settings.

    A tag is converted if some block enables it for ``all``; blocks that disable listed indices become
    ``exclude_index`` entries; ``level`` (256, 16, 4) sets ``bits`` and ``ema_decay`` the decay. Unlisted
    tags stay off, as in Mesa. Mesa's running estimates and stochastic rounding are the base.
    """
    base = PRESETS["mesa"]
    kinds: list[str] = []
    excluded: list[str] = []
    settings: dict[str, Any] = {}
    tag: str | None = None
    block: dict[str, Any] | None = None

    def close_block() -> None:
        if block is None or tag is None:
            return
        kind = _MESA_TAGS[tag]
        enable = block.get("enable", False)
        if block["by_index"] == "all":
            if enable and kind not in kinds:
                kinds.append(kind)
            if not enable and kind in kinds:
                kinds.remove(kind)
        elif not enable:
            excluded.extend(f"{kind}:{i}" for i in block["by_index"])
        elif kind not in kinds:
            raise PolicyError(
                f"{source}:{block['line']}: enabling only some {tag!r} layers by index is not supported; "
                "enable 'all' and disable the others by index"
            )

    lines = text.splitlines()
    for no, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        head, sep, value = line.partition(":")
        head, value = head.strip(), value.strip()
        if not sep:
            raise PolicyError(f"{source}:{no}: expected 'key: value', got {raw.strip()!r}")
        words = head.split()
        if words and words[0] == "on":
            close_block()
            if len(words) != 2 or words[1] not in _MESA_TAGS:
                raise PolicyError(f"{source}:{no}: unknown Mesa layer tag {head!r}; known: {sorted(_MESA_TAGS)}")
            tag, block = words[1], None
            continue
        if tag is None:
            raise PolicyError(f"{source}:{no}: {head!r} before any 'on <tag>:' line")
        if head == "by_index":
            close_block()
            if value == "all":
                block = {"by_index": "all", "line": no}
            else:
                try:
                    block = {"by_index": [int(v) for v in value.replace(",", " ").split()], "line": no}
                except ValueError:
                    raise PolicyError(f"{source}:{no}: by_index must be 'all' or indices, got {value!r}") from None
            continue
        if block is None:
            raise PolicyError(f"{source}:{no}: {head!r} before a 'by_index:' line")
        if head not in ("enable", "level", "ema_decay"):
            raise PolicyError(f"{source}:{no}: unknown key {head!r}; known: by_index, enable, level, ema_decay")
        try:
            if head == "enable":
                if value not in ("True", "true", "False", "false"):
                    raise ValueError
                block["enable"] = value in ("True", "true")
            elif head == "level":
                settings["bits"] = _MESA_LEVELS[int(value)]
            else:
                settings["ema_decay"] = float(value)
        except (ValueError, KeyError):
            raise PolicyError(f"{source}:{no}: bad value for {head!r}: {value!r}") from None
    close_block()
    try:
        return base.replace(
            name=Path(source).stem, kinds=tuple(kinds), exclude_index=tuple(excluded), **settings
        )
    except PolicyError as e:
        raise PolicyError(f"{source}: {e}") from None


PRESETS: dict[str, Policy] = {
    # Lossless techniques only: gradients equal the exact ones up to float rounding.
    "tempo": Policy(name="tempo", quantize=False),
    # Mesa as published: 8-bit, one scale per head for attention tensors, channel groups elsewhere, running
    # estimates (decay 0.9), stochastic rounding.
    "mesa": Policy(name="mesa", scale="running", ema_decay=0.9, stochastic=True),
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
