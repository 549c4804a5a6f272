"""notebooks/sweep_analysis.ipynb executes against the CPU sweep of tests/sweep.py, and against the committed H200
grid, and renders its figures."""

from __future__ import annotations

import pytest

from tests.sweep import ROOT, ensure_sweep

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def execute(sweep_dir) -> list:
    """Run the notebook with ``SWEEP`` set to ``sweep_dir``; its code cells' outputs, none of them an error."""
    nb = nbformat.read(ROOT / "notebooks" / "sweep_analysis.ipynb", as_version=4)
    (parameters,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    parameters.source = f"SWEEP = {str(sweep_dir)!r}"
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs


def test_notebook_executes_on_a_real_sweep(tmp_path_factory):
    outputs = execute(ensure_sweep(tmp_path_factory.getbasetemp()))
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3  # speed/MFU bars, Pareto scatter, breakdown
    text = "".join(o.get("text", "") for o in outputs)
    assert "12 points: 6 invalid, 4 ok, 1 oom, 1 error" in text
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert "injected by tests/sweep.py" in html  # the failed points' table


def test_notebook_executes_on_the_committed_h200_grid():
    outputs = execute(ROOT / "experiments" / "grid_30b" / "records" / "h200_1gpu" / "2026-11-30_09-27")
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3
    assert "12 points: 12 ok" in "".join(o.get("text", "") for o in outputs)
