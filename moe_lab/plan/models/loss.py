"""The loss group's models. The LM head's GEMMs are the same three passes under either loss (``dense_gemm``:
forward's, and backward's for the hidden states' and the weight's gradients, which chunked runs in forward): what
differs is what the loss holds at its peak and its memory traffic (``other``)."""

from __future__ import annotations

from moe_lab.models.loss import ChunkedLoss, FullLoss
from moe_lab.plan.memory import Step
from moe_lab.plan.models import OptionModel, planner_model

LOSS_BYTES_PER_LOGIT = 12.0  # the compiled loss: bf16 logits read, fp32 log-softmax forward and backward
# loss=chunked over several chunks, per head parameter: each chunk's bf16 share of the weight gradient written and
# read, the fp32 sum read and written; once, the sum scaled in place and cast to bf16
CHUNK_SUM_BYTES_PER_PARAM = 12.0
SUM_CAST_BYTES_PER_PARAM = 14.0
EAGER_CHUNK_BYTES_PER_LOGIT = 19.0  # uncompiled chunk: bf16 logits, fp32 upcast, exponentials, select, scaled


@planner_model("loss", FullLoss)
class FullLossPlan(OptionModel):
    name = "full"
    saves_head_weight = True  # for backward (one rank: autocast's bf16 copy of the fp32 head, kept into backward)

    def peak_bytes(self, tokens: int, hidden_size: int, vocab_size: int, compiled: bool) -> float:
        """Device bytes it holds at its peak beyond its inputs: the logits [T, V] in bf16 and their gradient;
        uncompiled, the fp32 upcast and log-softmax too."""
        return tokens * vocab_size * (2 + 2 if compiled else 2 + 4 + 4 + 4)

    def workspace(self, step: Step) -> float:
        """What it holds at the loss, the step's memory phase (``memory.plan_memory``)."""
        c = step.cfg
        return self.peak_bytes(step.tokens, c.hidden_size, c.vocab_size, step.compile)

    def traffic_bytes(self, step: Step) -> float:
        """HBM bytes of its memory-bound work per micro-batch (``other``)."""
        return step.tokens * step.cfg.vocab_size * LOSS_BYTES_PER_LOGIT


@planner_model("loss", ChunkedLoss)
class ChunkedLossPlan(FullLossPlan):
    name = "chunked"
    saves_head_weight = False  # its gradients are made in forward

    def peak_bytes(self, tokens: int, hidden_size: int, vocab_size: int, compiled: bool) -> float:
        """One chunk's logits and their gradient (uncompiled, ``EAGER_CHUNK_BYTES_PER_LOGIT``), the hidden states'
        gradient [T, H] in bf16 and the weight's: over one chunk in bf16; over several in fp32 beside, once the
        chunk's logits are gone, the chunk's bf16 share of it and the logits' gradient."""
        chunk_tokens = self.option.chunk_tokens
        chunk = min(chunk_tokens, tokens) * vocab_size
        in_chunk = chunk * (4 if compiled else EAGER_CHUNK_BYTES_PER_LOGIT)
        head, grad_hidden = hidden_size * vocab_size, 2 * tokens * hidden_size
        if tokens <= chunk_tokens:
            return 2 * head + grad_hidden + in_chunk
        return 4 * head + grad_hidden + max(in_chunk, 2 * chunk + 2 * head)

    def traffic_bytes(self, step: Step) -> float:
        """The logits' reads and writes as ``full``'s, chunk by chunk; over several chunks the weight gradient's sum."""
        logits = super().traffic_bytes(step)
        chunks = -(-step.tokens // self.option.chunk_tokens)
        if chunks == 1:
            return logits
        head = step.cfg.hidden_size * step.cfg.vocab_size
        return logits + head * (chunks * CHUNK_SUM_BYTES_PER_PARAM + SUM_CAST_BYTES_PER_PARAM)
