"""The language-model loss (the ``loss`` group): the LM head and the mean next-token cross-entropy over the
vocabulary, computed in fp32.

The model's forward hands its final hidden states, the LM head's weight and the labels to the loss
(``Qwen3MoeForCausalLM.forward(..., labels=, loss=)``), inside the head's own call, where FSDP2 has the weight
gathered; the loss knows nothing of process groups.

- ``full`` (``FullLoss``): every token's logits at once, [T, V] in the compute dtype, then the cross-entropy of their
  fp32 upcast; the logits and their gradient exist whole (4 bytes per logit compiled: 9.3 GiB at 16,384 tokens of
  Qwen3's 151,936-token vocabulary).
- ``chunked`` (``ChunkedLoss``): ``chunk_tokens`` tokens at a time. The loss is the graph's end, so each chunk's
  gradient is known as soon as its logits are: forward computes the chunk's logits, its loss and its logits'
  gradient, and from that the chunk's hidden-state gradient and its share of the head's weight gradient (summed over
  the chunks in fp32), then drops the chunk. Backward only scales the two gradients by the loss's own gradient. No
  GEMM runs twice (the head's three, as with ``full``), and only one chunk's logits exist at a time, beside the
  weight gradient's fp32 sum (4 bytes per head parameter) and each chunk's share of it in the compute dtype (2); at
  ``chunk_tokens`` or fewer tokens it holds what ``full`` holds.

Both leave a label of ``IGNORE_INDEX`` (-100, torch's ``cross_entropy`` default) out of the mean, as a data option
that masks tokens (prompts, padding) writes them; with every label ignored the mean is nan, as ``cross_entropy``'s.
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from moe_lab.runtime.errors import ConfigError

IGNORE_INDEX = -100


@runtime_checkable
class LanguageModelLoss(Protocol):
    """What a ``loss`` option provides."""

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean over tokens of the cross-entropy of ``hidden @ head_weight.T`` against ``labels``, in fp32.
        ``hidden`` [..., H]: the final norm's output; ``head_weight`` [V, H]: the LM head's weight as the head's
        forward sees it (gathered under FSDP2; cast as an enclosing autocast casts a linear's operands);
        ``labels`` [...]: token ids, ``IGNORE_INDEX`` where a token counts in no mean. Differentiable in ``hidden``
        and ``head_weight``."""
        ...

    def compiled(self) -> LanguageModelLoss:
        """This loss with its work over the vocabulary compiled (``trainer.compile``): the fp32 upcast, the
        log-softmax and its gradient fuse, and no fp32 copy of the logits is materialised."""
        ...


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [B, S, V] against labels [B, S] (``IGNORE_INDEX`` left out), computed
    in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


class FullLoss(LanguageModelLoss):
    """Every token's logits at once, then the cross-entropy of their fp32 upcast."""

    def __init__(self):
        self._cross_entropy = lm_loss

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._cross_entropy(F.linear(hidden, head_weight), labels)

    def compiled(self) -> FullLoss:
        out = copy.copy(self)
        out._cross_entropy = torch.compile(lm_loss, fullgraph=True)
        return out


def chunk_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed fp32 cross-entropy of a chunk's logits [C, V] against its labels [C] (``IGNORE_INDEX`` left out)."""
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


def chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's summed fp32 cross-entropy and the gradient of ``scale`` times it in its logits [C, V]:
    ``scale * (softmax - onehot(labels))`` computed in fp32 (zero in an ignored token's row), returned in the
    logits' dtype (as autograd gives the gradient of ``lm_loss``'s upcast). All of it element-wise but the row
    reduction, so that compiled it is a reduction and one kernel that reads the logits and writes their gradient,
    with no [C, V] buffer in between."""
    dtype, logits = logits.dtype, logits.float()
    counted = (labels != IGNORE_INDEX).unsqueeze(-1)
    labels = torch.where(counted, labels.unsqueeze(-1), 0)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = torch.where(counted, lse - logits.gather(-1, labels), 0.0).sum()
    probs = (logits - lse).exp()
    is_label = torch.arange(logits.shape[-1], device=logits.device) == labels
    # where, not a product with counted: with no label counted the scale is inf, and inf * 0 is nan
    return loss, torch.where(counted, torch.where(is_label, probs - 1, probs) * scale, 0.0).to(dtype)


def _counted(labels: torch.Tensor) -> torch.Tensor:
    """How many of ``labels`` count in the mean, a float32 tensor on their device (no host read)."""
    return (labels != IGNORE_INDEX).sum(dtype=torch.float32)


class ChunkedLoss(LanguageModelLoss):
    """The LM head and the cross-entropy ``chunk_tokens`` tokens at a time; the gradients computed in forward, one
    chunk's logits at a time (the module's docstring)."""

    def __init__(self, chunk_tokens: int = 4096):
        if chunk_tokens < 1:
            raise ConfigError("loss.chunk_tokens", f"must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self._loss, self._loss_and_grad = chunk_loss, chunk_loss_and_grad

    def __call__(self, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        device = hidden.device.type
        # The head's GEMMs in the dtype autocast would give a linear (one rank: bf16 copies of the fp32 operands,
        # whose gradients the casts widen back), else in the weight's (FSDP2's bf16 parameters, or fp32).
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else head_weight.dtype
        hidden, head_weight = hidden.to(dtype), head_weight.to(dtype)
        tokens, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        with torch.autocast(device, enabled=False):
            if torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad):
                loss = _ChunkedHeadCrossEntropy.apply(
                    tokens, head_weight, labels, self.chunk_tokens, self._loss_and_grad
                )
            else:  # evaluation: the loss alone
                chunks = zip(tokens.split(self.chunk_tokens), labels.split(self.chunk_tokens))
                loss = torch.stack([self._loss(h @ head_weight.t(), y) for h, y in chunks]).sum() / _counted(labels)
        return loss

    def compiled(self) -> ChunkedLoss:
        out = copy.copy(self)
        out._loss = torch.compile(chunk_loss, fullgraph=True)
        out._loss_and_grad = torch.compile(chunk_loss_and_grad, fullgraph=True)
        return out


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``tokens @ weight.T`` [T, V] against ``labels``, chunk by chunk, with both gradients
    computed in forward and scaled in backward (Liger-Kernel's fused linear cross-entropy does the same)."""

    @staticmethod
    def forward(ctx, tokens, weight, labels, chunk_tokens, loss_and_grad):
        needs_tokens_grad, needs_weight_grad = ctx.needs_input_grad[:2]
        scale = 1.0 / _counted(labels)
        grad_tokens = torch.empty_like(tokens) if needs_tokens_grad else None
        # The weight's gradient summed over several chunks in fp32, as the one GEMM over every token sums it (a bf16
        # gradient then rounded once, at the end); over one chunk that GEMM is the chunk's.
        several = tokens.shape[0] > chunk_tokens
        summed = torch.promote_types(weight.dtype, torch.float32) if several else weight.dtype
        grad_weight = torch.zeros_like(weight, dtype=summed) if needs_weight_grad else None
        total = torch.zeros((), dtype=torch.float32, device=tokens.device)
        for start in range(0, tokens.shape[0], chunk_tokens):
            h, y = tokens[start : start + chunk_tokens], labels[start : start + chunk_tokens]
            loss, grad_logits = loss_and_grad(h @ weight.t(), y, scale)
            total += loss
            if needs_tokens_grad:
                torch.mm(grad_logits, weight, out=grad_tokens[start : start + chunk_tokens])
            if needs_weight_grad:
                if grad_weight.dtype == weight.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:  # the chunk's share in the compute dtype (fp32 inside the GEMM), summed in fp32
                    grad_weight += grad_logits.t() @ h
            del grad_logits  # before the next chunk's logits exist
        ctx.save_for_backward(grad_tokens, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_tokens, grad_weight = ctx.saved_tensors
        # In place: saved tensors a second backward would read fail autograd's version check instead.
        if grad_tokens is not None:
            grad_tokens = grad_tokens.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_tokens, grad_weight, None, None, None
