import pytest

import slimact
from slimact.fit import fit, parse_bytes

transformers = pytest.importorskip("transformers")


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="size"):
        parse_bytes("8 parsecs")


def _zoo(name):
    from slimact.zoo import build, example_inputs

    model = build(name, layers=1)
    return model, (lambda b: example_inputs(model, b, 16))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_prediction_within_5_percent_of_profile_at_the_chosen_batch(name):
    model, make = _zoo(name)
    report = fit(model, make, "4GiB", policies=("plain", "int8"))  # 1-layer models: ~1.5 GiB of static state
    for row in report.rows:
        batch = min(row.max_batch, 6)  # the chosen batch, capped to keep the check fast
        assert batch >= 1
        if row.policy != "plain":
            slimact.convert(model, row.policy)
        measured = slimact.profile(model, make(batch)).activation_bytes
        slimact.revert(model)
        assert abs(row.predicted(batch) - measured) <= 0.05 * measured, row
        assert row.affine_error <= 0.02


def test_auto_picks_tempo_when_it_suffices_and_int8_only_when_needed():
    model, make = _zoo("gpt2")
    probe = fit(model, make, "64GiB")
    rows = {r.policy: r for r in probe.rows}
    tempo, int8 = rows["tempo"], rows["int8"]
    assert int8.per_sample < tempo.per_sample < rows["plain"].per_sample
    batch = 8

    def budget_for(row, b):  # the bytes at which `row` fits exactly b samples
        return probe.static + row.predicted(b)

    candidates = ("tempo", "int8")
    enough_for_tempo = budget_for(tempo, batch) + 1
    assert fit(model, make, enough_for_tempo, batch=batch, policies=candidates).chosen == "tempo"
    between = (budget_for(int8, batch) + budget_for(tempo, batch)) // 2
    assert fit(model, make, between, batch=batch, policies=candidates).chosen == "int8"
    too_small = budget_for(int8, batch) - int8.per_sample
    assert fit(model, make, too_small, batch=batch, policies=candidates).chosen is None


def test_policy_written_by_fit_reads_back(tmp_path):
    path = slimact.PRESETS["int8"].to_file(tmp_path / "p.toml")
    assert slimact.Policy.from_file(path).replace(name="int8") == slimact.PRESETS["int8"]
