"""DPO's losses against TRL 1.16's own code: ``DPOTrainer._compute_loss`` called on a tiny Llama (with TRL's fused
head and its preference collator), its loss and gradient against :mod:`lightning_parallel.preference.loss` to 1e-6
for sigmoid, IPO and robust; and the settings' checks."""

from __future__ import annotations

import copy
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lightning_parallel.preference.loss import (
    answer_tokens,
    check_loss_settings,
    metric_sums,
    pair_losses,
    sequence_logps,
    split_pairs,
)

trl = pytest.importorskip("trl", reason="trl is a test dependency (pip install -e .[dev])")
transformers = pytest.importorskip("transformers")

EXAMPLES = [  # answers of different lengths, prompts of different lengths: every mask matters
    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5, 9], "rejected_ids": [6]},
    {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11, 12, 13]},
    {"prompt_ids": [14, 15, 16, 17, 18], "chosen_ids": [19, 20], "rejected_ids": [21, 22]},
]


def _tiny_llama(seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def _trl_loss(policy, reference, batch, loss, beta, smoothing):
    """TRL's own ``DPOTrainer._compute_loss`` on a stand-in for the trainer's state (what the method reads)."""
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    fields = ("log_probs", "entropy", "mean_logits", "is_top1")
    for model in (policy, reference):
        add_fused_lm_head(model, outputs=fields)
    accelerator = SimpleNamespace(
        device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x, unwrap_model=lambda m: m
    )
    trainer = SimpleNamespace(
        model=policy, ref_model=reference, accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=False, args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        f_divergence_type="reverse_kl", loss_types=[loss], loss_weights=[1.0], beta=beta, label_smoothing=smoothing,
        use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1,
    )  # fmt: skip
    value = DPOTrainer._compute_loss(trainer, policy, batch, return_outputs=False)
    return value, trainer._metrics["train"]


def _ours(policy, reference, batch, loss, beta, smoothing):
    """Ours on the same batch, its rows reordered as our data lay them out (chosen, rejected of each pair)."""
    p = batch["input_ids"].shape[0] // 2
    order = torch.stack([torch.arange(p), torch.arange(p) + p], dim=1).reshape(-1)  # c0 r0 c1 r1 ...
    ids, attn, mask = (batch[k][order] for k in ("input_ids", "attention_mask", "completion_mask"))
    labels = ids.masked_fill(mask == 0, -100)
    logps = sequence_logps(policy(input_ids=ids, attention_mask=attn).logits, labels)
    with torch.no_grad():
        ref = sequence_logps(reference(input_ids=ids, attention_mask=attn).logits, labels)
    tokens = answer_tokens(labels)
    (c, r), (rc, rr), (tc, tr) = split_pairs(logps), split_pairs(ref), split_pairs(tokens)
    pairs = pair_losses(
        c, r, rc, rr, beta=beta, loss=loss, label_smoothing=smoothing, chosen_tokens=tc, rejected_tokens=tr
    )
    return pairs.losses.sum() / p, pairs


@pytest.mark.parametrize(("loss", "smoothing"), [("sigmoid", 0.0), ("ipo", 0.0), ("robust", 0.2)])
def test_loss_and_gradient_equal_trl(loss, smoothing):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    batch = DataCollatorForPreference(pad_token_id=0)(EXAMPLES)
    beta = 0.5
    policy, reference = _tiny_llama(0), _tiny_llama(1)
    ours_policy, ours_reference = copy.deepcopy(policy), copy.deepcopy(reference)
    trl_value, trl_metrics = _trl_loss(policy, reference, batch, loss, beta, smoothing)
    trl_value.backward()
    value, pairs = _ours(ours_policy, ours_reference, batch, loss, beta, smoothing)
    value.backward()
    assert trl_value.item() > 0.0
    torch.testing.assert_close(value, trl_value, rtol=1e-6, atol=1e-6)
    # the gradient as one vector, relative to its norm: TRL's chunked log-prob kernel and our cross-entropy sum in
    # different orders (element-wise, a few entries near 0 differ by ~1e-6 absolute in fp32)
    trl_grad = torch.cat([p.grad.flatten() for p in policy.parameters()])
    grad = torch.cat([p.grad.flatten() for p in ours_policy.parameters()])
    error = ((grad - trl_grad).norm() / trl_grad.norm()).item()
    print(f"{loss}: loss {value.item():.8f} vs {trl_value.item():.8f}, gradient relative error {error:.2e}")
    assert trl_grad.norm() > 0 and error < 1e-6
    sums = metric_sums(pairs) / len(EXAMPLES)
    trl_means = [trl_metrics[k][-1] for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")]
    torch.testing.assert_close(sums[:3], torch.tensor(trl_means), rtol=1e-5, atol=1e-6)
    assert sums[3].item() == pytest.approx(trl_metrics["rewards/accuracies"][-1])


def test_accuracy_is_zero_when_policy_is_reference():
    """TRL's accuracy at the first step (policy = reference): both rewards 0, chosen > rejected is false."""
    logps = torch.tensor([-3.0, -5.0])
    pairs = pair_losses(logps[:1], logps[1:], logps[:1], logps[1:], beta=0.1)
    assert pairs.accuracies.item() == 0.0 and pairs.margins.item() == 0.0
    assert pairs.losses.item() == pytest.approx(0.6931471805599453)  # log 2


@pytest.mark.parametrize(
    ("loss", "beta", "smoothing", "match"),
    [
        ("hinge", 0.1, 0.0, "dpo.loss='hinge' is unknown"),
        ("sigmoid", 0.0, 0.0, "dpo.beta=0.0 must be above 0"),
        ("robust", 0.1, 0.5, r"dpo.label_smoothing=0.5 must lie in \[0, 0.5\)"),
        ("sigmoid", 0.1, 0.1, "used by dpo.loss=robust only"),
    ],
)
def test_bad_loss_settings(loss, beta, smoothing, match):
    with pytest.raises(ValueError, match=match):
        check_loss_settings(loss, beta, smoothing)
