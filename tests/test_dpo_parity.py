"""DPO under the layouts against one process: a tiny Llama (LoRA, or every weight with a frozen reference copy split
like the policy, or a precomputed reference) trained 10 steps on preference pairs whose answers hold different
numbers of tokens (so the micro-batches of the ranks do too), fp32; the losses within 1e-5 relative and the
parameters within 1e-5 of the same module trained by a plain loop in this process on the whole global batches."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from test_text_data import _bpe, _save_tokenizer, _tiny_llama
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.preference.data import PreferencePairs, PreferenceSettings, build_preference_cache
from lightning_parallel.preference.module import DPOSettings, as_dpo
from lightning_parallel.preference.reference import COPY_NAME
from lightning_parallel.text import load_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

STEPS, GLOBAL_BATCH, SEQ_LEN, BETA = 10, 8, 48, 0.5
# LoRA's adapters start at zero and need a larger step to move; every weight trained at 1e-2 lets AdamW turn the
# summation-order noise of near-zero gradients (its eps is 1e-6) into 1.6e-5 parameter differences
LR = {True: 1e-2, False: 1e-3}  # by lora
WORDS = "list tuple dict set value name file loop open read write class module import return yield".split()

# label -> (world, strategy, tp); "lora" / "full" the weights trained, "precomputed" the reference computed first
FAST = {"zero2 lora": (2, "zero2", 1)}
SLOW = {
    "zero2 full": (2, "zero2", 1),
    "zero3 lora": (2, "zero3", 1),
    "zero3 full": (2, "zero3", 1),
    "zero3 full precomputed": (2, "zero3", 1),
    "tp2 lora": (2, "hybrid3d:tp=2", 2),
    "tp2 sp lora": (2, "hybrid3d:tp=2,sequence_parallel=1", 2),
    "zero0 lora": (2, "hybrid3d", 1),
    "zero1 lora": (2, "zero1", 1),
    "pp2 lora": (2, "hybrid3d:pp=2", 1),
    "pp2 full precomputed": (2, "hybrid3d:pp=2", 1),
    "pp2 x tp2 lora": (4, "hybrid3d:pp=2,tp=2", 2),
    "dp2 x tp2 zero3 lora": (4, "hybrid3d:tp=2,zero_stage=3", 2),
    "dp2 x tp2 zero3 full": (4, "hybrid3d:tp=2,zero_stage=3", 2),
}


@pytest.fixture(scope="module")
def dpo_setup(tmp_path_factory) -> dict[str, str]:
    """A BPE tokenizer with a chat template, 200 text pairs (answers of 1 to 8 words), their cache, a tiny Llama."""
    out = tmp_path_factory.mktemp("dpo")
    tokenizer = load_tokenizer(None, _save_tokenizer(_bpe(), out / "tokenizer"))[0]
    rng = random.Random(0)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))

    rows = [
        {"prompt": words(1, 4) + "?", "chosen": " " + words(1, 8), "rejected": " " + words(1, 8)} for _ in range(200)
    ]
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = build_preference_cache(PreferenceSettings(str(out / "pairs.jsonl"), SEQ_LEN), tokenizer, out / "cache")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_tiny_llama(tokenizer.vocab_size)).save_pretrained(out / "llama")
    return {"llama": str(out / "llama"), "cache": str(cache)}


def reference_of(label: str) -> str:
    return "precomputed" if "precomputed" in label else ("adapters" if "lora" in label else "copy")


def launch(tmp_path_factory, setup: dict, runs: dict, tag: str) -> Batch:
    case = {"name": "train", "steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN,
            "cache": setup["cache"], "path": setup["llama"], "loss": "sigmoid", "beta": BETA}  # fmt: skip
    spec = {
        label: (
            world,
            strategy,
            [{**case, "lora": "lora" in label, "lr": LR["lora" in label], "reference": reference_of(label)}],
        )  # fmt: skip
        for label, (world, strategy, _) in runs.items()
    }
    return Batch(tmp_path_factory, spec, tag=tag, worker="dpo")


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, dpo_setup) -> Batch:
    return launch(tmp_path_factory, dpo_setup, FAST, "dpo")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, dpo_setup) -> Batch:
    return launch(tmp_path_factory, dpo_setup, SLOW, "dpo_slow")


def global_batches(setup: dict) -> list[dict[str, torch.Tensor]]:
    """The STEPS global batches, in the order the workers' samplers give the whole world."""
    data = PreferencePairs(setup["cache"], SEQ_LEN)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return [b for b, _ in zip(DataLoader(data, batch_size=GLOBAL_BATCH, sampler=sampler), range(STEPS))]


def plain_training(setup: dict, lora: bool, reference: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same DPO module trained by a plain loop in this process: each whole global batch, its loss, AdamW."""
    from workers.cases.dpo import lora_config

    torch.manual_seed(0)
    peft = lora_config() if lora else None
    module = HFCausalLM(setup["llama"], lr=LR[lora], eps=1e-6, peft_config=peft, lazy_load=False)
    # a precomputed reference is the model as it starts: the base with adapters off, or a frozen copy
    live = {"precomputed": "adapters" if lora else "copy"}.get(reference, reference)
    model = as_dpo(module, DPOSettings(beta=BETA, reference=live))
    optimizer = model.configure_optimizers()
    losses = []
    for batch in global_batches(setup):
        loss = model.pair_scores(batch)[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith(COPY_NAME + ".")}
    return losses, state


class References(dict):
    def __init__(self, setup: dict) -> None:
        super().__init__()
        self.setup = setup

    def __missing__(self, key: tuple[bool, str]) -> tuple:
        self[key] = plain_training(self.setup, *key)
        return self[key]


@pytest.fixture(scope="module")
def references(dpo_setup) -> References:
    return References(dpo_setup)


def check(runs: Batch, label: str, spec: tuple, references: References) -> None:
    world, _, tp = spec
    want_losses, want_params = references["lora" in label, reference_of(label)]
    dp = world // tp // (2 if "pp=2" in spec[1] else 1)
    run = runs[label]
    loss_rel = assert_same_losses(run.losses("train", [d * tp for d in range(dp)]), want_losses, label)
    param_abs = assert_same_params(run.params("train"), want_params, label)
    print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")


@pytest.mark.parametrize("label", list(FAST))
def test_dpo_parity(label, fast_runs, references):
    check(fast_runs, label, FAST[label], references)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_dpo_parity_wider(label, slow_runs, references):
    check(slow_runs, label, SLOW[label], references)


def test_micro_batches_hold_different_answer_tokens(dpo_setup):
    """What the parity runs test: the pieces of a global batch (2 ranks' micro-batches) hold different numbers of
    answer tokens, so a token mean instead of a sum (or a per-token normalization) would not pass."""
    batch = global_batches(dpo_setup)[0]
    counts = [int((batch["labels"][s, :, 1:] != -100).sum()) for s in (slice(0, 4), slice(4, 8))]
    assert counts[0] != counts[1], counts


def test_a_reference_that_cannot_be_built_is_refused_with_the_reason(dpo_setup):
    """The LoRA base without adapters, and a second copy beside the adapters' base."""
    from workers.cases.dpo import lora_config

    plain = HFCausalLM(dpo_setup["llama"])
    with pytest.raises(ValueError, match="needs LoRA adapters on the model"):
        as_dpo(plain, DPOSettings(reference="adapters"))
    lora = HFCausalLM(dpo_setup["llama"], peft_config=lora_config())
    with pytest.raises(ValueError, match="the base with adapters off is the reference"):
        as_dpo(lora, DPOSettings(reference="copy"))
