"""What ``trainer.checkpoint.every`` costs a run, with and without ``trainer.checkpoint.async_save``.

    python experiments/parity/checkpoint_cost.py --out cost.json [--dir /tmp/ckpt] [--saves 3] [OVERRIDES...]

Builds the training state of ``+experiment=parity`` (the 2-layer Qwen3-30B-A3B proxy, 1.9B parameters, at batch
1; overrides change it) as the trainer does, takes one training step so the optimizer holds its state, then saves it ``--saves``
times each way through the trainer's own ``Checkpointer``: ``blocking_s`` is how long ``save`` holds the training
loop (sync: the whole write; async: the host copy of the state), ``written_s`` until the checkpoint is on disk and
marked complete. Each checkpoint is deleted after it is timed (only one is on disk at a time). A run that saves every
N steps of S seconds each pays about blocking_s / (N * S) of its time (plus, with async_save, what the background
write takes from the steps it overlaps). Writes JSON: environment, checkpoint bytes, per-save times, medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_lab import config
from moe_lab.checkpoint.checkpointer import Progress, state_bytes
from moe_lab.job.trainer import build_checkpointer, build_model
from moe_lab.optim.schedule import warmup_cosine
from moe_lab.results.record import environment, write_json_atomic
from moe_lab.runtime.paths import CONF_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", default="/tmp/moe_lab_checkpoint_cost", help="where the timed checkpoints go")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    config.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        # Not compiled: the state saved is the same, and one step need not wait for Inductor.
        cfg = compose(
            "train",
            overrides=[
                "+experiment=parity",
                "data.batch_size=1",
                "trainer.checkpoint.every=0",
                "trainer.compile=false",
                *args.overrides,
            ],
        )
    options = config.validate(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(cfg, options, device, dtype)
    optimizer = options.offload.build(model, options.make_optimizer, dtype)
    scheduler = warmup_cosine(optimizer, cfg.trainer.steps, cfg.trainer.warmup_steps, cfg.trainer.min_lr_ratio)
    batch = options.data.batch(0, 0, 1).to(device)
    with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        out = model(batch.inputs, batch.documents, labels=batch.labels, loss=options.loss)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()

    results = {
        "environment": environment(device, 1),
        "overrides": args.overrides,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    for async_save in (False, True):
        directory = Path(args.dir) / ("async" if async_save else "sync")
        shutil.rmtree(directory, ignore_errors=True)
        cfg.trainer.checkpoint = OmegaConf.merge(
            cfg.trainer.checkpoint, {"dir": str(directory), "keep": None, "async_save": async_save}
        )
        checkpointer = build_checkpointer(cfg, options, directory, model, optimizer, scheduler, device)
        results["checkpoint_bytes"] = state_bytes(checkpointer._state_dict(Progress(0)))
        saves = []
        for step in range(1, args.saves + 1):
            start = time.perf_counter()
            path = checkpointer.save(Progress(step, [0.0] * step), background=async_save)
            blocking = time.perf_counter() - start
            checkpointer.close()
            saves.append({"blocking_s": blocking, "written_s": time.perf_counter() - start})
            shutil.rmtree(path)
            print(f"async_save={async_save} save {step}: {saves[-1]}", flush=True)
        results["async" if async_save else "sync"] = {
            "saves": saves,
            **{k: statistics.median(s[k] for s in saves) for k in ("blocking_s", "written_s")},
        }
        write_json_atomic(args.out, results)
    gb = results["checkpoint_bytes"] / 1e9
    for mode in ("sync", "async"):
        r = results[mode]
        print(
            f"{mode}: {gb:.1f} GB, save blocks {r['blocking_s']:.2f} s, written after {r['written_s']:.2f} s "
            f"({gb / r['written_s']:.2f} GB/s)"
        )


if __name__ == "__main__":
    sys.exit(main())
