"""Checks of whether packing changes what a model computes, each returning the largest difference.

They are the checks behind the packing tests and `scripts/check_packing.py`.

The same documents go through the real data path (`collate_rows`) twice: packed into shared
rows, and padded one per row (the reference). A model that honours `cu_seqlens` and
`position_ids` gives the same logits, loss and gradients both ways, and no document's result
moves when another document in its row changes.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from src.data.packing.collate import collate_rows
from src.data.packing.packing import Sample, pack
from src.utils.contracts import IGNORE_INDEX

# Lengths that catch the usual mistakes: a one-token document, lengths that are not multiples
# of a Gated DeltaNet chunk (16, 32, 64), documents that cross chunk edges inside a row.
DEFAULT_LENGTHS = (1, 13, 16, 17, 40, 7, 33, 64, 2, 29, 50, 3)

# The largest difference each check of `run_checks` allows in fp32: logits as the transformers
# Qwen3-Next packed test, gradients relative; no leak at all.
TOLERANCES = {
    "logits_vs_alone": 1e-5,
    "logits_vs_padded": 1e-5,
    "loss_vs_padded": 1e-5,
    "grads_vs_padded": 1e-4,
    "grads_worst_parameter": 1e-3,
    "loss_across_packings": 1e-5,
    "leak_canary": 0.0,
}


def random_documents(vocab_size: int, lengths: Sequence[int], seed: int = 0) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Sample(
            torch.randint(0, vocab_size, (n,), generator=generator), torch.ones(n, dtype=torch.bool)
        )
        for n in lengths
    ]


def batches(
    documents: list[Sample], row_length: int, strategy: str = "best_fit"
) -> tuple[dict, dict]:
    """(packed batch, padded batch) of the same documents, as the datamodules build them."""
    rows = pack([len(d) for d in documents], row_length, strategy)
    packed = collate_rows([[documents[i] for i in row] for row in rows], 0, row_length)
    padded = collate_rows([[d] for d in documents], 0)
    return packed, padded


def logits_of(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(
        batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"]
    )


def per_document(values: torch.Tensor, batch: dict) -> list[torch.Tensor]:
    """A [B, T, ...] tensor cut into its documents' real tokens, in document order."""
    flat_index = batch["document_index"].flatten()
    flat = values.flatten(0, 1)
    return [flat[flat_index == d] for d in range(int(flat_index.max()) + 1)]


def documents_in_batch_order(batch: dict, documents: list[Sample]) -> list[int]:
    """Which input document each of the batch's documents is (by matching tokens)."""
    found, remaining = [], list(range(len(documents)))
    for tokens in per_document(batch["input_ids"], batch):
        match = next(i for i in remaining if torch.equal(documents[i].tokens, tokens))
        remaining.remove(match)
        found.append(match)
    return found


def mean_token_loss(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
    )


def gradients(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = mean_token_loss(logits_of(model, batch), batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach(), grads


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def run_checks(model: nn.Module, documents: list[Sample], row_length: int) -> dict[str, float]:
    """Largest differences between the packed and the reference computations, by check.

    The checks:

    - `logits_vs_alone`: packed logits vs each document run alone (max abs);
    - `logits_vs_padded`: packed vs padded batch, padding removed (max abs);
    - `loss_vs_padded`: mean token loss, relative;
    - `grads_vs_padded`: all parameter gradients together, relative;
    - `grads_worst_parameter`: the largest relative error of any one parameter's gradient
      (rounding dominates for parameters with tiny gradients, such as DeltaNet's decay rates);
    - `loss_across_packings`: best-fit vs greedy packing of the same documents, relative;
    - `leak_canary`: other documents' logits after changing one document (max abs, expect 0).
    """
    model.eval()  # no dropout; gradients still flow
    packed, padded = batches(documents, row_length)
    packed_order = documents_in_batch_order(packed, documents)
    results = {}
    with torch.no_grad():
        packed_logits = per_document(logits_of(model, packed), packed)
        padded_logits = per_document(logits_of(model, padded), padded)
        alone = [model(d.tokens[None])[0] for d in documents]
    results["logits_vs_alone"] = max(
        (logits - alone[i]).abs().max().item()
        for logits, i in zip(packed_logits, packed_order, strict=True)
    )
    results["logits_vs_padded"] = max(
        (logits - padded_logits[i]).abs().max().item()
        for logits, i in zip(packed_logits, packed_order, strict=True)
    )
    packed_loss, packed_grads = gradients(model, packed)
    padded_loss, padded_grads = gradients(model, padded)
    results["loss_vs_padded"] = relative_error(packed_loss, padded_loss)
    names = sorted(padded_grads)
    results["grads_vs_padded"] = relative_error(
        torch.cat([packed_grads[n].flatten() for n in names]),
        torch.cat([padded_grads[n].flatten() for n in names]),
    )
    results["grads_worst_parameter"] = max(
        relative_error(packed_grads[n], padded_grads[n]) for n in names
    )
    greedy, _ = batches(documents, row_length, "greedy")
    with torch.no_grad():
        greedy_loss = mean_token_loss(logits_of(model, greedy), greedy)
    results["loss_across_packings"] = relative_error(greedy_loss, packed_loss)
    results["leak_canary"] = leak_canary(model, packed)
    return results


@torch.no_grad()
def leak_canary(model: nn.Module, batch: dict) -> float:
    """How far the other documents' logits move when one document's tokens all change.

    Every token of the first document that has another one after it in its row is changed; the
    result is how far the logits of the batch's other real tokens moved (0.0 when documents are
    isolated).
    """
    index = batch["document_index"]
    rows = [int(torch.nonzero(index == d)[0, 0]) for d in range(int(index.max()) + 1)]
    canary = next(d for d in range(len(rows) - 1) if rows[d] == rows[d + 1])
    changed = dict(batch)
    changed["input_ids"] = torch.where(
        index == canary, (batch["input_ids"] + 1) % 7, batch["input_ids"]
    )
    others = ((index >= 0) & (index != canary))[..., None]
    before, after = logits_of(model, batch), logits_of(model, changed)
    return (before - after).masked_select(others).abs().max().item()
