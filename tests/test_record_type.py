"""The one ``Record`` type every result.json is made with: each outcome's fields, the JSON on disk, and the sweep
table reading every kind back (the shape tests/test_records.py checks on a real sweep)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.config import ConfigError
from moe_lab.results import load
from moe_lab.results.record import RESULT, Record

META = {"choices": {"ac": "full"}, "overrides": ["ac=full"], "sweep": None, "started_utc": "2026-12-01T00:00:00+00:00"}
CFG = OmegaConf.create({"trainer": {"steps": 2}, "ac": {"_target_": "moe_lab.parallel.ac.FullCheckpoint"}})


def point() -> Record:
    return Record.point(META, CFG, world_size=1, environment={"device": "cpu"})


def test_a_point_holds_meta_config_and_its_fields():
    assert point() == {**META, "world_size": 1, "environment": {"device": "cpu"}, "config": OmegaConf.to_container(CFG)}


def test_each_outcome_sets_status_and_error_and_leaves_the_point_as_it_was():
    base = point()
    ok = base.ok({"s_per_step": 0.5})
    assert (ok["status"], ok["error"], ok["metrics"]) == ("ok", None, {"s_per_step": 0.5})
    invalid = Record.point(META, CFG).invalid(ConfigError("parallel.ep", "must divide 8, got 3"))
    assert invalid["status"] == "invalid" and "world_size" not in invalid  # nothing ran: no device, no ranks
    assert invalid["environment"]["torch"] == torch.__version__ and "git_commit" in invalid["environment"]
    assert "device" not in invalid["environment"]
    message = "parallel.ep: must divide 8, got 3"
    assert invalid["error"] == {"type": "ConfigError", "key": "parallel.ep", "message": message}
    unexpected = base.invalid(KeyError("x"))["error"]
    assert (unexpected["type"], unexpected["key"]) == ("KeyError", None)
    assert unexpected["message"].startswith("validation failed")
    oom = base.failure(torch.OutOfMemoryError("CUDA out of memory"), {"peak_gpu_mem_gib": 1.0})
    assert oom["status"] == "oom" and oom["metrics"] == {"peak_gpu_mem_gib": 1.0} and "traceback" in oom["error"]
    crash = base.failure(RuntimeError("boom"))
    assert crash["status"] == "error" and crash["error"]["message"] == "boom" and "metrics" not in crash
    stopped = base.interrupted("SIGTERM", 3, "/ckpt/step_3", {"steps_done": 3})
    assert stopped["status"] == "interrupted" and stopped["metrics"] == {"steps_done": 3}
    assert stopped["error"]["exit_code"] == 143
    assert stopped["error"]["message"] == "SIGTERM received: stopped after step 3; checkpoint /ckpt/step_3"
    before = Record.point(META, CFG).interrupted("SIGINT", None, None)["error"]["message"]
    assert before == "SIGINT received: stopped before training started"
    assert "status" not in base  # every outcome is a new record


def test_a_plan_record_is_kind_plan():
    record = Record.plan(META, CFG, "2026-12-01T00:00:00+00:00").ok({"s_per_step": 1.0}, plan={"fits": True})
    assert record["kind"] == "plan" and record["plan"] == {"fits": True} and record["status"] == "ok"


@pytest.mark.parametrize("outcome", ["ok", "invalid", "oom", "interrupted"])
def test_written_records_load_as_table_rows(outcome, tmp_path):
    base = point()
    record = {
        "ok": lambda: base.ok({"s_per_step": 0.5}),
        "invalid": lambda: base.invalid(ConfigError("parallel.ep", "bad")),
        "oom": lambda: base.failure(torch.OutOfMemoryError("out of memory")),
        "interrupted": lambda: base.interrupted("SIGTERM", 1, None),
    }[outcome]()
    record.write(tmp_path / "0")
    assert json.loads((tmp_path / "0" / RESULT).read_text()) == json.loads(json.dumps(record))
    row = load(tmp_path).iloc[0]
    assert row["status"] == record["status"] and row["ac"] == "full"
    assert (row["s_per_step"] == 0.5) if outcome == "ok" else row["error_type"] == record["error"]["type"]
