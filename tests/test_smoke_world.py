import torch
import torch.distributed as dist

from tests.distributed import run_world


def _rank_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def test_run_world_collects_results():
    assert run_world(2, _rank_sum) == [1.0, 1.0]
