"""A transformers folder is enough: `model.pretrained=<folder>` gives the architecture."""

import pytest
import torch
from hydra.errors import InstantiationException

from src.checkpoints.restore import restore
from src.models.language.qwen import QwenConfig, QwenLM
from src.utils.errors import ConfigError, first_cause
from tests.helpers import FAST, compose_config
from train import train

# A Qwen3.5 text model whose sizes all differ from conf/model/qwen3_5_tiny.yaml's.
FOLDER_SIZES = dict(
    model_type="qwen3_5_text", vocab_size=320, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
    mrope_section=[2, 1, 1], linear_num_key_heads=1, linear_num_value_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
)  # fmt: skip
RUN = [
    *FAST,
    "experiment=lm_shakespeare",
    "model=qwen3_5_tiny",
    "data.max_seq_len=32",
    "data.batch_size=4",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_folder")
    torch.manual_seed(0)
    QwenLM(QwenConfig(**FOLDER_SIZES)).save_pretrained(path)
    return path


def test_the_folder_decides_the_sizes_the_chosen_config_leaves_open(folder, tmp_path):
    cfg = compose_config(tmp_path, [*RUN, f"model.pretrained={folder}"])
    train(cfg)
    restored = restore(tmp_path / "checkpoints" / "last.ckpt")
    config = restored.model.net.config
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    expected = QwenLM.from_pretrained(folder).state_dict()
    assert restored.model.net.state_dict().keys() == expected.keys()


def test_sizes_given_on_the_command_line_must_agree_with_the_folder(folder, tmp_path):
    overrides = [*RUN, f"model.pretrained={folder}", "model.config.hidden_size=128"]
    with pytest.raises(InstantiationException) as raised:
        train(compose_config(tmp_path, overrides))
    refusal = str(first_cause(raised.value, ConfigError))
    assert "hidden_size (128 here, 64 there)" in refusal
    assert "Leave them off the command line" in refusal
