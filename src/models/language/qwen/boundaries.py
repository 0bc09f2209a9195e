"""Document boundaries in packed rows, derived once per forward pass from `cu_seqlens`."""

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class DocumentBoundaries:
    """Where documents start inside the [B, T] rows of a packed batch, in every form a layer needs.

    `cu_seqlens` [N + 1] holds the offsets of the N documents in the flattened B*T tokens, from 0 to
    B*T, every row start included (so no document spans two rows), as FlashAttention's varlen
    kernels take it. flash-linear-attention takes them as int64, with a host copy that spares
    it a device sync, and caches what it derives from them by tensor identity: the one copy of
    each here, made once per forward pass, serves every layer.
    """

    cu_seqlens: torch.Tensor  # [N + 1] int32
    cu_seqlens_long: torch.Tensor  # [N + 1] int64, the same offsets as flash-linear-attention takes
    cu_seqlens_cpu: torch.Tensor  # [N + 1] int64 on the host
    starts: torch.Tensor  # [B, T] bool, True at the first token of each document
    position_in_document: torch.Tensor  # [B, T] long, 0 at each document start
    document_ids: torch.Tensor  # [B, T] long, unique across the whole batch
    max_seqlen: int

    @classmethod
    def from_cu_seqlens(
        cls, cu_seqlens: torch.Tensor | None, batch: int, length: int
    ) -> "DocumentBoundaries | None":
        """Validate `cu_seqlens` for a [batch, length] input; None when every row is one document.

        With nothing to separate, the layers then take their unmasked fast paths.

        The offsets are read on the host to be checked: one device sync per forward pass.
        """
        if cu_seqlens is None:
            return None
        offsets = _checked_offsets(cu_seqlens, batch, length)
        if len(offsets) == batch + 1:  # only the row starts: one document per row
            return None
        device = cu_seqlens.device
        total = batch * length
        starts = torch.zeros(total, dtype=torch.bool, device=device)
        cu_seqlens_long = cu_seqlens.long()
        starts[cu_seqlens_long[:-1]] = True
        document_ids = starts.cumsum(0) - 1  # [B*T], 0-based
        first_token = cu_seqlens_long[document_ids]
        position = torch.arange(total, device=device) - first_token
        lengths = [b - a for a, b in itertools.pairwise(offsets)]
        return cls(
            cu_seqlens=cu_seqlens.to(torch.int32),
            cu_seqlens_long=cu_seqlens_long,
            cu_seqlens_cpu=torch.tensor(offsets, dtype=torch.long),  # from the values read above
            starts=starts.view(batch, length),
            position_in_document=position.view(batch, length),
            document_ids=document_ids.view(batch, length),
            max_seqlen=max(lengths),
        )

    @cached_property
    def attention_mask(self) -> torch.Tensor:
        """[B, 1, T, T] bool, True where query t may attend to key s: causal, same document.

        Built on first use and shared by every attention layer of the forward pass.
        """
        ids = self.document_ids
        same_document = ids[:, :, None] == ids[:, None, :]
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        return (same_document & causal)[:, None]


def _checked_offsets(cu_seqlens: torch.Tensor, batch: int, length: int) -> list[int]:
    """The offsets as Python ints, or a ValueError that says what is wrong with them."""
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor (int32, FlashAttention's convention), got "
            f"shape {list(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
        )
    offsets = cu_seqlens.tolist()
    total = batch * length
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(
            f"cu_seqlens must run from 0 to B*T = {total} (input_ids is [{batch}, {length}]), "
            f"got {_preview(offsets)}"
        )
    if any(b <= a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {_preview(offsets)}")
    missing_rows = sorted(set(range(0, total, length)) - set(offsets))
    if missing_rows:
        raise ValueError(
            f"cu_seqlens must include every row start (multiples of T = {length}), so that no "
            f"document spans two rows; missing {_preview(missing_rows)}"
        )
    return offsets


def _preview(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"[{shown}{', ...' if len(values) > limit else ''}]"
