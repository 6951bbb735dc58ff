# The README names these targets. `install` pins the CPU torch wheel before anything else can pull a CUDA build.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
# pyproject's litgpt extra, installed without its dependencies (they conflict with transformers')
LITGPT_VERSION ?= 0.5.13

.PHONY: install train test test-full lint soak bench

install:
	$(PYTHON) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PYTHON) -m pip install --quiet -e ".[dev,hf]"
	$(PYTHON) -m pip install --quiet --no-deps litgpt==$(LITGPT_VERSION) psutil==7.2.2  # see the litgpt extra
	$(PYTHON) -c "import torch; assert '+cpu' in torch.__version__ or not torch.version.cuda, torch.__version__"

train: install
	$(PYTHON) recipes/train_gpt.py

test: install
	$(PYTHON) -m pytest -m "not slow and not gpu" -q --durations=25

test-full: install
	$(PYTHON) -m pytest -m "not gpu" -q

lint: install
	$(PYTHON) -m ruff check lightning_parallel tests examples recipes benchmarks
	$(PYTHON) -m ruff format --check lightning_parallel tests examples recipes benchmarks

# world 8 (pp=2 x dp=2 x tp=2), 300 steps, two workers SIGKILLed and restarted by torchrun: same final state
# as an undisturbed run (measured 12 minutes on 2 cores; SOAK_STEPS=... SOAK_EVERY=... change its length)
soak: install
	$(PYTHON) -m pytest tests/test_soak.py -m slow -q -s

# throughput, memory, communication and pipeline bubble against Lightning's own strategies: BENCHMARKS.md
bench: install
	$(PYTHON) benchmarks/bench.py
