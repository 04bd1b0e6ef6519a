import dataclasses

import pytest

import slimact
from slimact import Policy, PolicyError


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


@pytest.mark.parametrize(
    "text,match",
    [("bitz = 8\n", "unknown key 'bitz'"), ('bits = "8"\n', "key 'bits' must be int"), ("bits = \n", "p.toml")],
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
