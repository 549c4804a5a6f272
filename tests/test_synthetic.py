"""The synthetic data option: a batch is a function of (seed, step, sample), so its checkpointed position is empty
and a restored copy, at any world size, gives the batches the original gives."""

from __future__ import annotations

import torch

from moe_lab.data.synthetic import SyntheticData


def test_restored_synthetic_data_gives_the_same_global_batch_at_another_world_size():
    original = SyntheticData(seq_len=16, batch_size=4, vocab_size=64, seed=3)
    state = original.state_dict()
    assert state == {}  # nothing to keep: the step is the position
    restored = SyntheticData(seq_len=16, batch_size=2, vocab_size=64, seed=3)  # half the batch on each of two ranks
    restored.load_state_dict(state)
    step = 7
    whole = original.batch(step, dp_rank=0, dp_size=1)
    halves = [restored.batch(step, dp_rank=r, dp_size=2) for r in range(2)]
    assert torch.equal(torch.cat([h.inputs for h in halves]), whole.inputs)
    assert torch.equal(torch.cat([h.labels for h in halves]), whole.labels)
    assert not torch.equal(original.batch(step + 1, 0, 1).inputs, whole.inputs)  # the step does change the batch
