"""logger=wandb in offline mode: rank 0 logs the resolved config, per-step rows, group = sweep directory and
tags = group choices, finishes a failed run with a non-zero exit code, and writes nothing outside the run
directory (HOME, TMPDIR and the working directory are empty temp dirs that must stay free of wandb files)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

from tests.cli import train_cli
from tests.sweep import ROOT

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def read_wandb_records(path: Path) -> list:
    """The records of an offline ``run-*.wandb`` file (a LevelDB-style log: 7-byte file header, 32 KiB blocks,
    each chunk crc32 / length / type(1 full, 2 first, 3 middle, 4 last) then payload)."""
    data, block, pos, chunks, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def run_train(tmp_path: Path, args: list[str], inject=()) -> subprocess.CompletedProcess:
    dirs = {name: tmp_path / name for name in ("home", "tmp", "cwd")}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "XDG_"))}
    env.update(
        HOME=str(dirs["home"]), TMPDIR=str(dirs["tmp"]), PYTHONPATH=str(ROOT), MOE_LAB_INJECT=json.dumps(list(inject))
    )
    args = [*args, "logger=wandb", "trainer.steps=3", "data.seq_len=32"]
    return train_cli(*args, cwd=dirs["cwd"], env=env, script=str(ROOT / "tests" / "sweep.py"))  # forked: tests/cli.py


def assert_no_wandb_files_outside(tmp_path: Path) -> None:
    for name in ("home", "tmp", "cwd"):
        stray = [p for p in (tmp_path / name).rglob("*") if "wandb" in str(p).lower()]
        assert stray == [], stray


def offline_run(run_dir: Path) -> list:
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return read_wandb_records(run_file)


def test_offline_run_logs_config_steps_group_and_tags(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(tmp_path, ["-m", "ac=full", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((sweep / "0" / "result.json").read_text())["status"] == "ok"
    records = offline_run(sweep / "0")
    (run,) = [r.run for r in records if r.HasField("run")]
    assert run.run_group == str(sweep) and "ac=full" in run.tags and "model=tiny" in run.tags
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["ac"]["_target_"].endswith("FullCheckpoint") and config["trainer"]["steps"] == 3
    assert config["data"]["vocab_size"] == 512  # resolved, not "${model.vocab_size}"
    assert len([r for r in records if r.HasField("history")]) == 3
    (exit_record,) = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 0
    assert_no_wandb_files_outside(tmp_path)


def test_failed_run_finishes_its_wandb_run_and_exits_nonzero(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, [f"hydra.run.dir={run_dir}"], inject=[["error", {"ac": "none"}]])
    assert proc.returncode != 0
    assert json.loads((run_dir / "result.json").read_text())["status"] == "error"
    records = offline_run(run_dir)
    (exit_record,) = [r.exit for r in records if r.HasField("exit")]
    assert exit_record.exit_code == 1
    summary = {
        u.key: json.loads(u.value_json) for r in records if r.HasField("summary") for u in r.summary.update if u.key
    }
    assert summary["status"] == "error" and "injected" in summary["error"]
    assert_no_wandb_files_outside(tmp_path)
