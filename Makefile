# The README names these targets. `install` pins the CPU torch wheel before anything else can pull a CUDA build.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0

.PHONY: install train test test-full lint

install:
	$(PYTHON) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PYTHON) -m pip install --quiet -e ".[dev]"

train: install
	$(PYTHON) recipes/train_gpt.py

test: install
	$(PYTHON) -m pytest -m "not slow and not gpu" -q

test-full: install
	$(PYTHON) -m pytest -m "not gpu" -q

lint: install
	$(PYTHON) -m ruff check lightning_parallel tests examples recipes
	$(PYTHON) -m ruff format --check lightning_parallel tests examples recipes
