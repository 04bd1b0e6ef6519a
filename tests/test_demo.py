"""The demo's --quick run: the bounds the full run is held to, loosened to its length (40 text steps, 200
digits steps); the full run's figures are committed under docs/demo."""

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from slimact.demo import run_demo


@pytest.mark.slow
def test_quick_demo(tmp_path):
    results = {(r.task, r.policy): r for r in run_demo(tmp_path, quick=True)}
    for name in ("demo.png", "demo.md", "demo.csv"):
        assert (tmp_path / name).stat().st_size > 0
    text = {p: results[("text", p)] for p in ("plain", "tempo", "int8")}
    # tempo is exact: the same training to float rounding; int8 within 5% (2% on the full run).
    assert abs(text["tempo"].final_loss / text["plain"].final_loss - 1) <= 0.005
    assert abs(text["tempo"].heldout_loss / text["plain"].heldout_loss - 1) <= 0.005
    assert abs(text["int8"].final_loss / text["plain"].final_loss - 1) <= 0.05
    assert abs(text["int8"].heldout_loss / text["plain"].heldout_loss - 1) <= 0.05
    digits = {p: results[("digits", p)] for p in ("plain", "tempo", "int8")}
    assert digits["plain"].accuracy >= 0.6  # it learns in 200 steps
    assert abs(digits["int8"].accuracy - digits["plain"].accuracy) <= 0.06  # 1.5 points on the full run
    for task in ("text", "digits"):
        plain = results[(task, "plain")].activation_bytes
        assert results[(task, "int8")].activation_bytes <= 0.25 * plain
        assert results[(task, "tempo")].activation_bytes < plain
