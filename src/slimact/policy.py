"""``Policy``: what ``convert`` replaces and how each replaced layer keeps its tensors.

A policy is a frozen dataclass; presets are named instances; files hold the same fields: TOML or JSON
(optionally on top of a preset, ``preset = "mesa"``), or Mesa's own text format (``on gelu:`` sections of
``by_index:`` / ``enable:`` / ``level:`` / ``ema_decay:`` lines), so Mesa users can bring their files.
Unknown keys and bad values are errors that name the file, the line where known, and the key: a policy
that silently does nothing is worse than none (Mesa quietly disabled itself when its file was missing).

Layouts of the scale groups, by kind (see :meth:`Policy.quant_config`):

* attention tensors (``matmul`` operands and ``softmax`` outputs of rank 4, ``[B, H, T, D]``): per head
  (``head_groups = 0``) or ``head_groups`` groups of heads; the fused attention's ``q`` and ``k`` per head, with
  their own range, get a scale per 16 channels of a head (``slimact.functional._heads``);
* ``conv``, ``batchnorm`` and ``groupnorm`` inputs ``[N, C, ...]``: ``channel_groups`` groups along dim 1;
* everything else ``[..., C]``: ``channel_groups`` groups along the last dim.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import numbers
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from slimact._cache import cache
from slimact.quant.reference import QuantConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["KINDS", "LOSSLESS_KINDS", "PRESETS", "KindSettings", "Policy", "PolicyError"]

#: Layer kinds slimact can convert.
KINDS: tuple[str, ...] = (
    "linear", "conv", "batchnorm", "layernorm", "rmsnorm", "groupnorm", "matmul", "softmax", "gelu", "silu", "relu",
    "dropout", "mlp", "lmloss", "attention",
)
#: Kinds whose slimact form is exact when nothing is quantised (bit masks; outputs kept instead of inputs):
#: the ones a lossless policy (``quantize=False``, the ``"tempo"`` preset) converts.
LOSSLESS_KINDS: tuple[str, ...] = (
    "relu", "dropout", "layernorm", "rmsnorm", "groupnorm", "gelu", "silu", "mlp", "lmloss", "attention",
)
#: Kinds that pack no tensor whatever the policy (a dropout keeps its mask as bits, the LM loss keeps no logits):
#: ``per_kind`` compression settings of theirs would be ignored, so they are refused.
_PACKLESS_KINDS = ("dropout", "lmloss")
_HEADWISE_KINDS = ("matmul", "softmax", "attention")
_CHANNEL_FIRST_KINDS = ("conv", "batchnorm", "groupnorm")


class PolicyError(ValueError):
    """A policy (or policy file) that cannot be used as written."""



# Field checks, one table per class: (type, predicate, what the message says is expected). ``_checked`` applies
# them to the constructors' arguments and to the policy files' values alike (one code path, one message form:
# ``<where>: <field> must be <expected>, got <value>``, which ``_with_line`` finds the file line of).
_Check = tuple[type, Callable[[Any], bool], str]
_BITS = (8, 4, 2)
_SCALES = ("dynamic", "running")


def _every(ok: Callable[[str], bool]) -> Callable[[tuple[str, ...]], bool]:
    return lambda values: all(ok(v) for v in values)


def _is_kind(value: str) -> bool:
    return value in KINDS


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether one of the ``fnmatch`` ``patterns`` matches the qualified module name ``name`` or the name of a module
    above it: a pattern naming a block (``"transformer.h.0"``) covers every module inside it, as a user naming it
    means (``"model.layers.1*"`` also covers ``"model.layers.10"`` and its modules, as fnmatch does)."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), p) for i in range(1, len(parts) + 1) for p in patterns)


def _is_kind_index(entry: str) -> bool:
    return re.fullmatch(r"[a-z]+:\d+", entry) is not None and entry.split(":")[0] in KINDS


_COMMON: dict[str, _Check] = {
    "bits": (int, lambda v: v in _BITS, f"an int, one of {', '.join(map(str, _BITS))}"),
    "scale": (str, lambda v: v in _SCALES, " or ".join(map(repr, _SCALES))),
    # 0 is allowed: the estimate is then the previous tensor's range; 1 would never move.
    "ema_decay": (float, lambda v: 0.0 <= v < 1.0, "a float in [0, 1)"),
    "stochastic": (bool, bool.__instancecheck__, "a bool"),
    "quantize": (bool, bool.__instancecheck__, "a bool"),
}
_POLICY_FIELDS: dict[str, _Check] = {
    "name": (str, str.__instancecheck__, "a string"),
    **_COMMON,
    "channel_groups": (int, lambda v: v >= 1, "an int >= 1"),
    "head_groups": (int, lambda v: v >= 0, "an int >= 0 (0 = one per head)"),
    "kinds": (tuple, _every(_is_kind), f"a sequence of layer kinds ({', '.join(KINDS)})"),
    "include": (tuple, _every(str.__instancecheck__), "a sequence of fnmatch patterns (strings)"),
    "exclude": (tuple, _every(str.__instancecheck__), "a sequence of fnmatch patterns (strings)"),
    "exclude_index": (tuple, _every(_is_kind_index), "a sequence of 'kind:index' strings with a known kind"),
    "keep_logits": (bool, bool.__instancecheck__, "a bool"),
}
#: The :class:`KindSettings` fields that only say how a tensor is packed.
_COMPRESSION_FIELDS = ("bits", "scale", "ema_decay", "stochastic", "groups")
_KIND_FIELDS: dict[str, _Check] = {
    **_COMMON, "groups": (int, lambda v: v >= 0, "an int >= 0 (0 = one per channel or head)"),
}


def _normalised(kind: type, value: Any) -> tuple[bool, Any]:
    """``(fits, value)``: whether ``value`` is of ``kind`` (a bool is no int, an int is a float, a sequence
    of strings is a tuple of them), and the value as stored."""
    if kind is bool:
        return isinstance(value, bool), value
    if kind is int:
        fits = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return fits, int(value) if fits else value
    if kind is float:
        fits = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return fits, float(value) if fits else value
    if kind is tuple:
        fits = isinstance(value, (Sequence, AbstractSet)) and not isinstance(value, (str, bytes))
        return fits and all(isinstance(v, str) for v in value), tuple(value) if fits else value
    return isinstance(value, kind), value


def _checked(fields: dict[str, _Check], values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``values`` (field name -> value) checked against ``fields`` and normalised; ``None`` passes where the
    fields are optional (:class:`KindSettings`'). ``per_kind`` is checked as a table of kinds."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "per_kind" and fields is _POLICY_FIELDS:
            out[key] = _checked_per_kind(value, where)
            continue
        if key not in fields:
            raise PolicyError(f"{where}: unknown key {key!r}; known: {', '.join(fields)}")
        if value is None and fields is _KIND_FIELDS:
            out[key] = None
            continue
        kind, ok, expected = fields[key]
        fits, value = _normalised(kind, value)
        if not fits or not ok(value):
            raise PolicyError(f"{where}: {key} must be {expected}, got {values[key]!r}")
        out[key] = value
    return out


def _checked_per_kind(value: Any, where: str) -> tuple[tuple[str, KindSettings], ...]:
    """``per_kind`` (a mapping, or pairs, of layer kinds to :class:`KindSettings` or tables) as sorted pairs."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, str) and all(
        isinstance(item, tuple) and len(item) == 2 for item in value
    ):
        items = list(value)
    else:
        raise PolicyError(f"{where}: per_kind must be a table of layer kinds (kind -> settings), got {value!r}")
    out: dict[str, KindSettings] = {}
    for kind, settings in items:
        if kind not in KINDS:
            raise PolicyError(f"{where}: per_kind: unknown layer kind {kind!r}; known: {list(KINDS)}")
        if kind in out:
            raise PolicyError(f"{where}: per_kind: layer kind {kind!r} given twice")
        out[kind] = KindSettings.of(settings, f"{where}: per_kind.{kind}")
        if kind in _PACKLESS_KINDS:
            unused = next((f for f in _COMPRESSION_FIELDS if getattr(out[kind], f) is not None), None)
            if unused is not None:
                raise PolicyError(f"{where}: per_kind.{kind}: {unused} must be left unset: a {kind} packs no tensor "
                                  f"(it would be ignored); only quantize may be given")
    return tuple(sorted(out.items()))


def _set_checked(obj: Policy | KindSettings, where: str) -> None:
    """Check every field of a (frozen) ``obj`` as constructed, and store the normalised values."""
    fields = _POLICY_FIELDS if isinstance(obj, Policy) else _KIND_FIELDS
    names = [*fields, "per_kind"] if fields is _POLICY_FIELDS else list(fields)
    for key, value in _checked(fields, {n: getattr(obj, n) for n in names}, where).items():
        object.__setattr__(obj, key, value)


@dataclass(frozen=True)
class KindSettings:
    """Settings of one layer kind that override the policy's own (``None``: the policy's value).

    ``groups`` is the number of scale groups of that kind's tensors (0 = one per channel or head): channel groups;
    for ``matmul``, ``softmax`` and ``attention``, head groups of their ``[B, H, T, D]`` tensors, their tensors of
    any other rank taking the policy's ``channel_groups`` (a head count says nothing of a ``[B, T, C]`` tensor's
    channels). Every field is checked as
    :class:`Policy`'s are (:class:`PolicyError` naming the field, the value and what it must be).
    """

    bits: int | None = None
    scale: Literal["dynamic", "running"] | None = None
    ema_decay: float | None = None
    stochastic: bool | None = None
    groups: int | None = None
    quantize: bool | None = None

    def __post_init__(self) -> None:
        # Under torch.compile the only ones made are a checked policy's effective settings (``_settings``,
        # which dynamo traces into): checking them there would break the graph at every layer.
        if not torch.compiler.is_compiling():
            _set_checked(self, "KindSettings")

    @classmethod
    def of(cls, value: KindSettings | Mapping[str, Any], where: str) -> KindSettings:
        """``value`` itself, or the settings a table of them (a dict, as in a policy file) gives; errors start
        with ``where``."""
        if isinstance(value, KindSettings):
            return value
        if not isinstance(value, Mapping):
            raise PolicyError(f"{where} must be KindSettings or a table of {', '.join(_KIND_FIELDS)}, got {value!r}")
        return cls(**_checked(_KIND_FIELDS, value, where))


@dataclass(frozen=True)
class Policy:
    """How ``slimact.convert`` treats a model.

    Attributes:
        name: a label shown by ``summary``.
        bits: code width of compressed tensors (8; 4 and 2 where a layer supports them).
        scale: ``"dynamic"`` (each tensor's own per-group range) or ``"running"`` (Mesa's EMA estimate).
        ema_decay: decay of the running estimate.
        stochastic: stochastic (unbiased) rounding instead of round-to-nearest.
        channel_groups: scale groups along the channel dim (need not divide the channel count; an upper
            bound: a layer with fewer channels gets one group per channel).
        head_groups: scale groups along the head dim of ``[B, H, T, D]`` attention tensors; 0 = one per head.
        quantize: ``False`` keeps every tensor exact (only lossless techniques; the ``"tempo"`` preset).
        kinds: layer kinds to convert (see :data:`KINDS`).
        include: ``fnmatch`` patterns on qualified module names; if given, only the matching modules and the
            modules inside them convert (calls in model code are then routed only in the attention modules
            covered).
        exclude: patterns whose matches, and every module inside them, are left alone (their code's calls too).
        exclude_index: ``"kind:i"`` entries leaving alone the ``i``-th module of that kind (counted from 0
            in ``model.named_modules()`` order, as Mesa's ``by_index`` does, whatever the policy converts: a fused
            block's parts count, a Hugging Face attention module counts as an ``attention``, the LM loss is
            ``lmloss:0``; excluding a part of a fused block leaves the block unfused, as by name).
        per_kind: settings of single kinds overriding the ones above, ``{"attention": {"bits": 4},
            "gelu": {"quantize": False}}`` (:class:`KindSettings` or dicts; stored as sorted pairs). ``dropout`` and
            ``lmloss`` pack nothing: they take ``quantize`` alone. Fewer bits for one kind can keep more bytes, not
            fewer: a pack serves a later consumer of the same tensor only at that consumer's bits or more, so a
            4-bit GELU's codes no longer serve the next 8-bit Linear, which packs its own (GPT-2 with
            ``{"gelu": {"bits": 4}}``: 1.14x of ``"int8"``'s bytes); ``slimact.profile`` shows it.
        keep_logits: a language model called in training with labels computes its logits in the forward and
            returns them, as the plain model does. By default (``False``) its head and the loss run together
            in chunks and ``output.logits`` is a :class:`slimact.nn.lm_loss.LazyLogits` that computes them only
            if read (see :mod:`slimact.nn.lm_loss`). Either way the loss keeps no logits for the backward.
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
    per_kind: tuple[tuple[str, KindSettings], ...] = field(default=())
    keep_logits: bool = False

    def __post_init__(self) -> None:
        _set_checked(self, "Policy")

    def settings(self, kind: str) -> KindSettings:
        """The effective settings of ``kind``: its ``per_kind`` entry over the policy's own values."""
        return _settings(self, kind)

    @property
    def quantizes(self) -> bool:
        """Whether any enabled kind that packs tensors keeps them 8-bit (or fewer bits); ``False``: lossless.

        A ``quantize`` set on a kind that packs nothing (dropout, the LM loss) changes no byte, so it does not count.
        """
        return any(self.settings(k).quantize for k in self.kinds if k not in _PACKLESS_KINDS)

    def quant_config(self, kind: str, ndim: int) -> QuantConfig | None:
        """The compression of a rank-``ndim`` tensor saved by a layer of ``kind``; ``None``: keep it exact."""
        return _quant_config(self, kind, ndim) if self.settings(kind).quantize else None

    def skip_reason(self, kind: str, qualified_name: str, index: int = -1) -> str | None:
        """Why a module of ``kind`` named ``qualified_name`` (the ``index``-th of its kind) is left alone.

        ``None`` means: convert it.
        """
        if kind not in self.kinds:
            return f"kind {kind!r} not enabled by policy {self.name!r}"
        if self.include and not matches(qualified_name, self.include):
            return "not matched by policy include patterns"
        if matches(qualified_name, self.exclude):
            return "matched by policy exclude patterns"
        if f"{kind}:{index}" in self.exclude_index:
            return f"excluded by index ({kind}:{index})"
        if not self.settings(kind).quantize and kind not in LOSSLESS_KINDS:
            return f"policy {self.name!r} keeps {kind} tensors exact and a {kind} has no lossless saving yet"
        return None

    def replace(self, **changes: Any) -> Policy:
        """This policy with ``changes`` to its fields (checked as the constructor checks them)."""
        return dataclasses.replace(self, **changes)

    def to_file(self, path: str | os.PathLike[str]) -> Path:
        """Write this policy as TOML (every field), readable by :meth:`from_file`: ``path`` must end in ``.toml``."""
        lines = [f"# slimact policy {self.name!r}", ""]
        for f in dataclasses.fields(self):
            if f.name != "per_kind":
                lines.append(f"{f.name} = {_toml_value(getattr(self, f.name))}")
        for kind, settings in self.per_kind:
            lines += ["", f"[per_kind.{kind}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in dataclasses.asdict(settings).items() if v is not None]
        path = _toml_path(path)
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
        try:
            return cls._from_mapping(data, source=str(path))
        except PolicyError as e:
            raise PolicyError(_with_line(str(e), str(path), text)) from None

    @classmethod
    def _from_mapping(cls, data: dict[str, Any], source: str) -> Policy:
        data = dict(data)
        preset = data.pop("preset", "int8")
        if preset not in PRESETS:
            raise PolicyError(f"{source}: preset must be one of {', '.join(map(repr, PRESETS))}, got {preset!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = next((key for key in data if key not in known), None)
        if unknown is not None:
            raise PolicyError(f"{source}: unknown key {unknown!r}; known: preset, {', '.join(known)}")
        data.setdefault("name", Path(source).stem)
        return _replace_checked(PRESETS[preset], data, source)


def _replace_checked(base: Policy, changes: dict[str, Any], source: str) -> Policy:
    """``base`` with ``changes`` read from ``source``: checked as the constructor checks them, errors naming
    ``source``."""
    return base.replace(**_checked(_POLICY_FIELDS, changes, source))


def _with_line(message: str, source: str, text: str) -> str:
    """``message`` about ``source`` with the line of the key it names added (``file:line: ...``): a quoted
    ``key 'k'`` or ``kind 'k'``, or ``k must ...``; inside ``per_kind.<kind>:`` the search starts at that
    kind's table."""
    prefix = f"{source}: "
    if not message.startswith(prefix):
        return message
    body = message[len(prefix):]
    section = re.match(r"per_kind\.(\w+): ", body)
    key = re.search(r"(?:key|kind) '([^']+)'|(?:^|: )(\w+) must", body)
    if key is None:
        return message
    lines = text.splitlines()
    first = 0
    if section is not None:
        first = next((i for i, line in enumerate(lines) if re.search(rf'per_kind\.{section[1]}\b|"{section[1]}"\s*:',
                                                                         line)), 0)
    name = re.escape(key.group(1) or key.group(2))
    for no in range(first, len(lines)):
        if re.search(rf'(^|[\s{{,.\[])"?{name}"?\s*[\]=:]', lines[no]):
            return f"{source}:{no + 1}: {body}"
    return message


def _toml_path(path: str | os.PathLike[str]) -> Path:
    """``path`` for :meth:`Policy.to_file`, which writes TOML; a :class:`PolicyError` unless its suffix is ``.toml``
    (:meth:`Policy.from_file` reads a file by its suffix: any other it would refuse)."""
    path = Path(path)
    if path.suffix.lower() != ".toml":
        raise PolicyError(f"{str(path)!r}: a policy is written as TOML, to a file ending in .toml")
    return path


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(json.dumps(v) for v in value) + "]"


def _running(policy: Policy) -> bool:
    """Whether ``policy`` packs some tensors with a running estimate of their range (``scale="running"``, Mesa)."""
    return any(policy.settings(k).quantize and policy.settings(k).scale == "running" for k in policy.kinds)


@cache(maxsize=256)
def _settings(policy: Policy, kind: str) -> KindSettings:
    own = dict(policy.per_kind).get(kind, KindSettings())
    headwise = kind in _HEADWISE_KINDS
    return KindSettings(
        bits=policy.bits if own.bits is None else own.bits,
        scale=policy.scale if own.scale is None else own.scale,
        ema_decay=policy.ema_decay if own.ema_decay is None else own.ema_decay,
        stochastic=policy.stochastic if own.stochastic is None else own.stochastic,
        groups=(policy.head_groups if headwise else policy.channel_groups) if own.groups is None else own.groups,
        quantize=policy.quantize if own.quantize is None else own.quantize,
    )


@cache(maxsize=256)
def _quant_config(policy: Policy, kind: str, ndim: int) -> QuantConfig:
    s = _settings(policy, kind)
    if (kind in _HEADWISE_KINDS and ndim == 4) or (kind in _CHANNEL_FIRST_KINDS and ndim >= 2):
        group_dim, groups = 1, s.groups
    else:  # [..., C]; the other tensors of a head-wise kind (an attention input) get the policy's channel groups
        group_dim, groups = -1, policy.channel_groups if kind in _HEADWISE_KINDS else s.groups
    # clamp_groups: one group count serves layers of every width (the default 8 on a 4-feature Linear gives 4).
    return QuantConfig(bits=s.bits, group_dim=group_dim, groups=groups, scale=s.scale, decay=s.ema_decay,
                       stochastic=s.stochastic, clamp_groups=True)


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
    ``exclude_index`` entries; ``level`` (256, 16, 4) sets the tag's ``bits`` and ``ema_decay`` its decay
    (``per_kind``), from an ``all`` block (in a disabling block they are moot; in an enabling block of indices,
    per-layer settings, refused). Unlisted tags stay off, as in Mesa. Mesa's running estimates and stochastic
    rounding are the base. ``matmul`` and ``softmax`` both enabled also enable kind ``attention`` (slimact's fused
    attention, which computes both), with ``matmul``'s settings.
    """
    base = PRESETS["mesa"]
    kinds: list[str] = []
    excluded: list[str] = []
    settings: dict[str, dict[str, Any]] = {}
    tag: str | None = None
    block: dict[str, Any] | None = None
    sections: dict[str, int] = {}  # tag -> the line of its 'on <tag>:'

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
            if block["settings"]:
                settings.setdefault(kind, {}).update(block["settings"])
        elif not enable:
            # (a level or decay here is for layers kept exact: it sets nothing, and must not reach the tag's others)
            excluded.extend(f"{kind}:{i}" for i in block["by_index"])
        elif kind not in kinds:
            raise PolicyError(
                f"{source}:{block['line']}: enabling only some {tag!r} layers by index is not supported; "
                "enable 'all' and disable the others by index"
            )
        elif block["settings"]:  # settings are per kind here: applied to the tag, they would change every layer
            key, no = next(iter(block["lines"].items()))
            raise PolicyError(f"{source}:{no}: {key} for only some {tag!r} layers (by index) is not supported; "
                              "set it in the 'by_index: all' block")

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
            if words[1] in sections:  # (the second would silently win over the first's settings)
                raise PolicyError(f"{source}:{no}: a second 'on {words[1]}:' section (the first at line "
                                  f"{sections[words[1]]}): give each tag one")
            tag, block = words[1], None
            sections[tag] = no
            continue
        if tag is None:
            raise PolicyError(f"{source}:{no}: {head!r} before any 'on <tag>:' line")
        if head == "by_index":
            close_block()
            try:
                indices = "all" if value == "all" else [int(v) for v in value.replace(",", " ").split()]
            except ValueError:
                raise PolicyError(f"{source}:{no}: by_index must be 'all' or indices, got {value!r}") from None
            block = {"by_index": indices, "line": no, "settings": {}, "lines": {}}
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
                block["settings"]["bits"] = _MESA_LEVELS[int(value)]
            else:
                block["settings"]["ema_decay"] = float(value)
            if head != "enable":
                block["lines"][head] = no
        except (ValueError, KeyError):
            raise PolicyError(f"{source}:{no}: bad value for {head!r}: {value!r}") from None
    close_block()
    if not sections:
        raise PolicyError(f"{source}: no 'on <tag>:' section: a Mesa policy that names no layer converts nothing")
    if "matmul" in kinds and "softmax" in kinds and "attention" not in kinds:
        # Mesa's attention is its MatMul and Softmax modules; slimact's fused attention (transformers'
        # AttentionInterface, nn.MultiheadAttention, F.scaled_dot_product_attention) is kind "attention", which a
        # file enabling both meant too (a BERT kept its attention exact: 98,304 bytes where "mesa" keeps 22,592).
        kinds.append("attention")
        if "matmul" in settings:
            settings["attention"] = dict(settings["matmul"])
    return _replace_checked(
        base, {"name": Path(source).stem, "kinds": kinds, "exclude_index": excluded, "per_kind": settings}, source
    )


PRESETS: dict[str, Policy] = {
    # Lossless techniques only: gradients equal the exact ones up to float rounding. GroupNorm aside: its lossless
    # form keeps its output instead of its input, which saves nothing before a lossless SiLU (that keeps its own
    # output, shared with the next conv: GroupNorm -> SiLU -> Conv keeps two tensors either way) and adds a tensor
    # where a shortcut conv keeps the input anyway (a tiny diffusers UNet: 0.756x of plain's bytes -> 0.793x). A
    # policy may still name it (``kinds``): where the next layer keeps the output (GroupNorm -> Conv) it saves 4
    # bytes per element.
    "tempo": Policy(name="tempo", quantize=False, kinds=tuple(k for k in KINDS if k != "groupnorm")),
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
