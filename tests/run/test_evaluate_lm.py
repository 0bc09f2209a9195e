"""lm-evaluation-harness on trained language models: scripts/evaluate_lm.py and train.py's
`+lm_eval.tasks=[...]`, on the local sft_choice task (no download)."""

import json
import sys

import pytest
from omegaconf import OmegaConf

from src.data.corpus.tokenizers import ByteTokenizer
from src.models.language.language_model import LanguageModel
from src.run.language.hf_export import export_for_transformers
from src.run.language.lm_eval_tasks.sft_choice import QUESTIONS, make_questions
from src.run.language.lm_evaluation import LmEvalSettings, evaluate_checkpoint, metrics_of
from src.utils.errors import ConfigError
from tests.helpers import FAST, ROOT, TINY_LM, compose_config, run_script, run_train, tiny_config
from train import train

SCORES = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")


def sft_run(tmp_path, model: str) -> list[str]:
    """Two steps of response-only fine-tuning of a tiny `model` on the synthetic set."""
    sizes = [override for override in TINY_LM if not override.startswith("model=")]
    if model == "qwen3_next_tiny":
        sizes += ["model.config.linear_key_head_dim=16", "model.config.linear_value_head_dim=16"]
    return [
        "experiment=lm_sft",
        f"model={model}",
        *sizes,
        "trainer.max_steps=2",
        "data.synthetic_count=200",
        "data.exact_match_samples=2",
        f"data.cache_dir={tmp_path / 'cache'}",
        *FAST,
    ]


def assert_scores_recorded(run_dir, ckpt_path, examples: int) -> None:
    """metrics.json holds eval/sft_choice/<metric> beside the training metrics, equal to the
    scores in lm_eval/results.json, which ran `examples` questions of `ckpt_path`."""
    metrics = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    results = json.loads((run_dir / "lm_eval" / "results.json").read_text())
    assert "test/loss" in metrics, f"training metrics lost: {sorted(metrics)}"
    for score in SCORES:
        key = f"eval/sft_choice/{score}"
        assert key in metrics, f"{key} not in metrics.json: {sorted(metrics)}"
        assert metrics[key] == results["results"]["sft_choice"][f"{score},none"], key
    assert 0 <= metrics["eval/sft_choice/acc"] <= 1
    assert results["ckpt_path"] == str(ckpt_path.resolve())
    assert results["n-samples"]["sft_choice"]["effective"] == examples
    leftovers = sorted(p.name for p in (run_dir / "lm_eval").iterdir())
    assert leftovers == ["results.json"], f"the export was not removed: {leftovers}"


def test_the_shipped_questions_are_those_make_questions_writes():
    shipped = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    assert shipped == make_questions(), "sft_choice.jsonl differs: run write_questions()"
    for question in shipped:
        assert len(set(question["choices"])) == 4, question


def test_scores_are_named_by_task_and_metric_and_by_filter_unless_it_is_the_default():
    results = {
        "sft_choice": {"alias": "sft_choice", "acc,none": 0.5, "acc_stderr,none": "N/A"},
        "gsm8k": {"exact_match,strict-match": 0.25, "sample_len": 10},
    }
    assert metrics_of(results) == {
        "eval/sft_choice/acc": 0.5,
        "eval/gsm8k/exact_match/strict-match": 0.25,
    }


def test_training_s_lm_eval_settings_default_to_evaluate_lm_yaml_and_refuse_unknown_keys():
    defaults = OmegaConf.load(ROOT / "conf" / "evaluate_lm.yaml")
    settings = LmEvalSettings.for_training(OmegaConf.create({"tasks": "sft_choice", "limit": 5}))
    assert settings.tasks == ["sft_choice"], settings
    assert settings.limit == 5
    assert settings.batch_size == defaults.batch_size, settings
    with pytest.raises(ConfigError, match=r"lm_eval\.limt is not a setting"):
        LmEvalSettings.for_training(OmegaConf.create({"tasks": ["sft_choice"], "limt": 5}))


def test_the_exported_byte_tokenizer_gives_the_run_s_token_ids(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = LanguageModel(tiny_config("qwen3", vocab_size=320).to_dict())
    export_for_transformers(model, ByteTokenizer(), tmp_path)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "User: reverse héllo\nBot: olléh ☃"
    ids = exported(text, add_special_tokens=False).input_ids
    assert ids == ByteTokenizer().encode(text), f"{ids} != the bytes of {text!r}"
    assert exported.decode(ids) == text
    assert exported.eos_token_id == ByteTokenizer.eos_token_id


def test_without_lm_eval_the_evaluation_fails_at_once_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # None: `import lm_eval` raises
    settings = LmEvalSettings(["sft_choice"], [], None, None, 16, None)
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[eval\]"') as raised:
        evaluate_checkpoint(tmp_path / "absent.ckpt", tmp_path, settings)
    assert "\n" not in str(raised.value)
    assert not any(tmp_path.iterdir()), "it wrote something before failing"


@pytest.mark.slow
def test_training_with_lm_eval_records_the_scores_of_its_last_checkpoint(tmp_path):
    lm_eval = ["+lm_eval.tasks=[sft_choice]", "+lm_eval.limit=12"]
    result = run_train([*sft_run(tmp_path, "qwen3_tiny"), *lm_eval], tmp_path / "run")
    run_dir = tmp_path / "run"
    assert_scores_recorded(run_dir, run_dir / "checkpoints" / "last.ckpt", examples=12)
    # The run's summary comes once, after lm-eval, with its scores.
    console = result.stdout + result.stderr
    assert console.count("Run summary:") == 1, console[-3000:]
    summary = console[console.index("Run summary:") :]
    assert "eval/sft_choice/acc" in summary, summary
    assert "test/loss" in summary, summary


@pytest.mark.slow
def test_evaluate_lm_scores_a_hybrid_checkpoint_and_refuses_an_unknown_task(tmp_path):
    run_dir = tmp_path / "run"
    run_train(sft_run(tmp_path, "qwen3_next_tiny"), run_dir)
    ckpt_path = run_dir / "checkpoints" / "last.ckpt"
    evaluate = [f"ckpt_path={ckpt_path}", f"hydra.run.dir={tmp_path / 'evaluate'}"]
    run_script("scripts/evaluate_lm.py", [*evaluate, "tasks=[sft_choice]", "limit=12"])
    assert_scores_recorded(run_dir, ckpt_path, examples=12)

    refused = run_script("scripts/evaluate_lm.py", [*evaluate, "tasks=[no_such]"], check=False)
    assert refused.returncode == 1, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-2000:]
    last_line = refused.stderr.strip().splitlines()[-1]
    assert last_line.startswith("Error: tasks: lm-eval has no task 'no_such'"), last_line
    assert "sft_choice" in last_line, f"the local tasks are not named: {last_line}"


def test_a_mistyped_lm_eval_request_fails_before_training_not_after(tmp_path):
    cfg = compose_config(tmp_path, [*FAST, "+lm_eval.task=[sft_choice]"])  # task for tasks
    with pytest.raises(ConfigError, match="task"):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists(), "it trained before checking the request"
