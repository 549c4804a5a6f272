"""Layer-count proxies of torchtitan's Qwen3-MoE flavours, for the torchtitan baseline (experiments/torchtitan_baseline/torchtitan_baseline.py).

torchtitan 0.2.2's qwen3 flavours fix n_layers. Its trainer imports this module through
``--experimental.custom_import torchtitan_proxy`` (with its folder on PYTHONPATH) before it looks the flavour up,
and the qwen3 TrainSpec reads flavours from the very dict extended here, so ``--model.flavor 30B-A3B-4L`` is torchtitan's
own "30B-A3B" with 4 layers and nothing else changed.
"""

import copy
import dataclasses

from torchtitan.models.qwen3 import qwen3_args

MOE_FLAVOURS = ("debugmodel_moe", "30B-A3B", "235B-A22B")


def proxy_flavour(base: str, n_layers: int) -> str:
    return f"{base}-{n_layers}L"


for _base in MOE_FLAVOURS:
    _args = qwen3_args[_base]
    for _n in range(1, _args.n_layers + 1):
        # each proxy owns its MoEArgs: the trainer writes the forced-balance switch into them
        qwen3_args[proxy_flavour(_base, _n)] = dataclasses.replace(
            _args, n_layers=_n, moe_args=copy.deepcopy(_args.moe_args)
        )
