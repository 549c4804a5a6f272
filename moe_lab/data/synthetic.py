"""Deterministic synthetic token batches: the ``data`` group's ``synthetic`` option."""

from __future__ import annotations

import functools

import torch

from moe_lab.config.errors import ConfigError


class SyntheticData:
    """A learnable language: runs of a fixed random cycle over the vocabulary, restarted at random.

    Within a run token i+1 is the successor of token i on the cycle (a bigram rule a model learns quickly); with
    probability ``restart_prob`` a run restarts at a random token. Sample ``i`` of step ``s`` is a pure function of
    (seed, s, i). A step's global batch is samples [0, grad_accum * dp_size * batch_size): micro-batch m of rank r
    takes the ``batch_size`` samples from (m * dp_size + r) * batch_size on, so micro-batch m of all ranks together
    is one contiguous block, and any split of the same global batch into ranks, micro-batches and per-rank batch
    size trains on the same samples each step.
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

    def batch(self, step: int, dp_rank: int, *, micro_batch: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of micro-batch ``micro_batch`` of data-parallel rank ``dp_rank`` of ``dp_size``,
        each [batch_size, seq_len] int64 on the CPU."""
        first = (micro_batch * dp_size + dp_rank) * self.batch_size
        tokens = torch.stack([self.sample(step, first + j) for j in range(self.batch_size)])
        return tokens[:, :-1], tokens[:, 1:]

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
