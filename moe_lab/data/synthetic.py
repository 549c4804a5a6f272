"""Deterministic synthetic token batches: the ``data`` group's ``synthetic`` option."""

from __future__ import annotations

import functools

import torch

from moe_lab.config.errors import ConfigError


class SyntheticData:
    """A learnable language: runs of a fixed random cycle over the vocabulary, restarted at random.

    Within a run token i+1 is the successor of token i on the cycle (a bigram rule a model learns quickly); with
    probability ``restart_prob`` a run restarts at a random token. Sample ``j`` of step ``s`` is a pure function of
    (seed, s, j), and rank r takes samples [r * batch_size, (r + 1) * batch_size): any world size sees the same
    global batch.
    """

    def __init__(self, seq_len: int, batch_size: int, vocab_size: int, seed: int = 0, restart_prob: float = 0.1):
        if not 0.0 <= restart_prob <= 1.0:
            raise ConfigError("data.restart_prob", f"must be in [0, 1], got {restart_prob}")
        self.seq_len, self.batch_size, self.vocab_size = seq_len, batch_size, vocab_size
        self.seed, self.restart_prob = seed, restart_prob

    @functools.cached_property
    def cycle(self) -> torch.Tensor:
        # Made at the first batch, not when the option is built: validation builds it before the vocabulary's size
        # has been checked against the model's.
        return torch.randperm(self.vocab_size, generator=torch.Generator().manual_seed(self.seed))

    def batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each [batch_size, seq_len] int64 on the CPU."""
        first = dp_rank * self.batch_size
        tokens = torch.stack([self.sample(step, first + j) for j in range(self.batch_size)])
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict:
        """The data position a checkpoint keeps, beside the step. None here: a batch is a function of the step (a
        dataset read in order would return where each rank's reader stands)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position ``state_dict`` returned, at the same world size."""

    def sample(self, step: int, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 10_007 + index)
        n = self.seq_len + 1
        restart = torch.rand(n, generator=gen) < self.restart_prob
        restart[0] = True
        starts = torch.randint(self.vocab_size, (n,), generator=gen)
        position = torch.arange(n)
        run_start = torch.cummax(torch.where(restart, position, 0), dim=0).values
        cycle_pos = (starts[run_start] + position - run_start) % self.vocab_size
        return self.cycle[cycle_pos]
