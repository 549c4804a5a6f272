"""The generated tables of docs/performance.md and the studies' READMEs equal what experiments/doc_tables.py makes of
the committed records they name, and every table cites its records."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.sweep import ROOT


@pytest.fixture(scope="module")
def tables():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import doc_tables
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    return doc_tables


def test_generated_tables_are_up_to_date():
    proc = subprocess.run([sys.executable, "experiments/doc_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_changed_figure_is_regenerated_from_its_record(tables):
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert tables.render(doc) == doc
    stale = doc.replace("| 30B | 16,384 | balanced | 24.73 |", "| 30B | 16,384 | balanced | 99.99 |")
    assert stale != doc and tables.render(stale) == doc  # regenerating restores the measured figure


def test_every_table_names_existing_records_and_cites_them(tables):
    docs = [path.read_text() for path in tables.DOCS]
    blocks = [m for doc in docs for m in tables.BLOCK.finditer(doc)]
    assert len(blocks) >= 20 and {m["kind"] for m in blocks} == set(tables.KINDS)  # every kind in use
    for m in blocks:
        paths = m["args"].split()
        assert paths and all((ROOT / p).exists() for p in paths), m.group(1)
        assert all(f"`{p}`" in m["body"] for p in paths), m.group(1)  # under the table or in its raw column


def test_a_table_naming_a_missing_record_fails(tables):
    with pytest.raises(FileNotFoundError, match="no record at experiments/nope"):
        tables.render("<!-- table: grid experiments/nope -->\n<!-- /table -->")
    with pytest.raises(KeyError, match="no generator for table kind 'nope'"):
        tables.render("<!-- table: nope x -->\n<!-- /table -->")
