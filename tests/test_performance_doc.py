"""The generated tables of README.md, docs/, experiments/README.md and the studies' READMEs equal what
moe_lab.report makes of the committed records (the schema, the studies' READMEs) they name, and every
table cites its records."""

from __future__ import annotations

import json
import re

import pytest

from moe_lab import report
from tests.sweep import ROOT


def test_generated_tables_are_up_to_date():
    report.main(["--check"])  # exits naming the stale files; in this process, its tables cached for the others here


def test_a_changed_figure_is_regenerated_from_its_record():
    doc = (ROOT / "docs" / "performance.md").read_text()
    assert report.render(doc) == doc
    stale = doc.replace("| 30B | 16,384 | balanced | 24.73 |", "| 30B | 16,384 | balanced | 99.99 |")
    assert stale != doc and report.render(stale) == doc  # regenerating restores the measured figure


def test_every_table_names_existing_records_and_cites_them():
    docs = [path.read_text() for path in report.DOCS]
    blocks = [m for doc in docs for m in report.BLOCK.finditer(doc)]
    assert len(blocks) >= 20 and {m["kind"] for m in blocks} == set(report.KINDS)  # every kind in use
    for m in blocks:
        paths = m["args"].split()
        assert paths and all((ROOT / p).exists() for p in paths), m.group(1)
        if m["kind"] != "studies":  # the index names each study's README instead
            assert all(f"`{p}`" in m["body"] for p in paths), m.group(1)  # under the table or in its raw column


def test_the_study_index_lists_every_study_with_what_its_records_hold():
    index = report.studies("experiments")
    studies = sorted(p.parent.name for p in (ROOT / "experiments").glob("*/README.md"))
    assert [line.split("](")[0].removeprefix("| [") for line in index.splitlines()[2:]] == studies
    for study in studies:
        row = next(line for line in index.splitlines() if line.startswith(f"| [{study}]"))
        ran = row.split(" | ")[2]
        sittings = report._sittings(ROOT / "experiments" / study)
        assert ran == ("; ".join(f"{machine} ({report._utc(start)})" for machine, start in sittings) or "not run"), row
    assert "| [grid_235b](grid_235b/README.md) |" in index and "h200_1gpu (2026-12-01 11:19)" in index


def test_every_headline_cites_records_that_exist():
    for readme in sorted((ROOT / "experiments").glob("*/README.md")):
        for m in report.STUDY_PARAGRAPH.finditer(readme.read_text()):
            if m["name"] == "Headline":
                cited = re.findall(r"`(experiments/[^`]+)`", m["text"])
                assert cited and all((ROOT / p).exists() for p in cited), (readme, m["text"])


def test_the_key_reference_lists_every_option_and_schema_key():
    from moe_lab.config.help import SECTIONS, key_rows

    reference = report.keys("moe_lab/config/schema.py", "conf")
    for path in (ROOT / "conf").glob("*/*.yaml"):
        if path.parent.name not in ("hydra", "hardware", "tune"):  # tune: moe_lab.tune's own group (docs/tune.md)
            assert f"| `{path.stem}`" in reference, path
    for section, schema in SECTIONS.items():
        assert all(f"`{key}" in reference for key, _, _ in key_rows(section, schema))
    assert "| `parallel.ep` | `1` |" in reference


def test_a_table_naming_a_missing_record_fails():
    with pytest.raises(FileNotFoundError, match="no record at experiments/nope"):
        report.render("<!-- table: grid experiments/nope -->\n<!-- /table -->")
    with pytest.raises(KeyError, match="no generator for table kind 'nope'"):
        report.render("<!-- table: nope x -->\n<!-- /table -->")


def _ours(directory, points, gpus=2, seq=16384):
    """A moe_lab sweep's records: (dispatcher, ac, status, tokens/s/GPU, peak GiB) per point."""
    for n, (dispatcher, ac, status, tps, gib) in enumerate(points):
        (directory / str(n)).mkdir(parents=True)
        record = {
            "status": status,
            "choices": {"dispatcher": dispatcher, "ac": ac, "offload": "none"},
            "overrides": [],
            "config": {
                "model": {"name": "qwen3_235b", "num_layers": 2},
                "trainer": {"nproc_per_node": gpus},
                "data": {"seq_len": seq},
            },
            "metrics": {"tokens_per_s_per_gpu": tps, "mfu": tps and tps * 1e-5, "peak_gpu_mem_gib": gib}
            if status == "ok"
            else None,
        }
        (directory / str(n) / "result.json").write_text(json.dumps(record))
    return str(directory)


def _titan(path, points, gpus=2, seq=16384):
    """A torchtitan baseline file: (AC setting, status, tokens/s/GPU, reserved GiB) per point."""
    rows = [
        {
            "gpus": gpus,
            "seq_len": seq,
            "ac": ac,
            "status": status,
            "command": "torchrun ...",
            "tokens_per_s_per_gpu": tps,
            "mfu": tps and tps * 1e-5,
            "peak_gpu_mem_reserved_gib": gib,
        }
        for ac, status, tps, gib in points
    ]
    path.write_text(json.dumps({"proxy": {"torchtitan_flavour": "235B-A22B-2L", "layers": 2}, "points": rows}))
    return str(path)


def test_best_vs_best_divides_the_fastest_by_the_fastest_and_says_what_each_side_ran(tmp_path):
    ours = _ours(
        tmp_path / "ours",
        [
            ("fused", "none", "oom", None, None),
            ("fused", "selective", "ok", 51_000, 70.2),
            ("torch", "none", "ok", 45_000, 80.0),
            ("torch", "selective", "ok", 44_000, 66.0),
        ],
    )
    titan = _titan(
        tmp_path / "titan.json",
        [("none", "ok", 40_800, 87.0), ("full", "ok", 35_800, 79.7), ("layer-selective", "oom", None, None)],
    )
    row = report.best_vs_best(ours, titan).splitlines()[2].split(" | ")
    assert row[:4] == ["| Qwen3-235B-A22B, 2 layers", "2", "16,384", "fused + selective AC"]
    assert row[4:7] == ["51,000", "51.0 %", "70.2"]  # our fastest, not the same-AC point
    assert row[7:11] == ["none", "40,800", "40.8 %", "87.0"]  # torchtitan's fastest that ran
    assert row[11] == f"{51_000 / 40_800:.2f}x"
    assert (
        row[12]
        == "dispatcher fused, torch; ac none, selective; offload none; fused + none, offload none: oom; not run: ac full"
    )
    assert row[13] == "none, full, layer-selective (oom); not run: op-selective |"
    failed = _titan(tmp_path / "failed.json", [("none", "oom", None, None)])
    row = report.best_vs_best(ours, failed).splitlines()[2].split(" | ")
    assert row[7:12] == ["(none ok)", "", "", "", ""]  # nothing to divide by
    with pytest.raises(ValueError, match="is .*1, 16384.* is .*2, 16384"):
        report.best_vs_best(_ours(tmp_path / "one_gpu", [("fused", "selective", "ok", 1, 1)], gpus=1), titan)
