"""A hang explained (``parallel/heartbeat.py``). Fast: the heartbeat's judgement on a store of three ranks with a fake
clock and fake collective counters (a rank stopped, a rank behind, all fine), the watch handing a hang on, and the
dumps. Slow: two torchrun "nodes" (one process each, c10d rendezvous) train; rank 1 gets SIGSTOP; rank 0 names it and
ends, non-zero, well within the run's 30 s collective timeout, with its flight recorder and stacks written and named."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import WORKERS, free_port
from recipe_runs import env as recipe_env

from lightning_parallel.parallel.failure import FailureBoard, FailureWatch, process_alive
from lightning_parallel.parallel.heartbeat import Hang, Heartbeat, Timing, dump, timing_for

TIMING = Timing(interval_s=1.0, stale_s=10.0, behind_s=18.0)
GROUP = (0, 1, 2)


class World:
    """Three ranks' heartbeats on one store, a shared fake clock and counters the test moves by hand."""

    def __init__(self) -> None:
        self.now, self.store = 0.0, dist.HashStore()
        self.issued = {r: 0 for r in range(3)}
        self.beats = [
            Heartbeat(
                self.store,
                r,
                3,
                TIMING,
                counters=lambda r=r: {"g": (self.issued[r], GROUP)},
                step=lambda r=r: 100 + self.issued[r],
                pending=lambda r=r: f"gloo:all_reduce #{self.issued[r]}",
                clock=lambda: self.now,
            )
            for r in range(3)
        ]

    def run(self, seconds: float, ticking=(0, 1, 2), issuing=()) -> list[Hang | None]:
        """``seconds`` of beats: the ``ticking`` ranks beat each second, the ``issuing`` ranks issue one collective
        a second; what each ticking rank's watch concluded last."""
        verdicts = [None] * 3
        for _ in range(int(seconds)):
            self.now += 1.0
            for r in issuing:
                self.issued[r] += 1
            for r in ticking:
                verdicts[r] = self.beats[r].tick()
        return verdicts


def test_timing_follows_the_run_timeout(monkeypatch):
    monkeypatch.delenv("LIGHTNING_PARALLEL_HEARTBEAT_S", raising=False)
    monkeypatch.delenv("LIGHTNING_PARALLEL_HEARTBEAT_STALE_S", raising=False)
    assert timing_for(timedelta(seconds=30)) == Timing(1.0, 10.0, 22.5)
    assert timing_for(timedelta(minutes=30)) == Timing(5.0, 120.0, 1350.0)  # Lightning's default timeout
    monkeypatch.setenv("LIGHTNING_PARALLEL_HEARTBEAT_S", "0")
    assert timing_for(30).interval_s == 0  # off


def test_all_fine_no_alarm():
    world = World()
    assert world.run(30, issuing=(0, 1, 2)) == [None, None, None]
    assert world.run(15) == [None, None, None]  # nobody issues for 15 s (< behind_s), all beat: no alarm


def test_a_stopped_rank_is_named_once_the_others_wait():
    world = World()
    world.run(5, issuing=(0, 1, 2))
    # rank 2 stops (no beat, no collective); 0 and 1 keep issuing for a while: no alarm while they progress
    assert world.run(12, ticking=(0, 1), issuing=(0, 1)) == [None, None, None]
    world.issued[0] += 1  # rank 0 enters a collective rank 2 will never join; rank 1 too
    world.issued[1] += 1
    assert world.run(9, ticking=(0, 1)) == [None, None, None]  # waiting 9 s < stale_s
    verdicts = world.run(3, ticking=(0, 1))  # waiting stale_s, seen within two beats
    hang = verdicts[0]
    assert hang is not None and hang.ranks == (2,) and verdicts[1] == hang  # rank 1 took up rank 0's announcement
    assert hang.text.endswith("(found by rank 0)")
    pid = os.getpid()
    assert re.match(
        rf"rank 2 \(host \S+, pid {pid}, step 105, collectives issued g: 5\) stopped beating 2\d\.0 s ago", hang.text
    )
    assert "waiting: rank 0 in gloo:all_reduce #18, rank 1 in gloo:all_reduce #18" in hang.text, hang.text


def test_a_rank_behind_in_its_collectives_is_named():
    world = World()
    world.run(5, issuing=(0, 1, 2))
    world.issued[0] += 1  # ranks 0 and 2 entered the next collective; rank 1 beats but never issues it
    world.issued[2] += 1
    assert world.run(17) == [None, None, None]  # everyone beats; quiet for at most 17 s < behind_s
    verdicts = world.run(4)  # quiet for behind_s, seen within two beats
    assert all(v is not None and v.ranks == (1,) for v in verdicts), verdicts  # every rank names it, rank 1 too
    assert "rank 1 (host" in verdicts[0].text
    assert "is behind: 5 collectives issued on group g (ranks [0, 1, 2]), rank 0 6" in verdicts[0].text
    assert re.search(r"no rank has issued a collective for 1[89]\.0 s", verdicts[0].text), verdicts[0].text


def test_a_store_that_stops_answering_ends_the_run():
    world = World()
    world.run(3, issuing=(0, 1, 2))
    beat = world.beats[0]
    assert beat.store_failed("DistNetworkError: Broken pipe") is None
    world.now += 9.0
    assert beat.store_failed("DistNetworkError: Broken pipe") is None  # 9 s < stale_s
    world.now += 1.0
    hang = beat.store_failed("DistNetworkError: Broken pipe")
    assert hang.ranks == () and hang.text.startswith("the rendezvous store has not answered for 10.0 s (DistNetwork")
    world.run(1)  # it answers again: the count starts over
    assert beat.store_failed("DistNetworkError: Broken pipe") is None


def test_a_rank_that_ended_its_work_is_no_hang():
    world = World()
    world.run(5, issuing=(0, 1, 2))
    world.beats[2].finish()  # teardown: rank 2 said it is done, then went quiet
    world.issued[0] += 1
    assert world.run(30, ticking=(0, 1)) == [None, None, None]


def test_without_a_trainer_the_step_is_the_optimizer_steps_taken():
    store, weight = dist.HashStore(), torch.nn.Parameter(torch.ones(2))
    beat = Heartbeat(store, 0, 1, TIMING, counters=dict, pending=lambda: None)  # Fabric: no step given
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(3):
        weight.grad = torch.ones(2)
        optimizer.step()
    beat.beat()
    assert json.loads(store.get("lightning_parallel/beat/0"))["step"] == 3
    beat.finish()  # the hook goes with the heartbeat
    optimizer.step()
    assert json.loads(store.get("lightning_parallel/beat/0"))["done"] and beat.step() == 3


def test_the_watch_hands_a_hang_over_and_stops(tmp_path):
    class Beat:
        ticks, finished = 0, False

        def tick(self):
            self.ticks += 1
            return Hang((1,), "rank 1 stopped") if self.ticks == 3 else None

        def beat(self):
            pass

        def finish(self):
            self.finished = True

    beat, got = Beat(), []
    board = FailureBoard(dist.HashStore(), 0, 2)
    watch = FailureWatch(board, None, 0.02, heartbeat=beat, on_hang=got.append, watch_board=False).start()
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    watch.stop()
    assert [h.text for h in got] == ["rank 1 stopped"] and watch.cause == "rank 1 stopped" and beat.finished
    assert beat.ticks == 3  # the thread ended at the hang
    board.record(RuntimeError("hang: rank 1 stopped"), rank=1)  # what the response leaves for the launchers
    assert board.first_failure() == (1, "RuntimeError: hang: rank 1 stopped")


def test_dump_writes_the_flight_recorder_and_the_stacks(tmp_path):
    paths = dump(tmp_path / "fr", rank=3)
    assert [p.name for p in paths] == ["fr_rank_3", "fr_3.json", "stacks_3.txt"]
    assert "pg_status" in json.loads(paths[1].read_text())  # no process group here: no entries
    assert pickle.loads(paths[0].read_bytes())["version"] == json.loads(paths[1].read_text())["version"]
    assert "test_dump_writes_the_flight_recorder_and_the_stacks" in paths[2].read_text()


# ----- two torchrun nodes, one rank stopped or lagging -----

TIMEOUT = 30  # the strategy's collective timeout, seconds


def node(rank: int, port: int, cwd: Path, how: str = "stop", timeout: int = TIMEOUT) -> subprocess.Popen:
    # 0.1 s a step: rank 1 has beaten a few times (1 s apart at this timeout) when it stops at step 30
    opts = {"fail": how, "rank": 1, "step": 30, "pace": 0.1, "devices": 1, "nodes": 2, "timeout": timeout}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank)]
    cmd += ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    cmd += ["--rdzv-id", "heartbeat", "--monitor-interval", "0.5"]
    cmd += [WORKERS / "run.py", "rank_failure", "--opts", json.dumps(opts), "--out", cwd]
    env = {**recipe_env(), "PYTHONPATH": f"{recipe_env()['PYTHONPATH']}:{WORKERS}", "PYTHONUNBUFFERED": "1"}
    cwd.mkdir()
    out = open(cwd / "output.txt", "w")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen(list(map(str, cmd)), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # about 25-40 s on 2 busy cores
def test_a_stopped_rank_on_another_node_is_named_within_the_timeout(tmp_path):
    start, port = time.time(), free_port()
    nodes = [node(r, port, tmp_path / f"node{r}") for r in (0, 1)]
    outputs = lambda: [(tmp_path / f"node{r}" / "output.txt").read_text() for r in (0, 1)]  # noqa: E731
    stopped_pid = None
    try:
        deadline = time.monotonic() + 300
        while all(p.poll() is None for p in nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = time.time()
        text = "\n".join(outputs())
        found = re.search(r"^PID 1 (\d+)$", text, re.M)
        stopped_pid = int(found.group(1)) if found else None
        done = [i for i, p in enumerate(nodes) if p.poll() is not None]
        assert len(done) == 1, f"no agent ended in 300 s (or both did)\n{text[-6000:]}"
    finally:
        if stopped_pid is not None:
            try:
                os.kill(stopped_pid, signal.SIGKILL)  # a stopped process takes SIGKILL
            except ProcessLookupError:
                pass
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    survivor = outputs()[done[0]]
    assert nodes[done[0]].returncode != 0 and "PID 0 " in survivor, text[-6000:]
    (stopped_at,) = map(float, re.findall(r"^FAILING ([\d.]+)$", text, re.M))
    took = ended - stopped_at
    print(f"rank 1 stopped; rank 0's agent ended {took:.1f} s later (timeout {TIMEOUT} s); test {ended - start:.1f} s")
    assert took < 0.8 * TIMEOUT, f"took {took:.1f} s\n{survivor[-4000:]}"  # gloo's own timeout would take 30 s
    said = re.search(r"^\[rank 0\] hang: (.*)$", survivor, re.M)
    assert said, survivor[-4000:]
    print(said[0])
    assert re.match(
        rf"rank 1 \(host \S+, pid {stopped_pid}, step (\d+), collectives issued 0: (\d+),.*\) stopped beating", said[1]
    )
    step, issued = map(int, re.match(r"rank 1 \(.*?step (\d+), collectives issued 0: (\d+)", said[1]).groups())
    assert 10 <= step <= 30 and issued > 10, said[1]  # its last beat: training was under way
    assert re.search(r"waiting: rank 0 in gloo:\w+ \(group ", said[1]), said[1]
    folder = tmp_path / f"node{done[0]}" / "flight_recorder"  # the Trainer's default_root_dir: the node's cwd
    named = re.findall(r"(/\S+?)(?:,|\.? Ending)", said[1].split("flight recorder and stacks: ")[1])
    assert named == [str(folder / n) for n in ("fr_rank_0", "fr_0.json", "stacks_0.txt")], said[1]
    entries = json.loads((folder / "fr_0.json").read_text())["entries"]
    pending = [e["profiling_name"] for e in entries if not e["retired"]]
    assert len(entries) > 25 and pending and pending[0].startswith("gloo:"), pending  # its last collectives
    assert re.search(r"line \d+ in all_reduce\n", (folder / "stacks_0.txt").read_text())  # the main thread's wait
    # torch's analyzer reads the dump (with the group table gloo leaves out filled in) and misses rank 1's
    fr_trace = ["-m", "torch.distributed.flight_recorder.fr_trace", folder, "--prefix", "fr_rank_"]
    fr_trace += ["--allow-incomplete-ranks"]
    analyzed = subprocess.run([sys.executable, *map(str, fr_trace)], capture_output=True, text=True, timeout=120)
    said = analyzed.stdout + analyzed.stderr
    assert analyzed.returncode == 0 and "missed FR dumps from ranks ({1})" in said, said[-3000:]


@pytest.mark.slow  # about 70 s on 2 busy cores: behind_s is 45 s at this timeout
def test_a_rank_that_never_reaches_the_collective_is_named_behind(tmp_path):
    """Rank 1 sleeps in its step (beating all the while); rank 0 waits in the step's all-reduce: rank 0 names rank 1
    as behind once nobody has issued a collective for 0.75 x timeout and announces it, rank 1 takes it up (its stacks
    show the sleep), both exit 1 within the timeout (60 s: at 30 s the two beats of grace leave too little margin)."""
    port, timeout = free_port(), 60
    nodes = [node(r, port, tmp_path / f"node{r}", how="lag", timeout=timeout) for r in (0, 1)]
    outputs = lambda: [(tmp_path / f"node{r}" / "output.txt").read_text() for r in (0, 1)]  # noqa: E731
    try:  # the workers' ends are timed (the agent that lost the store to the other's exit takes a while to notice)
        deadline, workers = time.monotonic() + 300, {}
        while time.monotonic() < deadline and (len(workers) < 2 or any(map(process_alive, workers.values()))):
            workers = {int(r): int(p) for r, p in re.findall(r"^PID (\d) (\d+)$", "\n".join(outputs()), re.M)}
            time.sleep(0.2)
        ended = time.time()
        codes = [p.wait(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(outputs())
    assert codes[0] != 0 and codes[1] != 0, text[-6000:]
    (lagging_at,) = map(float, re.findall(r"^FAILING ([\d.]+)$", text, re.M))
    took = ended - lagging_at
    print(f"rank 1 lagging; both workers ended {took:.1f} s later (timeout {timeout} s)")
    assert took < timeout, text[-6000:]
    said = dict(re.findall(r"^\[rank (\d)\] hang: (.*)$", text, re.M))
    assert sorted(said) == ["0", "1"], text[-6000:]  # every rank names it, rank 1 itself too
    for message in said.values():
        print(message[:400])
        behind = r"rank 1 \(host \S+, pid \d+, step \d+, .*\) is behind: (\d+) collectives issued on group 0 "
        behind += r"\(ranks \[0, 1\]\), rank 0 (\d+)"
        found = re.match(behind, message)
        assert found and int(found[1]) < int(found[2]), message
        assert "no rank has issued a collective for" in message and "(found by rank " in message
    (stacks,) = (tmp_path / f"node{r}" / "flight_recorder" / "stacks_1.txt" for r in (0, 1) if "PID 1 " in outputs()[r])
    assert re.search(r"line \d+ in on_train_batch_start", stacks.read_text())  # where rank 1 is stuck
