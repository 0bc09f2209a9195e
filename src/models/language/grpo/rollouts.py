"""Rollouts: completions sampled from the policy with its KV-cache `generate`, as a token batch.

Prompts of equal length decode together, in batches of up to `batch_rows` rows: the cache needs
no padding or attention mask that way, and a group's `num_generations` copies of one prompt
always share a length. Each completion ends at its first end-of-turn token (kept: the policy
learns to stop) or after `max_new_tokens`.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from src.models.language.qwen.generation import generate
from src.utils.contracts import IGNORE_INDEX


@dataclass
class Rollout:
    """Prompts and completions as one batch, row r the completion of prompt `rows[r]`.

    `input_ids` [N, T] is each prompt then its completion, padded on the right; `labels` [N, T]
    supervises the completion tokens only (labels[t] is the token after position t).
    """

    rows: torch.Tensor  # [N] the prompt of each completion, an index into the batch
    completion_ids: list[list[int]]  # each completion's tokens, its end-of-turn token included
    finished: torch.Tensor  # [N] whether it ended with the end-of-turn token
    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(ids) for ids in self.completion_ids], dtype=torch.float32)


@torch.no_grad()
def sample(
    net: nn.Module,
    batch: dict,
    copies: int,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    batch_rows: int | None = None,
    **sampling,
) -> Rollout:
    """`copies` completions of each prompt of `batch`, prompt-major (module docstring).

    `sampling` is `generate`'s: temperature (0 for greedy), top_k, top_p, generator.
    """
    input_ids, prompt_lengths = batch["input_ids"], batch["prompt_lengths"].tolist()
    rows = torch.arange(len(prompt_lengths)).repeat_interleave(copies)
    completions: list[list[int]] = [[] for _ in rows]
    by_length: dict[int, list[int]] = {}
    for completion, prompt in enumerate(rows.tolist()):
        by_length.setdefault(prompt_lengths[prompt], []).append(completion)
    for length, members in by_length.items():
        for start in range(0, len(members), batch_rows or len(members)):
            chunk = members[start : start + (batch_rows or len(members))]
            prompts = input_ids[rows[chunk].to(input_ids.device), :length]
            out = generate(net, prompts, max_new_tokens, eos_token_id=eos_token_id, **sampling)[
                :, length:
            ]
            for completion, tokens in zip(chunk, out.tolist(), strict=True):
                completions[completion] = _through_end(tokens, eos_token_id)
    finished = torch.tensor([bool(c) and c[-1] == eos_token_id for c in completions])
    ids, labels = _token_batch(input_ids, prompt_lengths, rows, completions, pad_token_id)
    return Rollout(
        rows.to(input_ids.device), completions, finished.to(input_ids.device), ids, labels
    )


def _through_end(tokens: list[int], eos_token_id: int) -> list[int]:
    return tokens[: tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens


def _token_batch(
    prompt_ids: torch.Tensor,
    prompt_lengths: Sequence[int],
    rows: torch.Tensor,
    completions: list[list[int]],
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of each prompt followed by its completion (see `Rollout`)."""
    lengths = [prompt_lengths[p] + len(c) for p, c in zip(rows.tolist(), completions, strict=True)]
    input_ids = torch.full((len(completions), max(lengths)), pad_token_id, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    prompts = prompt_ids.cpu()
    for row, (prompt, completion) in enumerate(zip(rows.tolist(), completions, strict=True)):
        start = prompt_lengths[prompt]
        input_ids[row, :start] = prompts[prompt, :start]
        input_ids[row, start : start + len(completion)] = torch.tensor(completion)
        labels[row, start - 1 : start - 1 + len(completion)] = torch.tensor(completion)
    device = prompt_ids.device
    return input_ids.to(device), labels.to(device)
