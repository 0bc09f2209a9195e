"""QwenLM: a Qwen3 / Qwen3-Next / Qwen3.5 decoder whose parameter names are the checkpoints' own.

Reading order: `DecoderLayer` (pre-norm residual block around a token mixer and an MLP), then
`QwenLM` (embedding, layers, final norm, lm_head). The mixers live in `attention.py` and
`deltanet.py`, the norms, RoPE and MLP in `layers.py`, the mixture of experts in `moe.py`;
transformers' folders are read and written by `transformers_format/`, through the state-dict
adapter of each model type.
"""

from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from src.models.language.qwen.attention import Attention
from src.models.language.qwen.boundaries import DocumentBoundaries
from src.models.language.qwen.config import QwenConfig
from src.models.language.qwen.deltanet import GatedDeltaNet, ShortConvolution, gated_deltanet
from src.models.language.qwen.generation import Cache, generate
from src.models.language.qwen.kernels import Kernels
from src.models.language.qwen.layers import MLP, RMSNorm, ZeroCentredRMSNorm, rotary_tables
from src.models.language.qwen.loss import TokenLoss, label_logps, next_token_loss
from src.models.language.qwen.moe import Experts, Router, SparseMoeBlock, load_balancing_loss
from src.models.language.qwen.transformers_format.folders import (
    check_same_architecture,
    read_hf_config,
    read_hf_weights,
    save_hf_directory,
)
from src.utils.errors import DataError


class DecoderLayer(nn.Module):
    """x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).

    The mixer is `self_attn` (full attention) or `linear_attn` (Gated DeltaNet), as
    `config.layer_types` says, and the MLP a dense SwiGLU or, where `config.is_sparse_layer`,
    a mixture of experts; the attribute names are the checkpoints'. With `checkpointed`
    set, a training forward keeps only the layer's input and recomputes the rest in backward.
    """

    checkpointed = False

    def __init__(self, config: QwenConfig, index: int, kernels: Kernels | None = None):
        super().__init__()
        norm = ZeroCentredRMSNorm if config.zero_centred_norms else RMSNorm
        assert config.layer_types is not None, "QwenConfig.__post_init__ fills in layer_types"
        self.is_linear = config.layer_types[index] == "linear_attention"
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = gated_deltanet(config, index, kernels)
        else:
            self.self_attn = Attention(config, index, kernels)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                config.shared_expert_intermediate_size,
            )
            if config.is_sparse_layer(index)
            else MLP(config.hidden_size, config.intermediate_size)
        )

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
    Qwen3ForCausalLM / Qwen3NextForCausalLM (dense MLP) / Qwen3_5ForCausalLM, so state dicts map
    one to one (a multimodal folder's language model through its state-dict adapter).
    `source` is the transformers folder the weights came from, if any: what QwenLM does not hold
    (a vision tower, MTP layers) is written back from it by `save_pretrained`, never kept in
    the state dict.
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
        self.source: Path | None = None
        norm = ZeroCentredRMSNorm if config.zero_centred_norms else RMSNorm
        layers = [DecoderLayer(config, i, kernels) for i in range(config.num_hidden_layers)]
        self.model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size),
                "layers": nn.ModuleList(layers),
                "norm": norm(config.hidden_size, config.rms_norm_eps),
            }
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()
        for layer in layers:
            layer.checkpointed = activation_checkpointing

    # The ModuleDict keeps the checkpoints' `model.*` names; these give its entries their types.
    @property
    def _embed_tokens(self) -> nn.Embedding:
        return cast(nn.Embedding, self.model["embed_tokens"])

    @property
    def _layers(self) -> nn.ModuleList:
        return cast(nn.ModuleList, self.model["layers"])

    @property
    def _norm(self) -> RMSNorm:
        return cast(RMSNorm, self.model["norm"])

    def tie_weights(self) -> None:
        """Share lm_head's weight with the embedding when `tie_word_embeddings` says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self._embed_tokens.weight

    def reset_parameters(self) -> None:
        """Initialise as transformers' Qwen3 does: N(0, initializer_range) weights, zero biases.

        Each norm and Gated DeltaNet gate is set to its own starting value.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | ShortConvolution):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
                if isinstance(module, nn.Linear) and module.bias is not None:  # only Linear has one
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm | GatedDeltaNet):
                module.reset_parameters()
            elif isinstance(module, Router | Experts):
                module.reset_parameters(std=self.config.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: Cache | None = None,
        labels: torch.Tensor | None = None,
        per_label: bool = False,
    ) -> torch.Tensor | TokenLoss:
        """Logits [B, T, vocab] for input_ids [B, T], or with labels their TokenLoss.

        position_ids: [B, T]; with multimodal RoPE (Qwen3.5) also [3, B, T], the temporal,
            height and width positions (on text the three are equal).
        cu_seqlens: document offsets in the flattened B*T tokens (int32, row starts included);
            each document then sees only itself, and its positions restart at 0 unless
            position_ids [B, T] are given.
        cache: per-layer keys/values and recurrent states, updated in place (generation).
        labels: [B, T] targets, already shifted (labels[t] follows position t), IGNORE_INDEX
            where nothing is supervised. Computed here, in the forward, so that FSDP has the
            head's weight gathered.
        per_label: with labels, each label's log-probability [B, T] (0 where IGNORE_INDEX)
            instead of their TokenLoss, for losses over whole responses (preference tuning).
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got {list(input_ids.shape)}")
        if cache is not None and cu_seqlens is not None:
            raise ValueError(
                "cu_seqlens marks the documents of packed training rows; decode with a cache "
                "one sequence per row instead"
            )
        if input_ids.device.type == "cpu":  # reading GPU ids here would wait for the device
            self.refuse_vision_tokens(input_ids)
        batch, length = input_ids.shape
        boundaries = DocumentBoundaries.from_cu_seqlens(cu_seqlens, batch, length)
        if position_ids is None:
            position_ids = self._default_positions(input_ids, boundaries, cache)
        elif position_ids.ndim == 3 and not (
            self.config.multimodal_rope and position_ids.shape[0] == 3
        ):
            raise ValueError(
                f"position_ids of shape {list(position_ids.shape)}: [3, B, T] (temporal, height, "
                f"width) needs multimodal RoPE (Qwen3.5); give [B, T] otherwise"
            )
        x = self._embed_tokens(input_ids)  # [B, T, hidden]
        c = self.config
        rotary = rotary_tables(
            position_ids, c.rotary_dim, c.rope_theta, x.dtype, c.mrope_section
        )  # cos, sin [B or 1, T, rotary_dim / 2]
        for i, layer in enumerate(self._layers):
            x = layer(x, rotary, boundaries, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length += length
        hidden = self._norm(x)
        if labels is None:
            return self.lm_head(hidden)
        if per_label:
            return label_logps(hidden, self.lm_head.weight, labels, self.loss_chunk_size)
        return next_token_loss(hidden, self.lm_head.weight, labels, self.loss_chunk_size)

    def sparse_blocks(self) -> list[SparseMoeBlock]:
        """The mixture-of-experts MLPs, in layer order (none in a dense model)."""
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def router_aux_loss(self) -> torch.Tensor | None:
        """The load-balancing loss of the last forward's routing; None for a dense model.

        transformers' `aux_loss` over every sparse layer; training adds `router_aux_loss_coef`
        times it to the mean token loss.
        """
        blocks = self.sparse_blocks()
        if not blocks:
            return None
        c = self.config
        logits = [block.router_logits for block in blocks]
        return load_balancing_loss(logits, c.num_experts, c.num_experts_per_tok)

    def sparse_layer_indices(self) -> list[int]:
        """The indices of the layers whose MLP is a mixture of experts."""
        return [i for i, layer in enumerate(self._layers) if isinstance(layer.mlp, SparseMoeBlock)]

    def tokens_per_expert(self) -> dict[int, torch.Tensor]:
        """Each sparse layer's last (token, choice) count per expert [E], by layer index."""
        return {
            index: layer.mlp.tokens_per_expert
            for index, layer in enumerate(self._layers)
            if isinstance(layer.mlp, SparseMoeBlock)
        }

    def refuse_vision_tokens(self, input_ids: torch.Tensor) -> None:
        """Raise a DataError if input_ids hold an image or video token (they read the host).

        Those positions are the vision tower's to fill in, and QwenLM is the text model only.
        """
        for token in self.config.vision_token_ids:
            if bool((input_ids == token).any()):
                raise DataError(
                    f"input_ids hold image/video token {token}: QwenLM trains the text model "
                    f"only; leave images and videos out of the data (or their placeholder "
                    f"tokens), as there is no vision tower to fill them in."
                )

    @staticmethod
    def _default_positions(input_ids, boundaries, cache) -> torch.Tensor:
        if boundaries is not None:
            return boundaries.position_in_document
        offset = 0 if cache is None else cache.length
        return torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device)[None]

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, a tied lm_head counted once.

        `exclude_embeddings` drops the embedding table and an untied lm_head (Kaplan et al.'s N).
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self._embed_tokens.weight.numel()
            if not self.config.tie_word_embeddings:
                total -= self.lm_head.weight.numel()
        return total

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Estimated FLOPs per token at sequence length `seq_len`, for model FLOPs utilisation.

        2 per weight of every matmul a token goes through (lm_head included; of a mixture of
        experts only the `num_experts_per_tok` it is routed to), plus the sequence mixing: causal
        attention over (seq_len + 1) / 2 keys on average, and for Gated DeltaNet the chunked
        algorithm as run (C x C blocks and d_k x d_v state products). Training is 3x the forward
        (the backward costs two forwards); recomputation and elementwise work are not counted.
        """
        c = self.config
        assert c.layer_types is not None, "QwenConfig.__post_init__ fills in layer_types"
        matmul_weights: float = self.num_parameters(True) + c.vocab_size * c.hidden_size
        for block in self.sparse_blocks():  # the experts a token is not routed to do nothing
            idle = 1 - c.num_experts_per_tok / c.num_experts
            matmul_weights -= idle * sum(p.numel() for p in block.experts.parameters())
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
        """FLOPs of one causal (query, key) pair over all full-attention layers.

        q.k and p.v, 2 x 2 x heads x head_dim each (3x for training). The only part of
        `flops_per_token` that grows with the length attended over.
        """
        c = self.config
        assert c.layer_types is not None, "QwenConfig.__post_init__ fills in layer_types"
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
        """Load a transformers-format folder (config.json + safetensors, sharded or not).

        A multimodal folder (Qwen3.5) gives its language model; the folder becomes `source`.
        """
        with torch.device("meta"):  # shapes only: the weights come from the files
            model = cls(read_hf_config(directory), kernels)
        state_dict = read_hf_weights(directory, model.state_dict())
        model.load_state_dict(state_dict, strict=True, assign=True)
        model.tie_weights()  # assigning gave lm_head and the embedding a Parameter each
        model.source = Path(directory)
        return model.to(dtype)

    def load_hf_weights(self, directory: str | Path) -> None:
        """Copy a transformers folder's weights into this model, to fine-tune a released checkpoint.

        The folder's config.json is first checked to describe the same architecture; the folder
        becomes `source`.
        """
        check_same_architecture(self.config, directory)
        self.load_state_dict(read_hf_weights(directory, self.state_dict()))
        self.source = Path(directory)

    def save_pretrained(self, directory: str | Path, max_shard_bytes: int | None = None) -> None:
        """Write config.json + model.safetensors that transformers loads back.

        With a `source` folder, its tensors that QwenLM does not use (a multimodal folder's
        vision tower, MTP layers) are written too, unchanged, and its config.json is the base of
        the new one: the result is the source's model with this one's text weights.
        """
        save_hf_directory(
            directory, self.config, self.state_dict(), max_shard_bytes, source=self.source
        )
