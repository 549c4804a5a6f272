"""notebooks/sweep_analysis.ipynb runs headless through papermill from the repository root, as the README says,
against the CPU sweep of tests/sweep.py and against the committed H200 grid, and renders its figures."""

from __future__ import annotations

import pytest

from tests.sweep import ROOT, ensure_sweep

pytestmark = pytest.mark.slow  # papermill runs the notebook

papermill = pytest.importorskip("papermill")
nbformat = pytest.importorskip("nbformat")

H200_GRID = "experiments/grid_30b/records/h200_1gpu/2026-11-30_09-27"


def execute(sweep: str, tmp_path) -> list:
    """Run the notebook with ``SWEEP`` set to ``sweep``; its code cells' outputs, none of them an error."""
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(
        ROOT / "notebooks" / "sweep_analysis.ipynb",
        out,
        parameters={"SWEEP": sweep},
        cwd=ROOT,
        kernel_name="python3",
        progress_bar=False,
    )
    nb = nbformat.read(out, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs


def text(outputs) -> str:
    return "".join(o.get("text", "") for o in outputs)


def html(outputs) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in outputs)


def test_notebook_executes_on_a_real_sweep(shared_tmp_path, tmp_path):
    outputs = execute(str(ensure_sweep(shared_tmp_path)), tmp_path)
    # speed/MFU bars, Pareto scatter, breakdown, loss curves, their differences, expert load per layer and over steps
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 6
    assert "12 points: 6 invalid, 4 ok, 1 oom, 1 error" in text(outputs)
    assert "injected by tests/sweep.py" in html(outputs)  # the failed points' table
    assert "no point ran on a GPU the planner has a profile of" in text(outputs)  # a CPU sweep: nothing to plan


def test_notebook_executes_on_the_committed_h200_grid_by_its_relative_path(tmp_path):
    outputs = execute(H200_GRID, tmp_path)  # relative to the repository root, papermill's working directory
    # speed/MFU bars, Pareto scatter, breakdown, loss curves, their differences, planned vs measured; recorded before
    # expert_load: no load figure
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 6
    assert "max |difference|" in html(outputs)
    assert "no expert_load in these records" in text(outputs)
    assert "s_per_step planned" in html(outputs) and "peak_gpu_mem_gib error %" in html(outputs)
    assert "12 points: 12 ok; axes: ['offload', 'ac', 'dispatcher']" in text(outputs)


def test_notebook_executes_on_committed_plans(tmp_path):
    """A sweep of plans (kind plan: no steps, so no loss curve) reads as a sweep of runs, its curves left out."""
    outputs = execute("experiments/plan/records/h200_1gpu", tmp_path)
    assert "fewer than two ok points with a loss curve (a plan has none): nothing to compare" in text(outputs)
