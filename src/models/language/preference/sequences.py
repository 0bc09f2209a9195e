"""Each response's log-probability from one forward over a batch of preference pairs.

A preference batch is a token batch (src/data/packing/collate.py) whose documents are responses
with their prompts: packed, a pair's chosen and rejected documents share a row, each attending
to itself only; padded, chosen documents fill the first rows and rejected ones the next, as in
TRL's concatenated forward. Either way `pair_documents` [P, 2] gives the document index of each
pair's chosen and rejected response, and the labels supervise the responses only.
"""

import torch
from torch import nn

from src.models.language.preference.losses import Pair
from src.utils.contracts import IGNORE_INDEX


def response_logps(net: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Pair, Pair]:
    """The log-probabilities of each pair's responses summed over their tokens, and the counts.

    Chosen and rejected responses go through `net` in one forward.
    """
    logps = net(
        batch["input_ids"],
        position_ids=batch.get("position_ids"),
        cu_seqlens=batch.get("cu_seqlens"),
        labels=batch["labels"],
        per_label=True,
    )  # [B, T], 0 where not supervised
    pairs = batch["pair_documents"]  # every document of the batch is one pair's response
    supervised = batch["labels"] != IGNORE_INDEX
    sums, counts = per_document(logps, supervised, batch["document_index"], pairs.numel())
    chosen, rejected = pairs.unbind(1)
    return Pair(sums[chosen], sums[rejected]), Pair(counts[chosen], counts[rejected])


def per_document(
    values: torch.Tensor, supervised: torch.Tensor, document_index: torch.Tensor, documents: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` [B, T] summed over each document's supervised positions, and how many there are.

    A masked sum rather than a scatter: deterministic on every device, so that a resumed run
    repeats its sums bit for bit; and no matmul, which autocast would take to 16 bits.
    """
    one_hot = document_index.flatten() == torch.arange(documents, device=values.device)[:, None]
    mask = one_hot & supervised.flatten()  # [D, B*T]
    return torch.where(mask, values.flatten(), 0).sum(1), mask.sum(1)
