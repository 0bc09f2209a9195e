"""QwenLM: a Qwen3 / Qwen3-Next decoder whose parameter names are the checkpoints' own.

Reading order: `DecoderLayer` (pre-norm residual block around a token mixer and an MLP), then
`QwenLM` (embedding, layers, final norm, lm_head). The mixers live in `attention.py` and
`deltanet.py`, the norms, RoPE and MLP in `layers.py`; transformers' folders are read and written
by `hf_io.py`, through the state-dict adapter of each model type (`state_dict_adapter.py`).
"""

from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from src.models.language.qwen.attention import Attention
from src.models.language.qwen.boundaries import DocumentBoundaries
from src.models.language.qwen.config import QwenConfig
from src.models.language.qwen.deltanet import GatedDeltaNet, ShortConvolution
from src.models.language.qwen.generation import Cache, generate
from src.models.language.qwen.hf_io import (
    check_same_architecture,
    read_hf_config,
    read_hf_weights,
    save_hf_directory,
)
from src.models.language.qwen.kernels import Kernels
from src.models.language.qwen.layers import MLP, RMSNorm, ZeroCentredRMSNorm, rotary_tables
from src.models.language.qwen.loss import TokenLoss, next_token_loss


class DecoderLayer(nn.Module):
    """x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).

    The mixer is `self_attn` (full attention) or `linear_attn` (Gated DeltaNet), as
    `config.layer_types` says; the attribute names are the checkpoints'. With `checkpointed`
    set, a training forward keeps only the layer's input and recomputes the rest in backward.
    """

    checkpointed = False

    def __init__(self, config: QwenConfig, index: int, kernels: Kernels | None = None):
        super().__init__()
        norm = ZeroCentredRMSNorm if config.is_next else RMSNorm
        self.is_linear = config.layer_types[index] == "linear_attention"
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, index, kernels)
        else:
            self.self_attn = Attention(config, index, kernels)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, rotary, boundaries=None, cache=None) -> torch.Tensor:
        if self.checkpointed and cache is None and torch.is_grad_enabled():
            # Inside the layer, so that an FSDP unit wraps the checkpoint, as torchtitan and
            # Lightning's own activation_checkpointing_policy do.
            return checkpoint(self._block, x, rotary, boundaries, use_reentrant=False)
        return self._block(x, rotary, boundaries, cache)

    def _block(self, x, rotary, boundaries=None, cache=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, boundaries, cache)
        else:
            h = self.self_attn(h, rotary, boundaries, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenLM(nn.Module):
    """Causal language model: token ids [B, T] -> next-token logits [B, T, vocab_size].

    `self.model.*` and `self.lm_head` carry the same names and shapes as transformers'
    Qwen3ForCausalLM / Qwen3NextForCausalLM (dense MLP), so state dicts map one to one.
    `kernels` chooses the fused kernels every layer may call (`kernels.PYTORCH`: none); by
    default the installed ones, on GPU inputs. Given labels, `forward` returns the loss instead
    of the logits, `loss_chunk_size` rows of logits at a time (None: all at once).
    `activation_checkpointing` recomputes each decoder layer in backward.
    """

    def __init__(
        self,
        config: QwenConfig,
        kernels: Kernels | None = None,
        loss_chunk_size: int | None = 512,
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        self.config = config
        self.loss_chunk_size = loss_chunk_size
        norm = ZeroCentredRMSNorm if config.is_next else RMSNorm
        self.model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size),
                "layers": nn.ModuleList(
                    DecoderLayer(config, i, kernels) for i in range(config.num_hidden_layers)
                ),
                "norm": norm(config.hidden_size, config.rms_norm_eps),
            }
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()
        for layer in self.model.layers:
            layer.checkpointed = activation_checkpointing

    def tie_weights(self) -> None:
        """Share lm_head's weight with the embedding when `tie_word_embeddings` says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_parameters(self) -> None:
        """The initialisation of transformers' Qwen3: N(0, initializer_range) weights, zero
        biases, each norm and Gated DeltaNet gate at its own starting value."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | ShortConvolution):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm | GatedDeltaNet):
                module.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: Cache | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | TokenLoss:
        """Logits [B, T, vocab] for input_ids [B, T], or with labels their TokenLoss.

        cu_seqlens: document offsets in the flattened B*T tokens (int32, row starts included);
            each document then sees only itself, and its positions restart at 0 unless
            position_ids [B, T] are given.
        cache: per-layer keys/values and recurrent states, updated in place (generation).
        labels: [B, T] targets, already shifted (labels[t] follows position t), IGNORE_INDEX
            where nothing is supervised. Computed here, in the forward, so that FSDP has the
            head's weight gathered.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got {list(input_ids.shape)}")
        if cache is not None and cu_seqlens is not None:
            raise ValueError(
                "cu_seqlens marks the documents of packed training rows; decode with a cache "
                "one sequence per row instead"
            )
        batch, length = input_ids.shape
        boundaries = DocumentBoundaries.from_cu_seqlens(cu_seqlens, batch, length)
        if position_ids is None:
            position_ids = self._default_positions(input_ids, boundaries, cache)
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        rotary = rotary_tables(
            position_ids, self.config.rotary_dim, self.config.rope_theta, x.dtype
        )  # cos, sin [B or 1, T, rotary_dim / 2]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rotary, boundaries, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length += length
        hidden = self.model.norm(x)
        if labels is None:
            return self.lm_head(hidden)
        return next_token_loss(hidden, self.lm_head.weight, labels, self.loss_chunk_size)

    @staticmethod
    def _default_positions(input_ids, boundaries, cache) -> torch.Tensor:
        if boundaries is not None:
            return boundaries.position_in_document
        offset = 0 if cache is None else cache.length
        return torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)[None]

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, a tied lm_head counted once. `exclude_embeddings` leaves out the
        embedding table and an untied lm_head (Kaplan et al.'s N)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.model.embed_tokens.weight.numel()
            if not self.config.tie_word_embeddings:
                total -= self.lm_head.weight.numel()
        return total

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Estimated FLOPs per token at sequence length `seq_len`, for model FLOPs utilisation.

        2 per weight of every matmul (lm_head included), plus the sequence mixing: causal
        attention over (seq_len + 1) / 2 keys on average, and for Gated DeltaNet the chunked
        algorithm as run (C x C blocks and d_k x d_v state products). Training is 3x the forward
        (the backward costs two forwards); recomputation and elementwise work are not counted.
        """
        c = self.config
        matmul_weights = self.num_parameters(exclude_embeddings=True) + c.vocab_size * c.hidden_size
        # Attention: each token attends to (seq_len + 1) / 2 keys on average.
        mixing = self.attention_flops_per_pair(training=False) * (seq_len + 1) / 2
        for layer_type in c.layer_types:
            if layer_type != "full_attention":  # per value head: C x C blocks, d_k x d_v states
                d_k, d_v = c.linear_key_head_dim, c.linear_value_head_dim
                per_head = c.linear_chunk_size * (5 * d_k + 3 * d_v) + 6 * d_k * d_v
                mixing += c.linear_num_value_heads * per_head
        forward = 2 * matmul_weights + mixing
        return 3 * forward if training else forward

    def attention_flops_per_pair(self, training: bool = True) -> float:
        """FLOPs of one causal (query, key) pair over all full-attention layers: q.k and p.v,
        2 x 2 x heads x head_dim each (3x for training). The only part of `flops_per_token`
        that grows with the length attended over."""
        c = self.config
        full_layers = sum(layer_type == "full_attention" for layer_type in c.layer_types)
        forward = 2 * 2 * c.num_attention_heads * c.head_dim * full_layers
        return 3 * forward if training else forward

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """Continue input_ids [B, T] by up to `max_new_tokens`; see `generation.generate`."""
        return generate(self, input_ids, max_new_tokens, **sampling)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        dtype: torch.dtype = torch.float32,
        kernels: Kernels | None = None,
    ) -> "QwenLM":
        """Load a transformers-format folder (config.json + safetensors, sharded or not)."""
        with torch.device("meta"):  # shapes only: the weights come from the files
            model = cls(read_hf_config(directory), kernels)
        state_dict = read_hf_weights(directory, model.state_dict())
        model.load_state_dict(state_dict, strict=True, assign=True)
        model.tie_weights()  # assigning gave lm_head and the embedding a Parameter each
        return model.to(dtype)

    def load_hf_weights(self, directory: str | Path) -> None:
        """Copy a transformers folder's weights into this model, once its config.json is checked
        to describe the same architecture (to fine-tune a released checkpoint)."""
        check_same_architecture(self.config, directory)
        self.load_state_dict(read_hf_weights(directory, self.state_dict()))

    def save_pretrained(self, directory: str | Path, max_shard_bytes: int | None = None) -> None:
        """Write config.json + model.safetensors that transformers loads back."""
        save_hf_directory(directory, self.config, self.state_dict(), max_shard_bytes)
