"""Exact-match accuracy of greedy answers: what validation loss cannot say about an SFT model."""

from collections import defaultdict

import torch

from src.models.language.qwen.generation import generate


@torch.no_grad()
def count_exact_matches(
    model, tokenizer, examples: list[tuple[list[int], str]], max_new_tokens: int = 64
) -> int:
    """Count the (prompt ids, expected answer) examples that `model` answers exactly.

    Decoding is greedy until the end-of-turn token; prompts of equal length form one batch.
    """
    device = next(model.parameters()).device
    by_length: dict[int, list[tuple[list[int], str]]] = defaultdict(list)
    for prompt, answer in examples:
        by_length[len(prompt)].append((prompt, answer))
    correct = 0
    was_training = model.training
    model.eval()
    for group in by_length.values():
        prompts = torch.tensor([prompt for prompt, _ in group], device=device)
        longest = max(len(tokenizer.encode(answer)) for _, answer in group)
        out = generate(
            model,
            prompts,
            max_new_tokens=min(max_new_tokens, longest + 1),
            eos_token_id=tokenizer.eos_token_id,
        )
        for row, (_, answer) in zip(out[:, prompts.shape[1] :].tolist(), group, strict=True):
            if tokenizer.eos_token_id in row:
                correct += tokenizer.decode(row[: row.index(tokenizer.eos_token_id)]) == answer
    model.train(was_training)
    return correct
