"""docs/performance.md's generated tables equal what benchmarks/performance_tables.py makes of the committed raw
results, and every table marker in the doc has a generator."""

from __future__ import annotations

import subprocess
import sys

from tests.sweep import ROOT


def test_performance_doc_tables_are_generated_from_the_results():
    proc = subprocess.run([sys.executable, "benchmarks/performance_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_changed_result_makes_the_check_fail():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import performance_tables as tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    doc = tables.DOC.read_text()
    assert tables.render(doc) == doc
    stale = doc.replace("| 30B | 16,384 | balanced | 24.73 |", "| 30B | 16,384 | balanced | 99.99 |")
    assert stale != doc and tables.render(stale) == doc  # regenerating restores the measured figure
