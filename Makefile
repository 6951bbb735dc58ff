# The README and docs/install.md name these targets. `install` pins torch 2.13.0 before anything else can pull another build:
# the CPU wheel (TORCH=cpu), or the CUDA build from TORCH_CUDA_INDEX (TORCH=cuda; a CUDA torch 2.13 already
# installed is kept). TORCH defaults to cuda where `nvidia-smi -L` lists a GPU, else cpu.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
ifeq ($(origin TORCH),undefined)
TORCH := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif
# pyproject's litgpt extra, installed without its dependencies (they conflict with transformers')
LITGPT_VERSION ?= 0.5.13
OUT ?= gpu_check_out
GPU_CHECK_ARGS ?=

# the ft extra (torchft) and the OpenTelemetry packages its import needs, as verified together
FT_PACKAGES = torchft==0.2.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
	opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
	opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2 \
	opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
	googleapis-common-protos==1.76.0 protobuf==7.36.2

.PHONY: install install-torch train test test-full lint docs soak bench gpu-check gpu-wheels gpu-rehearsal-env \
	gpu-rehearsal

install: install-torch
	$(PYTHON) -m pip install --quiet -e ".[dev,hf,peft,docs]"
	$(PYTHON) -m pip install --quiet --no-deps litgpt==$(LITGPT_VERSION) psutil==7.2.2  # see the litgpt extra
	$(PYTHON) -m pip install --quiet --no-deps $(FT_PACKAGES)  # see the ft extra
	$(PYTHON) -m pip install --quiet --no-deps torchao==0.18.0  # see the fp8 extra
ifeq ($(TORCH),cuda)
	$(PYTHON) -c "import torch; assert torch.version.cuda, 'TORCH=cuda but torch ' + torch.__version__ + ' is a CPU build'"
else
	$(PYTHON) -c "import torch; assert '+cpu' in torch.__version__ or not torch.version.cuda, torch.__version__"
endif

install-torch:
ifeq ($(TORCH),cuda)
	$(PYTHON) -c "import torch, sys; sys.exit(not (torch.version.cuda and torch.__version__.startswith('$(TORCH_VERSION)')))" \
		2>/dev/null || $(PYTHON) -m pip install --quiet torch==$(TORCH_VERSION) --index-url $(TORCH_CUDA_INDEX)
else ifeq ($(TORCH),cpu)
	$(PYTHON) -m pip install --quiet torch==$(TORCH_VERSION)
else
	$(error TORCH=$(TORCH) is unknown: use TORCH=cpu or TORCH=cuda)
endif

train: install
	$(PYTHON) recipes/train_gpt.py

test: install
	$(PYTHON) -m pytest -m "not slow and not gpu" -q --durations=25

test-full: install
	$(PYTHON) -m pytest -m "not gpu" -q

lint: install
	$(PYTHON) -m ruff check lightning_parallel tests examples recipes benchmarks
	$(PYTHON) -m ruff format --check lightning_parallel tests examples recipes benchmarks

# the documentation site (docs/, mkdocs.yml) into site/; strict: a broken link, anchor, include or docstring fails
docs: install
	$(PYTHON) -m lightning_parallel.recipes.reference --check  # docs/reference/strategy-keys.md matches the schema
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --quiet

# world 8 (pp=2 x dp=2 x tp=2), 300 steps, two workers SIGKILLed and restarted by torchrun: same final state
# as an undisturbed run (measured 12 minutes on 2 cores; SOAK_STEPS=... SOAK_EVERY=... change its length)
soak: install
	$(PYTHON) -m pytest tests/test_soak.py -m slow -q -s

# throughput, memory, communication and pipeline bubble against Lightning's own strategies: BENCHMARKS.md
bench: install
	$(PYTHON) benchmarks/bench.py

# one prepared check for a lent GPU (one H200, Python 3.12, torch 2.11 + CUDA 13, no network): the gpu test tier at
# world 1, the fast kernels against their math twins, MFU of GPT-2 small (ours, a plain PyTorch loop, Lightning's own),
# peak memory against the planner, LitGPT's full.py under FSDP and ours; OUT/gpu_check.json and .md, written after each
# section. 440 s at most (the sections' caps and grace: benchmarks/gpu_check/__main__.py), inside one 600 s device
# call. It never reaches for a network: the packages the device lacks come from .whl/ (`make gpu-wheels` here, the
# call carries .whl), installed offline; a package still missing skips the sections that need it, with the reason.
# torch is never installed here (a CPU torch is reported and the GPU-only measurements say so). GPU_CHECK_ARGS:
# e.g. --dry-run (CPU), --only gpu_tier,kernels. Without make: PYTHONPATH=. python3 -m benchmarks.gpu_check --out DIR
gpu-check:
	PYTHONPATH=$(CURDIR) PYTHONUNBUFFERED=1 $(PYTHON) -m benchmarks.gpu_check --out $(OUT) $(GPU_CHECK_ARGS)

# the pure-Python wheels the lent machine's image lacks (hydra-core, omegaconf, antlr4 built from its sdist, litgpt,
# lightning) into .whl/, under the 64 MiB a device call carries (the command prints the sizes; the list is
# benchmarks/gpu_check/deps.py's CARRIED)
gpu-wheels:
	$(PYTHON) -m benchmarks.gpu_check.deps --gather .whl

# the CPU rehearsal of the device call (tests/test_gpu_check.py runs it in `make test-full`): gpu-check's dry run under
# torch 2.11 and Python 3.12 with the device image's packages, the network blocked, .whl/ the only source.
# gpu-rehearsal-env builds its environment once (~/.cache/lightning-parallel/gpu-rehearsal, about 5 GB)
gpu-rehearsal-env:
	$(PYTHON) -m benchmarks.gpu_check.rehearsal env

gpu-rehearsal:
	$(PYTHON) -m benchmarks.gpu_check.rehearsal run --out $(OUT)/rehearsal
