"""The Hydra entry point: compose -> validate -> hand over to the job (``moe_lab.job.lifecycle``), which trains
(``moe_lab.job.trainer``) and records.

    python -m moe_lab.train                                   # tiny model on CPU, about a minute
    python -m moe_lab.train model=qwen3_30b model.num_layers=4 data.seq_len=8192 trainer.nproc_per_node=2 parallel.ep=2
    python -m moe_lab.train -m ac=full,selective              # a sweep: one result.json per point
    python -m moe_lab.train --help                            # every group and key in a line
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from moe_lab import config
from moe_lab.config.validate import check_command_line
from moe_lab.job.launcher import rank_hydra_overrides
from moe_lab.job.lifecycle import run_job
from moe_lab.results.record import job_meta
from moe_lab.runtime.errors import ConfigError
from moe_lab.runtime.paths import CONF_DIR

config.register()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> dict | None:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    run_dir = Path(hc.runtime.output_dir)
    meta = job_meta(hc) | {"log_file": str(run_dir / f"{hc.job.name}.log")}
    return run_job(cfg, run_dir, meta, multirun=multirun)


if __name__ == "__main__":
    sys.argv += rank_hydra_overrides()  # under torchrun / srun, ranks other than 0 leave no Hydra files
    if "--help" in sys.argv:
        sys.argv.append(config.register_help())
    try:  # a mistyped key gets moe_lab's message before Hydra's advice to append it with +
        check_command_line(sys.argv)
    except ConfigError as e:
        sys.exit(f"invalid config: {e}")
    main()
