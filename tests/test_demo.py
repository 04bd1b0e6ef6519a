"""The demo's --quick run: the bounds the full run is held to, loosened to its length (40 text steps, 200
digits steps); the full run's figures are committed under docs/demo."""

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from slimact.demo import run_demo


@pytest.mark.slow
@pytest.mark.parametrize("task", ["text", "digits"])  # (one task a worker: make test's two end together)
def test_quick_demo(tmp_path, task):
    results = {r.policy: r for r in run_demo(tmp_path, quick=True, tasks=(task,))}
    assert set(results) == {"plain", "tempo", "int8"}
    for name in ("demo.png", "demo.md", "demo.csv"):
        assert (tmp_path / name).stat().st_size > 0
    if task == "text":
        # tempo is exact: the same training to float rounding; int8 within 5% (2% on the full run).
        assert abs(results["tempo"].final_loss / results["plain"].final_loss - 1) <= 0.005
        assert abs(results["tempo"].heldout_loss / results["plain"].heldout_loss - 1) <= 0.005
        assert abs(results["int8"].final_loss / results["plain"].final_loss - 1) <= 0.05
        assert abs(results["int8"].heldout_loss / results["plain"].heldout_loss - 1) <= 0.05
    else:
        assert results["plain"].accuracy >= 0.6  # it learns in 200 steps
        assert abs(results["int8"].accuracy - results["plain"].accuracy) <= 0.06  # 1.5 points on the full run
    plain = results["plain"].activation_bytes
    assert results["int8"].activation_bytes <= 0.25 * plain
    assert results["tempo"].activation_bytes < plain


def test_an_unknown_task_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="the demo's tasks are"):
        run_demo(tmp_path, quick=True, tasks=("audio",))
