"""``python -m moe_lab.compare``: two tiny CPU runs of one config are bitwise equal (exit 0), a run with a perturbed
learning rate is not (exit 1, naming run, step, difference and band); the noise band from repeats, a noise record
and a stated envelope; a sweep directory stands for its points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from moe_lab import compare
from moe_lab.results.record import METRICS, RESULT

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """Three tiny 4-step CPU runs in one process: points 0 and 1 the same config, point 2 a slightly larger LR."""
    out = tmp_path_factory.mktemp("compare") / "sweep"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_lab.train",
            "-m",
            "trainer.steps=4",
            "trainer.warmup_steps=1",
            "data.seq_len=16",
            "data.batch_size=2",
            "optimizer.lr=0.003,0.003,0.0031",
            f"hydra.sweep.dir={out}",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    return out


def run_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "moe_lab.compare", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_equal_runs_pass_and_a_perturbed_run_fails(sweep, tmp_path):
    equal = run_cli(sweep / "0", sweep / "1", "--assert-equal")
    assert equal.returncode == 0, equal.stdout + equal.stderr
    assert "bitwise equal" in equal.stdout

    perturbed = run_cli(sweep / "0", sweep / "2", "--assert-equal", "--plot", tmp_path / "diff.png")
    assert perturbed.returncode == 1
    assert "FAIL optimizer.lr=0.0031: differs from optimizer.lr=0.003 first at step 1" in perturbed.stdout
    assert (tmp_path / "diff.png").stat().st_size > 0

    # The band from a repeat of the reference is 0 here (CPU runs repeat bit for bit): the LR change leaves it.
    noise = run_cli(sweep / "0", sweep / "2", "--noise", sweep / "1")
    assert noise.returncode == 1 and "leaves the band first at step 1" in noise.stdout
    # A stated envelope wide enough holds it; the whole sweep directory stands for its three points.
    assert run_cli(sweep, "--rtol", "1e-3").returncode == 0


def fake_run(directory: Path, losses: list[float], status: str = "ok", lr: float = 0.1) -> Path:
    """A run directory as a run leaves it, with these losses."""
    directory.mkdir(parents=True)
    record = {
        "status": status,
        "error": None,
        "choices": {},
        "overrides": [f"optimizer.lr={lr}"],
        "config": {"optimizer": {"lr": lr}},
        "metrics": {},
    }
    (directory / RESULT).write_text(json.dumps(record))
    (directory / METRICS).write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in enumerate(losses)))
    return directory


def test_noise_band_is_the_running_maximum_of_the_repeats_spread(tmp_path):
    ref = fake_run(tmp_path / "ref", [3.0, 2.5, 2.0, 1.5])
    repeat1 = fake_run(tmp_path / "r1", [3.0, 2.5001, 2.0, 1.5003])
    repeat2 = fake_run(tmp_path / "r2", [3.0, 2.4998, 2.0002, 1.5001])
    table = compare.curves(compare.load_runs([ref, repeat1, repeat2]))
    band = compare.noise_from_repeats(table)
    assert band.tolist() == pytest.approx([0.0, 3e-4, 3e-4, 3e-4], abs=1e-12)  # step 2's 2e-4 is no tighter bound

    inside = fake_run(tmp_path / "inside", [3.0, 2.5002, 2.0002, 1.4998], lr=0.2)
    outside = fake_run(tmp_path / "outside", [3.0, 2.5, 2.0005, 1.5], lr=0.3)
    record = tmp_path / "noise.json"
    repeats = ["--noise", str(repeat1), str(repeat2)]
    assert compare.main([str(ref), str(inside), *repeats, "--write-noise", str(record)]) == 0
    assert json.loads(record.read_text())["band"][1] == [1, pytest.approx(3e-4)]
    # The record stands in for the repeats; the run two steps outside fails, named with its step, difference and band.
    assert compare.main([str(ref), str(inside), "--noise", str(record)]) == 0
    assert compare.main([str(ref), str(outside), "--noise", str(record)]) == 1
    verdict = compare.check(
        compare.curves(compare.load_runs([ref, outside])),
        compare.load_runs([ref, outside]),
        compare.read_noise(record, table.index),
        0.0,
        0.0,
        False,
    )[0]
    assert verdict.message.startswith(
        "optimizer.lr=0.3: leaves the band first at step 2: difference +5.000e-04, band 3.000e-04"
    )
    # A noise record committed beside the reference is read without --noise.
    (tmp_path / "ref" / "noise.json").write_text(json.dumps({"envelope": 1e-3}))
    assert compare.main([str(ref), str(outside)]) == 0


def test_a_failed_or_short_run_fails_the_comparison(tmp_path):
    ref = fake_run(tmp_path / "ref", [3.0, 2.5, 2.0])
    failed = fake_run(tmp_path / "failed", [3.0], status="oom", lr=0.2)
    short = fake_run(tmp_path / "short", [3.0, 2.5], lr=0.3)
    assert compare.main([str(ref), str(failed), "--rtol", "1"]) == 1
    assert compare.main([str(ref), str(short), "--assert-equal"]) == 1
    assert compare.main([str(ref), str(short), "--atol", "1"]) == 1


def test_a_failed_reference_is_said_to_have_failed(tmp_path, capsys):
    """Comparing against where a failed run got to is allowed (where two runs parted), never silently."""
    failed = fake_run(tmp_path / "failed", [3.0, 2.5], status="error", lr=0.2)
    run = fake_run(tmp_path / "run", [3.0, 2.5, 2.0], lr=0.3)
    compare.main([str(failed), str(run)])
    assert "note: the reference ended error (" in capsys.readouterr().out
    compare.main([str(run), str(failed)])
    assert "note: the reference" not in capsys.readouterr().out


def test_bad_input_is_one_line_naming_the_run_and_the_file(tmp_path, capsys):
    """Exit 2 with one line, no traceback: a run directory that does not exist, one holding no record, a record that
    is none, an ok run without its metrics.jsonl, and a metrics.jsonl with a line in the middle that is no row."""
    ref = fake_run(tmp_path / "ref", [3.0, 2.5, 2.0])
    empty = tmp_path / "empty"
    empty.mkdir()
    no_record = fake_run(tmp_path / "no_record", [3.0], lr=0.2)
    (no_record / RESULT).write_text('{"status": "ok", "conf')
    no_metrics = fake_run(tmp_path / "no_metrics", [3.0], lr=0.3)
    (no_metrics / METRICS).unlink()
    bad_row = fake_run(tmp_path / "bad_row", [3.0, 2.5], lr=0.4)
    (bad_row / METRICS).write_text('{"step": 0, "loss": 3.0}\nnot json\n{"step": 2, "loss": 2.0}\n')
    for run, expected in (
        (tmp_path / "missing", f"{tmp_path / 'missing'}: no such run directory"),
        (empty, f"{empty}: no result.json in it or under it"),
        (no_record, f"{no_record}: {no_record / RESULT}: "),
        (no_metrics, f"{no_metrics}: no metrics.jsonl ({no_metrics / METRICS}), though its record says ok"),
        (bad_row, f"{bad_row / METRICS}: line 2 is no metrics row"),
    ):
        for check in ([], ["--assert-equal"]):
            assert compare.main([str(ref), str(run), *check]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"python -m moe_lab.compare: {expected}") and err.count("\n") == 1, err
    # A failed run may have no metrics.jsonl: it fails the comparison as a failed run (1), not as bad input.
    failed = fake_run(tmp_path / "failed", [], status="oom", lr=0.5)
    (failed / METRICS).unlink()
    assert compare.main([str(ref), str(failed)]) == 1


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--rtol", "-1"], "--rtol must be >= 0, got -1"),
        (["--atol", "-0.5"], "--atol must be >= 0, got -0.5"),
        (["--noise-factor", "-2"], "--noise-factor must be >= 0, got -2"),
        (["--noise", "REF"], "--noise: REF holds no run but the reference; give repeats of it"),
        (["--assert-equal", "--atol", "1e-6"], "--assert-equal checks bitwise equality: give no --rtol / --atol"),
    ],
)
def test_a_wrong_argument_is_exit_2_naming_it(tmp_path, capsys, arguments, message):
    ref = fake_run(tmp_path / "ref", [3.0, 2.5, 2.0])
    run = fake_run(tmp_path / "run", [3.0, 2.5, 2.0], lr=0.2)
    arguments = [str(ref) if a == "REF" else a for a in arguments]
    with pytest.raises(SystemExit) as exit_status:
        compare.main([str(ref), str(run), *arguments])
    assert exit_status.value.code == 2 and message.replace("REF", str(ref)) in capsys.readouterr().err


def test_a_cut_last_line_reads_as_the_steps_so_far_and_says_so(tmp_path, capsys):
    ref = fake_run(tmp_path / "ref", [3.0, 2.5, 2.0])
    killed = fake_run(tmp_path / "killed", [3.0, 2.5, 2.0], lr=0.2)
    text = (killed / METRICS).read_text()
    (killed / METRICS).write_text(text[: len(text) - 9])  # as a run killed mid-write leaves it
    assert compare.main([str(ref), str(killed)]) == 0  # no check asked: shown, not failed
    out = capsys.readouterr().out
    assert (
        f"note: {killed / METRICS}: its last line is cut short (a run stopped while writing it): read up to step 1"
        in out
    )
    assert "steps [2] are in one run only" in out
    assert compare.main([str(ref), str(killed), "--assert-equal"]) == 1
    assert "equal where both have a value, but steps [2] are in one run only" in capsys.readouterr().out
    assert compare.main([str(killed), str(ref), "--atol", "1"]) == 1  # as the reference too: step 2 in one run only
    assert "within the band where both have a value, but steps [2] are in one run only" in capsys.readouterr().out


def test_with_no_check_differences_are_shown_not_judged_and_integer_keys_stay_integers(tmp_path, capsys):
    ref = fake_run(tmp_path / "ref", [3.0, 2.5, 2.0])
    deeper = fake_run(tmp_path / "deeper", [3.0, 2.45, 2.1], lr=0.1)
    record = json.loads((deeper / RESULT).read_text())
    record["overrides"] = ["model.num_layers=4"]
    record["config"]["model"] = {"num_layers": 4}
    (deeper / RESULT).write_text(json.dumps(record))
    assert compare.main([str(ref), str(deeper)]) == 0
    out = capsys.readouterr().out
    assert "     model.num_layers=4: largest difference +1.000e-01 at step 2" in out, out
    assert "band" not in out.split("check: none")[1] and "4.0" not in out


def test_a_stated_rtol_alone_is_a_check_that_fails_a_run_outside_it(tmp_path, capsys):
    """``--rtol`` with nothing else: the band is rtol x |reference| at each step, and a run that leaves it fails."""
    ref = fake_run(tmp_path / "ref", [3.0, 2.0, 1.0])
    run = fake_run(tmp_path / "run", [3.0, 2.001, 1.002], lr=0.2)  # 5e-4 and 2e-3 of the reference
    assert compare.main([str(ref), str(run), "--rtol", "1e-3"]) == 1
    out = capsys.readouterr().out
    assert "check: band = rtol 0.001 x |reference|" in out
    assert "FAIL optimizer.lr=0.2: leaves the band first at step 2: difference +2.000e-03, band 1.000e-03" in out
    assert compare.main([str(ref), str(run), "--rtol", "3e-3"]) == 0


def test_repeats_within_a_sweep_are_told_apart_and_each_compared(tmp_path, capsys):
    """Points with the same label (a sweep's repeats of one config) each get a column and a verdict of their own,
    named by their run directory."""
    sweep = tmp_path / "sweep"
    fake_run(sweep / "0", [3.0, 2.5, 2.0], lr=0.1)
    fake_run(sweep / "1", [3.0, 2.5, 2.0], lr=0.1)
    fake_run(sweep / "2", [3.0, 2.5, 2.1], lr=0.2)
    runs = compare.load_runs([sweep])
    assert runs["label"].tolist() == ["optimizer.lr=0.1 (0)", "optimizer.lr=0.1 (1)", "optimizer.lr=0.2"]
    assert compare.main([str(sweep), "--assert-equal"]) == 1
    out = capsys.readouterr().out
    assert "ok   optimizer.lr=0.1 (1): bitwise equal to optimizer.lr=0.1 (0) at all 3 steps" in out
    assert "FAIL optimizer.lr=0.2: differs from optimizer.lr=0.1 (0) first at step 2" in out


def test_a_noise_records_band_is_carried_forward_and_back_to_the_steps_compared(tmp_path):
    """A band given from step 1 holds at step 0 too, and a step between two given ones has the earlier's."""
    record = tmp_path / "noise.json"
    record.write_text(json.dumps({"band": [[1, 1e-3], [3, 2e-3]], "envelope": 2e-3}))
    band = compare.read_noise(record, pd.Index([0, 1, 2, 3, 4]))
    assert band.tolist() == [1e-3, 1e-3, 1e-3, 2e-3, 2e-3]
    record.write_text(json.dumps({"envelope": 5e-4}))  # no band: the envelope at every step
    assert compare.read_noise(record, pd.Index([0, 1])).tolist() == [5e-4, 5e-4]
    record.write_text(json.dumps({"metric": "loss"}))
    with pytest.raises(ValueError, match="a noise record holds band"):
        compare.read_noise(record, pd.Index([0, 1]))


def test_a_noise_band_from_records_the_sweeps_own_the_widest_of_several_and_scaled(tmp_path, capsys):
    """Without --noise, a noise record in the reference's sweep directory is read; of several records given, each
    step takes the widest band; --noise-factor scales the band."""
    sweep = tmp_path / "sweep"
    ref = fake_run(sweep / "0", [3.0, 2.5, 2.0])
    run = fake_run(sweep / "1", [3.0, 2.5015, 2.0], lr=0.2)  # 1.5e-3 off at step 1
    (sweep / "noise.json").write_text(json.dumps({"envelope": 1e-3}))
    assert compare.main([str(ref), str(run)]) == 1  # checked, against the sweep's record
    assert f"band = noise band (noise record {sweep / 'noise.json'})" in capsys.readouterr().out

    narrow, wide = tmp_path / "narrow.json", tmp_path / "wide.json"
    narrow.write_text(json.dumps({"envelope": 1e-3}))
    wide.write_text(json.dumps({"band": [[0, 0.0], [1, 2e-3]]}))
    assert compare.main([str(ref), str(run), "--noise", str(narrow)]) == 1
    assert compare.main([str(ref), str(run), "--noise", str(narrow), str(wide)]) == 0
    assert compare.main([str(ref), str(run), "--noise", str(wide), str(narrow)]) == 0
    capsys.readouterr()
    assert compare.main([str(ref), str(run), "--noise", str(narrow), "--noise-factor", "2"]) == 0
    assert f"noise band (noise record {narrow}, x 2)" in capsys.readouterr().out


def test_a_failed_run_fails_even_where_its_curve_matches_and_one_failure_fails_the_comparison(tmp_path, capsys):
    """A run that ended oom or error after every step the reference has is still a failed run; the other runs are
    judged as ever, and the exit status is 1 when any run fails."""
    ref = fake_run(tmp_path / "ref", [3.0, 2.5, 2.0])
    equal = fake_run(tmp_path / "equal", [3.0, 2.5, 2.0], lr=0.2)
    failed = fake_run(tmp_path / "failed", [3.0, 2.5, 2.0], status="error", lr=0.3)
    assert compare.main([str(ref), str(equal), str(failed), "--atol", "1e-3"]) == 1
    out = capsys.readouterr().out
    assert "ok   optimizer.lr=0.2: within the band at all 3 steps" in out
    assert "FAIL optimizer.lr=0.3: status error (" in out


def test_a_written_noise_record_names_the_reference_and_its_repeats(tmp_path):
    ref = fake_run(tmp_path / "ref", [3.0, 2.5, 2.0])
    repeat1 = fake_run(tmp_path / "r1", [3.0, 2.5002, 2.0])
    repeat2 = fake_run(tmp_path / "r2", [3.0, 2.4999, 2.0001])
    run = fake_run(tmp_path / "run", [3.0, 2.5, 2.0], lr=0.2)
    record = tmp_path / "noise.json"
    assert compare.main([str(ref), str(run), "--noise", str(repeat1), str(repeat2), "--write-noise", str(record)]) == 0
    written = json.loads(record.read_text())
    assert (written["metric"], written["reference"]) == ("loss", str(ref))
    assert written["repeats"] == [str(repeat1), str(repeat2)]  # the reference is no repeat of itself
    assert written["envelope"] == pytest.approx(3e-4) and [s for s, _ in written["band"]] == [0, 1, 2]
