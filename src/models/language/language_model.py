"""The LightningModule that trains a QwenLM on next-token prediction."""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torchmetrics import MaxMetric, SumMetric

from src.models.language.adapters import build_adapter
from src.models.language.exact_match import count_exact_matches
from src.models.language.expert_parallel import dispatched_bytes
from src.models.language.parallel import shard_decoder_layers
from src.models.language.qwen import QwenConfig, QwenLM
from src.models.language.qwen.kernels import PYTORCH
from src.models.language.qwen.loss import TokenLoss
from src.models.language.qwen.moe import expert_load
from src.models.language.qwen.transformers_format.folders import (
    config_for_checkpoint,
    folder_layout,
)
from src.models.optimization import OptimizedModule, OptimizerFactory
from src.utils.contracts import TOKENS, ExactMatchExample, Tokenizer
from src.utils.errors import ConfigError

# Summed over a validation or test split: token losses, supervised tokens, and tokens predicted
# right (argmax).
EVAL_SUMS = ("loss", "tokens", "correct")
# The checkpoint key naming the transformers folder whose unused tensors (a vision tower, MTP
# layers) an export writes back: the rebuilt model has no `pretrained` to know it by.
SOURCE_KEY = "qwen_source_folder"
# model.kernels: None lets each layer use the installed fused kernels on GPU inputs.
KERNEL_CHOICES = {"auto": None, "pytorch": PYTORCH}


class LanguageModel(OptimizedModule):
    """Train a QwenLM on next-token prediction with the configured optimizer and schedule.

    Batches are dicts: `input_ids` and `labels` [B, T] (labels[t] is the target of position t,
    IGNORE_INDEX where nothing is supervised), optionally `position_ids` [B, T] and
    `cu_seqlens` (int32 document offsets of packed rows). `train/loss` is the mean over every
    supervised token of the optimizer step, however the tokens fall into micro-batches. A
    mixture of experts adds `router_aux_loss_coef` times its load-balancing loss
    (`train/aux_loss`) to what it optimises, and logs each sparse layer's busiest expert over
    the mean (`moe/layer_{i}/load_max_over_mean`, the worst as `moe/load_max_over_mean`).

    - `config`: a QwenConfig as a plain dict; `pretrained`: a transformers-format folder (e.g. a
      released Qwen3 checkpoint) for the starting weights. Its config.json is checked against
      `config`: whole by default, or only the fields named in `explicit_config` (those the user
      set on the command line), the folder giving all others; the model is built as the folder
      says either way.
    - `optimizer`, `scheduler`: as for `ImageClassifier` (src/models/optimization.py); the Qwen
      configs choose `optimizer=adamw_lm` and `scheduler=warmup_cosine`. Without an optimizer
      the module still evaluates and generates.
    - `loss_chunk_size`: rows of logits computed at a time (src/models/language/qwen/loss.py);
      `activation_checkpointing` recomputes each decoder layer in backward.
    - `adapter` (`adapter=lora`, src/models/language/adapters.py): freezes the base and trains
      LoRA adapters; checkpoints then hold the adapters and name the base, which `pretrained`
      (else the recorded path) supplies again on loading.
    """

    batch_kind = TOKENS
    # The optimizer step's running sums, reset by _reset_step after each step.
    _step_normaliser: int | None
    _step_loss_sum: torch.Tensor | float  # becomes a tensor on the batch's device
    _step_tokens: torch.Tensor | int

    def __init__(
        self,
        config: dict[str, Any],
        optimizer: OptimizerFactory | None = None,
        scheduler: dict[str, Any] | None = None,
        pretrained: str | None = None,
        kernels: str = "auto",
        loss_chunk_size: int | None = 512,
        activation_checkpointing: bool = False,
        adapter: dict[str, Any] | None = None,
        explicit_config: list[str] | None = None,
    ):
        super().__init__(optimizer, scheduler)
        if kernels not in KERNEL_CHOICES:
            raise ConfigError(
                f"model.kernels={kernels!r}: choose auto (the installed fused kernels on GPU "
                f"inputs) or pytorch (the PyTorch code everywhere, e.g. to compare the two)"
            )
        if loss_chunk_size is not None and loss_chunk_size < 1:
            raise ConfigError(
                f"model.loss_chunk_size={loss_chunk_size}: give the rows of logits computed at "
                f"a time (e.g. 512), or null for all of them at once"
            )
        qwen_config = QwenConfig.from_dict(dict(config))
        if pretrained:
            qwen_config = config_for_checkpoint(qwen_config, pretrained, explicit_config)
        # Only plain values as hyperparameters (the adapter adds its own below), so that
        # checkpoints load with torch.load(weights_only=True).
        self.save_hyperparameters({"config": qwen_config.to_dict()}, logger=False)
        self.net = QwenLM(
            qwen_config, KERNEL_CHOICES[kernels], loss_chunk_size, activation_checkpointing
        )
        if pretrained:
            self.net.load_hf_weights(pretrained)
        # adapter=lora: the base frozen in its dtype, LoRA adapters the only trained weights.
        self.adapter = build_adapter(self.net, adapter, pretrained)
        self.hparams.update(self.adapter.hyperparameters())  # load_from_checkpoint
        # A frozen base is left out of checkpoints; on_load_checkpoint puts it back and checks
        # that every other key is there (FSDP2's strategy loads the state before that hook).
        self.strict_loading = not self.adapter.freezes_base
        # Weight decay on matrices only, not on norms, biases or the DeltaNet gates. By name,
        # while shapes are still whole: wrappers such as FSDP flatten them later.
        self.no_weight_decay = frozenset(n for n, p in self.named_parameters() if p.ndim < 2)
        self.eval_sums = nn.ModuleDict(
            {stage: nn.ModuleDict({n: SumMetric() for n in EVAL_SUMS}) for stage in ("val", "test")}
        )
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in checkpoints, so a resumed run keeps its best
        self._reset_step()

    def forward(self, input_ids, position_ids=None, cu_seqlens=None) -> torch.Tensor:
        return self.net(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens)

    def metric_keys(self) -> set[str]:
        """The metrics this module logs (src/run/metric_keys.py checks monitors against them)."""
        keys = {"train/loss", "val/acc_best"}
        keys |= {f"{stage}/{name}" for stage in ("val", "test") for name in ("loss", "ppl", "acc")}
        if sparse := self.net.sparse_layer_indices():
            keys |= {"train/aux_loss", "moe/load_max_over_mean", "moe/dispatched_bytes"}
            keys |= {f"moe/layer_{index}/load_max_over_mean" for index in sparse}
        return keys

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Refuse image/video tokens while the ids are still on the host (no device sync)."""
        if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
            self.net.refuse_vision_tokens(batch["input_ids"])
        return batch

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.adapter.check_can_train()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """An adapter run's checkpoint holds its adapters and names its base, not its weights.

        The checkpoint names the base by path and fingerprint (`adapter_base`) instead of holding
        the frozen base weights again. A model loaded from a transformers folder names it, so
        that an export of the restored run writes back what the model does not hold.
        """
        self.adapter.strip_checkpoint(checkpoint)
        if self.net.source is not None:
            checkpoint[SOURCE_KEY] = str(self.net.source)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Put an adapter checkpoint's base back into its state dict, so that it loads whole.

        The base is first checked to be the one it was trained on (loaded from the recorded path
        if this model has none). The folder the weights came from becomes the network's `source`
        again, unless one was given now, and the config the run trained with gives its folder
        layout.
        """
        self.adapter.complete_checkpoint(checkpoint, self)
        if (source := checkpoint.get(SOURCE_KEY)) and self.net.source is None:
            self.net.source = Path(source)  # unless the folder was given anew (a moved base)
        if recorded := checkpoint.get("hyper_parameters", {}).get("config"):
            # A multimodal folder's (qwen3_5) where the run's config said qwen3_5_text.
            self.net.config = folder_layout(self.net.config, QwenConfig.from_dict(recorded))

    def configure_model(self) -> None:
        """Shard the decoder layers under FSDP2 (`trainer=model_parallel`); a no-op otherwise."""
        shard_decoder_layers(self.net, self.device_mesh)

    def flops_per_batch(self, batch: dict[str, torch.Tensor]) -> float | torch.Tensor:
        """Training FLOPs of a batch (what the Throughput callback's MFU adds up).

        Padded rows attend over the whole row. Packed rows (`document_lengths` [B, D]) attend
        within each document, so the dense part is counted per token slot and the attention
        part per document, over its own length: a 0-d tensor on the batch's device, so that
        counting never waits for it.
        """
        rows, length = batch["input_ids"].shape
        per_token = self.net.flops_per_token(length)
        if "document_lengths" not in batch:
            return rows * length * per_token
        # An n-token document has n (n + 1) / 2 causal query-key pairs.
        per_pair = self.net.attention_flops_per_pair()
        dense_per_token = per_token - per_pair * (length + 1) / 2
        lengths = batch["document_lengths"]
        # As in the packed attention's cu_seqlens, each row's last document absorbs its padding.
        last = ((lengths > 0).sum(1) - 1).clamp_min(0)
        padding = length - lengths.sum(1)
        segments = lengths.scatter_add(1, last[:, None], padding[:, None])
        pairs = (segments * (segments + 1) // 2).sum()  # exact in int64
        # float64 so that long sums of ~1e13 per batch stay exact; MPS has no float64.
        dtype = torch.float32 if pairs.device.type == "mps" else torch.float64
        return rows * length * dense_per_token + per_pair * pairs.to(dtype)

    @property
    def vocab_size(self) -> int:
        return self.net.config.vocab_size

    def count_exact_matches(
        self, tokenizer: Tokenizer, examples: Sequence[ExactMatchExample]
    ) -> int:
        """How many prompts the model answers exactly, decoding greedily.

        This is the ExactMatch callback's score.
        """
        return count_exact_matches(self.net, tokenizer, list(examples))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, tokens, _ = self._token_loss(batch)
        # Summed token losses over a normaliser fixed for the step: on_before_optimizer_step
        # turns the accumulated gradient into that of the mean over the step's tokens.
        if self._step_normaliser is None:
            # Rows, not B*T: every rank's micro-batches hold the same number of rows, while
            # padded rows may differ in length between ranks.
            self._step_normaliser = batch["labels"].shape[0]
        self._step_loss_sum = self._step_loss_sum + loss_sum.detach()
        self._step_tokens = self._step_tokens + tokens
        return (loss_sum + self._router_loss(tokens)) / self._step_normaliser

    def _router_loss(self, tokens: torch.Tensor) -> torch.Tensor | float:
        """The mixture of experts' weighted load-balancing loss, as a sum over `tokens`.

        on_before_optimizer_step divides the step's gradient by its supervised tokens: a
        micro-batch's auxiliary loss enters times its own, so one micro-batch optimises
        transformers' `loss + router_aux_loss_coef * aux_loss` exactly, and several are weighed
        by their tokens. 0 for a dense model.
        """
        aux_loss = self.net.router_aux_loss()
        if aux_loss is None:
            return 0.0
        self.log("train/aux_loss", aux_loss.detach(), on_step=True)
        # Read on logging steps only, as Lightning's own LearningRateMonitor decides them.
        if self.trainer._logger_connector.should_update_logs:
            loads = {i: expert_load(n) for i, n in self.net.tokens_per_expert().items()}
            for index, load in loads.items():
                self.log(f"moe/layer_{index}/load_max_over_mean", load, on_step=True)
            self.log("moe/load_max_over_mean", torch.stack(list(loads.values())).max())
            # Expert parallelism: the bytes this rank sent in this forward's all-to-alls.
            if (sent := dispatched_bytes(self.net)) is not None:
                self.log("moe/dispatched_bytes", float(sent), on_step=True)
        return self.net.config.router_aux_loss_coef * aux_loss * tokens

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the accumulated gradient into that of the mean loss over the step's tokens."""
        # The step's training_steps have run: they set the normaliser and made both sums tensors.
        assert self._step_normaliser is not None
        assert isinstance(self._step_loss_sum, torch.Tensor)
        assert isinstance(self._step_tokens, torch.Tensor)
        # Lightning calls this before gradient clipping, so clipping sees the mean's gradient.
        # Both sums in one all-reduce, straight to the process group: Lightning's
        # strategy.reduce adds a barrier, a second collective per step.
        dtype = torch.promote_types(self._step_loss_sum.dtype, torch.float32)
        sums = torch.stack([self._step_tokens.to(dtype), self._step_loss_sum.to(dtype)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        tokens, loss_sum = sums[0].clamp_min(1), sums[1]
        # Lightning divided each micro-batch loss by accumulate_grad_batches; DDP averages devices.
        micro_batches = self.trainer.accumulate_grad_batches * self.trainer.world_size
        scale = (self._step_normaliser * micro_batches / tokens).item()
        if scale != 1.0:
            for parameter in self.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        self.log("train/loss", loss_sum / tokens, on_step=True, prog_bar=True)
        self._reset_step()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._accumulate_eval("val", batch)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._accumulate_eval("test", batch)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _token_loss(self, batch: dict[str, torch.Tensor]) -> TokenLoss:
        return self.net(
            batch["input_ids"],
            position_ids=batch.get("position_ids"),
            cu_seqlens=batch.get("cu_seqlens"),
            labels=batch["labels"],
        )

    def _accumulate_eval(self, stage: str, batch: dict[str, torch.Tensor]) -> None:
        loss_sum, tokens, correct = self._token_loss(batch)
        sums = cast(Mapping[str, SumMetric], self.eval_sums[stage])  # as built in __init__
        sums["loss"].update(loss_sum)
        sums["tokens"].update(tokens)
        # Lightning evaluates without gradients, where the loss also counts the right argmaxes.
        assert correct is not None
        sums["correct"].update(correct)

    def _log_eval(self, stage: str) -> None:
        """Log the loss per supervised token over the whole split, its perplexity and accuracy.

        The accuracy is next-token accuracy; the exact-match accuracy of SFT data comes from the
        ExactMatch callback.
        """
        sums = cast(Mapping[str, SumMetric], self.eval_sums[stage])  # as built in __init__
        tokens = sums["tokens"].compute().clamp_min(1)
        loss = sums["loss"].compute() / tokens
        accuracy = sums["correct"].compute() / tokens
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val")
        self.log(f"{stage}/ppl", loss.exp())
        self.log(f"{stage}/acc", accuracy)
        if stage == "val" and not self.trainer.sanity_checking:
            self.val_acc_best(accuracy)
            self.log("val/acc_best", self.val_acc_best.compute())
        for metric in sums.values():
            metric.reset()

    def _reset_step(self) -> None:
        self._step_normaliser = None
        self._step_loss_sum = 0.0
        self._step_tokens = 0
