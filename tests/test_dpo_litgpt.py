"""DPO on LitGPT's GPT (``LitGPTCausalLM``) under the layouts against one process: a tiny Llama-style LitGPT
checkpoint folder trained 10 steps on the preference pairs of tests/test_dpo_parity.py (answers of different
lengths, so the ranks' micro-batches hold different numbers of answer tokens), fp32, with LitGPT's LoRA (the
reference: its layers with rank 0, no copy), every weight (a frozen copy split like the policy) or a precomputed
reference; the losses within 1e-5 relative and the parameters within 1e-5 of the same module trained by a plain loop
in this process on the whole global batches. And the single-process pieces: LitGPT's adapters switched off give the
base model's log-probabilities, conversations read with LitGPT's prompt style."""

from __future__ import annotations

import pytest
import test_dpo_parity
import torch
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from test_dpo_parity import BETA, GLOBAL_BATCH, LR, SEQ_LEN, STEPS, global_batches, reference_of

from lightning_parallel.preference.data import PreferencePairs
from lightning_parallel.preference.loss import sequence_logps
from lightning_parallel.preference.module import DPOSettings, as_dpo
from lightning_parallel.preference.reference import COPY_NAME, adapters_off

dpo_setup = test_dpo_parity.dpo_setup  # the pairs, their cache and tokenizer (a module fixture)

litgpt = pytest.importorskip("litgpt")

# every linear layer of the blocks adapted (q, k, v, projection, MLP; not the head, as peft's "all-linear"), rank 4,
# no dropout (its draws would differ by tp rank). With the head adapted too, AdamW at 1e-2 turns the summation-order
# noise of the head adapters' gradients into 5.6e-5 parameter differences under zero2 (losses still within 1e-5)
LORA = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_query": True, "lora_key": True, "lora_value": True,
        "lora_projection": True, "lora_mlp": True, "lora_head": False}  # fmt: skip

# label -> (world, strategy, tp, pp)
FAST = {"zero2 lora": (2, "zero2", 1, 1)}
SLOW = {
    "zero2 full": (2, "zero2", 1, 1),
    "zero3 lora": (2, "zero3", 1, 1),
    "zero3 full": (2, "zero3", 1, 1),
    "zero3 full precomputed": (2, "zero3", 1, 1),
    "tp2 lora": (2, "hybrid3d:tp=2", 2, 1),
    "tp2 full": (2, "hybrid3d:tp=2", 2, 1),
    "pp2 lora": (2, "hybrid3d:pp=2", 1, 2),
    "pp2 full precomputed": (2, "hybrid3d:pp=2", 1, 2),
    "pp2 full": (2, "hybrid3d:pp=2", 1, 2),  # the frozen copy staged like the policy
}


@pytest.fixture(scope="module")
def litgpt_folder(dpo_setup, tmp_path_factory) -> str:
    """A tiny Llama-style LitGPT checkpoint folder (model_config.yaml, lit_model.pth) for the pairs' tokenizer."""
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    pairs = PreferencePairs(dpo_setup["cache"], SEQ_LEN)
    vocab = int(max(pairs.ids.max(), pairs.pad_id)) + 1
    config = Config(
        name="tiny-dpo", block_size=64, vocab_size=vocab, padded_vocab_size=-(-vocab // 8) * 8, n_layer=2, n_head=4,
        n_query_groups=2, n_embd=32, intermediate_size=64, rotary_percentage=1.0, parallel_residual=False,
        bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("litgpt")
    save_config(config, folder)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), folder / "lit_model.pth")
    return str(folder)


def case_of(label: str, folder: str, cache: str) -> dict:
    lora = "lora" in label
    return {"name": "train", "model": "litgpt", "path": folder, "lora": LORA if lora else None, "cache": cache,
            "seq_len": SEQ_LEN, "steps": STEPS, "global_batch": GLOBAL_BATCH, "lr": LR[lora], "loss": "sigmoid",
            "beta": BETA, "reference": reference_of(label)}  # fmt: skip


def launch(tmp_path_factory, setup: dict, folder: str, runs: dict, tag: str) -> Batch:
    spec = {label: (w, strategy, [case_of(label, folder, setup["cache"])]) for label, (w, strategy, *_) in runs.items()}
    return Batch(tmp_path_factory, spec, tag=tag, worker="dpo_models")


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, dpo_setup, litgpt_folder) -> Batch:
    return launch(tmp_path_factory, dpo_setup, litgpt_folder, FAST, "dpo_litgpt")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, dpo_setup, litgpt_folder) -> Batch:
    return launch(tmp_path_factory, dpo_setup, litgpt_folder, SLOW, "dpo_litgpt_slow")


def without_mask(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def plain_training(case: dict, setup: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same DPO module trained by a plain loop in this process: each whole global batch, its loss, AdamW."""
    from workers.cases.dpo_models import build_module

    torch.manual_seed(0)
    lora = case["lora"] is not None
    live = {"precomputed": "adapters" if lora else "copy"}.get(case["reference"], case["reference"])
    model = as_dpo(build_module(case), DPOSettings(beta=BETA, reference=live))
    optimizer = model.configure_optimizers()
    losses = []
    for batch in global_batches(setup):
        loss = model.pair_scores(without_mask(batch))[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith(COPY_NAME + ".")}
    return losses, state


_references: dict = {}


def check(runs: Batch, label: str, spec: tuple, setup: dict, folder: str) -> None:
    world, _, tp, pp = spec
    key = ("lora" in label, reference_of(label))
    if key not in _references:
        _references[key] = plain_training(case_of(label, folder, setup["cache"]), setup)
    want_losses, want_params = _references[key]
    dp = world // tp // pp
    run = runs[label]
    loss_rel = assert_same_losses(run.losses("train", [d * tp for d in range(dp)]), want_losses, label)
    param_abs = assert_same_params(run.params("train"), want_params, label)
    assert len(want_params) == len(run.params("train")), label
    print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")


@pytest.mark.slow  # 25 s at world 2: the fast tier has the HF zero2 case (tests/test_dpo_parity.py)
@pytest.mark.parametrize("label", list(FAST))
def test_dpo_litgpt_parity(label, fast_runs, dpo_setup, litgpt_folder):
    check(fast_runs, label, FAST[label], dpo_setup, litgpt_folder)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_dpo_litgpt_parity_wider(label, slow_runs, dpo_setup, litgpt_folder):
    check(slow_runs, label, SLOW[label], dpo_setup, litgpt_folder)


def test_litgpt_adapters_off_is_the_base(dpo_setup, litgpt_folder):
    """LitGPT's LoRA switched off (every layer's rank 0 for the block) gives the base model's log-probabilities
    and leaves the adapters as they were; a frozen copy without LoRA gives the policy's own at the start."""
    from litgpt import GPT, Config

    from lightning_parallel.litgpt import LitGPTCausalLM

    torch.manual_seed(0)
    module = as_dpo(LitGPTCausalLM(litgpt_folder, lora=LORA), DPOSettings(beta=BETA))
    for name, p in module.named_parameters():
        if "lora_B" in name:  # adapters that change the output
            p.data.normal_(std=0.5)
    batch = global_batches(dpo_setup)[0]
    ids, labels = batch["input_ids"].flatten(0, 1), batch["labels"].flatten(0, 1)
    base = GPT(Config.from_file(f"{litgpt_folder}/model_config.yaml"))
    base.load_state_dict(torch.load(f"{litgpt_folder}/lit_model.pth", weights_only=True))
    with torch.no_grad():
        want = sequence_logps(base(ids), labels)
        adapted = sequence_logps(module(ids), labels)
        with adapters_off(module.model):
            off = sequence_logps(module(ids), labels)
        again = sequence_logps(module(ids), labels)
        ref = module.reference_logps(ids, labels, {})
    torch.testing.assert_close(off, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-5)
    assert (adapted - want).abs().max() > 1e-2  # the adapters do change the output
    assert torch.equal(again, adapted)  # and are back after the block
    copy = as_dpo(LitGPTCausalLM(litgpt_folder), DPOSettings(beta=BETA, reference="copy"))
    with torch.no_grad():
        torch.testing.assert_close(copy.reference_logps(ids, labels, {}), want, rtol=0, atol=0)
    assert not any(p.requires_grad for p in getattr(copy, COPY_NAME).parameters())


def test_single_turn_conversations_in_litgpt_prompt_style():
    """With LitGPT's tokenizer (a prompt style, no chat template) single-turn conversational pairs are read as the
    text rows they hold; other turns are refused, naming them."""
    from lightning_parallel.preference.litgpt import single_turn_text

    prompt, chosen = [{"role": "user", "content": "Hi?"}], [{"role": "assistant", "content": "Hello."}]
    rejected = [{"role": "assistant", "content": "No."}]
    assert single_turn_text(prompt, chosen, rejected) == ("Hi?", "Hello.", "No.")
    with pytest.raises(ValueError, match=r"\['user', 'user'\]"):
        single_turn_text(prompt + prompt, chosen, rejected)


def test_pairs_are_padded_after_their_answers(dpo_setup):
    """LitGPT reads the pairs without attention mask: padded on the right, after every answer token."""
    batch = global_batches(dpo_setup)[0]
    mask = batch["attention_mask"]
    answers = batch["labels"] != -100
    last = mask.sum(-1, keepdim=True)
    positions = torch.arange(mask.shape[-1])
    assert torch.equal(mask.bool(), positions < last)  # padding only after the sequence
    assert not (answers & ~mask.bool()).any()


def test_the_recipe_takes_litgpt(tmp_path, monkeypatch):
    """``recipes/dpo.py model=litgpt_chat_tiny``: the parent builds the cache of the default (conversational) pairs
    with LitGPT's tokenizer, the prompt written in the folder's prompt style; the rows carry no attention mask."""
    from test_dpo_recipe import compose_dpo

    from lightning_parallel.recipes.dpo import check_dpo_config
    from lightning_parallel.recipes.dpo_data import preference_splits
    from lightning_parallel.recipes.finetune_data import tokenizer_of

    monkeypatch.chdir(tmp_path)
    cfg = compose_dpo(f"assets={tmp_path / 'dpo'}", "model=litgpt_chat_tiny")
    check_dpo_config(cfg)
    item = preference_splits(cfg)[0][0]
    assert "attention_mask" not in item
    start = int((item["labels"][0] != -100).nonzero()[0])  # the first answer token
    tokenizer = tokenizer_of(cfg)
    assert tokenizer.is_litgpt
    assert tokenizer.decode(item["input_ids"][0, :start].tolist()).startswith("Instruct: ")  # phi-2's style


@pytest.mark.slow
def test_the_recipe_learns_the_preferences_with_litgpt(tmp_path):
    """``python recipes/dpo.py model=litgpt_chat_tiny``: LitGPT's LoRA, held-out accuracy from 0 to above 0.8."""
    import json

    from recipe_runs import ROOT, run

    run(tmp_path, ROOT / "recipes" / "dpo.py", "model=litgpt_chat_tiny", timeout=1800)
    (metrics_file,) = (tmp_path / "outputs").glob("*/*/metrics.json")
    dpo = json.loads(metrics_file.read_text())["dpo"]
    assert dpo["before"]["accuracy"] == 0.0 and dpo["before"]["margin"] == 0.0
    assert dpo["after"]["accuracy"] > 0.8 and dpo["after"]["margin"] > 1.0, dpo
    assert dpo["reference"] == "adapters" and dpo["reference_bytes_per_rank"] == [0]
