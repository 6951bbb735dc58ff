"""``make gpu-check OUT=folder``: one prepared check of the lent GPU (one H200, torch 2.11, no network), in at most
440 s (the sections' caps and grace, ``__main__.SECTIONS``), the packages it lacks installed offline from ``.whl/``
(:mod:`.deps`); rehearsed on CPU under torch 2.11 with the network blocked (:mod:`.rehearsal`).

Sections, each in a fresh interpreter under a time limit (a hung CUDA call cannot be interrupted in-process), each
recorded and written to ``OUT/gpu_check.json`` and ``OUT/gpu_check.md`` as soon as it ends; a failed or timed-out
section is recorded with its error and the next one runs:

1. ``environment``: torch, CUDA, NCCL, the device and its memory, the packages.
2. ``gpu_tier``: ``pytest -m gpu`` (tests/gpu/: our strategies against Lightning's on one GPU), pass/fail per test.
3. ``kernels``: the CUDA fast paths (ring attention's block kernels, MoE grouped GEMM) against their math twins:
   outputs and gradients in bf16 and fp32, and their speed (CUDA events).
4. ``mfu_plain``, ``mfu_lightning``, ``mfu_ours``: GPT-2 small (``model=gpt2_124m`` with the GPT-2 vocabulary, 50304,
   sequence 1024, bf16-mixed, compiled) as a plain PyTorch loop, under Lightning's single-device strategy and under
   ours (hybrid3d, ZeRO-1, world 1): tokens/s and MFU on the same batch.
5. ``memory``: ``mfu_ours``'s peak ``torch.cuda.max_memory_allocated`` against the planner's estimate.
6. ``litgpt_fsdp``: LitGPT's ``finetune/full.py`` under Lightning's ``FSDPStrategy`` and ours (ZeRO-3).

``--dry-run``: the same sections through the same code on CPU with a tiny GPT (tests/test_gpu_check.py runs it in
``make test``, all but ``litgpt_fsdp``; its slow rehearsal runs all of it under torch 2.11); what only CUDA can
measure is reported as skipped.

Here rather than in the package: it measures the package and runs its tests (tests/gpu/), as benchmarks/bench.py.
"""
