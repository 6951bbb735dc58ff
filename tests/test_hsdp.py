"""HSDP (``dp_shard``): ZeRO 1-3 sharded inside dp_shard ranks, replicated across dp / dp_shard replicas.

Training (tests/workers/cases/gpt.py): 2 replicas x 2 shards at world 4, fp32, 10 AdamW steps, plain / clipped /
accumulated: losses within 1e-5 relative and parameters within 1e-5 of the single-process run. The mesh and the
checks need no process group: a replica's shards (and tp, cp) are neighbouring ranks, and a layout whose node-local
axes do not divide the node size is refused with the node size in the message. Checkpoints saved under HSDP resume
at plain dp, plain ZeRO and in one process with the next losses of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import PARITY_CASES, Batch
from parity import assert_same_losses, assert_same_params

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.data.hybrid_shard import replica_bytes
from lightning_parallel.parallel.data.stages import ZERO_STAGES
from lightning_parallel.parallel.measure.comm_volume import CommCounter, CommEvent

FAST = {"zero3": "hybrid3d:dp_shard=2,zero_stage=3"}  # `make test`
SLOW = {
    "zero1": "hybrid3d:dp_shard=2,zero_stage=1",
    "zero2": "hybrid3d:dp_shard=2,zero_stage=2",
    "zero3-strategy": "zero3:dp_shard=2",
    "zero2-tp2": "hybrid3d:dp_shard=2,tp=2,zero_stage=2",
    "zero3-cp2": "hybrid3d:dp_shard=2,cp=2,zero_stage=3",  # the shard role flattened (dp_cp) in the 2-D mesh
}
WORLD = {"zero2-tp2": 8, "zero3-cp2": 8}
STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}
EPOCH, RESUMED_STEPS = 5, 2  # checkpoints: saved after EPOCH steps, then RESUMED_STEPS more
SAVE = {"name": "save", "steps": EPOCH, "epoch_steps": EPOCH}


# ----- the mesh, without any process group -----


def test_replicas_are_outermost_so_shards_and_tp_stay_inside_a_node():
    dims = ParallelConfig(dp_shard=2, tp=2, zero_stage=3).dims(8)  # dp=4: 2 replicas x 2 shards, tp=2
    assert (dims.dp, dims.dpr, dims.dp_shard) == (4, 2, 2)
    sized = {axis: d for axis, d in dims.degrees.items() if d > 1}
    assert list(sized.items()) == [("dpr", 2), ("dp", 2), ("tp", 2)]  # in mesh order; every other axis of size 1
    # row-major, as init_device_mesh lays it out; the size-1 axes dropped: (dpr, dp, tp)
    ranks = torch.arange(8).reshape(tuple(dims.degrees.values())).squeeze()
    node_size = 4  # two nodes of 4: ranks 0-3 and 4-7
    for replica in range(2):  # one replica's shards and tp ranks: one node
        inside = ranks[replica].flatten()
        assert len({int(r) // node_size for r in inside}) == 1, inside
    for shard in range(2):  # the ranks holding the same shard: one per node
        across = ranks[:, shard, 0]
        assert len({int(r) // node_size for r in across}) == 2, across
    assert dims.role_size("batch") == 4 and dims.node_local() == {"tp": 2, "dp_shard": 2}
    dims.check_node_size(4, 2)
    with pytest.raises(ValueError, match=r"tp\(2\) \* dp_shard\(2\) = 4 does not divide the node size 2"):
        dims.check_node_size(2, 4)


def test_the_slurm_job_checks_the_node_aware_mesh():
    """hydra/launcher=slurm with trainer.devices tasks per node: the recipe's checks accept tp x dp_shard = the node
    size, and refuse a layout that would put a replica's shards on two nodes, naming the node size."""
    from hydra import compose, initialize_config_dir
    from recipe_runs import ROOT

    from lightning_parallel.recipes import gpt
    from lightning_parallel.recipes.config import register_configs

    register_configs()
    base = ["hydra/launcher=slurm", "trainer.num_nodes=2", "strategy=hybrid3d", "strategy.zero_stage=3"]
    fits = [*base, "trainer.devices=4", "strategy.tp=2", "strategy.dp_shard=2", "data.global_batch_size=8"]
    crosses = [*base, "trainer.devices=2", "strategy.dp_shard=4", "trainer.num_nodes=4", "data.global_batch_size=8"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_gpt", overrides=fits, return_hydra_config=True)
        assert (cfg.hydra.launcher.nodes, cfg.hydra.launcher.tasks_per_node) == (2, 4)
        gpt.check_config(compose("train_gpt", overrides=fits))
        with pytest.raises(ValueError, match=r"dp_shard\(4\) = 4 does not divide the node size 2"):
            gpt.check_config(compose("train_gpt", overrides=crosses))


def test_bytes_split_by_the_axes_of_their_groups():
    counter = CommCounter()
    counter.events = [
        CommEvent("all_reduce", 100, 2, "float32", "g1"),
        CommEvent("all_gather", 40, 2, "float32", "g2"),
        CommEvent("all_reduce", 8, 4, "float32", "unknown"),
    ]
    axes_of = {"g1": "dpr", "g2": "dp"}
    assert {a: row["sent_bytes"] for a, row in counter.by_axis(axes_of).items()} == {"dpr": 100, "dp": 20, "other": 12}
    assert counter.by_kind(axes_of)["all_reduce"]["by_axis"] == {"dpr": 100, "other": 12}
    assert "by_axis" not in counter.by_kind()["all_reduce"]


def test_dp_shard_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"dp_shard=3 must divide dp=4 .* divisors of 4"):
        ParallelConfig(dp_shard=3, zero_stage=3).dims(4)
    with pytest.raises(ValueError, match=r"dp_shard=2 \(HSDP\) with zero_stage=0 .* set zero_stage to 1, 2 or 3"):
        ParallelConfig(dp_shard=2).validate()
    with pytest.raises(ValueError, match=r"dp_shard=2 \(HSDP\) with ep=2"):
        ParallelConfig(dp=4, dp_shard=2, ep=2, zero_stage=2).validate()
    assert ParallelConfig(dp_shard=4, zero_stage=3).dims(4).dpr == 1  # dp_shard = dp: plain ZeRO


def test_replica_bytes_are_one_all_reduce_of_the_shard():
    assert replica_bytes(1000.0, dp_shard=2, replicas=2) == 2 * 500 * 1 / 2
    assert replica_bytes(1000.0, dp_shard=4, replicas=1) == 0.0


# ----- training, against one process -----


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory) -> Batch:
    """The parity runs, and in the same launches the saves the fast checkpoint test resumes from."""
    folder = tmp_path_factory.mktemp("hsdp-ckpts")
    runs = {label: (4, spec, PARITY_CASES) for label, spec in FAST.items()}
    runs["hsdp3-save"] = (4, FAST["zero3"], [{**SAVE, "save": str(folder / "hsdp3.ckpt")}])
    runs["plain-save"] = (1, "auto", [{**SAVE, "save": str(folder / "plain.ckpt")}])
    return Batch(tmp_path_factory, runs, tag="hsdp")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory) -> Batch:
    runs = {label: (WORLD.get(label, 4), spec, PARITY_CASES) for label, spec in SLOW.items()}
    return Batch(tmp_path_factory, runs, tag="hsdp-slow")


def check(run, reference, label: str, tp: int = 1) -> None:
    leaders = list(range(0, len(run.ranks), tp))  # one rank per dp index
    if tp == 1:  # model states sharded over dp_shard=2 ranks (x cp), not dp=4
        sharding = ZERO_STAGES[STAGE[label.split("-")[0]]]
        want = sharding.state_bytes_exact(run.case("plain")["num_params"], 4 if "cp2" in label else 2)
        assert run.case("plain")["memory"]["total"] == want, (label, run.case("plain")["memory"], want)
    for case in PARITY_CASES:
        name = case["name"]
        loss_rel = assert_same_losses(run.losses(name, leaders), reference.losses(name), f"HSDP {label} {name}")
        param_abs = assert_same_params(run.params(name), reference.params(name), f"HSDP {label} {name}")
        print(f"HSDP 2x2 {label} {name}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")
    want_val = reference.case("plain")["val_loss"]
    for rank in range(len(run.ranks)):
        got = run.case("plain", rank)["val_loss"]
        assert abs(got - want_val) <= 1e-5 * want_val, f"{label} rank {rank} val_loss {got} != {want_val}"


@pytest.mark.parametrize("label", list(FAST))
def test_hsdp_matches_one_process(fast_runs, reference, label):
    check(fast_runs[label], reference, label)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_hsdp_zero_stages_match_one_process(slow_runs, reference, label):
    check(slow_runs[label], reference, label, tp=2 if "tp2" in label else 1)


# ----- checkpoints: replicas hold the same shards; any layout reads them -----


def resume(ckpt) -> list[dict]:
    return [{"name": "resume", "steps": EPOCH + RESUMED_STEPS, "epoch_steps": EPOCH, "resume": str(ckpt)}]


def check_resumed(saved: Batch, saves: list[str], resumed: Batch, layouts: list[str]) -> None:
    """Each saved run's losses match one process's; each resumed layout continues with the uninterrupted losses."""
    for label in saves:
        assert_same_losses(saved[label].losses("save"), saved["plain-save"].losses("save"), f"{label} before saving")
    want = resumed["reference"].losses("resume")
    assert len(want) == RESUMED_STEPS
    for label in layouts:
        rel = assert_same_losses(resumed[label].losses("resume"), want, f"checkpoint resumed by {label}")
        param = assert_same_params(resumed[label].params("resume"), resumed["reference"].params("resume"), label)
        print(f"resumed by {label}: next losses {resumed[label].losses('resume')}, rel {rel:.1e}, params {param:.1e}")


def test_checkpoint_saved_under_hsdp_resumes_in_one_process(fast_runs, tmp_path_factory):
    folder = fast_runs["hsdp3-save"].case("save")  # launches the saves
    hsdp, plain = (Path(fast_runs.runs[k][2][0]["save"]) for k in ("hsdp3-save", "plain-save"))
    assert folder and hsdp.exists()
    layouts = {"one-process": (1, "hybrid3d", resume(hsdp)), "reference": (1, "auto", resume(plain))}
    resumed = Batch(tmp_path_factory, layouts, tag="hsdp-resume")
    check_resumed(fast_runs, ["hsdp3-save"], resumed, ["one-process"])


@pytest.mark.slow
def test_checkpoints_move_between_hsdp_and_plain_layouts(tmp_path, tmp_path_factory):
    """HSDP ZeRO-3 and ZeRO-2 saved, read by plain ZeRO at dp=2 and 4 and plain dp; a one-process checkpoint
    read by HSDP ZeRO-1 and ZeRO-3."""
    hsdp3, hsdp2, plain = tmp_path / "hsdp3.ckpt", tmp_path / "hsdp2.ckpt", tmp_path / "plain.ckpt"
    saves = {
        "hsdp3": (4, "hybrid3d:dp_shard=2,zero_stage=3", [{**SAVE, "save": str(hsdp3)}]),
        "hsdp2": (4, "hybrid3d:dp_shard=2,zero_stage=2", [{**SAVE, "save": str(hsdp2)}]),
        "plain-save": (1, "auto", [{**SAVE, "save": str(plain)}]),
    }
    saved = Batch(tmp_path_factory, saves, tag="hsdp-save-slow")
    saved["plain-save"]
    layouts = {
        "zero2-dp2-from-hsdp3": (2, "zero2", resume(hsdp3)),
        "dp4-from-hsdp2": (4, "hybrid3d", resume(hsdp2)),
        "zero3-dp4-from-hsdp2": (4, "zero3", resume(hsdp2)),
        "one-process-from-hsdp2": (1, "hybrid3d", resume(hsdp2)),
        "hsdp1-from-plain": (4, "hybrid3d:dp_shard=2,zero_stage=1", resume(plain)),
        "hsdp3-from-plain": (4, "hybrid3d:dp_shard=2,zero_stage=3", resume(plain)),
        "reference": (1, "auto", resume(plain)),
    }
    resumed = Batch(tmp_path_factory, layouts, tag="hsdp-resume-slow")
    check_resumed(saved, ["hsdp3", "hsdp2"], resumed, [k for k in layouts if k != "reference"])


@pytest.mark.slow
def test_checkpoint_saved_at_cp2_under_hsdp_resumes_at_plain_dp_and_in_one_process(tmp_path, tmp_path_factory):
    """Saved at cp=2 x HSDP ZeRO-3 (2 replicas x 2 shards, world 8), read by plain dp=2 and by one process."""
    ckpt, plain = tmp_path / "cp2-hsdp3.ckpt", tmp_path / "plain.ckpt"
    saves = {
        "cp2-hsdp3": (8, "hybrid3d:dp_shard=2,cp=2,zero_stage=3", [{**SAVE, "save": str(ckpt)}]),
        "plain-save": (1, "auto", [{**SAVE, "save": str(plain)}]),
    }
    saved = Batch(tmp_path_factory, saves, tag="cp2-hsdp-save")
    saved["plain-save"]
    layouts = {
        "dp2-from-cp2-hsdp3": (2, "hybrid3d", resume(ckpt)),
        "one-process-from-cp2-hsdp3": (1, "hybrid3d", resume(ckpt)),
        "reference": (1, "auto", resume(plain)),
    }
    resumed = Batch(tmp_path_factory, layouts, tag="cp2-hsdp-resume")
    check_resumed(saved, ["cp2-hsdp3"], resumed, [k for k in layouts if k != "reference"])
