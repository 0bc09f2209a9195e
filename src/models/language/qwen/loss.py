"""Next-token loss from the final hidden states and head weight, without [tokens, vocab] logits.

At Qwen3's 151,936-token vocabulary those logits are the largest tensor of a training step.

With gradients, PyTorch's `F.linear_cross_entropy` computes the head and the loss in row chunks.
Without gradients (validation, test) a short loop over the same chunks also counts the argmax
predictions, which the fused op does not return.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from src.utils.contracts import IGNORE_INDEX


class TokenLoss(NamedTuple):
    """Sums over one batch's supervised tokens (labels != IGNORE_INDEX)."""

    loss_sum: torch.Tensor  # sum of the token cross-entropies, in fp32 or the head's wider dtype
    tokens: torch.Tensor  # how many tokens are supervised
    correct: torch.Tensor | None  # argmax equal to the label; None when computed with gradients


def next_token_loss(
    hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, chunk_size: int | None
) -> TokenLoss:
    """Cross-entropy of `hidden` [..., hidden_size] @ head_weight.T against `labels` [...].

    `chunk_size` rows of logits exist at a time; None computes the full logits at once (the
    reference path). Under autocast the head runs in the autocast dtype, as `nn.Linear` would,
    and the loss is summed in fp32, or in fp64 for an fp64 model.
    """
    hidden, head_weight = _in_autocast_dtype(hidden.flatten(0, -2), head_weight)
    labels = labels.flatten()
    tokens = (labels != IGNORE_INDEX).sum()
    with_gradients = torch.is_grad_enabled()
    if with_gradients and chunk_size is not None:
        return TokenLoss(_fused_loss_sum(hidden, head_weight, labels, chunk_size), tokens, None)
    loss_sum = hidden.new_zeros((), dtype=summed_dtype(hidden))
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    rows_per_chunk = chunk_size or max(len(hidden), 1)  # None: every row in one chunk
    for rows, targets in zip(
        hidden.split(rows_per_chunk), labels.split(rows_per_chunk), strict=True
    ):
        logits = F.linear(rows, head_weight).to(loss_sum.dtype)
        loss_sum = loss_sum + F.cross_entropy(
            logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        if not with_gradients:
            correct += (logits.argmax(-1) == targets).sum()
    return TokenLoss(loss_sum, tokens, None if with_gradients else correct)


def label_logps(
    hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, chunk_size: int | None
) -> torch.Tensor:
    """The log-probability of each label [...] under `hidden` @ head_weight.T, 0 where ignored.

    Preference losses sum them over each response. As for `next_token_loss`, `chunk_size` rows
    of logits exist at a time (None: all at once), and the values are in fp32 or wider.
    """
    shape = labels.shape
    hidden, head_weight = _in_autocast_dtype(hidden.flatten(0, -2), head_weight)
    labels = labels.flatten()
    if torch.is_grad_enabled() and chunk_size is not None:
        losses = F.linear_cross_entropy(
            hidden,
            head_weight,
            labels,
            reduction="none",
            ignore_index=IGNORE_INDEX,
            options=nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size, acc_policy="compact"),
        )
        return -losses.to(summed_dtype(hidden)).view(shape)
    rows_per_chunk = chunk_size or max(len(hidden), 1)
    chunks = [
        F.cross_entropy(
            F.linear(rows, head_weight).to(summed_dtype(hidden)),
            targets,
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        for rows, targets in zip(
            hidden.split(rows_per_chunk), labels.split(rows_per_chunk), strict=True
        )
    ]
    return -torch.cat(chunks).view(shape)


def _in_autocast_dtype(hidden, head_weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in the autocast dtype when autocast is on, as `nn.Linear` would compute the head."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return hidden.to(dtype), head_weight.to(dtype)
    return hidden, head_weight


def _fused_loss_sum(hidden, head_weight, labels, chunk_size: int) -> torch.Tensor:
    """F.linear_cross_entropy's chunked sum, in fp32 at least whatever the head's dtype.

    Its "sum" comes back in the input dtype, and in bf16 a sum of thousands of token losses is
    good to about 0.3%: below fp32, per-token losses are summed here instead (about 25% more
    time in the head, which then recomputes its chunks in backward). "compact" keeps fewer fp32
    intermediates than the "accurate" that PyTorch picks for bf16 on CPUs: measured with the
    same gradients (2e-3 from fp32 either way) and twice as fast on a CPU with bf16 matmuls.
    """
    low_precision = hidden.dtype in (torch.bfloat16, torch.float16)
    losses = F.linear_cross_entropy(
        hidden,
        head_weight,
        labels,
        reduction="none" if low_precision else "sum",
        ignore_index=IGNORE_INDEX,
        options=nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size, acc_policy="compact"),
    )
    return losses.sum(dtype=summed_dtype(hidden))


def summed_dtype(hidden: torch.Tensor) -> torch.dtype:
    """fp32, or the hidden states' dtype where it is wider (an fp64 run keeps its precision)."""
    return torch.promote_types(hidden.dtype, torch.float32)
