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
from src.models.language.grpo.objective import GRPOObjective
from src.models.language.objectives import NextToken, Objective
from src.models.language.parallel import shard_decoder_layers
from src.models.language.preference.objective import PreferenceObjective
from src.models.language.qwen import QwenConfig, QwenLM
from src.models.language.qwen.kernels import PYTORCH
from src.models.language.qwen.moe import expert_load
from src.models.language.qwen.transformers_format.folders import (
    config_for_checkpoint,
    folder_layout,
)
from src.models.optimization import OptimizedModule, OptimizerFactory
from src.utils.contracts import TOKENS, Adapter, ExactMatchExample, MixedData, Tokenizer
from src.utils.errors import ConfigError

# The checkpoint key naming the transformers folder whose unused tensors (a vision tower, MTP
# layers) an export writes back: the rebuilt model has no `pretrained` to know it by.
SOURCE_KEY = "qwen_source_folder"
# model.kernels: None lets each layer use the installed fused kernels on GPU inputs.
KERNEL_CHOICES = {"auto": None, "pytorch": PYTORCH}


class LanguageModel(OptimizedModule):
    """Train a QwenLM on next tokens, preferences or rewards, with the configured optimizer.

    Batches are dicts: `input_ids` and `labels` [B, T] (labels[t] is the target of position t,
    IGNORE_INDEX where nothing is supervised), optionally `position_ids` [B, T] and
    `cu_seqlens` (int32 document offsets of packed rows); GRPO's are prompts
    (src/data/text/prompts/). `objective` says what is optimised
    (src/models/language/objectives.py): `next_token`, the mean cross-entropy over every
    supervised token; `dpo`, a preference loss over pairs of responses (options in
    `preference`, src/models/language/preference/); or `grpo`, a clipped surrogate over the
    model's own rewarded completions of prompts (options in `grpo`,
    src/models/language/grpo/). `train/loss` is the mean over the optimizer step's tokens,
    pairs or completions, however they fall into micro-batches. A mixture of experts adds
    `router_aux_loss_coef` times its load-balancing loss (`train/aux_loss`) to what it
    optimises, and logs each sparse layer's busiest expert over the mean
    (`moe/layer_{i}/load_max_over_mean`, the worst as `moe/load_max_over_mean`).

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
    - `adapter` (`adapter=lora` or `adapter=qlora`, src/models/language/adapters.py): freezes
      the base (QLoRA: stored as 4-bit NF4) and trains LoRA adapters; checkpoints then hold the
      adapters and name the base, which `pretrained` (else the recorded path) supplies again
      on loading.
    """

    batch_kind = TOKENS
    # The optimizer step's running sums (loss, units, metrics), reset by _reset_step after each.
    _step_normaliser: int | None
    _step_sums: dict[str, torch.Tensor]

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
        objective: str = "next_token",
        preference: dict[str, Any] | None = None,
        grpo: dict[str, Any] | None = None,
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
        # adapter=lora (qlora): the base frozen in its dtype (in NF4), the adapters all that trains.
        self.adapter = build_adapter(self.net, adapter, pretrained)
        self.hparams.update(self.adapter.hyperparameters())  # load_from_checkpoint
        options = {"dpo": preference, "grpo": grpo}.get(objective)
        self.objective = build_objective(objective, options, self.net, self.adapter)
        if objective != "next_token":
            # What load_from_checkpoint rebuilds the objective from: GRPO's without its reward
            # functions, which are code (a loaded model generates and exports without them).
            grpo_options = {k: v for k, v in (grpo or {}).items() if k != "rewards"}
            self.hparams.update(
                {"objective": objective, "preference": preference, "grpo": grpo_options}
            )
        # A frozen base is left out of checkpoints; on_load_checkpoint puts it back and checks
        # that every other key is there (FSDP2's strategy loads the state before that hook).
        self.strict_loading = not self.adapter.freezes_base
        # Weight decay on matrices only, not on norms, biases or the DeltaNet gates. By name,
        # while shapes are still whole: wrappers such as FSDP flatten them later.
        self.no_weight_decay = frozenset(n for n, p in self.named_parameters() if p.ndim < 2)
        self.eval_sums = nn.ModuleDict(
            {
                stage: nn.ModuleDict({n: SumMetric() for n in self.objective.eval_sums})
                for stage in ("val", "test")
            }
        )
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # in checkpoints, so a resumed run keeps its best
        # A data mixture's evaluation sums, per stage one per source: made at each evaluation
        # (the sources are the data's), and kept out of the module and its checkpoints.
        self._source_sums: dict[str, list[tuple[str, dict[str, SumMetric]]]] = {}
        self._reset_step()

    def forward(self, input_ids, position_ids=None, cu_seqlens=None) -> torch.Tensor:
        return self.net(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens)

    def metric_keys(self, sources: Sequence[str] = ()) -> set[str]:
        """The metrics this module logs (src/run/metric_keys.py checks monitors against them).

        `sources`: a data mixture's, whose evaluation metrics it also logs each apart.
        """
        keys = {"train/loss", "val/acc_best"}
        keys |= {f"train/{name}" for name in self.objective.step_metrics}
        names = self.objective.eval_metrics
        for stage in ("val", "test"):
            keys |= {f"{stage}/{name}" for name in names}
            keys |= {f"{stage}/sources/{s}/{name}" for s in sources for name in names}
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
        if self._trainer is not None:  # the reference log-probabilities of a preference run
            trainer = self._trainer
            device = trainer.strategy.root_device
            self.objective.setup(self.net, getattr(trainer, "datamodule", None), device)

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
        loss_sum, units, metrics = self.objective.sums(self.net, batch)
        # Summed losses over a normaliser fixed for the step: on_before_optimizer_step turns the
        # accumulated gradient into that of the mean over the step's units (tokens or pairs).
        if self._step_normaliser is None:
            # Rows, not B*T: every rank's micro-batches hold the same number of rows, while
            # padded rows may differ in length between ranks.
            self._step_normaliser = batch["input_ids"].shape[0]
        for name, value in {"loss": loss_sum, "units": units, **metrics}.items():
            previous = self._step_sums.get(name)
            value = value.detach()
            self._step_sums[name] = value if previous is None else previous + value
        return (loss_sum + self._router_loss(units)) / self._step_normaliser

    def _router_loss(self, units: torch.Tensor) -> torch.Tensor | float:
        """The mixture of experts' weighted load-balancing loss, as a sum over `units`.

        on_before_optimizer_step divides the step's gradient by its units (supervised tokens, or
        pairs): a micro-batch's auxiliary loss enters times its own, so one micro-batch
        optimises transformers' `loss + router_aux_loss_coef * aux_loss` exactly, and several
        are weighed by their units. 0 for a dense model.
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
        return self.net.config.router_aux_loss_coef * aux_loss * units

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the accumulated gradient into that of the mean loss over the step's units."""
        # The step's training_steps have run: they set the normaliser and the sums.
        assert self._step_normaliser is not None
        # Lightning calls this before gradient clipping, so clipping sees the mean's gradient.
        # All sums in one all-reduce, straight to the process group: Lightning's
        # strategy.reduce adds a barrier, a second collective per step.
        dtype = torch.promote_types(self._step_sums["loss"].dtype, torch.float32)
        names = list(self._step_sums)
        sums = torch.stack([self._step_sums[name].to(dtype) for name in names])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        totals = dict(zip(names, sums, strict=True))
        units = totals["units"].clamp_min(1)
        # Lightning divided each micro-batch loss by accumulate_grad_batches; DDP averages devices.
        micro_batches = self.trainer.accumulate_grad_batches * self.trainer.world_size
        scale = (self._step_normaliser * micro_batches / units).item()
        if scale != 1.0:
            for parameter in self.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        for name, mean in self.objective.step_means(totals).items():
            self.log(f"train/{name}", mean, on_step=True, prog_bar=name == "loss")
        self._reset_step()

    def validation_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._accumulate_eval("val", batch, dataloader_idx)

    def test_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._accumulate_eval("test", batch, dataloader_idx)

    def on_validation_epoch_start(self) -> None:
        self._start_source_sums("val")

    def on_test_epoch_start(self) -> None:
        self._start_source_sums("test")

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _start_source_sums(self, stage: str) -> None:
        """Fresh sums for each source of a data mixture, one loader each, on every rank.

        Every rank makes them all, so that each rank's sums meet the others' when computed.
        """
        datamodule = getattr(self.trainer, "datamodule", None)
        names = datamodule.source_names if isinstance(datamodule, MixedData) else ()
        self._source_sums[stage] = [
            (source, {name: SumMetric().to(self.device) for name in self.objective.eval_sums})
            for source in names
        ]

    def _accumulate_eval(
        self, stage: str, batch: dict[str, torch.Tensor], dataloader_idx: int
    ) -> None:
        loss_sum, units, metrics = self.objective.sums(self.net, batch)
        sums = cast(Mapping[str, SumMetric], self.eval_sums[stage])  # as built in __init__
        per_source = self._source_sums.get(stage)
        for name, value in {"loss": loss_sum, "units": units, **metrics}.items():
            sums[name].update(value)
            if per_source:
                per_source[dataloader_idx][1][name].update(value)

    def _log_eval(self, stage: str) -> None:
        """Log the objective's metrics over the whole split, and val/acc_best (its best).

        With a data mixture, also each source's, as `<stage>/sources/<name>/<metric>`.
        """
        sums = cast(Mapping[str, SumMetric], self.eval_sums[stage])  # as built in __init__
        metrics = self.objective.evaluation({name: sum_.compute() for name, sum_ in sums.items()})
        for name, value in metrics.items():
            self.log(f"{stage}/{name}", value, prog_bar=stage == "val" and name == "loss")
        if stage == "val" and not self.trainer.sanity_checking:
            self.val_acc_best(metrics[self.objective.accuracy])
            self.log("val/acc_best", self.val_acc_best.compute())
        for metric in sums.values():
            metric.reset()
        for source, source_sums in self._source_sums.pop(stage, []):
            computed = {name: sum_.compute() for name, sum_ in source_sums.items()}
            for name, value in self.objective.evaluation(computed).items():
                self.log(f"{stage}/sources/{source}/{name}", value)

    def _reset_step(self) -> None:
        self._step_normaliser = None
        self._step_sums = {}


def build_objective(
    name: str, options: dict[str, Any] | None, net: QwenLM, adapter: Adapter
) -> Objective:
    """The objective `model.objective` names, with its options (model.preference, model.grpo)."""
    if name == "next_token":
        return NextToken()
    if name == "dpo":
        return PreferenceObjective.build(options or {}, net, adapter)
    if name == "grpo":
        return GRPOObjective.build(options or {}, net, adapter)
    raise ConfigError(
        f"model.objective={name!r}: choose next_token (pretraining, SFT), dpo (preference "
        f"pairs, data=preferences; model.preference.loss_type picks DPO, IPO, hinge, SimPO or "
        f"ORPO) or grpo (rewarded completions of prompts, data=prompts, experiment=lm_grpo)"
    )
