"""Training the Qwen LM: byte data, loss normalisation, optimizer and schedule, train.py,
checkpoints, generation."""

import csv
import math
from functools import partial
from pathlib import Path

import hydra
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from eval import evaluate
from scripts.generate import main as generate_main
from src.checkpoints.restore import restore
from src.data.text.byte_text import ByteTextDataModule, ByteTokenizer, TokenWindows
from src.models.language.language_model import LanguageModel
from src.models.optimization import warmup_cosine
from tests.helpers import FAST, ROOT, TINY_LM, compose_config, quiet_trainer
from train import train

SHAKESPEARE = ROOT / "src" / "data" / "assets" / "tinyshakespeare.txt"
# The Shakespeare experiment with its tiny models shrunk further, so that 40 steps take seconds.
SMALL = [
    "experiment=lm_shakespeare",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.head_dim=16",
    "scheduler.scheduler.warmup_steps=5",
    "data.max_seq_len=64",
    "data.batch_size=8",
    "logger=csv",
    "trainer.log_every_n_steps=1",
    "trainer.limit_train_batches=40",
    "trainer.val_check_interval=null",
    "trainer.check_val_every_n_epoch=1",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
]


def logged(run_dir, key: str) -> list[float]:
    """The values of one metric, in logging order, from the CSV logger's metrics.csv."""
    (path,) = run_dir.glob("**/metrics.csv")
    with path.open() as file:
        return [float(row[key]) for row in csv.DictReader(file) if row.get(key)]


@pytest.fixture(scope="module")
def trained_hybrid(tmp_path_factory):
    """One short bf16-mixed run of the hybrid model, shared by the checkpoint tests."""
    run_dir = tmp_path_factory.mktemp("hybrid")
    overrides = [
        *FAST,
        *SMALL,
        "model=qwen3_next_tiny",
        "model.config.linear_key_head_dim=16",
        "model.config.linear_value_head_dim=16",
        "trainer.precision=bf16-mixed",  # whatever this CPU computes natively
    ]
    return run_dir, train(compose_config(run_dir, overrides))


def test_the_hybrid_lm_trains_through_train_py_in_bf16_mixed_precision(trained_hybrid):
    run_dir, record = trained_hybrid
    losses = logged(run_dir, "train/loss")
    assert losses[-1] < losses[0] - 1.0, f"the loss did not fall: {losses[0]} -> {losses[-1]}"
    metrics = record["metrics"]
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-4)
    assert metrics["test/loss"] < math.log(320)


def test_the_dense_lm_trains_through_train_py(tmp_path):
    train(
        compose_config(
            tmp_path, [*FAST, *SMALL, "model=qwen3_tiny", "trainer.precision=32-true", "test=false"]
        )
    )
    losses = logged(tmp_path, "train/loss")
    assert losses[-1] < losses[0] - 1.0, f"the loss did not fall: {losses[0]} -> {losses[-1]}"


def test_checkpoints_hold_plain_values_and_reload_for_eval_and_generation(trained_hybrid, tmp_path):
    _, record = trained_hybrid
    path = record["best_model_path"]
    checkpoint = torch.load(path, weights_only=True)
    hyperparameters = checkpoint["hyper_parameters"]
    assert hyperparameters["config"]["model_type"] == "qwen3_next"
    assert hyperparameters["config"]["hidden_size"] == 64
    # The network's weights, and the best validation accuracy so far (for exact resume).
    assert all(key.startswith(("net.", "val_acc_best.")) for key in checkpoint["state_dict"])

    module = restore(path).model
    weights = {f"net.{k}": v for k, v in module.net.state_dict().items()}
    stored = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}
    assert weights.keys() == stored.keys()
    assert all(torch.equal(weights[k], v) for k, v in stored.items())

    result = evaluate(compose_config(tmp_path, [f"ckpt_path={path}"], config_name="eval"))
    assert result["metrics"]["test/loss"] == pytest.approx(record["metrics"]["test/loss"], rel=1e-3)

    command = ["--ckpt", path, "--prompt", "ROMEO:", "--max-new-tokens", "20"]
    (text,) = generate_main(command)
    assert text.startswith("ROMEO:"), text
    assert len(text) > len("ROMEO:"), text
    assert generate_main(command) == [text], "the same seed samples the same continuation"


class RecordsGradients(LanguageModel):
    """Keeps the gradients as the optimizer receives them (after the rescale)."""

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.seen = {name: p.grad.clone() for name, p in self.named_parameters()}


def test_the_step_loss_is_the_mean_over_every_supervised_token_of_the_step(tmp_path):
    """Two micro-batches with 10 and 3 supervised tokens: the gradient must weigh all 13 tokens
    equally, not average two per-micro-batch means."""
    config = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    module = RecordsGradients(config, optimizer=partial(torch.optim.SGD, lr=0.0))
    batches = []
    for supervised in (10, 3):
        ids = torch.randint(0, 32, (1, 12))
        labels = torch.full((1, 12), -100)
        labels[0, :supervised] = torch.randint(0, 32, (supervised,))
        batches.append({"input_ids": ids, "labels": labels})
    reference = LanguageModel(config)
    reference.load_state_dict(module.state_dict())
    total = sum(
        F.cross_entropy(
            reference(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), reduction="sum"
        )
        for b in batches
    )
    (total / 13).backward()

    trainer = quiet_trainer(max_steps=1, accumulate_grad_batches=2, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))

    for name, parameter in reference.named_parameters():
        assert torch.allclose(module.seen[name], parameter.grad, atol=1e-6), name
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(total.item() / 13)


def test_a_mixture_of_experts_optimises_its_load_balancing_loss_and_logs_the_load(tmp_path):
    """One micro-batch: the gradient is that of transformers' loss + coef * aux_loss."""
    config = dict(
        model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[0],
        router_aux_loss_coef=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    module = RecordsGradients(config, optimizer=partial(torch.optim.SGD, lr=0.0))
    ids = torch.randint(0, 32, (2, 12))
    labels = torch.randint(0, 32, (2, 12))
    reference = LanguageModel(config)
    reference.load_state_dict(module.state_dict())
    mean = F.cross_entropy(reference(ids).flatten(0, 1), labels.flatten())
    aux_loss = reference.net.router_aux_loss()
    (mean + 0.5 * aux_loss).backward()

    trainer = quiet_trainer(max_steps=1, log_every_n_steps=1, default_root_dir=tmp_path)
    batches = [{"input_ids": ids, "labels": labels}]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))

    for name, parameter in reference.named_parameters():
        assert torch.allclose(module.seen[name], parameter.grad, atol=1e-6), name
    metrics = trainer.callback_metrics
    assert metrics["train/loss"].item() == pytest.approx(mean.item(), rel=1e-5)
    assert metrics["train/aux_loss"].item() == pytest.approx(aux_loss.item(), rel=1e-5)
    counts = reference.net.tokens_per_expert()[1].float()
    assert set(reference.net.tokens_per_expert()) == {1}  # layer 0 is dense
    assert metrics["moe/layer_1/load_max_over_mean"].item() == pytest.approx(
        (counts.max() / counts.mean()).item()
    )
    assert metrics["moe/load_max_over_mean"] == metrics["moe/layer_1/load_max_over_mean"]


def test_the_learning_rate_warms_up_linearly_then_follows_a_cosine():
    def schedule(step):
        return warmup_cosine(step, warmup_steps=10, total_steps=lambda: 110, min_lr_ratio=0.1)

    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.55)
    assert schedule(110) == pytest.approx(0.1) == schedule(500)


def lm_optimization(tmp_path, overrides: list[str], total_steps: float = 600.0):
    """The module `train.py <overrides>` would train (tiny widths) and what its
    `configure_optimizers` returns, with the run's total steps fixed at `total_steps`."""
    cfg = compose_config(tmp_path, [*overrides, *TINY_LM[1:]])
    module = hydra.utils.instantiate(cfg.model)
    module.total_steps = lambda: total_steps  # what the Trainer would report for max_steps
    return cfg, module, module.configure_optimizers()


@pytest.mark.parametrize(
    ("model", "lr", "warmup"),
    [("qwen3_tiny", 2e-3, 50), ("qwen3_next_tiny", 2e-3, 50), ("qwen3_0_6b", 3e-4, 2000)],
)
def test_each_qwen_config_chooses_adamw_and_warmup_cosine_with_its_own_values(
    tmp_path, model, lr, warmup
):
    cfg = compose_config(tmp_path, [f"model={model}"])
    assert dict(cfg.model.optimizer) == {
        "_target_": "torch.optim.AdamW",
        "_partial_": True,
        "lr": lr,
        "weight_decay": 0.1,
        "betas": [0.9, 0.95],
    }, f"{model}: optimizer {cfg.model.optimizer}"
    schedule = cfg.model.scheduler
    assert schedule.scheduler._target_ == "src.models.optimization.warmup_cosine_schedule"
    assert (schedule.scheduler.warmup_steps, schedule.scheduler.min_lr_ratio) == (warmup, 0.1)
    assert schedule.interval == "step", f"{model}: the schedule steps per {schedule.interval}"
    assert not {"lr", "weight_decay", "betas", "warmup_steps", "min_lr_ratio"} & cfg.model.keys()


def test_the_lm_trains_with_the_same_adamw_and_schedule_as_before_the_optimizer_groups(tmp_path):
    """The optimizer the LM built itself before it took the `optimizer` and `scheduler` groups:
    AdamW(lr 2e-3, betas (0.9, 0.95)), decay 0.1 on matrices, 0 on vectors, in parameter
    order; linear warmup over 50 steps, then a cosine to 0.1 x lr at the last step (600)."""
    _, module, configured = lm_optimization(tmp_path, ["experiment=lm_text"])
    optimizer, lr_scheduler = configured["optimizer"], configured["lr_scheduler"]
    assert type(optimizer) is torch.optim.AdamW
    assert lr_scheduler["interval"] == "step"

    def factor(step):
        if step < 50:
            return (step + 1) / 50
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 50) / 550)))

    params = [p for p in module.parameters() if p.requires_grad]
    before = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=2e-3,
        betas=(0.9, 0.95),
    )
    before_schedule = torch.optim.lr_scheduler.LambdaLR(before, factor)
    assert optimizer.state_dict()["param_groups"] == before.state_dict()["param_groups"]
    for group, old in zip(optimizer.param_groups, before.param_groups, strict=True):
        assert [id(p) for p in group["params"]] == [id(p) for p in old["params"]]

    lrs, expected = {}, {}
    for step in range(701):
        lrs[step] = [group["lr"] for group in optimizer.param_groups]
        expected[step] = [group["lr"] for group in before.param_groups]
        for each in (optimizer, before):
            each.step()  # no gradients: the weights stay
        lr_scheduler["scheduler"].step()
        before_schedule.step()
    assert lrs == expected, "the learning rates differ from the warmup-cosine formula"
    for step, lr in [(0, 4e-5), (49, 2e-3), (50, 2e-3), (325, 1.1e-3), (600, 2e-4), (700, 2e-4)]:
        assert lrs[step] == pytest.approx([lr, lr], rel=1e-12), f"lr at step {step}"
    optimizer.load_state_dict(before.state_dict())  # a checkpoint from before resumes here


def test_weight_decay_follows_the_parameter_names_recorded_before_any_wrapping(tmp_path):
    """FSDP flattens parameters to 1-D views and wrappers rename them (here activation
    checkpointing, as trainer=fsdp offers): matrices must still decay and vectors must not."""
    cfg = compose_config(tmp_path, ["model=qwen3_next_tiny", *TINY_LM[1:]])
    module = hydra.utils.instantiate(cfg.model)
    matrices = {name for name, p in module.named_parameters() if p.ndim >= 2}
    vectors = {name for name, p in module.named_parameters() if p.ndim < 2}
    assert "net.model.norm.weight" in vectors
    assert "net.model.embed_tokens.weight" in matrices
    assert any("A_log" in name for name in vectors), "the DeltaNet gates are vectors"
    layers = module.net.model.layers
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer)
    for parameter in module.parameters():
        parameter.data = parameter.data.reshape(-1)
    wrapped = {p: name for name, p in module.named_parameters()}
    assert any("_checkpoint_wrapped_module" in name for name in wrapped.values())

    decay, no_decay = module.param_groups()
    assert no_decay["weight_decay"] == 0.0
    assert "weight_decay" not in decay
    unwrap = {name.replace("_checkpoint_wrapped_module.", "") for name in wrapped.values()}
    assert unwrap == matrices | vectors
    decayed = {wrapped[p].replace("_checkpoint_wrapped_module.", "") for p in decay["params"]}
    exempt = {wrapped[p].replace("_checkpoint_wrapped_module.", "") for p in no_decay["params"]}
    assert decayed == matrices, f"decayed but not matrices: {decayed ^ matrices}"
    assert exempt == vectors, f"exempt but not vectors: {exempt ^ vectors}"


def test_optimizer_sgd_trains_the_lm_with_sgd(tmp_path):
    _, module, configured = lm_optimization(tmp_path, ["experiment=lm_text", "optimizer=sgd"])
    optimizer = configured["optimizer"]
    assert type(optimizer) is torch.optim.SGD, f"optimizer=sgd built {type(optimizer).__name__}"
    group = optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"]) == (0.9, True)
    lr = group["lr"]
    assert lr == pytest.approx(0.01 / 50), "SGD's lr 0.01 at the first step of the warmup"
    torch.manual_seed(0)
    ids = torch.randint(0, 320, (2, 16))
    F.cross_entropy(module(ids).flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    optimizer.step()
    for name, p in module.named_parameters():
        # SGD's first step with Nesterov momentum 0.9 and no weight decay: lr x 1.9 x gradient.
        expected = before[name] - lr * 1.9 * p.grad
        assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-7), f"{name} moved unlike SGD"


@pytest.mark.parametrize("no_schedule", ["scheduler=none", "~scheduler"])
def test_without_a_scheduler_the_lm_keeps_a_constant_learning_rate(tmp_path, no_schedule):
    _, _, configured = lm_optimization(tmp_path, ["experiment=lm_text", no_schedule])
    assert isinstance(configured, torch.optim.AdamW), f"{no_schedule} returned {configured}"
    assert [group["lr"] for group in configured.param_groups] == [2e-3, 2e-3]


def test_byte_rows_are_shifted_pairs_and_the_splits_never_overlap():
    data = ByteTextDataModule(str(SHAKESPEARE), max_seq_len=32, batch_size=4)
    data.setup()
    batch = next(iter(data.val_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    text = ByteTokenizer().decode(batch["input_ids"][0].tolist())
    assert text in SHAKESPEARE.read_text()
    splits = [data.datasets[split] for split in ("train", "val", "test")]
    assert [s.end for s in splits[:-1]] == [s.begin for s in splits[1:]]  # back to back
    assert (splits[0].begin, splits[-1].end) == (0, len(SHAKESPEARE.read_bytes()) + 1)


def test_byte_windows_are_read_by_position_and_the_last_ends_with_end_of_text(
    tmp_path, monkeypatch
):
    path = tmp_path / "nine.txt"
    path.write_bytes(b"abcdefghi")
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("the file was read whole"))
    windows = TokenWindows(path, 0, 10, seq_len=3)  # the 9 bytes, then end of text
    assert len(windows) == 3
    assert windows[0]["input_ids"].tolist() == list(b"abc")
    assert windows[0]["labels"].tolist() == list(b"bcd")
    assert windows[2]["input_ids"].tolist() == list(b"ghi")
    assert windows[2]["labels"].tolist() == [*b"hi", ByteTokenizer.eos_token_id]


def test_the_old_seq_len_key_still_sets_max_seq_len_with_a_deprecation_message(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="src.data.text.byte_text"):
        data = ByteTextDataModule(str(SHAKESPEARE), seq_len=48)
    assert data.max_seq_len == 48
    assert "data.seq_len is deprecated: it is data.max_seq_len=48 now" in caplog.text
    cfg = compose_config(tmp_path, ["experiment=lm_shakespeare", "data.seq_len=48"])
    assert hydra.utils.instantiate(cfg.data).max_seq_len == 48


def test_the_byte_tokenizer_round_trips_any_text():
    tokenizer = ByteTokenizer()
    text = "Thou art — ἀγαθός! 🌹\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([*tokenizer.encode("end"), tokenizer.eos_token_id]) == "end"


def test_a_vocabulary_larger_than_the_model_is_refused(tmp_path):
    cfg = compose_config(tmp_path, [*FAST, *SMALL, "model.config.vocab_size=200"])
    with pytest.raises(ValueError, match="vocab_size to at least 257"):
        train(cfg)


def test_model_kernels_chooses_the_layers_kernels_and_refuses_anything_else(tmp_path):
    from src.models.language.qwen.kernels import PYTORCH
    from src.utils.errors import ConfigError

    cfg = compose_config(tmp_path, ["model=qwen3_next_tiny", "model.kernels=pytorch"])
    model = hydra.utils.instantiate(cfg.model)
    layers = [layer.linear_attn if layer.is_linear else layer.self_attn
              for layer in model.net.model.layers]  # fmt: skip
    assert all(layer.kernels is PYTORCH for layer in layers)
    automatic = hydra.utils.instantiate(compose_config(tmp_path, ["model=qwen3_tiny"]).model)
    assert all(layer.self_attn.kernels is None for layer in automatic.net.model.layers)
    with pytest.raises(ConfigError, match=r"model\.kernels='fused': choose auto .* or pytorch"):
        LanguageModel(config=dict(cfg.model.config), kernels="fused")
