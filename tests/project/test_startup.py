"""Start-up: `train.py --help` and a digits run import none of the libraries they do not use.

Each of these costs from 0.1 s to seconds at start-up; they are imported where they are used
(`scripts/bench.py --cases startup` measures the start-up itself). transformers (and its
tokenizers), matplotlib and torchvision's models are not on the list: `import lightning`
imports them (through torchmetrics), so every run pays for them whatever this project does.
"""

import json
import os
import subprocess
import sys

from tests.helpers import FAST, ROOT

NOT_IMPORTED = [
    "sklearn",  # data=digits reads scikit-learn's file, without scikit-learn (0.5 s)
    "pandas",
    "joblib",
    "pyarrow",
    "datasets",
    "peft",
    "torchao",  # adapter=qlora's 4-bit base (peft imports it too, where installed)
    "lm_eval",
    "optuna",
    "mlflow",
    "wandb",
    "src.run.language.lm_evaluation",  # train.py imports it for `+lm_eval.tasks=[...]` only
    "src.models.language.qwen",
]

# In a fresh interpreter: `train.py --help`, then a one-epoch digits run, as train.py runs them.
SCRIPT = """
import contextlib, io, json, sys
from pathlib import Path
run_dir, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
import train
sys.argv = ["train.py", "--help"]
with contextlib.redirect_stdout(io.StringIO()) as shown:
    train.main()
assert "== Groups (group=option) ==" in shown.getvalue(), shown.getvalue()[-2000:]
from src.run.config.compose import compose_run_config
record = train.train(compose_run_config(run_dir, overrides))
assert "test/acc" in record["metrics"], record
print(json.dumps(sorted(sys.modules)))
"""


def test_help_and_a_digits_run_import_none_of_the_libraries_they_do_not_use(tmp_path):
    environment = os.environ | {"PROJECT_LOG_DIR": str(tmp_path / "logs")}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run"), json.dumps(FAST)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = set(json.loads(result.stdout.splitlines()[-1]))
    assert "lightning" in imported  # the run did run
    assert not imported & set(NOT_IMPORTED), sorted(imported & set(NOT_IMPORTED))
