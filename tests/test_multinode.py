"""Two "nodes" on this machine: two torchrun agents meeting by c10d rendezvous on a loopback address
(``--nnodes 2 --node-rank 0/1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``), two processes each, run the GPT
recipe under hybrid3d with HSDP (ZeRO-3 sharded over the 2 processes of a node, replicated across the nodes) and
log the same per-step training losses and final validation loss as one process; the bytes that crossed the nodes
are one all-reduce of each rank's shard per step."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port
from recipe_runs import GPT, run_recipe
from recipe_runs import env as recipe_env

STEPS = ["trainer=debug", "trainer.max_steps=4", "trainer.val_check_interval=4", "sample_tokens=4"]
SMALL = ["model=gpt_tiny", "data.global_batch_size=8", "checkpoint=none", "trainer.logger=csv"]
NO_CLIP = ["trainer.gradient_clip_val=null"]  # the norm's scalar all-reduces would cross replicas too
HSDP = ["strategy=hybrid3d", "strategy.dp_shard=2", "strategy.zero_stage=3"]


def logged_losses(run_dir: Path) -> list[float]:
    with open(run_dir / "logs" / "version_0" / "metrics.csv") as f:
        return [float(row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


def node(rank: int, port: int, cwd: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank)]
    cmd += ["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    cmd += ["--rdzv-id", "two-nodes", str(GPT), *STEPS, *SMALL, *NO_CLIP, *HSDP]
    cmd += ["trainer.devices=2", "trainer.num_nodes=2", f"hydra.run.dir={cwd / 'run'}"]
    cwd.mkdir()
    out = open(cwd / "output.txt", "w")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(cmd, cwd=cwd, env=recipe_env(), stdout=out, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_nodes_by_c10d_rendezvous_train_like_one_process(tmp_path):
    port = free_port()
    nodes = [node(rank, port, tmp_path / f"node{rank}") for rank in (0, 1)]
    try:
        codes = [p.wait(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:  # the other agent failed: do not leave this one waiting at the rendezvous
                p.kill()
    outputs = [(tmp_path / f"node{r}" / "output.txt").read_text() for r in (0, 1)]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
    # global rank 0 writes metrics.json and the logs: on whichever node the rendezvous made node 0
    (run_dir,) = [tmp_path / f"node{r}" / "run" for r in (0, 1) if (tmp_path / f"node{r}" / "run" / "logs").is_dir()]
    (tmp_path / "one").mkdir()
    one = run_recipe(GPT, tmp_path / "one", *STEPS, *SMALL, *NO_CLIP, "strategy=hybrid3d", "trainer.devices=1")
    got = json.loads((run_dir / "metrics.json").read_text())
    assert got["layout"]["world_size"] == 4 and got["layout"]["num_nodes"] == 2 and got["layout"]["dp_shard"] == 2
    want_losses, got_losses = logged_losses(tmp_path / "one" / "run"), logged_losses(run_dir)
    print(f"two nodes: {got_losses}\none process: {want_losses}")
    assert len(got_losses) == len(want_losses) == 4
    for step, (g, w) in enumerate(zip(got_losses, want_losses)):
        assert abs(g - w) <= 1e-5 * abs(w), f"step {step}: two nodes {g} != one process {w}"
    assert abs(got["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * one["final_val_loss"]
    # what crossed the nodes: the replicas' all-reduce of each rank's shard (its ZeRO-3 parameters' bytes), once
    for rank, (axes, states) in enumerate(zip(got["comm_bytes_by_axis"], got["model_state_bytes"])):
        print(f"rank {rank} bytes by axis: {axes}")
        kinds = got["comm_bytes_per_step"][rank]
        assert set(kinds["all_reduce"]["by_axis"]) >= {"dpr"} and "dpr" not in kinds["all_gather"]["by_axis"]
        assert axes["dpr"]["payload_bytes"] == states["params"], (axes, states)
        assert axes["dpr"]["sent_bytes"] == 2 * states["params"] * (2 - 1) / 2  # one ring all-reduce over 2 replicas
        assert axes["dpr"]["calls"] == kinds["reduce_scatter"]["calls"]  # one per FSDP unit, after its reduce-scatter
