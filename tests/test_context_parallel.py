"""Context parallelism (cp): the attention against plain causal attention, and training against one process.

Attention (tests/workers/cases/context.py, world 2 and 4): ring and Ulysses attention on each rank's two mirrored
chunks give the rows and the q, k, v gradients of ``scaled_dot_product_attention(is_causal=True)`` on the whole
sequence; the ring sends exactly the bytes of ``ring_bytes`` (its block kernels: tests/test_ring_kernels.py, its
overlap: tests/test_ring_overlap.py, its 16-bit wire: tests/test_ring_precision.py). Training
(tests/workers/cases/gpt.py): fp32, 10 AdamW steps, plain / clipped / accumulated, the tiny GPT (sequence 16:
2 x cp chunks of 4 at cp=2, of 2 at cp=4); losses within 1e-5 relative and parameters within 1e-5 of the
single-process run.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import torch
from conftest import PARITY_CASES, Batch
from harness import run_worker
from parity import assert_same_losses, assert_same_params
from recipe_runs import GPT, run_recipe

from lightning_parallel.parallel.context import (
    check_heads,
    check_sequence,
    positions,
    ring_bytes,
    shard_sequence,
    unshard_sequence,
)
from lightning_parallel.parallel.context.split import natural_order, to_natural_order, to_rank_order

ATTENTION_CASES = [
    {"name": "ring", "mode": "ring", "seq_len": 16},
    {"name": "ring-long", "mode": "ring", "seq_len": 24, "batch": 1, "heads": 2, "head_dim": 16},
    {"name": "ring-fp64", "mode": "ring", "seq_len": 16, "dtype": "float64"},
    {"name": "ring-math", "mode": "ring", "seq_len": 16, "kernel": "math"},  # the twin other devices run
    {"name": "ulysses", "mode": "ulysses", "seq_len": 16},
]


# ----- the split, without any process group -----


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_and_inverse(cp):
    x = torch.arange(2 * 4 * cp * 3).reshape(2, 4 * cp, 3)  # 2 samples of 4cp tokens: 2cp chunks of 2
    pieces = [shard_sequence(x, cp, r) for r in range(cp)]
    assert all(p.shape == (2, 4, 3) for p in pieces)
    assert torch.equal(unshard_sequence(pieces), x)
    # each rank holds chunk r and its mirror 2cp - 1 - r; the positions say which tokens those are
    for r, piece in enumerate(pieces):
        assert torch.equal(piece[0, :, 0] // 3, positions(4, cp, r))
    assert positions(4, 2, 0).tolist() == [0, 1, 6, 7] and positions(4, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ulysses_chunk_order_needs_no_index_tensor(cp):
    """Ulysses' reorder of the gathered chunks (a flip and a cat, nothing built on the host) is the index-tensor one,
    and its inverse puts them back."""
    gathered = torch.arange(cp * 2 * 5).reshape(1, cp, 2, 5)  # (B, ranks, their two chunks, chunk tokens)
    ordered = to_natural_order(gathered, dim=1)
    assert torch.equal(ordered, gathered.reshape(1, 2 * cp, 5)[:, natural_order(cp)])
    assert torch.equal(to_rank_order(ordered, dim=1), gathered)


def test_causal_work_is_balanced():
    """Keys each rank's queries attend to (causal): the same on every rank with the mirrored chunks."""
    for cp in (2, 4, 8):
        work = [int((positions(8, cp, r) + 1).sum()) for r in range(cp)]
        assert len(set(work)) == 1, work


def test_bad_splits_name_the_setting():
    with pytest.raises(ValueError, match=r"cp=3 splits each sequence into 2 \* cp = 6"):
        check_sequence(16, 3)
    with pytest.raises(ValueError, match=r"cp_mode='ulysses' with cp=4 .* n_head / tp = 8 / 4 = 2"):
        check_heads(8, 4, tp=4)
    check_heads(8, 4, tp=2)


# ----- the attention, on 2 and 4 processes -----


@pytest.mark.parametrize("world", [2, 4])
def test_attention_matches_plain_causal_attention(world, tmp_path):
    ranks = run_worker("context", world, ["--cases", json.dumps(ATTENTION_CASES)], tmp_path)
    for rank, results in enumerate(ranks):
        for got in results:
            bar = 1e-12 if got["name"].endswith("fp64") else 2e-6
            label = f"cp={world} rank {rank} {got['name']}"
            assert got["out"] <= bar, f"{label}: output off by {got['out']:.1e}"
            assert max(got["grads"]) <= bar, f"{label}: q, k, v gradients off by {got['grads']}"
            if got["mode"] == "ring":
                assert got["sent"] == ring_bytes(got["kv_bytes"], world), f"{label}: ring bytes {got['sent']}"


# ----- training, against one process -----


class Layout(NamedTuple):
    world: int
    settings: str  # hybrid3d settings
    dp: int = 1
    cp: int = 2
    tp: int = 1

    @property
    def spec(self) -> str:
        return f"hybrid3d:{self.settings}"

    @property
    def label(self) -> str:
        return f"w{self.world}-{self.settings.replace(',', '-').replace('=', '').replace('_', '')}"

    @property
    def leaders(self) -> list[int]:
        """One rank per (dp, cp) index on the first stage: their local token means average to the global loss."""
        return [(d * self.cp + c) * self.tp for d in range(self.dp) for c in range(self.cp)]


LAYOUTS = [  # `make test`
    Layout(2, "cp=2"),
    Layout(2, "cp=2,cp_mode=ulysses"),
]
SLOW_LAYOUTS = [
    Layout(4, "cp=4", cp=4),
    Layout(4, "cp=4,cp_mode=ulysses", cp=4),
    Layout(4, "cp=2,tp=2", tp=2),
    Layout(4, "cp=2,tp=2,cp_mode=ulysses", tp=2),
    Layout(4, "cp=2,pp=2,microbatches=2"),
    Layout(2, "cp=2,zero_stage=3"),
    Layout(4, "dp=2,cp=2,zero_stage=1", dp=2),
    Layout(2, "cp=2,activation_checkpointing=full"),
    Layout(2, "cp=2,compile=1"),  # the ring's send/recv break the compiled graph; the rest compiles
    Layout(4, "cp=2,tp=2,sequence_parallel=1", tp=2),
    Layout(4, "dp=2,cp=2,zero_stage=2", dp=2),
    Layout(8, "pp=2,cp=2,tp=2,zero_stage=1,microbatches=2", tp=2),
    Layout(8, "dp=2,cp=2,tp=2,zero_stage=3,cp_mode=ulysses", dp=2, tp=2),
]


def check(run, reference, layout: Layout) -> None:
    for case in PARITY_CASES:
        name = case["name"]
        loss_rel = assert_same_losses(
            run.losses(name, layout.leaders), reference.losses(name), f"{layout.label} {name}"
        )
        param_abs = assert_same_params(run.params(name), reference.params(name), f"{layout.label} {name}")
        print(f"{layout.label} {name}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")
    want_val = reference.case("plain")["val_loss"]
    for rank in range(layout.world):  # sync_dist averages the cp ranks' token means: the whole sequence's
        got_val = run.case("plain", rank)["val_loss"]
        assert abs(got_val - want_val) <= 1e-5 * want_val, (
            f"{layout.label} rank {rank} val_loss {got_val} != {want_val}"
        )
        assert run.case("plain", rank)["val_samples"] == reference.case("plain")["val_samples"], (
            "cp ranks share samples"
        )


def _batch(tmp_path_factory, layouts: list[Layout], tag: str) -> Batch:
    runs = {layout.label: (layout.world, layout.spec, PARITY_CASES) for layout in layouts}
    return Batch(tmp_path_factory, runs, tag=tag)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Batch:
    return _batch(tmp_path_factory, LAYOUTS, "cp")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory) -> Batch:
    return _batch(tmp_path_factory, SLOW_LAYOUTS, "cp-slow")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.label)
def test_context_parallel_matches_one_process(runs, reference, layout):
    check(runs[layout.label], reference, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW_LAYOUTS, ids=lambda layout: layout.label)
def test_context_parallel_wide_matches_one_process(slow_runs, reference, layout):
    check(slow_runs[layout.label], reference, layout)


# ----- the long-sequence recipe: activation memory and ring bytes -----


@pytest.mark.slow
def test_long_sequence_recipe_halves_activations_and_sends_the_ring_bytes(tmp_path):
    """model=gpt_long (1024 tokens): at cp=2 each rank holds about half the activations of one process, the ring
    sends what ring_bytes says per layer (forward and backward) in the measured step, and Ulysses' all-to-alls
    what its formula says."""
    short = ["trainer=debug", "trainer.max_steps=4", "sample_tokens=4", "data.global_batch_size=4"]
    (tmp_path / "cp1").mkdir()
    (tmp_path / "cp2").mkdir()
    one = run_recipe(GPT, tmp_path / "cp1", "model=gpt_long", "strategy=hybrid3d", "trainer.devices=1", *short)
    two = run_recipe(GPT, tmp_path / "cp2", "+experiment=gpt_long_cp2", *short, timeout=600)
    assert two["layout"]["cp"] == 2 and two["layout"]["cp_mode"] == "ring" and one["layout"]["cp"] == 1
    ratio = [b / one["activation_memory_bytes"][0] for b in two["activation_memory_bytes"]]
    print(f"activation bytes per rank at cp=2 / cp=1: {ratio}")
    assert all(0.4 <= r <= 0.6 for r in ratio), ratio
    # 4 samples of 1024 tokens, d_model 64, fp32: each rank's K and V are 2 x 4 x 512 x 64 x 4 bytes; 2 layers
    kv = 2 * 4 * 512 * 64 * 4
    per_layer = ring_bytes(kv, 2)
    want = 2 * (per_layer["forward"] + per_layer["backward"])
    for rank, comm in enumerate(two["comm_bytes_per_step"]):
        sent = comm["send"]["sent_bytes"]
        print(f"rank {rank}: ring sent {sent:.0f} bytes, theory {want}")
        assert sent == pytest.approx(want, rel=0.05), (rank, comm)
    # Ulysses: q, k, v and the output each cross once per layer forward and once backward, (cp-1)/cp of them
    (tmp_path / "ulysses").mkdir()
    uly = run_recipe(GPT, tmp_path / "ulysses", "+experiment=gpt_long_cp2", "strategy.context.mode=ulysses", *short)
    ratio = [b / one["activation_memory_bytes"][0] for b in uly["activation_memory_bytes"]]
    print(f"Ulysses activation bytes per rank at cp=2 / cp=1: {ratio}")
    assert all(0.4 <= r <= 0.6 for r in ratio), ratio
    want = 2 * 2 * 4 * (kv // 2) * (2 - 1) / 2  # layers x (forward + backward) x 4 tensors x bytes x (cp-1)/cp
    for rank, comm in enumerate(uly["comm_bytes_per_step"]):
        sent = comm["all_to_all"]["sent_bytes"]
        print(f"rank {rank}: Ulysses all-to-all sent {sent:.0f} bytes, theory {want:.0f}")
        assert sent == pytest.approx(want, rel=0.05), (rank, comm)


# ----- checkpoints: parameters are replicated over cp, saved under single-process names -----

EPOCH, RESUMED_STEPS = 5, 2


@pytest.mark.slow
def test_checkpoint_saved_at_cp2_resumes_at_dp2_under_ulysses_and_in_one_process(tmp_path, tmp_path_factory):
    saved, plain = tmp_path / "cp2.ckpt", tmp_path / "plain.ckpt"
    save = {"name": "save", "steps": EPOCH, "epoch_steps": EPOCH}
    runs = {
        "cp2": (2, "hybrid3d:cp=2,zero_stage=1", [{**save, "save": str(saved)}]),
        "plain": (1, "auto", [{**save, "save": str(plain)}]),
    }
    saves = Batch(tmp_path_factory, runs, tag="cp-save")
    assert_same_losses(saves["cp2"].losses("save"), saves["plain"].losses("save"), "cp=2 before saving")

    def resume(ckpt):
        return [{"name": "resume", "steps": EPOCH + RESUMED_STEPS, "epoch_steps": EPOCH, "resume": str(ckpt)}]

    layouts = {
        "dp2": (2, "hybrid3d:dp=2", resume(saved)),
        "cp2-ulysses-zero3": (2, "hybrid3d:cp=2,cp_mode=ulysses,zero_stage=3", resume(saved)),
        "one-process": (1, "hybrid3d", resume(saved)),
    }
    resumed = Batch(tmp_path_factory, {**layouts, "reference": (1, "auto", resume(plain))}, tag="cp-resume")
    want = resumed["reference"].losses("resume")
    assert len(want) == RESUMED_STEPS
    for label in layouts:  # every rank's local mean: dp ranks' samples, or cp ranks' halves of the same samples
        assert_same_losses(resumed[label].losses("resume"), want, f"cp=2 checkpoint resumed by {label}")
        assert_same_params(resumed[label].params("resume"), resumed["reference"].params("resume"), label)


# ----- mixed precision (tests/test_precision.py's cases and bars) -----

PRECISION_CASES = [
    {"name": "fp16", "steps": 10, "precision": "16-mixed", "clip": 0.05, "validate": True},
    {"name": "fp16_sgd", "steps": 6, "precision": "16-mixed", "optimizer": "sgd", "clip": 1.0, "accumulate": 2},
    {"name": "bf16", "steps": 10, "precision": "bf16-mixed"},
    {"name": "bf16_true", "steps": 10, "precision": "bf16-true", "clip": 0.05},
]
PRECISION_BAR = {"fp16": 5e-5, "fp16_sgd": 5e-4, "bf16": 5e-4, "bf16_true": 5e-4}


@pytest.mark.slow
def test_mixed_precision_matches_one_process(tmp_path_factory):
    """Ring and Ulysses at cp=2 in fp16 (torch's GradScaler in the reference: the same loss scales), bf16-mixed and
    bf16-true: losses within the precision tests' bars of one process in the same precision."""
    layouts = {"ring": "hybrid3d:cp=2", "ulysses": "hybrid3d:cp=2,cp_mode=ulysses"}
    runs = {label: (2, spec, PRECISION_CASES) for label, spec in layouts.items()}
    batch = Batch(tmp_path_factory, {**runs, "single": (1, "auto", PRECISION_CASES)}, tag="cp-precision")
    for label in layouts:
        for case in PRECISION_CASES:
            name = case["name"]
            got, want = batch[label].losses(name), batch["single"].losses(name)
            worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
            print(f"cp=2 {label} {name}: max loss rel diff {worst:.1e} (bar {PRECISION_BAR[name]:.0e})")
            assert worst <= PRECISION_BAR[name], f"{label} {name}: {got} vs {want}"
            if case["precision"] == "16-mixed":
                for rank in range(2):
                    assert batch[label].case(name, rank)["scales"] == batch["single"].case(name)["scales"]
