"""`model.objective=grpo`: a LanguageModel trained on its own sampled completions (data=prompts).

Each training step samples `num_generations` completions of every prompt of its batch
(rollouts.py), scores them with the reward functions (rewards.py), normalises the rewards within
each prompt's group into advantages and optimises the clipped surrogate (losses.py). Validation
and test answer each held-out prompt once, greedily, and score that.

Logged under train/: `loss`, `reward_mean` and `reward_std` (the weighted reward's mean and
its mean within-group std), `rewards/<name>/mean` per function, `completions/mean_length`,
`completions/clipped_ratio` (the share cut at max_completion_length), `frac_reward_zero_std`
(groups that teach nothing), `clip_ratio/region_mean` (tokens whose ratio was clipped) and, with
`beta`, `kl`. Under val/ and test/: `reward_mean`, `rewards/<name>/mean` and
`completions/mean_length`; val/acc_best is the best `val/reward_mean`.
"""

import difflib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from src.models.language.grpo.losses import (
    LOSS_TYPES,
    SurrogateOptions,
    group_advantages,
    surrogate_loss,
)
from src.models.language.grpo.rewards import Rewards
from src.models.language.grpo.rollouts import Rollout, sample
from src.models.language.objectives import ObjectiveSums
from src.models.language.preference.reference import FrozenCopy, adapters_disabled
from src.utils.contracts import IGNORE_INDEX, Adapter, TokenizedData
from src.utils.errors import ConfigError

log = logging.getLogger(__name__)


class GRPOObjective(nn.Module):
    """GRPO's loss and metrics (module docstring); `model.grpo` holds its options.

    A module so that a frozen copy of the network (the KL reference of a full fine-tune) is
    moved and checkpointed with the model, and so that checkpoints keep the state of the
    rollouts' random generator (`get_extra_state`): a resumed run samples what the uninterrupted
    one would.
    """

    accuracy = "reward_mean"

    def __init__(
        self,
        rewards: Rewards,
        surrogate: SurrogateOptions,
        num_generations: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        scale_rewards: bool = True,
        generation_batch_size: int | None = None,
        reference: FrozenCopy | None = None,
    ):
        super().__init__()
        self.rewards = rewards
        self.surrogate = surrogate
        self.num_generations = num_generations
        self.sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        self.scale_rewards = scale_rewards
        self.generation_batch_size = generation_batch_size
        self.reference = reference
        self.tokenizer: Any = None
        self.generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None  # loaded before the generator exists
        per_function = [f"rewards/{name}/mean" for name in rewards.names]
        self.step_metrics = (
            "reward_mean",
            "reward_std",
            *per_function,
            "completions/mean_length",
            "completions/clipped_ratio",
            "frac_reward_zero_std",
            "clip_ratio/region_mean",
            *(("kl",) if surrogate.beta else ()),
        )
        scored = [f"rewards/{name}/{s}" for name in rewards.names for s in ("sum", "scored")]
        self.eval_sums = ("loss", "units", "reward", "completion_tokens", *scored)
        self.eval_metrics = ("reward_mean", *per_function, "completions/mean_length")

    @classmethod
    def build(cls, options: Mapping[str, Any], net: nn.Module, adapter: Adapter) -> "GRPOObjective":
        """The objective of `model.grpo`'s options, for `net` as just built.

        With `beta` > 0 the KL reference is the base under disabled adapters (LoRA), else a
        frozen copy of `net`.
        """
        options = dict(options)
        rewards = Rewards(options.pop("rewards", None) or {})
        surrogate_keys = SurrogateOptions.__dataclass_fields__
        surrogate = SurrogateOptions(
            **{k: options.pop(k) for k in list(options) if k in surrogate_keys}
        )
        internal = ("surrogate", "reference")
        known = [k for k in inspect.signature(cls).parameters if k not in internal]
        known += list(surrogate_keys)
        for key in sorted(options.keys() - set(known)):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"model.grpo.{key} is no GRPO option: {hint}they are {', '.join(sorted(known))}"
            )
        check_options(surrogate, options)
        reference = FrozenCopy(net) if surrogate.beta and not adapter.freezes_base else None
        return cls(rewards, surrogate, reference=reference, **options)

    # -- the Objective protocol ---------------------------------------------------------------

    def setup(self, net: nn.Module, datamodule: Any, device: torch.device) -> None:
        """Take the tokenizer of the prompt data, and seed the rollouts' generator on `device`."""
        if not isinstance(datamodule, TokenizedData):
            raise ConfigError(
                f"model.objective=grpo samples completions of prompts and decodes them for the "
                f"rewards: use data=prompts, not {type(datamodule).__name__}"
            )
        self.rewards.check_some()
        self.tokenizer = datamodule.tokenizer
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        seed = (torch.initial_seed() + rank) % 2**63
        self.generator = torch.Generator(device).manual_seed(seed)
        self._restore_generator()

    def sums(self, net: nn.Module, batch: dict[str, Any]) -> ObjectiveSums:
        if "prompt_lengths" not in batch:
            raise ConfigError(
                "model.objective=grpo trains on prompts, and this batch holds token sequences: "
                "use data=prompts (experiment=lm_grpo)"
            )
        if net.training:
            return self._training_sums(net, batch)
        return self._evaluation_sums(net, batch)

    def step_means(self, totals: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's logged means from its sums: per completion, or per completion token."""
        completions = totals["completions"].clamp_min(1)
        tokens = totals["completion_tokens"].clamp_min(1)
        means = {
            "loss": totals["loss"] / totals["units"].clamp_min(1),
            "reward_mean": totals["reward"] / completions,
            "reward_std": totals["reward_std"] / completions,
            "completions/mean_length": totals["completion_tokens"] / completions,
            "completions/clipped_ratio": totals["truncated"] / completions,
            "frac_reward_zero_std": totals["zero_std"] / completions,
            "clip_ratio/region_mean": totals["clipped_tokens"] / tokens,
        }
        if "kl" in totals:
            means["kl"] = totals["kl"] / tokens
        return means | self._function_means(totals)

    def evaluation(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each metric's mean over the split's prompts, one greedy completion each."""
        prompts = sums["units"].clamp_min(1)
        return {
            "reward_mean": sums["reward"] / prompts,
            **self._function_means(sums),
            "completions/mean_length": sums["completion_tokens"] / prompts,
        }

    # -- checkpoints -------------------------------------------------------------------------

    def get_extra_state(self) -> torch.Tensor | None:
        return None if self.generator is None else self.generator.get_state()

    def set_extra_state(self, state: torch.Tensor | None) -> None:
        self._generator_state = state
        self._restore_generator()

    def _restore_generator(self) -> None:
        """Give the generator the state a checkpoint holds, once both are there."""
        if self.generator is None or self._generator_state is None:
            return
        try:
            self.generator.set_state(self._generator_state)
        except RuntimeError:  # the state of a generator on another kind of device
            log.warning(
                "The checkpoint's rollout random state is that of a %s generator's, not the %s "
                "one this run samples with: the rollouts go on from the seed instead",
                "CUDA" if len(self._generator_state) == 16 else "CPU",
                self.generator.device.type,
            )

    # -- training and evaluation -------------------------------------------------------------

    def _training_sums(self, net: nn.Module, batch: dict[str, Any]) -> ObjectiveSums:
        rollout = self._rollout(net, batch, self.num_generations, self.sampling)
        reward, per_function = self._score(batch, rollout)
        advantages, group_std = group_advantages(reward, self.num_generations, self.scale_rewards)
        # The reference's forward first, as DPO's: a mixture of experts' router statistics, which
        # the model reads after this, are then the policy's (with LoRA both run the same net).
        reference = self._reference_logps(net, rollout) if self.surrogate.beta else None
        logps = token_logps(net, rollout)
        mask = rollout.labels != IGNORE_INDEX
        loss, units, token_sums = surrogate_loss(
            logps, logps.detach(), reference, advantages.to(logps.device), mask, self.surrogate
        )
        sums = {
            "completions": len(reward),
            "completion_tokens": rollout.lengths.sum(),
            "reward": reward.sum(),
            "reward_std": group_std.sum(),
            "truncated": (~rollout.finished).sum(),
            "zero_std": (group_std == 0).sum(),
        }
        sums |= _function_sums(per_function)
        device = logps.device
        return ObjectiveSums(loss, units, _on(device, sums) | token_sums)

    def _evaluation_sums(self, net: nn.Module, batch: dict[str, Any]) -> ObjectiveSums:
        greedy = {"temperature": 0.0}
        rollout = self._rollout(net, batch, 1, greedy)
        reward, per_function = self._score(batch, rollout)
        device = batch["input_ids"].device
        sums = {"reward": reward.sum(), "completion_tokens": rollout.lengths.sum()}
        sums |= _function_sums(per_function)
        prompts = torch.tensor(len(reward), device=device)
        return ObjectiveSums(torch.zeros((), device=device), prompts, _on(device, sums))

    def _rollout(self, net: nn.Module, batch: dict[str, Any], copies: int, sampling) -> Rollout:
        """`copies` completions per prompt, sampled with dropout off (as the policy scores them)."""
        was_training = net.training
        net.eval()
        try:
            return sample(
                net,
                batch,
                copies,
                self.surrogate.max_completion_length,
                self.tokenizer.eos_token_id,
                self.tokenizer.pad_token_id,
                self.generation_batch_size,
                generator=self.generator,
                **sampling,
            )
        finally:
            net.train(was_training)

    def _score(
        self, batch: dict[str, Any], rollout: Rollout
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each completion's weighted reward [N] and every function's scores [N] (NaN: none)."""
        rows = rollout.rows.tolist()
        eos = self.tokenizer.eos_token_id
        texts = [
            self.tokenizer.decode([t for t in ids if t != eos]) for ids in rollout.completion_ids
        ]
        prompts = [batch["prompts"][row] for row in rows]
        completions = [
            text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
            for text, prompt in zip(texts, prompts, strict=True)
        ]
        columns = {name: [values[row] for row in rows] for name, values in batch["columns"].items()}
        return self.rewards.score(prompts, completions, rollout.completion_ids, columns)

    @torch.no_grad()
    def _reference_logps(self, net: nn.Module, rollout: Rollout) -> torch.Tensor:
        if self.reference is not None:
            return token_logps(self.reference.net, rollout)
        with adapters_disabled(net):
            return token_logps(net, rollout)

    def _function_means(self, sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            f"rewards/{name}/mean": sums[f"rewards/{name}/sum"]
            / sums[f"rewards/{name}/scored"].clamp_min(1)
            for name in self.rewards.names
        }


def token_logps(net: nn.Module, rollout: Rollout) -> torch.Tensor:
    """Each completion token's log-probability under `net` [N, T], 0 off the completions."""
    return net(rollout.input_ids, labels=rollout.labels, per_label=True)


def _on(device: torch.device, sums: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Counts and host sums as fp32 tensors on `device`, where the model's own sums are."""
    return {
        key: torch.as_tensor(value, dtype=torch.float32).to(device) for key, value in sums.items()
    }


def _function_sums(per_function: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each function's scores summed and counted, unscored (NaN) completions left out."""
    sums = {}
    for name, scores in per_function.items():
        sums[f"rewards/{name}/sum"] = scores.nansum()
        sums[f"rewards/{name}/scored"] = (~scores.isnan()).sum()
    return sums


def check_options(surrogate: SurrogateOptions, options: Mapping[str, Any]) -> None:
    """Refuse options GRPO cannot run with, naming the key and the fix."""
    if surrogate.loss_type not in LOSS_TYPES:
        raise ConfigError(
            f"model.grpo.loss_type={surrogate.loss_type!r}: choose one of {', '.join(LOSS_TYPES)}"
        )
    if options.get("num_generations", 8) < 2:
        raise ConfigError(
            f"model.grpo.num_generations={options.get('num_generations')}: GRPO compares "
            f"completions within a group, so it needs at least 2 per prompt"
        )
    if surrogate.max_completion_length < 1:
        raise ConfigError(
            f"model.grpo.max_completion_length={surrogate.max_completion_length}: give the "
            f"most tokens a completion may have (1 or more)"
        )
    if surrogate.epsilon <= 0 or surrogate.beta < 0:
        raise ConfigError(
            f"model.grpo.epsilon must be positive and beta 0 or more; got epsilon="
            f"{surrogate.epsilon}, beta={surrogate.beta}"
        )
