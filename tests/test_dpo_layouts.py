"""DPO under more layouts against one process (the setup, the runs and the single-process references of
tests/test_dpo_parity.py): context parallelism (each pair's sequences split over cp ranks, the answer
log-probabilities summed over them), HSDP (dp_shard), and pp under every schedule of the pipeline's table
(lightning_parallel/parallel/pipeline/schedules.py), with the LoRA base or a frozen reference copy split into stages
like the policy. fp32, 10 steps, micro-batches holding different numbers of answer tokens; losses within 1e-5
relative, parameters within 1e-5."""

from __future__ import annotations

import pytest
from parity import assert_same_losses, assert_same_params
from test_dpo_parity import References, launch, reference_of
from test_dpo_parity import dpo_setup as dpo_setup  # noqa: F401  (fixtures)
from test_dpo_parity import references as references  # noqa: F401

from lightning_parallel.parallel.pipeline.schedules import SCHEDULES

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _pp(schedule: str, extra: str = "") -> str:
    virtual = ",pp_virtual_stages=2" if SCHEDULES[schedule].fixed_stages is None else ""
    return f"hybrid3d:pp=2,pp_schedule={schedule}{virtual}{extra}"


# label -> (world, strategy, the global ranks whose losses average to the global batch's: one per dp rank)
# cp=2 with every weight trained: its parameters agree to 7e-7; with LoRA to 9.5e-6, one entry of a lora_A whose
# gradient is near 0 for the first steps (B starts at 0), which AdamW's normalization turns into a full-size step
FAST = {"cp2 full": (2, "hybrid3d:cp=2", [0, 1])}
SLOW = {
    "cp2 lora": (2, "hybrid3d:cp=2", [0, 1]),
    "cp2 lora precomputed": (2, "hybrid3d:cp=2", [0, 1]),
    "cp2 full precomputed": (2, "hybrid3d:cp=2", [0, 1]),
    "cp2 x dp2 zero2 lora": (4, "hybrid3d:cp=2,zero_stage=2", [0, 1, 2, 3]),
    "hsdp dp4 dp_shard2 lora": (4, "hybrid3d:dp_shard=2,zero_stage=3", [0, 1, 2, 3]),
    "hsdp dp4 dp_shard2 full": (4, "hybrid3d:dp_shard=2,zero_stage=3", [0, 1, 2, 3]),
    **{f"pp2 {name} lora": (2, _pp(name), [0]) for name in SCHEDULES},
}
# the frozen reference copy split into stages like the policy
COPY = {
    "pp2 full copy": (2, "hybrid3d:pp=2", [0]),
    "pp2 x tp2 full copy": (4, "hybrid3d:pp=2,tp=2", [0]),
    "pp2 x dp2 zero3 full copy": (4, "hybrid3d:pp=2,zero_stage=3", [0, 1]),
}


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, dpo_setup):  # noqa: F811
    return launch(tmp_path_factory, dpo_setup, {k: v[:2] + (1,) for k, v in FAST.items()}, "dpo_layouts")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, dpo_setup):  # noqa: F811
    return launch(tmp_path_factory, dpo_setup, {k: v[:2] + (1,) for k, v in SLOW.items()}, "dpo_layouts_slow")


@pytest.fixture(scope="module")
def copy_runs(tmp_path_factory, dpo_setup):  # noqa: F811
    return launch(tmp_path_factory, dpo_setup, {k: v[:2] + (1,) for k, v in COPY.items()}, "dpo_layouts_copy")


def check(runs, label: str, spec: tuple, references: References) -> None:  # noqa: F811
    _, _, loss_ranks = spec
    want_losses, want_params = references["lora" in label, reference_of(label)]
    run = runs[label]
    loss_rel = assert_same_losses(run.losses("train", loss_ranks), want_losses, label)
    param_abs = assert_same_params(run.params("train"), want_params, label)
    print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")


def test_every_schedule_is_covered():
    """A schedule added to the pipeline's table gets its DPO parity run here."""
    assert {k.split()[1] for k in SLOW if k.startswith("pp2 ")} == set(SCHEDULES)


@pytest.mark.parametrize("label", list(FAST))
def test_dpo_layout_parity(label, fast_runs, references):  # noqa: F811
    check(fast_runs, label, FAST[label], references)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_dpo_layout_parity_wider(label, slow_runs, references):  # noqa: F811
    check(slow_runs, label, SLOW[label], references)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(COPY))
def test_dpo_reference_copy_under_pp(label, copy_runs, references):  # noqa: F811
    check(copy_runs, label, COPY[label], references)


@pytest.mark.slow
def test_each_stage_holds_its_part_of_the_copy(copy_runs, references):  # noqa: F811
    """At pp=2 each rank holds the copy's layers of its own stage: the ranks' bytes add up to one whole copy."""
    whole = sum(v.numel() * v.element_size() for v in references[False, "copy"][1].values())
    held = [copy_runs["pp2 full copy"].case("train", r)["copy_bytes"] for r in (0, 1)]
    assert sum(held) == whole and max(held) < whole, (held, whole)


def test_cp_rows_keep_every_answer_token_and_the_pairs_whole():
    """The layout cp splits: rows (chosen, rejected, ...) with each position's target, the reference (2B,) left out
    of the split (one dimension), no mask; the answer log-probabilities summed over the cp ranks' chunks of those
    rows equal the unsplit pairs' (every target kept, the one crossing a chunk boundary too)."""
    import torch

    from lightning_parallel.parallel.context.split import shard_sequence
    from lightning_parallel.preference.context import cp_rows
    from lightning_parallel.preference.loss import sequence_logps
    from lightning_parallel.preference.module import pair_rows

    torch.manual_seed(0)
    ids = torch.randint(0, 11, (2, 2, 8))
    labels = ids.clone()
    labels[..., :3] = -100  # the prompt
    labels[1, 1, 6:] = -100  # padding
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    batch["reference_logps"] = torch.randn(2, 2)
    rows = cp_rows(batch)
    assert set(rows) == {"input_ids", "labels", "reference_logps"} and rows["reference_logps"].dim() == 1
    flat_ids, flat_labels, _, ref = pair_rows(batch)
    assert torch.equal(rows["input_ids"], flat_ids) and torch.equal(rows["reference_logps"], ref)
    logits = torch.randn(4, 8, 11)
    cp = 2
    pieces = [
        sequence_logps(shard_sequence(logits, cp, r), shard_sequence(rows["labels"], cp, r), shifted=True)
        for r in range(cp)
    ]
    torch.testing.assert_close(sum(pieces), sequence_logps(logits, flat_labels), rtol=1e-6, atol=1e-6)
