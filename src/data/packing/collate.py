"""One collate function for packed and padded text batches, derived from the document lengths.

Everything the model and the loss need is derived here from one source of truth, the per-row
document lengths.

For a batch of B rows of T token slots, each row holding one or more documents followed by
padding:

- `input_ids` [B, T]: the documents' tokens back to back, then `pad_id`;
- `document_lengths` [B, D]: the lengths of each row's documents, 0 after the last;
- `position_ids` [B, T]: 0, 1, 2, ... restarting at every document (a split continuation
  starts at its offset); padding continues its row's last document;
- `cu_seqlens` [N + 1] int32: offsets of the N documents in the flattened B*T tokens, row starts
  included, FlashAttention's convention. Padding belongs to its row's last document (it sits
  after every real token, so causal layers never let a real token see it) and never forms a
  document of its own;
- `document_index` [B, T]: which of the N documents a token belongs to, -1 on padding;
- `labels` [B, T]: the target of every position, shifted inside each document: token t + 1 of
  the same document, or IGNORE_INDEX at each document's last position, on padding and wherever
  the target is not trained on (SFT prompts).
"""

from collections.abc import Sequence

import torch

from src.data.packing.packing import Sample
from src.utils.contracts import IGNORE_INDEX


def collate_rows(
    rows: Sequence[Sequence[Sample]],
    pad_id: int,
    row_length: int | None = None,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """A batch from `rows`, each a list of samples that fit in one row.

    Rows are `row_length` slots long (packing), or as long as the longest row rounded up to a
    multiple of `pad_to_multiple_of` when None (padding to the batch's longest).
    """
    lengths = [[len(sample) for sample in row] for row in rows]
    longest = max(sum(row) for row in lengths)
    if row_length is None:
        row_length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    if longest > row_length or any(not row or 0 in row for row in lengths):
        raise ValueError(
            f"every row needs one or more non-empty samples and at most {row_length} tokens"
        )
    batch, slots = len(rows), (len(rows), row_length)
    input_ids = torch.full(slots, pad_id, dtype=torch.long)
    targets = torch.zeros(slots, dtype=torch.bool)
    next_tokens = torch.full(slots, IGNORE_INDEX, dtype=torch.long)  # labels of last tokens
    offsets = torch.zeros(slots, dtype=torch.long)
    for b, row in enumerate(rows):
        start = 0
        for sample in row:
            end = start + len(sample)
            input_ids[b, start:end] = sample.tokens
            targets[b, start:end] = sample.targets
            next_tokens[b, end - 1] = sample.next_token
            offsets[b, start:end] = sample.position_offset
            start = end
        offsets[b, start:] = row[-1].position_offset  # padding continues the last document
    document_lengths = torch.zeros(batch, max(map(len, lengths)), dtype=torch.long)
    for b, row_lengths in enumerate(lengths):
        document_lengths[b, : len(row_lengths)] = torch.tensor(row_lengths)
    metadata = document_metadata(document_lengths, row_length)
    return {
        "input_ids": input_ids,
        "labels": shifted_labels(input_ids, targets, next_tokens, metadata["document_index"]),
        "position_ids": metadata["position_ids"] + offsets,
        "cu_seqlens": metadata["cu_seqlens"],
        "document_index": metadata["document_index"],
        "document_lengths": document_lengths,
    }


def document_metadata(document_lengths: torch.Tensor, row_length: int) -> dict[str, torch.Tensor]:
    """`position_ids`, `cu_seqlens` and `document_index` of rows with these document lengths.

    `document_lengths` is [B, D], zero after each row's last document.
    """
    batch = document_lengths.shape[0]
    real = document_lengths.sum(1)
    documents_per_row = (document_lengths > 0).sum(1)
    # Each row's last document absorbs the row's padding.
    segment_lengths = document_lengths.clone()
    rows = torch.arange(batch)
    segment_lengths[rows, documents_per_row - 1] += row_length - real
    segments = segment_lengths[segment_lengths > 0]  # row-major: row by row, in order
    cu_seqlens = torch.cat((torch.zeros(1, dtype=torch.long), segments.cumsum(0)))
    segment_of_token = torch.repeat_interleave(torch.arange(len(segments)), segments)
    position = torch.arange(batch * row_length) - cu_seqlens[segment_of_token]
    is_real = torch.arange(row_length)[None, :] < real[:, None]
    document_index = torch.where(is_real, segment_of_token.view(batch, row_length), -1)
    return {
        "position_ids": position.view(batch, row_length),
        "cu_seqlens": cu_seqlens.to(torch.int32),
        "document_index": document_index,
    }


def shifted_labels(
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    next_tokens: torch.Tensor,
    document_index: torch.Tensor,
) -> torch.Tensor:
    """labels[t] = input_ids[t + 1] where t + 1 is in t's document and is a target.

    At a document's last position, `next_tokens` (the continuation of a split sample, else
    IGNORE_INDEX).
    """
    following = torch.cat(
        (input_ids[:, 1:], torch.full_like(input_ids[:, :1], IGNORE_INDEX)), dim=1
    )
    following_targets = torch.cat((targets[:, 1:], torch.zeros_like(targets[:, :1])), dim=1)
    following_document = torch.cat((document_index[:, 1:], -torch.ones_like(input_ids[:, :1])), 1)
    same_document = (following_document == document_index) & (document_index >= 0)
    labels = torch.where(same_document & following_targets, following, IGNORE_INDEX)
    is_last = (document_index >= 0) & ~same_document
    return torch.where(is_last, next_tokens, labels)
