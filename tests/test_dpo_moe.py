"""DPO on Hugging Face MoE models (tiny Mixtral and Qwen3-MoE, as tests/test_hf_moe_parity.py builds them) with the
experts split over ep, against one process: the preference pairs of tests/test_dpo_parity.py (answers of different
lengths), fp32, 10 steps, LoRA on the attention (the reference: adapters off), every weight (a frozen copy) or a
precomputed reference; the loss is the DPO loss plus ``router_aux_loss_coef`` times HF's load-balancing loss of
the policy's forward, as TRL 1.16 adds it (:mod:`lightning_parallel.preference.moe`): losses within 1e-5 relative,
parameters within 1e-5. Under pp each pipeline microbatch is a batch of the load-balancing loss (as in
tests/test_hf_moe_parity.py), so the one-process reference sums the losses of the global batch's microbatch parts.
And the single-process pieces: the auxiliary loss is in the loss (TRL's rule turns it on), the reference's forward
computes none."""

from __future__ import annotations

import pytest
import test_dpo_parity
import torch
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from test_dpo_parity import BETA, GLOBAL_BATCH, SEQ_LEN, STEPS, global_batches, reference_of

from lightning_parallel.preference.data import PreferencePairs
from lightning_parallel.preference.module import DPOSettings, as_dpo
from lightning_parallel.preference.reference import COPY_NAME

dpo_setup = test_dpo_parity.dpo_setup  # the pairs, their cache and tokenizer (a module fixture)

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

LR = {True: 1e-2, False: 1e-3}  # by lora, as tests/test_dpo_parity.py
DENSE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # fmt: skip
# the load-balancing loss weighted 0.1 (HF's default 0.001 would hide a wrong gradient under the 1e-5 bars)
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.1}
FIELDS = {
    "mixtral": {"model_type": "mixtral", **DENSE, **AUX, "intermediate_size": 64, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", **DENSE, **AUX, "head_dim": 8, "intermediate_size": 64,
                  "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 3},
}  # fmt: skip
# LoRA (peft) on the attention, the experts frozen and split over ep
MOE_LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}

# label -> (world, strategy, pipeline microbatches); the model's name first, "lora" / "full" / "precomputed"
SLOW = {
    "mixtral ep2 lora": (2, "hybrid3d:ep=2", 1),
    "qwen3_moe ep2 lora": (2, "hybrid3d:ep=2", 1),
    "mixtral ep2 zero2 full": (2, "hybrid3d:ep=2,zero_stage=2", 1),
    "mixtral ep2 zero2 full precomputed": (2, "hybrid3d:ep=2,zero_stage=2", 1),
    "mixtral ep2 zero2 lora": (2, "hybrid3d:ep=2,zero_stage=2", 1),
    "mixtral pp2 ep2 lora": (4, "hybrid3d:pp=2,ep=2,microbatches=2", 2),
}


def case_of(label: str, cache: str, vocab: int) -> dict:
    lora = "lora" in label
    config = {**FIELDS[label.split()[0]], "vocab_size": vocab}
    return {"name": "train", "model": "hf", "config": config, "lora": MOE_LORA if lora else None, "cache": cache,
            "seq_len": SEQ_LEN, "steps": STEPS, "global_batch": GLOBAL_BATCH, "lr": LR[lora], "loss": "sigmoid",
            "beta": BETA, "reference": reference_of(label)}  # fmt: skip


def vocab_of(cache: str) -> int:
    pairs = PreferencePairs(cache, SEQ_LEN)
    return int(max(pairs.ids.max(), pairs.pad_id)) + 1


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, dpo_setup) -> Batch:
    cache = dpo_setup["cache"]
    spec = {label: (w, s, [case_of(label, cache, vocab_of(cache))]) for label, (w, s, _) in SLOW.items()}
    return Batch(tmp_path_factory, spec, tag="dpo_moe", worker="dpo_models")


def build(case: dict):
    """The case's DPO module, its weights there (a model from its config alone: initialized as the workers do)."""
    from workers.cases.dpo_models import build_module

    torch.manual_seed(0)
    lora = case["lora"] is not None
    live = {"precomputed": "adapters" if lora else "copy"}.get(case["reference"], case["reference"])
    model = as_dpo(build_module(case), DPOSettings(beta=BETA, reference=live))
    model.materialize()
    return model


def plain_training(case: dict, setup: dict, microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same DPO module trained by a plain loop in this process on the whole global batches, each cut into
    ``microbatches`` parts (a pipeline microbatch's pairs of every rank) whose losses are averaged."""
    model = build(case)
    optimizer = model.configure_optimizers()
    losses = []
    for batch in global_batches(setup):
        parts = [{k: v.chunk(microbatches)[m] for k, v in batch.items()} for m in range(microbatches)]
        loss = sum(model.pair_scores(part)[0] for part in parts) / microbatches
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith(COPY_NAME + ".")}
    return losses, state


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_dpo_moe_parity(label, slow_runs, dpo_setup):
    world, strategy, micro = SLOW[label]
    case = case_of(label, dpo_setup["cache"], vocab_of(dpo_setup["cache"]))
    want_losses, want_params = plain_training(case, dpo_setup, micro)
    run = slow_runs[label]
    loss_rel = assert_same_losses(run.losses("train"), want_losses, label)
    param_abs = assert_same_params(run.params("train"), want_params, label)
    if reference_of(label) == "copy":  # the frozen copy's experts split over ep as the policy's
        assert all(run.case("train", r)["copy_expert_params"] > 0 for r in range(world)), label
    print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")


def test_dpo_loss_adds_the_load_balancing_loss(dpo_setup):
    """TRL's rule: a MoE whose config has output_router_logits (off here) and a nonzero coefficient gets it on; the
    loss is the DPO loss plus coef x HF's load-balancing loss of the policy's forward (HF's own aux_loss), the
    reference's forward computes none."""
    cache = dpo_setup["cache"]
    case = case_of("mixtral ep2 lora", cache, vocab_of(cache))
    case["config"] = {**case["config"], "output_router_logits": False}
    model = build(case)
    assert model.hf_model.config.output_router_logits is True
    batch = {k: v[:4] for k, v in global_batches(dpo_setup)[0].items()}
    for p in model.parameters():
        if p.requires_grad:
            p.data.normal_(std=0.1)  # adapters that move the policy off the reference
    calls = []
    model.reference_logps = _recording(model.reference_logps, model, calls)
    with torch.no_grad():
        loss, _ = model.pair_scores(batch)
        ids, mask = batch["input_ids"].flatten(0, 1), batch["attention_mask"].flatten(0, 1)
        aux = model.model(input_ids=ids, attention_mask=mask, use_cache=False).aux_loss  # HF's own
    assert calls == [False], calls  # the reference's forward ran with router logits off
    assert aux is not None and aux.item() > 0
    model.hf_model.router_aux_loss_coef = 0.0  # the same batch without it
    with torch.no_grad():
        plain, _ = model.pair_scores(batch)
    torch.testing.assert_close(loss - plain, 0.1 * aux, rtol=1e-5, atol=1e-7)
    assert model.hf_model.config.output_router_logits is True  # restored after the reference's forward


def _recording(method, model, calls: list):
    def recorded(*args, **kwargs):
        calls.append(model.hf_model.config.output_router_logits)
        return method(*args, **kwargs)

    return recorded


@pytest.mark.slow
def test_the_load_balancing_loss_changes_the_training(dpo_setup):
    """The parity runs test the load-balancing loss's gradient too: without it (coefficient 0) the one-process
    training of the LoRA case ends elsewhere, by more than the 1e-5 bar."""
    cache = dpo_setup["cache"]
    case = case_of("mixtral ep2 lora", cache, vocab_of(cache))
    with_aux = plain_training(case, dpo_setup, 1)[1]
    case["config"] = {**case["config"], "router_aux_loss_coef": 0.0}
    without = plain_training(case, dpo_setup, 1)[1]
    assert max((with_aux[k] - without[k]).abs().max().item() for k in with_aux) > 1e-4
