# Every target that needs Python runs `make install` first when .venv/ is missing,
# so `make train` or `make test` works as the very first command on a fresh clone.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install install-min check-env kernel tensorboard train test test-slow test-kernels \
	test-all test-min bench lint audit format docs clean clean-logs

help: ## Show this help
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,loggers,eval]"
	touch $(STAMP)

install: $(STAMP) ## Create .venv/ and install the project (editable) with its dev, loggers and eval extras

# The floors of pyproject.toml kept true: a second environment, inside .venv/ (ignored), holds
# every direct dependency at its floor (`scripts/dependencies.py floors` writes the
# constraints) and the rest at what those allow; `make test-min` runs the fast suite on it.
# Rebuilt from nothing whenever pyproject.toml changes (about 2 minutes, torch from the
# machine's own files where pip finds it there).
MIN_VENV := $(VENV)/min
MIN_STAMP := $(MIN_VENV)/.installed
MIN_EXTRAS := dev,loggers,eval

$(MIN_STAMP): pyproject.toml scripts/dependencies.py | $(STAMP)
	rm -rf $(MIN_VENV)
	python3 -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PY) scripts/dependencies.py floors --extras $(MIN_EXTRAS) > $(MIN_VENV)/floors.txt
	$(MIN_VENV)/bin/python -m pip install --quiet -c $(MIN_VENV)/floors.txt -e ".[$(MIN_EXTRAS)]"
	touch $(MIN_STAMP)

install-min: $(MIN_STAMP) ## Install the lowest versions pyproject.toml allows into .venv/min/

check-env: $(STAMP) ## Print versions, GPUs, CPU bf16 support and the trainer/precision to use
	$(PY) scripts/check_env.py

kernel: $(STAMP) ## Register .venv as the Jupyter kernel "Python (PyTorch template)"
	$(PY) -m ipykernel install --user --name pytorch-template --display-name "Python (PyTorch template)"

tensorboard: $(STAMP) ## Browse the runs under logs/ in TensorBoard (ARGS="--port 6007")
	$(PY) -m tensorboard.main --logdir logs $(ARGS)

train: $(STAMP) ## Train the default model on the embedded dataset (ARGS="model=cnn ...")
	$(PY) train.py $(ARGS)

# The suites run in two processes (pytest-xdist), each module's tests in one of them, so that a
# module-scoped fixture (a trained run) is built once; the longest modules start first
# (tests/conftest.py). The slowest tests are listed, to keep the cost in sight.
SUITE_OPTIONS := -n 2 --dist loadfile --durations=15

test: $(STAMP) ## Run the fast test suite (under 5 minutes on 2 cores)
	$(PY) -m pytest -m "not slow" $(SUITE_OPTIONS) $(ARGS)

test-slow: $(STAMP) ## Run only the slow tests (real data, longer training)
	$(PY) -m pytest -m slow $(SUITE_OPTIONS) $(ARGS)

test-min: $(MIN_STAMP) ## Run the fast test suite on the lowest versions pyproject.toml allows
	$(MIN_VENV)/bin/python -m pytest -m "not slow" $(SUITE_OPTIONS) $(ARGS)

test-kernels: $(STAMP) ## Run the GPU kernels on CPU through Triton's interpreter
	$(PY) -m pytest -m kernels $(ARGS)

test-all: $(STAMP) ## Run every test
	$(PY) -m pytest $(ARGS)

bench: $(STAMP) ## Benchmark the template against a hand-written loop (ARGS="--quick ...")
	$(PY) scripts/bench.py $(ARGS)

# The audit asks the package index's JSON API about the floors and the installed packages. It
# fails only on what this project can mend: an advisory with a fixed release in a direct
# dependency (at its floor: raise the floor; as installed: upgrade it) and a floor the index
# has yanked. An advisory in a package that only other packages need (a dev tool's own
# dependency) or with no fixed release is printed as a note. Where the index does not answer
# (no network, or a mirror without the per-release API) it prints why and passes, in a
# fraction of a second; with the index, under 15 s (docs/dependencies.md).
lint: $(STAMP) ## Check the code: ruff's rules and format, the layers, the types, the advisories
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m mypy
	$(PY) scripts/dependencies.py audit

audit: $(STAMP) ## Ask the package index for advisories in the floors and the installed packages
	$(PY) scripts/dependencies.py audit $(ARGS)

format: $(STAMP) ## Reformat the code with ruff
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# The docs extra goes into the same .venv, once, on top of what $(STAMP) installed.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP) ## Build the guides as a website in site/, offline; every warning fails it
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean: ## Remove caches and build leftovers
	rm -rf .pytest_cache .ruff_cache *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

clean-logs: ## Remove every run under logs/
	rm -rf logs/
