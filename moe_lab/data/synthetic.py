"""Deterministic synthetic token batches: the ``data`` group's ``synthetic`` option."""

from __future__ import annotations

import functools

import torch

from moe_lab.data.batch import Batch, DataSource, refuse_another_sources_state
from moe_lab.runtime.errors import ConfigError


class SyntheticData(DataSource):
    """A learnable language: runs of a fixed random cycle over the vocabulary, restarted at random.

    Within a run token i+1 is the successor of token i on the cycle (a bigram rule a model learns quickly); with
    probability ``restart_prob`` a run restarts at a random token. Sample ``i`` of step ``s`` is a pure function of
    (seed, s, i). A step's global batch is samples [0, grad_accum * dp_size * batch_size): micro-batch m of rank r
    takes the ``batch_size`` samples from (m * dp_size + r) * batch_size on, so micro-batch m of all ranks together
    is one contiguous block, and any split of the same global batch into ranks, micro-batches and per-rank batch
    size trains on the same samples. The held-out split (``eval_batch``) draws from streams no step uses.
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

    def validate(self, cfg, target) -> None:
        if not 1 <= self.vocab_size <= cfg.model.vocab_size:
            raise ConfigError(
                "data.vocab_size", f"must be in [1, model.vocab_size={cfg.model.vocab_size}], got {self.vocab_size}"
            )

    def batch(self, step: int, dp_rank: int, dp_size: int, micro_batch: int = 0, micro_batches: int = 1) -> Batch:
        """Micro-batch ``micro_batch`` (of ``micro_batches``) of rank ``dp_rank``'s (of ``dp_size``) share of step
        ``step``'s batch, [batch_size, seq_len] on the CPU."""
        return self._batch(step, (micro_batch * dp_size + dp_rank) * self.batch_size)

    def eval_batch(self, index: int, dp_rank: int, dp_size: int, micro_batch: int = 0, micro_batches: int = 1) -> Batch:
        """Micro-batch ``micro_batch`` of rank ``dp_rank``'s share of held-out batch ``index``: streams of negative
        step numbers, split as a step's batch is."""
        return self._batch(-1 - index, (micro_batch * dp_size + dp_rank) * self.batch_size)

    def state_dict(self) -> dict:
        """Nothing: a batch is a function of (seed, step, sample), so the step is all a resumed run needs."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        refuse_another_sources_state(state, set(self.state_dict()), "synthetic")

    def _batch(self, step: int, first: int) -> Batch:
        tokens = torch.stack([self.sample(step, first + j) for j in range(self.batch_size)])
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def sample(self, step: int, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step * 10_007 + index) % 2**63)
        n = self.seq_len + 1
        restart = torch.rand(n, generator=gen) < self.restart_prob
        restart[0] = True
        starts = torch.randint(self.vocab_size, (n,), generator=gen)
        position = torch.arange(n)
        run_start = torch.cummax(torch.where(restart, position, 0), dim=0).values
        cycle_pos = (starts[run_start] + position - run_start) % self.vocab_size
        return self.cycle[cycle_pos]
