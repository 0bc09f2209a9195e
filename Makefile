# Every target that needs Python runs `make install` first when .venv/ is missing,
# so `make train` or `make test` works as the very first command on a fresh clone.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install check-env kernel tensorboard train test test-slow test-kernels test-all bench \
	lint format clean clean-logs

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,loggers,eval]"
	touch $(STAMP)

install: $(STAMP) ## Create .venv/ and install the project (editable) with its dev, loggers and eval extras

check-env: $(STAMP) ## Print versions, GPUs, CPU bf16 support and the trainer/precision to use
	$(PY) scripts/check_env.py

kernel: $(STAMP) ## Register .venv as the Jupyter kernel "Python (PyTorch template)"
	$(PY) -m ipykernel install --user --name pytorch-template --display-name "Python (PyTorch template)"

tensorboard: $(STAMP) ## Browse the runs under logs/ in TensorBoard (ARGS="--port 6007")
	$(PY) -m tensorboard.main --logdir logs $(ARGS)

train: $(STAMP) ## Train the default model on the embedded dataset (ARGS="model=cnn ...")
	$(PY) train.py $(ARGS)

test: $(STAMP) ## Run the fast test suite (under 5 minutes on 2 cores)
	$(PY) -m pytest -m "not slow" $(ARGS)

test-slow: $(STAMP) ## Run only the slow tests (real data, longer training)
	$(PY) -m pytest -m slow $(ARGS)

test-kernels: $(STAMP) ## Run the GPU kernels on CPU through Triton's interpreter
	$(PY) -m pytest -m kernels $(ARGS)

test-all: $(STAMP) ## Run every test
	$(PY) -m pytest $(ARGS)

bench: $(STAMP) ## Benchmark the template against a hand-written loop (ARGS="--quick ...")
	$(PY) scripts/bench.py $(ARGS)

lint: $(STAMP) ## Check style with ruff
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP) ## Reformat the code with ruff
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean: ## Remove caches and build leftovers
	rm -rf .pytest_cache .ruff_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

clean-logs: ## Remove every run under logs/
	rm -rf logs/
