"""HFCausalLM(peft_config=LoraConfig(...)) under pipeline parallelism (every schedule; a stage that holds no adapter;
a frozen embedding tied to the head across stages) and the composite layouts (pp x tp, dp x tp with ZeRO-3, HSDP),
against the same peft model trained in one process (tests/test_hf_lora.py's reference and checks)."""

from __future__ import annotations

import pytest
import transformers
from causal_lm_parity import launch
from test_hf_lora import (
    LORA,
    MODELS,
    check_frozen_base_holds_nothing,
    check_lora_run,
    folders,  # noqa: F401  (fixtures: the model folders and the single-process references, of LORA's models)
    references,  # noqa: F401
)
from test_hf_parity import CONFIGS

# More adapted models, put into test_hf_lora's LORA and MODELS while this module's tests run
VARIANTS = {
    # the adapters on the head only: pp's first stage (embedding and blocks) holds none
    "llama head": (CONFIGS["llama"], {**LORA["llama"], "target_modules": ["lm_head"]}),
    # the frozen embedding tied to the frozen head, on two stages
    "llama tied": (lambda: transformers.LlamaConfig(**{**CONFIGS["llama"]().to_diff_dict(),
                                                        "tie_word_embeddings": True}), LORA["llama"]),
}  # fmt: skip

# label -> (world, strategy spec, model, tp). Llama's 5 pipeline layers split 3 + 2: the last stage (final norm and
# head) holds no adapter in every "llama" run
FAST = {
    "llama lora pp2 1f1b clip": (2, "hybrid3d:pp=2", "llama", 1),
    "llama lora pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "llama", 2),
    "gpt2 lora dp2 x tp2 zero3 clip": (4, "hybrid3d:tp=2,zero_stage=3", "gpt2", 2),
    "llama lora hsdp 2x2 zero3": (4, "hybrid3d:dp_shard=2,zero_stage=3", "llama", 1),
}
SLOW = {
    "llama lora pp2 gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "llama", 1),
    "llama lora pp2 interleaved_1f1b clip": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "llama", 1),
    "llama lora pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "llama", 1),
    "llama head lora pp2 1f1b": (2, "hybrid3d:pp=2", "llama head", 1),
    "llama head lora pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "llama head", 1),
    "llama tied lora pp2 1f1b clip": (2, "hybrid3d:pp=2", "llama tied", 1),
    "gpt2 lora pp2 1f1b": (2, "hybrid3d:pp=2", "gpt2", 1),
    "gpt2 lora pp2 gpipe clip": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "gpt2", 1),
    "gpt2 lora pp2 interleaved_1f1b": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "gpt2", 1),
    "gpt2 lora pp2 zero_bubble clip": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "gpt2", 1),
    "gpt2 lora pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "gpt2", 2),
    "llama lora dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", "llama", 2),
    "llama lora hsdp 2x2 zero2 clip": (4, "hybrid3d:dp_shard=2,zero_stage=2", "llama", 1),
}


@pytest.fixture(scope="module", autouse=True)
def variants():
    with pytest.MonkeyPatch.context() as patch:
        for name, (config, lora) in VARIANTS.items():
            patch.setitem(MODELS, name, config)
            patch.setitem(LORA, name, lora)
        yield


def lora_launch(tmp_path_factory, folders: dict, runs: dict, tag: str):  # noqa: F811
    return launch(tmp_path_factory, folders, runs, tag, "hf", extra={m: {"lora": c} for m, c in LORA.items()})


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders):  # noqa: F811
    return lora_launch(tmp_path_factory, folders, FAST, "lora_layouts")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders):  # noqa: F811
    return lora_launch(tmp_path_factory, folders, SLOW, "lora_layouts_slow")


@pytest.mark.parametrize("label", list(FAST))
def test_lora_layout_parity(label, fast_runs, references, folders):  # noqa: F811
    check_lora_run(fast_runs, label, FAST[label], references, folders)
    check_frozen_base_holds_nothing(fast_runs, label, FAST[label])


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_lora_layout_parity_wider(label, slow_runs, references, folders):  # noqa: F811
    check_lora_run(slow_runs, label, SLOW[label], references, folders)
    check_frozen_base_holds_nothing(slow_runs, label, SLOW[label])
