"""strategy='async_ps': parameter servers on the last ranks, workers on the others (issue 18, part 2).

staleness=0 is synchronous training and must equal one process on the global batch (losses 1e-5 relative,
parameters 1e-5, gradient clipping included); staleness=s > 0 keeps every worker within s steps of the slowest;
a worker killed with SIGKILL leaves the servers and the other workers going to the end; a checkpoint (the
servers' shards and counters) resumes where the run was. Unit tests need no process group.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import REPO, WORKERS, _env, free_port, run_worker
from parity import assert_same_losses, assert_same_params

from lightning_parallel import AsyncPSStrategy
from lightning_parallel.parallel.async_ps import FlatLayout, check_settings
from lightning_parallel.parallel.async_ps.layout import shard_optimizer


def run_ps(world: int, out: Path, **case) -> list[dict]:
    """``case`` (cases/async_ps.py's settings) on ``world`` processes: each rank's result."""
    return run_worker("async_ps", world, ["--opts", json.dumps(case)], out)


def mean_losses(ranks: list[dict]) -> list[float]:
    """Each step's loss on the global batch: the mean of the workers' losses on their equal shares."""
    by_step: dict[int, list[float]] = {}
    for r in ranks:
        for step, loss in r["losses"]:
            by_step.setdefault(step, []).append(loss)
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


def reference(tmp_path: Path, **case) -> tuple[list[float], dict]:
    ranks = run_ps(1, tmp_path / "ref", reference=True, **case)
    return mean_losses(ranks), torch.load(tmp_path / "ref" / "params.pt")


def parity(tmp_path: Path, world: int, servers: int, **case) -> None:
    want_losses, want_params = reference(tmp_path, **case)
    ranks = run_ps(world, tmp_path / "ps", num_servers=servers, staleness=0, **case)
    workers = [r for r in ranks if r["role"] == "worker"]
    assert len(workers) == world - servers and all(r["global_step"] == 10 for r in workers)
    label = f"async_ps staleness=0, {len(workers)} workers + {servers} servers"
    loss_diff = assert_same_losses(mean_losses(workers), want_losses, label)
    param_diff = assert_same_params(torch.load(tmp_path / "ps" / "params.pt"), want_params, label)
    print(f"{label}: losses within {loss_diff:.1e} (relative), parameters within {param_diff:.1e}")
    counters = ranks[0]["counters"]
    assert [c["updates"] for c in counters] == [10] * servers  # one update per global batch


def test_staleness0_equals_one_process(tmp_path):
    parity(tmp_path, 3, 1, clip=0.5)


@pytest.mark.slow
def test_staleness0_with_two_servers_equals_one_process(tmp_path):
    """The flat parameters split over 2 servers: the clipping norm sums both servers' slices."""
    parity(tmp_path, 4, 2, clip=0.5)


def test_bounded_staleness_keeps_workers_within_the_bound(tmp_path):
    """One worker sleeps 0.1 s a step: the other runs ahead, but never more than staleness=2 steps."""
    ranks = run_ps(3, tmp_path, staleness=2, steps=12, slow_sleep=0.1, val_every=6)
    (server,) = ranks[0]["counters"]
    assert server["pushes"] == {"0": 12, "1": 12} and server["updates"] == 24  # every push is one update
    assert server["max_clock_gap"] == 2, server  # ran ahead as far as allowed, no further
    assert 0 < server["max_staleness"] <= 2 * 2 + 1, server  # updates between a pull and its push
    for r in ranks[:2]:
        assert [step for step, _ in r["val_losses"]] == [6, 12] and all(math.isfinite(v) for _, v in r["val_losses"])
    assert ranks[0]["val_losses"] == ranks[1]["val_losses"]  # reduced over both workers
    final = mean_losses(ranks[:2])
    assert final[-1] < final[0] - 0.3, final  # it trains


def launch_independent(world: int, out: Path, case: dict) -> list[subprocess.Popen]:
    """Each rank its own process with torchrun's environment and no agent above them: nothing ends the others
    when one dies (torchrun's agent, and the tests' zygote, stop every rank once one has failed)."""
    port, procs = free_port(), []
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        env = {**_env(world, port), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        log = open(out / f"rank{rank}.log", "w")
        cmd = [sys.executable, str(WORKERS / "run.py"), "async_ps", "--opts", json.dumps(case), "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    return procs


def test_killed_worker_leaves_the_run_going(tmp_path):
    """Synchronous (staleness=0), 2 workers + 1 server: worker 1 is SIGKILLed in the forward of its step 3. The
    server drops it from the synchronous wait (its step 3 is lost: it never pushed it); worker 0 and the server
    finish all 10 steps and exit 0; from step 3 on, each update is worker 0's gradient alone."""
    procs = launch_independent(3, tmp_path, {"kill_rank": 1, "kill_step": 3})
    deadline = time.monotonic() + 240
    for proc in procs:
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(3)]
    codes = [p.returncode for p in procs]
    assert codes == [0, -9, 0], "\n".join(
        f"--- rank {r} ({c}) ---\n{t[-3000:]}" for r, (c, t) in enumerate(zip(codes, logs))
    )
    worker, server = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 2))
    assert worker["global_step"] == 10 and [s for s, _ in worker["losses"]] == list(range(10))
    (counters,) = server["counters"]
    assert counters["dead_workers"] == [1] and counters["pushes"] == {"0": 10, "1": 3}
    assert counters["updates"] == 10
    assert all(math.isfinite(loss) for _, loss in worker["losses"])


@pytest.mark.slow
def test_checkpoint_resumes_like_the_uninterrupted_run(tmp_path):
    """staleness=0: a checkpoint at step 5 (the server's shard, Adam state and update counter) resumed for
    steps 5..9 gives the uninterrupted run's losses and final parameters."""
    # epochs of 5 batches: the checkpoint at step 5 ends an epoch, and a plain DataLoader resumes exactly there
    whole = run_ps(3, tmp_path / "whole", epoch_steps=5, ckpt_dir=str(tmp_path / "ckpts"))
    saved = tmp_path / "ckpts" / "epoch=0-step=5.ckpt"
    state = torch.load(saved, weights_only=False)
    assert state["optimizer_states"][0]["async_ps"]["servers"][0]["updates"] == 5
    resumed = run_ps(3, tmp_path / "resumed", epoch_steps=5, resume=str(saved))
    want = mean_losses(whole[:2])[5:]
    assert_same_losses(mean_losses(resumed[:2]), want, "resumed at step 5")
    assert resumed[0]["counters"][0]["updates"] == 10
    assert_same_params(
        torch.load(tmp_path / "resumed" / "params.pt"), torch.load(tmp_path / "whole" / "params.pt"), "resumed"
    )


@pytest.mark.slow
def test_fully_async_fast_worker_is_not_held_back(tmp_path):
    """staleness above max_steps: the slowed worker (0.3 s a step) holds nobody; the fast worker finishes its
    steps while the slow one has pushed fewer (counts, not timings)."""
    ranks = run_ps(3, tmp_path, staleness=1000, steps=12, slow_sleep=0.3)
    (server,) = ranks[0]["counters"]
    assert server["updates"] == 24 and server["max_clock_gap"] > 2, server


# ----- no process group -----


def test_flat_shards_step_like_the_whole_parameters():
    """AdamW with two param groups on 3 servers' flat pieces: exactly the unsharded update."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() == 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.01)
    layout = FlatLayout.of(optimizer, 3)
    shards = [shard_optimizer(optimizer, layout, s) for s in range(3)]
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        flat_grad = layout.flat_grads()
        for s, (opt, pieces) in enumerate(shards):
            for piece, (_, lo, hi) in zip(pieces, layout.pieces(s)):
                piece.grad = flat_grad[lo:hi].clone()
            opt.step()
        optimizer.step()
    got = torch.cat([torch.cat([p.detach() for p in pieces]) for _, pieces in shards])
    torch.testing.assert_close(got, layout.flat_params(), rtol=0, atol=1e-7)


def test_settings_are_checked():
    with pytest.raises(ValueError, match=r"num_servers=0 must be a positive integer"):
        AsyncPSStrategy(num_servers=0)
    with pytest.raises(ValueError, match=r"staleness=-1 must be an integer >= 0"):
        check_settings(1, -1)
    with pytest.raises(TypeError, match=r"LBFGS is not element-wise"):
        model = torch.nn.Linear(2, 2)
        shard_optimizer(torch.optim.LBFGS(model.parameters()), FlatLayout.of(torch.optim.SGD(model.parameters()), 1), 0)


# ----- the GPT recipe -----

CONVERGE = ["model=gpt_tiny", "trainer.enable_progress_bar=false", "sample_tokens=0", "trainer.logger=none"]
CONVERGE += ["trainer.limit_val_batches=16", "strategy=async_ps", "trainer.devices=3"]


@pytest.mark.slow
def test_recipe_converges_at_staleness_4_like_synchronous(tmp_path):
    """600 updates of 8 samples each: synchronous (global batch 8: each update averages 2 x 4) against
    staleness 4 (global batch 16 split over 2 workers, every push of 8 samples one update, 300 steps each).
    The final validation loss is at most 5% above the synchronous run's; run through the recipe, metrics.json."""
    from recipe_runs import GPT, run_recipe

    (tmp_path / "sync").mkdir()
    (tmp_path / "stale").mkdir()
    sync = run_recipe(
        GPT,
        tmp_path / "sync",
        *CONVERGE,
        "data.global_batch_size=8",
        "trainer.max_steps=600",
        "trainer.val_check_interval=600",
        timeout=900,
    )
    stale = run_recipe(
        GPT,
        tmp_path / "stale",
        *CONVERGE,
        "data.global_batch_size=16",
        "strategy.staleness=4",
        "trainer.max_steps=300",
        "trainer.val_check_interval=300",
        timeout=900,
    )
    assert sync["async_ps"]["updates"] == stale["async_ps"]["updates"] == 600
    assert sync["async_ps"]["samples_per_update"] == stale["async_ps"]["samples_per_update"] == 8
    gap = stale["final_val_loss"] / sync["final_val_loss"] - 1
    print(
        f"val loss after 600 updates: sync {sync['final_val_loss']:.4f}, staleness 4 {stale['final_val_loss']:.4f}"
        f" ({100 * gap:+.1f}%)"
    )
    # converges: no more than 5% behind (the interleaving of pushes varies run to run: -5.6% and -1.9% seen here)
    assert gap < 0.05, (sync["final_val_loss"], stale["final_val_loss"])
