import copy
import dataclasses
import re

import pytest

import slimact
from slimact import Policy, PolicyError
from slimact.policy import _toml_value


def test_presets_and_frozen():
    assert set(slimact.PRESETS) >= {"tempo", "mesa", "int8"}
    mesa = slimact.PRESETS["mesa"]
    assert mesa.scale == "running" and mesa.ema_decay == 0.9 and mesa.stochastic and mesa.bits == 8
    assert not slimact.PRESETS["tempo"].quantize
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesa.bits = 4


def test_quant_config_follows_policy():
    policy = Policy(bits=4, channel_groups=3, head_groups=2, stochastic=True)
    cfg = policy.quant_config("linear", 3)
    assert (cfg.bits, cfg.groups, cfg.stochastic, cfg.group_dim) == (4, 3, True, -1)
    assert (policy.quant_config("matmul", 4).group_dim, policy.quant_config("matmul", 4).groups) == (1, 2)
    assert policy.quant_config("softmax", 3).group_dim == -1  # not an attention map: channel groups
    assert (policy.quant_config("conv", 4).group_dim, policy.quant_config("conv", 4).groups) == (1, 3)
    assert Policy().quant_config("softmax", 4).groups == 0  # default: one group per head


@pytest.mark.parametrize(
    "kwargs", [{"bits": 3}, {"scale": "ema"}, {"kinds": ("linear", "warp")}, {"channel_groups": 0}, {"include": "x"}]
)
def test_bad_policy_is_an_error(kwargs):
    with pytest.raises(PolicyError):
        Policy(**kwargs)


def test_from_toml_and_json(tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text('preset = "mesa"\nbits = 4\nexclude = ["lm_head"]\nema_decay = 1\n', encoding="utf-8")
    with pytest.raises(PolicyError, match="ema_decay"):
        Policy.from_file(toml)
    toml.write_text('preset = "mesa"\nbits = 4\nexclude = ["lm_head"]\n', encoding="utf-8")
    p = Policy.from_file(toml)
    assert (p.bits, p.scale, p.exclude, p.name) == (4, "running", ("lm_head",), "p")
    js = tmp_path / "q.json"
    js.write_text('{"channel_groups": 2}', encoding="utf-8")
    assert Policy.from_file(js).channel_groups == 2
    assert slimact.policy.resolve(str(js)).channel_groups == 2


def test_to_file_writes_only_what_from_file_reads(tmp_path, capsys):
    # to_file wrote TOML under any name, and from_file refused the file it wrote ("unknown policy file type").
    with pytest.raises(PolicyError, match=r"a policy is written as TOML, to a file ending in \.toml"):
        slimact.PRESETS["int8"].to_file(tmp_path / "p.policy")
    assert not (tmp_path / "p.policy").exists()
    # slimact fit says so before it measures anything
    from slimact.cli import main

    for name in ("p.policy", ".toml"):  # (".toml" is a name with no suffix, as to_file reads it)
        with pytest.raises(SystemExit) as exited:
            main(["fit", "--model", "gpt2", "--tiny", "--budget", "8MiB", "--out", str(tmp_path / name)])
        assert exited.value.code == 2
        assert "a policy is written as TOML, to a file ending in .toml" in capsys.readouterr().err


def test_a_mesa_text_file_enabling_matmul_and_softmax_compresses_fused_attention(tmp_path):
    # Mesa's attention is its MatMul and Softmax modules; a file enabling both left a Hugging Face model's attention
    # (kind "attention") exact: BERT kept 98,304 bytes there where the "mesa" preset keeps 22,592.
    pytest.importorskip("transformers")
    from _harness import tiny_hf

    f = tmp_path / "policy.txt"
    f.write_text("".join(f"on {tag}:\n    by_index: all\n    enable: True\n    level: 16\n"
                         for tag in ("fc", "layernorm", "matmul", "softmax")), encoding="utf-8")
    policy = Policy.from_file(f)
    assert "attention" in policy.kinds and policy.settings("attention").bits == 4
    plain, inputs = tiny_hf("bert")
    kept = slimact.profile(slimact.convert(plain, f), inputs).by_kind
    assert 0 < kept["attention"] < slimact.profile(slimact.revert(plain), inputs).by_kind["attention"] / 4


@pytest.mark.parametrize(
    "text,match",
    [
        ("bitz = 8\n", "unknown key 'bitz'"),
        ('bits = "8"\n', "bits must be an int, one of 8, 4, 2, got '8'"),
        ("bits = \n", "p.toml"),
    ],
)
def test_file_errors_name_file_and_key(tmp_path, text, match):
    f = tmp_path / "p.toml"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError, match=match) as e:
        Policy.from_file(f)
    assert str(f) in str(e.value)


def test_missing_file_and_unknown_preset_are_errors(tmp_path):
    with pytest.raises(PolicyError, match="does not exist"):
        slimact.convert(__import__("torch").nn.Linear(2, 2), tmp_path / "nope.toml")
    with pytest.raises(PolicyError, match="unknown policy"):
        slimact.policy.resolve("int9")


MESA_FILE = """\
# a Mesa policy file, as its README writes them
on gelu: # layer tag
    by_index: all # layer index
    enable: True
    level: 256
    ema_decay: 0.9

    by_index: 1 # exclude the GELU with index 1
    enable: False

on layernorm:
    by_index: all
    enable: True
    ema_decay: 0.8
"""


def test_mesa_text_file_enabling_only_gelu_and_layernorm_converts_only_those(tmp_path):
    import torch
    from torch import nn

    f = tmp_path / "policy.txt"
    f.write_text(MESA_FILE, encoding="utf-8")
    policy = Policy.from_file(f)
    assert policy.kinds == ("gelu", "layernorm")
    assert policy.exclude_index == ("gelu:1",)
    assert (policy.scale, policy.stochastic) == ("running", True)
    # Mesa's level and ema_decay are per layer tag: per-kind settings.
    assert (policy.settings("gelu").bits, policy.settings("gelu").ema_decay) == (8, 0.9)
    assert policy.settings("layernorm").ema_decay == 0.8

    def block():
        return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.Softmax(-1), nn.ReLU(), nn.Dropout())

    model = slimact.convert(nn.Sequential(block(), block(), block()), f)
    converted = {n: m._slimact_kind for n, m in model.named_modules() if isinstance(m, slimact.nn.SlimModule)}
    assert converted == {"0.0": "layernorm", "0.2": "gelu", "1.0": "layernorm", "2.0": "layernorm", "2.2": "gelu"}
    assert slimact.summary(model).skipped["1.2"] == "excluded by index (gelu:1)"
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()


@pytest.mark.parametrize(
    "text,match",
    [
        ("on attention:\n  by_index: all\n  enable: True\n", r"p.txt:1: unknown Mesa layer tag"),
        ("on gelu:\n  by_index: all\n  enable: maybe\n", r"p.txt:3: bad value for 'enable'"),
        ("on gelu:\n  by_index: all\n  level: 100\n", r"p.txt:3: bad value for 'level'"),
        ("on gelu:\n  by_index: all\n  groups: 3\n", r"p.txt:3: unknown key 'groups'"),
        ("on gelu:\n  enable: True\n", r"p.txt:2: 'enable' before a 'by_index:' line"),
        ("by_index: all\n", r"p.txt:1: 'by_index' before any 'on <tag>:' line"),
        ("on gelu:\n  by_index: 2\n  enable: True\n", r"p.txt:2: enabling only some 'gelu' layers"),
        ("# nothing but a comment\n\n", r"p.txt: no 'on <tag>:' section"),
        ("on gelu:\n  by_index: all\n  enable: True\non gelu:\n  by_index: all\n  enable: False\n",
         r"p.txt:4: a second 'on gelu:' section \(the first at line 1\)"),
    ],
)
def test_mesa_text_errors_name_file_and_line(tmp_path, text, match):
    f = tmp_path / "p.txt"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError, match=match):
        Policy.from_file(f)


def test_per_kind_settings_override_the_policy_for_that_kind_only():
    p = Policy(per_kind={"attention": {"bits": 4, "groups": 2}, "gelu": {"quantize": False},
                         "linear": slimact.KindSettings(scale="running", stochastic=True)})
    att = p.quant_config("attention", 4)
    assert (att.bits, att.group_dim, att.groups) == (4, 1, 2)
    assert p.quant_config("gelu", 3) is None  # kept exact: the lossless in-place form
    lin = p.quant_config("linear", 3)
    assert (lin.bits, lin.scale, lin.stochastic, lin.groups) == (8, "running", True, 8)
    assert p.quant_config("layernorm", 3) == Policy().quant_config("layernorm", 3)
    # Off for one kind that has no lossless form: that kind is left alone, with the reason.
    assert "no lossless saving" in Policy(per_kind={"linear": {"quantize": False}}).skip_reason("linear", "fc")
    assert hash(p) == hash(Policy(per_kind=dict(reversed(list(dict(p.per_kind).items())))))


def test_per_kind_settings_reach_the_converted_layers():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
    x = torch.randn(16, 64, requires_grad=True)
    default = slimact.profile(slimact.convert(copy.deepcopy(model)), x).by_kind
    four = slimact.profile(slimact.convert(copy.deepcopy(model), Policy(per_kind={"gelu": {"bits": 4}})), x).by_kind
    assert four["gelu"] < default["gelu"] and four["linear"] == default["linear"]


def test_per_kind_toml_round_trip(tmp_path):
    p = Policy(name="mixed", per_kind={"attention": {"bits": 4}, "gelu": {"quantize": False, "groups": 3}})
    q = Policy.from_file(p.to_file(tmp_path / "mixed.toml"))
    assert q == p


@pytest.mark.parametrize(
    "text,match,line",
    [
        ("[per_kind.gelux]\nbits = 4\n", "unknown layer kind 'gelux'", 1),
        ("[per_kind.gelu]\nbits = 4\nbitz = 4\n", "per_kind.gelu: unknown key 'bitz'", 3),
        ('bits = 8\n[per_kind.gelu]\nbits = "4"\n', "per_kind.gelu: bits must be an int", 3),
        ("bits = 8\n\n[per_kind.gelu]\nbits = 5\n", "per_kind.gelu: bits must be an int, one of 8, 4, 2, got 5", 4),
        ('[per_kind.attention]\nscale = "runing"\n', "scale must be 'dynamic' or 'running'", 2),
        ("per_kind = 3\n", "per_kind must be a table", 1),
    ],
)
def test_per_kind_file_errors_name_file_line_and_key(tmp_path, text, match, line):
    f = tmp_path / "p.toml"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError, match=match) as e:
        Policy.from_file(f)
    assert str(e.value).startswith(f"{f}:{line}: "), str(e.value)


# Every field, a value of the wrong type and (where the type has values outside the field's range) one out of
# range: each is refused at construction, naming the field and the value.
_BAD_POLICY_FIELDS = [
    ("name", 3), ("bits", "8"), ("bits", True), ("bits", 8.0), ("bits", 3), ("bits", 16), ("scale", 1),
    ("scale", "ema"), ("ema_decay", "0.9"), ("ema_decay", True), ("ema_decay", 1.0), ("ema_decay", -0.1),
    ("ema_decay", float("nan")), ("ema_decay", float("inf")), ("stochastic", "yes"), ("stochastic", 1),
    ("stochastic", None), ("channel_groups", True), ("channel_groups", 2.0), ("channel_groups", "2"),
    ("channel_groups", 0), ("channel_groups", -1), ("head_groups", True), ("head_groups", 1.5), ("head_groups", -1),
    ("quantize", "no"), ("quantize", 0), ("kinds", "linear"), ("kinds", ("linear", 3)), ("kinds", ("linear", "warp")),
    ("include", "x"), ("include", (1,)), ("exclude", "x"), ("exclude", [None]), ("exclude_index", "gelu:1"),
    ("exclude_index", (1,)), ("exclude_index", ("gelu",)), ("exclude_index", ("warp:1",)),
    ("exclude_index", ("gelu:-1",)),
]


@pytest.mark.parametrize("field,value", _BAD_POLICY_FIELDS, ids=[f"{f}={v!r}" for f, v in _BAD_POLICY_FIELDS])
def test_every_policy_field_is_checked_at_construction(field, value):
    with pytest.raises(PolicyError, match=rf"^Policy: {field} must be .*, got {re.escape(repr(value))}$"):
        Policy(**{field: value})
    with pytest.raises(PolicyError, match=rf"^Policy: {field} must be "):
        slimact.PRESETS["mesa"].replace(**{field: value})


_BAD_KIND_FIELDS = [
    ("bits", "4"), ("bits", True), ("bits", 5), ("scale", 3), ("scale", "ema"), ("ema_decay", "x"),
    ("ema_decay", 1.5), ("stochastic", 1), ("stochastic", "yes"), ("groups", True), ("groups", 2.5), ("groups", -1),
    ("quantize", "no"), ("quantize", 1),
]


@pytest.mark.parametrize("field,value", _BAD_KIND_FIELDS, ids=[f"{f}={v!r}" for f, v in _BAD_KIND_FIELDS])
def test_every_kind_settings_field_is_checked_as_object_and_as_table(field, value):
    shown = re.escape(repr(value))
    with pytest.raises(PolicyError, match=rf"^KindSettings: {field} must be .*, got {shown}$"):
        slimact.KindSettings(**{field: value})
    with pytest.raises(PolicyError, match=rf"^Policy: per_kind\.gelu: {field} must be .*, got {shown}$"):
        Policy(per_kind={"gelu": {field: value}})


@pytest.mark.parametrize(
    "per_kind,match",
    [
        (3, "per_kind must be a table of layer kinds"),
        ("gelu", "per_kind must be a table of layer kinds"),
        ([("gelu",)], "per_kind must be a table of layer kinds"),
        ({"warp": {}}, "per_kind: unknown layer kind 'warp'"),
        ({3: {}}, "per_kind: unknown layer kind 3"),
        ({"gelu": {"bitz": 4}}, "per_kind.gelu: unknown key 'bitz'"),
        ({"gelu": 4}, "per_kind.gelu must be KindSettings or a table"),
        ([("gelu", {}), ("gelu", {"bits": 4})], "layer kind 'gelu' given twice"),
    ],
)
def test_per_kind_table_is_checked(per_kind, match):
    with pytest.raises(PolicyError, match=match):
        Policy(per_kind=per_kind)


def test_checked_fields_are_stored_normalised():
    p = Policy(ema_decay=0, kinds=["linear", "gelu"], include={"a*"}, per_kind={"gelu": {"ema_decay": 1 // 2}})
    assert p.ema_decay == 0.0 and isinstance(p.ema_decay, float)
    assert (p.kinds, p.include) == (("linear", "gelu"), ("a*",))
    assert p.settings("gelu").ema_decay == 0.0 and isinstance(p.settings("gelu").ema_decay, float)
    assert hash(p) == hash(Policy(ema_decay=0.0, kinds=("linear", "gelu"), include=("a*",),
                                  per_kind=(("gelu", slimact.KindSettings(ema_decay=0.0)),)))


# The constructions the repository itself makes (src and tests): all still valid.
_VALID = [
    {}, {"name": "exact", "quantize": False}, {"exclude": ("*.fc2",)}, {"kinds": ("linear",)},
    {"bits": 4, "channel_groups": 3, "head_groups": 2, "stochastic": True},
    {"per_kind": {"attention": {"bits": 4, "groups": 2}, "gelu": {"quantize": False},
                  "linear": slimact.KindSettings(scale="running", stochastic=True)}},
    {"per_kind": {"linear": {"quantize": False}}}, {"per_kind": {"gelu": {"bits": 4}}},
    {"name": "mixed", "per_kind": {"attention": {"bits": 4}, "gelu": {"quantize": False, "groups": 3}}},
    {"kinds": tuple(k for k in slimact.policy.KINDS if k not in ("dropout", "gelu", "linear"))},
    {"bits": 2, "scale": "running", "ema_decay": 0.0, "head_groups": 0, "exclude_index": ("gelu:1", "linear:0")},
]


@pytest.mark.parametrize("kwargs", _VALID)
def test_existing_constructions_and_presets_stay_valid(kwargs, tmp_path):
    p = Policy(**kwargs)
    assert Policy.from_file(p.to_file(tmp_path / "p.toml")) == p
    for name, preset in slimact.PRESETS.items():
        assert preset.replace(**kwargs) == Policy(**{**dataclasses.asdict(preset), "per_kind": preset.per_kind,
                                                      **kwargs})
        assert Policy.from_file(preset.to_file(tmp_path / f"{name}.toml")) == preset


@pytest.mark.parametrize("kind", ["dropout", "lmloss"])
@pytest.mark.parametrize("setting", [{"bits": 4}, {"scale": "running"}, {"ema_decay": 0.5}, {"stochastic": True},
                                     {"groups": 2}])
def test_per_kind_compression_settings_of_a_kind_that_compresses_nothing_are_an_error(kind, setting, tmp_path):
    # A dropout keeps its mask as bits and the LM loss keeps no logits: neither packs a tensor, so these settings
    # would be ignored (Policy(per_kind={"dropout": {"bits": 2}}) converted and trained as "int8" does, silently).
    (field,) = setting
    with pytest.raises(PolicyError, match=rf"^Policy: per_kind\.{kind}: {field} must be left unset: "):
        Policy(per_kind={kind: setting})
    f = tmp_path / "p.toml"
    f.write_text(f"bits = 8\n\n[per_kind.{kind}]\n{field} = {_toml_value(setting[field])}\n", encoding="utf-8")
    with pytest.raises(PolicyError, match=rf"^{re.escape(str(f))}:4: per_kind\.{kind}: {field} must be left unset"):
        Policy.from_file(f)
    assert Policy(per_kind={kind: {"quantize": False}}).settings(kind).quantize is False  # (exact either way)


def test_a_level_or_decay_in_a_by_index_block_never_reaches_the_other_layers_of_the_tag(tmp_path):
    # Mesa's level and ema_decay lines belong to their by_index block; slimact's settings are per kind, and a level in
    # a block of indices was applied to every layer of the tag: "by_index: 1 / enable: False / level: 16" made every
    # other GELU 4-bit, silently.
    f = tmp_path / "p.txt"
    f.write_text("on gelu:\n  by_index: all\n  enable: True\n  level: 256\n  ema_decay: 0.9\n"
                 "  by_index: 1\n  enable: False\n  level: 16\n  ema_decay: 0.5\n", encoding="utf-8")
    policy = Policy.from_file(f)  # (the layers of a disabling block are kept exact: its level means nothing)
    assert policy.exclude_index == ("gelu:1",)
    assert (policy.settings("gelu").bits, policy.settings("gelu").ema_decay) == (8, 0.9)
    for line in ("level: 16", "ema_decay: 0.5"):
        f.write_text(f"on gelu:\n  by_index: all\n  enable: True\n  by_index: 1 2\n  enable: True\n  {line}\n",
                     encoding="utf-8")
        with pytest.raises(PolicyError, match=rf"p.txt:6: {line.split(':')[0]} for only some 'gelu' layers"):
            Policy.from_file(f)
