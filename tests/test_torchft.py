"""fault_tolerance='torchft': two replica groups of two ranks each (launched as two torchruns, as torchft
expects), one SIGKILLed mid-training: the other goes on alone without a restart, the killed one restarts, rejoins
by a live state transfer from its peer (no checkpoint) and both reach max_steps. docs/fault-tolerance.md's
statement is checked: the final parameters equal one process in which step s averaged the batches of the groups
in step s's quorum. Plus the settings' checks (single process)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from parity import assert_same_params
from recipe_runs import GPT, run_recipe
from recipe_runs import env as recipe_env
from workers.cases.fault_tolerance import batch_of, model, optimizer

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.fault_tolerance import check_backend, lighthouse_address, sampler_kwargs

RUN = Path(__file__).parent / "workers" / "run.py"

STEPS, KILL_AT = 80, 8


# ----- settings (no process group) -----


def test_torchft_settings_are_checked_before_launch(monkeypatch):
    ft = {"fault_tolerance": "torchft"}
    with pytest.raises(ValueError, match="fault_tolerance='bogus' is unknown"):
        ParallelConfig(fault_tolerance="bogus").validate()
    with pytest.raises(ValueError, match="ft_replica_id=2 names no replica group of 2"):
        ParallelConfig(**ft, ft_replica_id=2).validate()
    with pytest.raises(ValueError, match="ft_min_replicas=3 exceeds ft_replicas=2"):
        ParallelConfig(**ft, ft_min_replicas=3).validate()
    with pytest.raises(ValueError, match="ft_timeout=0 is not a duration"):
        ParallelConfig(**ft, ft_timeout=0).validate()
    for refused, why in [({"pp": 2}, "pipeline"), ({"dp_shard": 2, "zero_stage": 2}, "HSDP's replicas")]:
        with pytest.raises(ValueError, match=why):
            ParallelConfig(**ft, **refused).validate()
    with pytest.raises(ValueError, match="overlapped parameter gathers"):
        ParallelConfig(**ft, overlap_grad_reduce=True).validate()
    with pytest.warns(UserWarning, match="ft_\\* settings only apply"):
        ParallelConfig(ft_replicas=3).validate()
    for refused in ({"tp": 2}, {"zero_stage": 3}):
        with pytest.raises(ValueError, match="the live state transfer carries plain tensors"):
            ParallelConfig(**ft, **refused).validate()
    assert ParallelConfig(**ft, cp=2, zero_stage=2).validate().fault_tolerance == "torchft"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="needs torchft: pip install --no-deps torchft"):
        ParallelConfig(**ft).validate()


def test_torchft_lighthouse_backend_and_samples(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="needs a lighthouse: start `torchft_lighthouse"):
        lighthouse_address(None)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://h:1")
    assert lighthouse_address(None) == "http://h:1" and lighthouse_address("http://x:2") == "http://x:2"
    check_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="runs on cpu \\(gloo\\) or cuda \\(NCCL\\), not meta"):
        check_backend(torch.device("meta"))
    # group 1 of 2, batch rank 1 of 2: the 4th of 4 sample shards; without torchft the kwargs pass through
    config = ParallelConfig(fault_tolerance="torchft", ft_replica_id=1)
    assert sampler_kwargs(config, {"num_replicas": 2, "rank": 1}) == {"num_replicas": 4, "rank": 3}
    assert sampler_kwargs(ParallelConfig(), {"num_replicas": 2, "rank": 1}) == {"num_replicas": 2, "rank": 1}


def test_torchft_front_doors():
    """The recipes take it on strategy=hybrid3d only (zero1..3 and ddp would ignore it); Fabric refuses it."""
    from omegaconf.errors import OmegaConfBaseException

    from lightning_parallel.fabric.strategy import check_fabric_config
    from lightning_parallel.recipes.common import build_strategy
    from lightning_parallel.recipes.strategy_conf import strategy_conf

    ft = {"fault_tolerance": "torchft", "ft_replica_id": 1, "ft_lighthouse": "http://h:1"}
    strategy = build_strategy(strategy_conf("hybrid3d", zero_stage=2, **ft))
    assert (strategy.config.fault_tolerance, strategy.config.ft_replica_id) == ("torchft", 1)
    for name, schema in (("zero2", "zero1..3"), ("ddp", "ddp")):
        with pytest.raises(
            OmegaConfBaseException, match=f"Key 'fault_tolerance' not in 'the keys of strategy={schema}"
        ):
            strategy_conf(name, **ft)  # their schemas have no such key
    with pytest.raises(ValueError, match="runs under the Trainer only"):
        check_fabric_config(ParallelConfig(**ft).validate(), "Hybrid3DFabricStrategy")


# ----- two replica groups, one killed -----


def launch(replica: int, lighthouse: str, out: Path, zero_stage: int, no_wait: bool = False) -> subprocess.Popen:
    env = recipe_env()
    case = {"replica": replica, "lighthouse": lighthouse, "steps": STEPS, "sleep": 2.0, "zero_stage": zero_stage}
    case |= {"dir": str(out), "no_wait": no_wait}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(RUN)]
    cmd += ["fault_tolerance", "--opts", json.dumps(case), "--out", str(out / f"replica{replica}")]
    log = open(out / f"torchrun{replica}.log", "a")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def workers_of(agent: subprocess.Popen) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()]


def lines(out: Path, replica: int, rank: int) -> list[list[int]]:
    path = out / f"replica{replica}_rank{rank}.log"
    return [list(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition, job: subprocess.Popen, out: Path, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        logs = "".join(p.read_text()[-3000:] for p in sorted(out.glob("torchrun*.log")))
        assert job.poll() is None and time.monotonic() < deadline, f"{what}: {logs}"
        time.sleep(0.05)


def quorum_sizes(trace: list[list[int]]) -> list[int]:
    """Committed step s -> how many groups its quorum held, from a rank of group 0 (in every quorum)."""
    sizes, done = [], 0
    for step, participants, _pid in trace:
        if step == done + 1:  # committed (a dropped step leaves the count where it was)
            sizes.append(participants)
            done = step
    return sizes


def reference(sizes: list[int]) -> dict[str, torch.Tensor]:
    """One process: step s averages the batches of both dp ranks of each group in its quorum (group 0 alone
    when it held one group: group 0 took part in every step)."""
    net = model()
    opt = optimizer(net.parameters())
    for step, size in enumerate(sizes):
        batches = [batch_of(step, group, rank) for group in range(size) for rank in range(2)]
        loss = torch.stack([torch.nn.functional.mse_loss(net(x), y) for x, y in batches]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2])  # 2: the optimizer's flat slices travel on the rejoin too
def test_torchft_killed_replica_rejoins_and_final_state_is_the_quorums_average(tmp_path, zero_stage):
    coordination = pytest.importorskip("torchft.coordination", reason="fault_tolerance='torchft' needs torchft")
    lighthouse = coordination.LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=2000
    )
    jobs: list[subprocess.Popen] = []
    try:
        address = lighthouse.address()
        jobs += [launch(0, address, tmp_path, zero_stage), launch(1, address, tmp_path, zero_stage)]
        wait_for(lambda: len(lines(tmp_path, 1, 0)) >= KILL_AT, jobs[1], tmp_path, "group 1 never reached KILL_AT")
        for pid in [*workers_of(jobs[1]), jobs[1].pid]:  # the whole group: both ranks (own sessions), its agent
            os.kill(pid, signal.SIGKILL)
        jobs[1].wait(timeout=60)
        killed_at = lines(tmp_path, 1, 0)[-1][0]
        jobs[1] = launch(1, address, tmp_path, zero_stage, no_wait=True)
        for job in jobs:
            assert job.wait(timeout=600) == 0, "".join(p.read_text()[-4000:] for p in tmp_path.glob("torchrun*.log"))
    finally:
        for job in jobs:
            if job.poll() is None:
                for pid in [*workers_of(job), job.pid]:
                    os.kill(pid, signal.SIGKILL)
        lighthouse.shutdown()

    survivor = lines(tmp_path, 0, 0)
    assert len({pid for *_, pid in survivor}) == 1, "group 0 was restarted"
    assert [s[:2] for s in survivor] == [s[:2] for s in lines(tmp_path, 0, 1)], "group 0's ranks disagree"
    sizes = quorum_sizes(survivor)
    assert len(sizes) == STEPS and survivor[-1][0] == STEPS
    alone = [s for s, n in enumerate(sizes) if n == 1 and s >= killed_at]
    assert alone, f"no step ran with group 0 alone after the kill at step {killed_at}: {sizes}"
    rejoined = lines(tmp_path, 1, 0)
    restarted = [step for step, _, pid in rejoined if pid != rejoined[0][2]]
    assert restarted and restarted[0] > killed_at, f"the restarted group began at {restarted[:1]}, not from a peer"
    assert sizes[-1] == 2 and rejoined[-1][0] == STEPS, "the restarted group did not rejoin up to max_steps"
    ends = [json.loads((tmp_path / f"replica{g}" / f"rank{r}.json").read_text()) for g in (0, 1) for r in (0, 1)]
    assert all(end["global_step"] == STEPS for end in ends), f"the ranks' global steps at the end: {ends}"
    runs = [(n, len(list(g))) for n, g in itertools.groupby(sizes)]
    print(f"zero_stage={zero_stage}: killed at step {killed_at}; (groups, steps) in a row: {runs}")
    want = reference(sizes)
    for group in (0, 1):
        got = torch.load(tmp_path / f"replica{group}.pt")
        assert_same_params(got, want, f"group {group}, quorum sizes per step {sizes}")


@pytest.mark.slow
def test_torchft_recipe_one_group_equals_the_plain_run(tmp_path):
    """The recipe with strategy.fault_tolerance=torchft and a single replica group (a quorum of one) trains exactly
    as without it: the same final train and validation losses."""
    coordination = pytest.importorskip("torchft.coordination", reason="fault_tolerance='torchft' needs torchft")
    args = ["trainer=debug", "trainer.max_steps=6", "sample_tokens=8", "strategy=hybrid3d", "strategy.zero_stage=1"]
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        ft = [
            "strategy.fault_tolerance=torchft",
            "strategy.torchft.replicas=1",
            f"strategy.torchft.lighthouse={lighthouse.address()}",
        ]
        (tmp_path / "ft").mkdir()
        got = run_recipe(GPT, tmp_path / "ft", *args, *ft)
    finally:
        lighthouse.shutdown()
    (tmp_path / "plain").mkdir()
    want = run_recipe(GPT, tmp_path / "plain", *args)
    assert (got["final_train_loss"], got["final_val_loss"]) == (want["final_train_loss"], want["final_val_loss"])
