"""Autoregressive decoding with per-layer caches: greedy, or sampled (temperature, top-k, top-p)."""

import torch

from src.models.language.qwen.attention import KVCache
from src.models.language.qwen.config import QwenConfig
from src.models.language.qwen.deltanet import DeltaNetCache


class Cache:
    """What a QwenLM carries between decoding steps: each layer's cache and the tokens seen.

    Attention layers keep keys and values; Gated DeltaNet layers keep the convolution inputs and
    the recurrent state.
    """

    def __init__(self, config: QwenConfig):
        assert config.layer_types is not None, "QwenConfig.__post_init__ fills in layer_types"
        self.layers = [
            DeltaNetCache() if layer_type == "linear_attention" else KVCache()
            for layer_type in config.layer_types
        ]
        self.length = 0


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """input_ids [B, T] followed by up to `max_new_tokens` new tokens per row.

    temperature 0 is greedy decoding; above 0, tokens are sampled from softmax(logits /
    temperature), restricted to the `top_k` most likely when given, and to the smallest set of
    most likely tokens whose probability reaches `top_p` (nucleus sampling) below 1. Decoding
    stops early once every row has produced an `eos_token_id`; rows that finished first are
    padded with it.
    The prompt is read in one forward pass, then each step feeds one token through the cache.
    """
    if (
        temperature < 0
        or (top_k is not None and top_k < 1)
        or not 0 < top_p <= 1
        or max_new_tokens < 0
    ):
        raise ValueError(
            f"Need temperature >= 0, top_k >= 1 or None, 0 < top_p <= 1 and max_new_tokens >= "
            f"0; got temperature={temperature}, top_k={top_k}, top_p={top_p}, "
            f"max_new_tokens={max_new_tokens}"
        )
    stop = None if eos_token_id is None else torch.tensor(eos_token_id, device=input_ids.device)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    cache = Cache(model.config)
    logits = model(input_ids, cache=cache)[:, -1]
    tokens = [input_ids]
    for _ in range(max_new_tokens):
        token = _next_token(logits, temperature, top_k, top_p, generator)  # [B]
        if stop is not None:
            token = torch.where(finished, stop.view(-1)[0], token)
            finished |= torch.isin(token, stop)
        tokens.append(token[:, None])
        if finished.all():
            break
        logits = model(token[:, None], cache=cache)[:, -1]
    return torch.cat(tokens, dim=1)


def _next_token(logits, temperature, top_k, top_p, generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth_largest = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, -torch.inf)
    if top_p < 1:
        # Keep each token whose more likely tokens hold less than top_p: the smallest nucleus.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        outside_sorted = probs.cumsum(dim=-1) - probs >= top_p
        outside = torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)
        logits = logits.masked_fill(outside, -torch.inf)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(1)
