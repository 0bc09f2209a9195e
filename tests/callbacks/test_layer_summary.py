"""The layer summary's table and totals (src/callbacks/measurement/layer_summary.py)."""

from types import SimpleNamespace

from lightning.pytorch import LightningModule
from torch import nn

from src.callbacks.measurement.layer_summary import LayerSummary


class TiedLanguageModel(LightningModule):
    """An embedding whose weight the output head shares, as Qwen3's small models do."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.block = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight
        self.embed.requires_grad_(False)  # and a frozen part, for the trainable count

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def test_a_weight_two_layers_share_is_counted_once(tmp_path):
    model = TiedLanguageModel()
    LayerSummary(str(tmp_path)).on_fit_start(SimpleNamespace(is_global_zero=True), model)

    summary = (tmp_path / "model_summary.txt").read_text()
    shared, block = 1000 * 64, 64 * 64 + 64
    assert f"Total params: {shared + block:,}" in summary, summary
    assert f"Trainable params: {block:,}" in summary, summary
    assert f"Non-trainable params: {shared:,}" in summary, summary


def test_with_an_input_shape_the_table_holds_each_layers_output(tmp_path):
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5))
    module = LightningModule()
    module.net = model
    module.forward = model.forward
    LayerSummary(str(tmp_path), input_shape=[3, 4]).on_fit_start(
        SimpleNamespace(is_global_zero=True), module
    )
    summary = (tmp_path / "model_summary.txt").read_text()
    assert "[1, 5]" in summary, summary
    assert "Total params: 65" in summary, summary
