"""Layer-count proxies of torchtitan's Qwen3-MoE flavours, for the torchtitan baseline (experiments/torchtitan_baseline/torchtitan_baseline.py).

torchtitan 0.2.2's qwen3 flavours fix n_layers. Its trainer imports this module through
``--experimental.custom_import torchtitan_proxy`` (with its folder on PYTHONPATH) before it looks the flavour up,
and the qwen3 TrainSpec reads flavours from the very dict extended here, so ``--model.flavor 30B-A3B-4L`` is torchtitan's
own "30B-A3B" with 4 layers and nothing else changed; ``30B-A3B-48L-16E`` also narrows its 128 experts to 16.
"""

import copy
import dataclasses

from torchtitan.models.qwen3 import qwen3_args

MOE_FLAVOURS = ("debugmodel_moe", "30B-A3B", "235B-A22B")
# Expert counts a proxy may narrow to: 16 is one GPU's share of the 128 experts at EP 8 (experiments/full_depth).
EXPERT_COUNTS = (16,)


def proxy_flavour(base: str, n_layers: int, num_experts: int | None = None) -> str:
    return f"{base}-{n_layers}L" + (f"-{num_experts}E" if num_experts else "")


for _base in MOE_FLAVOURS:
    _args = qwen3_args[_base]
    for _n in range(1, _args.n_layers + 1):
        for _experts in (None, *EXPERT_COUNTS):
            # each proxy owns its MoEArgs: the trainer writes the forced-balance switch into them
            _moe = copy.deepcopy(_args.moe_args)
            if _experts:
                _moe.num_experts = _experts
            qwen3_args[proxy_flavour(_base, _n, _experts)] = dataclasses.replace(_args, n_layers=_n, moe_args=_moe)
