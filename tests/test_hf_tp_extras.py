"""Families whose tp or pp needed more than the Llama plan: Qwen3 and Gemma 3 (per-head q/k norms, HF's
``replicated_with_grad_allreduce``) under tp with and without sequence parallelism, and the forward extras applied
at the pipeline layers under pp (Gemma 2's final logit softcapping, Cohere's ``logit_scale``, Granite's embedding
and logit scalings): the same 10 AdamW steps as the plain HF model trained in one process (fp32)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import transformers  # a test dependency: make install installs the hf extra
from causal_lm_parity import CLIP, check, launch
from conftest import Batch
from test_hf_parity import SMALL, plain_hf_training, save_folders

NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
# the extras at sizes that change the logits (tests/test_hf_families.py::test_forward_extras_matter); Gemma's
# head_dim 8 with 4 heads of a 32-wide model
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, **NO_SPECIAL_TOKENS, head_dim=8),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL, **NO_SPECIAL_TOKENS, head_dim=8, sliding_window=4, final_logit_softcapping=0.5
    ),
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL, **NO_SPECIAL_TOKENS, head_dim=8, sliding_window=4, final_logit_softcapping=0.5
    ),
    "cohere": lambda: transformers.CohereConfig(**SMALL, **NO_SPECIAL_TOKENS, logit_scale=0.5),
    "granite": lambda: transformers.GraniteConfig(
        **SMALL,
        **NO_SPECIAL_TOKENS,
        embedding_multiplier=2.0,
        logits_scaling=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
    ),
}
# label -> (world, strategy spec, model, tp), as tests/test_hf_parity.py; every run of one world size in one launch
FAST = {
    "qwen3 tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "qwen3", 2),
    "gemma2 pp2": (2, "hybrid3d:pp=2", "gemma2", 1),
}
SLOW = {
    "qwen3 tp2": (2, "hybrid3d:tp=2", "qwen3", 2),
    "gemma3 tp2": (2, "hybrid3d:tp=2", "gemma3", 2),
    "gemma3 tp2 sp clip": (2, "hybrid3d:tp=2,sequence_parallel=1", "gemma3", 2),
    "cohere pp2": (2, "hybrid3d:pp=2", "cohere", 1),
    "granite pp2": (2, "hybrid3d:pp=2", "granite", 1),
    # the partial q/k norm gradients through ZeRO-3's reduction (FSDP2) and beside ZeRO-1's flat buffers
    "qwen3 dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", "qwen3", 2),
    "gemma3 dp2 x tp2 sp zero1": (4, "hybrid3d:tp=2,zero_stage=1,sequence_parallel=1", "gemma3", 2),
    "gemma2 pp2 x tp2 clip": (4, "hybrid3d:pp=2,tp=2", "gemma2", 2),
    "granite pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "granite", 2),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return save_folders(tmp_path_factory, CONFIGS)


@pytest.fixture(scope="module")
def references(folders) -> Callable[[str, tuple], dict]:
    """The plain HF trainings ``check`` compares a run against, each (model, clip) computed when first asked for."""
    done: dict = {}

    def of(label: str, spec: tuple) -> dict:
        model, clip = spec[2], CLIP if "clip" in label else None
        if (model, clip) not in done:
            done[model, clip] = plain_hf_training(folders[model], clip)
        return done

    return of


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, FAST, "hf_extras", "hf")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, SLOW, "hf_extras_slow", "hf")


@pytest.mark.parametrize("label", list(FAST))
def test_tp_extras_parity(label, fast_runs, references):
    check(fast_runs, label, FAST[label], references(label, FAST[label]))


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_tp_extras_parity_wider(label, slow_runs, references):
    check(slow_runs, label, SLOW[label], references(label, SLOW[label]))
