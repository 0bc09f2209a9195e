"""Expert parallelism (`trainer=model_parallel trainer.strategy.expert_parallel_size=N`) on CPU:
two gloo processes that split the experts compute what one process does, train the LM like
one, resume each other's checkpoints, and bad sizes are refused in one line."""

import copy
import csv
import json
import math
import os
from types import SimpleNamespace

import hydra
import pytest
import torch
import torch.distributed as dist
from hydra.errors import InstantiationException
from torch.distributed.device_mesh import init_device_mesh

from src.models.language.expert_parallel import EXPERT_MESH_DIMS, ExpertParallelExperts
from src.models.language.parallel import shard_decoder_layers
from src.models.language.qwen import QwenLM
from src.models.language.qwen.moe import Experts
from src.utils.errors import ConfigError, first_cause
from tests.run.support import free_port

# -- the dispatch and combine, against one process's Experts ------------------------------------

HIDDEN, EXPERTS, TOP_K, TOKENS, EXPERT_PARALLEL = 16, 4, 2, 6, 2
# The experts each rank's tokens may choose, by world size. Storage rank d holds experts
# d * E / W onwards; the expert-parallel rank d % 2 of its group runs those of ranks d % 2,
# 2 + d % 2, ...: with 2 ranks rank 0 runs experts 0-1, with 4 ranks ranks 0 and 2 run 0 and 2.
CHOICES = {
    2: {
        # Expert 3 gets no token; rank 1 sends all its rows to rank 0 and keeps none.
        "uneven": [[0, 1, 2], [0, 1]],
        # Nobody routes to rank 1's experts: it receives no row, and still takes part.
        "one_rank_idle": [[0, 1], [0, 1]],
    },
    4: {
        "uneven": [[0, 1, 2], [0, 2], [1, 2], [0, 2]],  # expert 3 idle, rank 1 keeps none
        "one_rank_idle": [[0, 2], [0, 2], [0, 2], [0, 2]],  # ranks 1 and 3 receive nothing
    },
}


def routed_inputs(world, routing):
    """Per rank: x [N, hidden], indices [N, k], weights [N, k] and an output gradient, all fp32."""
    generator = torch.Generator().manual_seed(1)
    inputs = []
    for choices in CHOICES[world][routing]:
        picks = [torch.randperm(len(choices), generator=generator)[:TOP_K] for _ in range(TOKENS)]
        indices = torch.tensor(choices)[torch.stack(picks)]
        x = torch.randn(TOKENS, HIDDEN, generator=generator)
        weights = torch.rand(TOKENS, TOP_K, generator=generator)
        grad = torch.randn(TOKENS, HIDDEN, generator=generator)
        inputs.append((x, indices, weights, grad))
    return inputs


def run_experts(experts, x, indices, weights, grad):
    """The output and the input gradients (x, weights) of `experts` for an output gradient."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = experts(x, indices, weights)
    (out * grad).sum().backward()
    return out.detach(), x.grad, weights.grad


def dispatch_worker(rank, world, port, results_dir):
    """One of `world` ranks, 2 per expert-parallel group: its tokens of each routing, and how
    far output and gradients are from one process's."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shape = (world // EXPERT_PARALLEL, EXPERT_PARALLEL, 1)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=EXPERT_MESH_DIMS)
        torch.manual_seed(0)
        reference = Experts(HIDDEN, 8, EXPERTS)
        reference.reset_parameters(std=0.5)
        # Each rank stores E / W experts, with the gradient's mean over the ranks.
        stored = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
        results = {}
        for routing in CHOICES[world]:
            inputs = routed_inputs(world, routing)
            split = ExpertParallelExperts(copy.deepcopy(reference), mesh)
            got = run_experts(split, *inputs[rank])
            reference.zero_grad()
            expected = [run_experts(reference, *each) for each in inputs][rank]
            pairs = [("output", got[0], expected[0]), ("x.grad", got[1], expected[1])]
            pairs.append(("weights.grad", got[2], expected[2]))
            for name in ("gate_up_proj", "down_proj"):
                mean = getattr(reference, name).grad[stored] / world
                pairs.append((f"{name}.grad", getattr(split, name).grad.to_local(), mean))
            differences = {name: (a - b).abs().max().item() for name, a, b in pairs}
            results[routing] = {"differences": differences, "bytes": split.last_dispatched_bytes}
        (results_dir / f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def expected_dispatched_bytes(world, routing, rank):
    """fp32 rows a rank sends to the other of its group: its pairs for the experts the other
    runs, then the other's pairs for the experts it runs, which it returns."""
    inputs = routed_inputs(world, routing)
    other = rank + 1 if rank % 2 == 0 else rank - 1
    # Expert e is stored on rank e * W / E and run by rank (e * W / E) % 2 of each group.
    mine, theirs = ((inputs[r][1] * world // EXPERTS) % 2 for r in (rank, other))
    rows = int((mine != rank % 2).sum()) + int((theirs == rank % 2).sum())
    return rows * HIDDEN * 4


def check_dispatch(world, results_dir):
    torch.multiprocessing.start_processes(
        dispatch_worker, args=(world, free_port(), results_dir), nprocs=world, start_method="spawn"
    )
    for rank in range(world):
        results = json.loads((results_dir / f"{rank}.json").read_text())
        assert results.keys() == CHOICES[world].keys()
        for routing, result in results.items():
            where = f"rank {rank}, {routing} routing"
            assert max(result["differences"].values()) < 1e-5, (where, result["differences"])
            assert result["bytes"] == expected_dispatched_bytes(world, routing, rank), where


def test_two_ranks_splitting_the_experts_compute_what_one_process_does(tmp_path):
    check_dispatch(2, tmp_path)


@pytest.mark.slow
def test_two_groups_of_two_gather_their_experts_and_compute_what_one_process_does(tmp_path):
    """4 ranks: each stores one expert and runs two, gathered from the other group."""
    check_dispatch(4, tmp_path)


# -- train.py: the same training under either layout, and checkpoints that cross them ----------


@pytest.fixture(scope="module")
def helpers():
    """tests.helpers, imported here and not above: it imports train.py (seconds), and every
    rank spawned above imports this module."""
    import tests.helpers

    return tests.helpers


# The packed-text Qwen3-MoE shrunk to seconds: 4 experts, top 2, over two FSDP2 processes
# (fp32: the strategy has no float64), each decoder layer recomputed in backward (its
# all-to-alls too), a checkpoint every 2 of the 6 steps.
MOE_RUN = [
    "experiment=lm_text",
    "model=qwen3_moe_tiny",
    "model.config.hidden_size=32",
    "model.config.head_dim=16",
    "model.config.moe_intermediate_size=16",
    "model.config.num_experts=4",
    "model.config.num_hidden_layers=2",
    "model.activation_checkpointing=true",
    "data.max_seq_len=64",
    "data.batch_size=8",
    "scheduler.scheduler.warmup_steps=2",
    "trainer.max_steps=6",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "logger=csv",
    "test=false",
    "trainer=model_parallel",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "callbacks.last_checkpoint.every_n_train_steps=2",
    "callbacks.last_checkpoint.every_n_epochs=null",
    "callbacks.last_checkpoint.save_top_k=-1",
]
EXPERT_PARALLEL_2 = "trainer.strategy.expert_parallel_size=2"


def logged(run_dir, key):
    """A metric's value at each step it was logged, from the CSV logger's metrics.csv."""
    with open(run_dir / "csv" / "metrics.csv") as file:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(file) if row.get(key)}


def step_checkpoint(run_dir, step):
    return run_dir / "checkpoints" / f"step_{step:08d}.ckpt"


@pytest.fixture(scope="module")
def layouts(helpers, tmp_path_factory):
    """Three runs of MOE_RUN: `fsdp` all 6 steps without expert parallelism; `experts`, expert
    parallelism 2 resumed from fsdp's step 2; `fsdp_again`, resumed from experts' step 4."""
    root = tmp_path_factory.mktemp("layouts")
    runs = {
        "fsdp": [],
        "experts": [EXPERT_PARALLEL_2, f"ckpt_path={step_checkpoint(root / 'fsdp', 2)}"],
        "fsdp_again": [f"ckpt_path={step_checkpoint(root / 'experts', 4)}"],
    }
    for name, overrides in runs.items():
        helpers.run_train([*helpers.FAST, *MOE_RUN, *overrides], root / name)
    return root


@pytest.mark.slow
def test_expert_parallelism_trains_as_data_parallelism_does_and_logs_what_it_sends(layouts):
    fsdp = logged(layouts / "fsdp", "train/loss")
    experts = logged(layouts / "experts", "train/loss")  # from fsdp's weights at step 2
    assert list(experts) == [2, 3, 4, 5]
    for step, loss in experts.items():
        assert loss == pytest.approx(fsdp[step], abs=1e-5), f"step {step}"
    # Rank 0's bytes per step: at most every row out and back, in fp32, over 2 layers.
    rows = 8 * 64 * 2  # its rows of tokens, times top 2
    sent = logged(layouts / "experts", "moe/dispatched_bytes")
    assert list(sent) == [2, 3, 4, 5]
    assert all(0 < value <= 2 * rows * 32 * 4 * 2 for value in sent.values()), sent
    assert not logged(layouts / "fsdp", "moe/dispatched_bytes")


@pytest.mark.slow
def test_checkpoints_resume_under_the_other_layout(helpers, layouts):
    """fsdp's step 2 resumed with expert parallelism, whose step 4 resumed without, end where
    the run that never stopped does."""
    expected, _ = helpers.final_state(layouts / "fsdp")
    for name in ("experts", "fsdp_again"):
        checkpoint, _ = helpers.final_state(layouts / name)
        assert checkpoint["global_step"] == 6
        weights = checkpoint["state_dict"]
        assert weights.keys() == expected["state_dict"].keys()
        for key, value in expected["state_dict"].items():
            torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-5, msg=f"{name}: {key}")


# -- refusals ----------------------------------------------------------------------------------


def strategy_refusal(helpers, tmp_path, *overrides):
    """The ConfigError that building trainer=model_parallel's strategy raises, as one line."""
    cfg = helpers.compose_config(tmp_path, ["trainer=model_parallel", *overrides])
    with pytest.raises(InstantiationException) as raised:
        hydra.utils.instantiate(cfg.trainer.strategy)
    error = first_cause(raised.value, ConfigError)
    assert error is not None, raised.value
    assert "\n" not in str(error)
    return str(error)


def test_the_model_parallel_config_splits_no_experts_unless_asked(helpers, tmp_path):
    cfg = helpers.compose_config(tmp_path, ["trainer=model_parallel", "trainer.devices=4"])
    assert hydra.utils.instantiate(cfg.trainer.strategy).expert_parallel_size == 1


def test_an_expert_parallel_size_that_does_not_divide_the_processes_is_refused(helpers, tmp_path):
    message = strategy_refusal(helpers, tmp_path, "trainer.devices=3", EXPERT_PARALLEL_2)
    assert "expert_parallel_size=2 must divide the 3 data-parallel processes" in message
    message = strategy_refusal(helpers, tmp_path, "trainer.strategy.expert_parallel_size=0")
    assert "expert_parallel_size=0" in message


class ExpertMesh:
    """What shard_decoder_layers reads of a (groups, size, 1) expert-parallel mesh before it
    splits anything."""

    mesh_dim_names = EXPERT_MESH_DIMS

    def __init__(self, groups, size):
        self.sizes = {"expert_data_parallel": groups, "expert_parallel": size, "tensor_parallel": 1}

    def __getitem__(self, names):
        names = [names] if isinstance(names, str) else names
        size = math.prod(self.sizes[name] for name in names)
        return SimpleNamespace(
            size=lambda: size, _flatten=lambda _: SimpleNamespace(size=lambda: size)
        )


def model_refusal(net, mesh):
    with pytest.raises(ConfigError) as raised:
        shard_decoder_layers(net, mesh)
    assert "\n" not in str(raised.value)
    return str(raised.value)


def test_expert_parallelism_refuses_a_model_without_experts(helpers):
    message = model_refusal(QwenLM(helpers.tiny_config("qwen3")), ExpertMesh(1, 2))
    assert "this qwen3 model has none: set trainer.strategy.expert_parallel_size=1" in message


@pytest.mark.parametrize(("groups", "size"), [(1, 4), (2, 2)], ids=["size", "processes"])
def test_expert_parallelism_refuses_experts_it_cannot_split_whole(helpers, groups, size):
    """6 experts split neither 4 ways, nor 2 ways over 2 x 2 processes that store them whole."""
    net = QwenLM(helpers.tiny_config("qwen3_moe", num_experts=6))
    message = model_refusal(net, ExpertMesh(groups, size))
    assert f"over {groups * size} data-parallel processes needs num_experts (6)" in message


def test_expert_parallelism_refuses_lora_on_the_experts(helpers, tmp_path):
    adapted = ["model=qwen3_moe_tiny", "adapter=lora", "adapter.target_experts=true"]
    model = hydra.utils.instantiate(helpers.compose_config(tmp_path, adapted).model)
    message = model_refusal(model.net, ExpertMesh(1, 2))
    assert "adapter.target_experts=true cannot run with expert parallelism" in message
