"""One rank fails (an exception, or SIGKILL) mid-training: every other rank ends within the collective timeout,
the error names the rank that failed first, and no process of the run is left. Under Lightning's own
launcher (a plain ``Trainer(strategy=Hybrid3DStrategy(...), devices=2)`` script), under torchrun (world 4,
dp x tp) and through the recipe's launcher (torch elastic)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import WORKERS, free_port
from omegaconf.errors import ConfigAttributeError
from recipe_runs import env as recipe_env
from test_recipe_gpt import SHORT

from lightning_parallel import Hybrid3DStrategy, ZeroStrategy
from lightning_parallel.parallel.failure import FailureBoard, is_collective_failure, process_alive, to_timeout
from lightning_parallel.recipes.common import build_strategy
from lightning_parallel.recipes.strategy_conf import strategy_conf

TIMEOUT = 30  # strategy timeout, seconds: every rank must be gone this long after the failure
RUN = WORKERS / "run.py"


def case(**settings) -> list[str]:
    """run.py's arguments for cases/rank_failure.py with ``settings``."""
    return [RUN, "rank_failure", "--opts", json.dumps(settings)]


def run(cmd: list, cwd: Path) -> tuple[int, str, float]:
    """Run ``cmd``; returns its exit code, its output and when it ended (unix time)."""
    env = {**recipe_env(), "PYTHONPATH": f"{recipe_env()['PYTHONPATH']}:{WORKERS}", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(list(map(str, cmd)), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr, time.time()


def assert_ended_in_time(output: str, ended: float, world: int) -> dict[int, int]:
    """Every rank started, the run ended within TIMEOUT of the failure, and no rank's process is left."""
    pids = {int(r): int(p) for r, p in re.findall(r"^PID (\d+) (\d+)$", output, re.M)}
    assert sorted(pids) == list(range(world)), output[-4000:]
    (failed_at,) = re.findall(r"^FAILING ([\d.]+)$", output, re.M)
    took = ended - float(failed_at)
    print(f"all processes gone {took:.1f} s after the failure")
    assert took < TIMEOUT, f"the run took {took:.1f} s after the failure (timeout {TIMEOUT} s)\n{output[-4000:]}"
    left = [pid for pid in pids.values() if process_alive(pid)]
    assert not left, f"processes of the run still alive: {left}"
    return pids


@pytest.mark.parametrize("how", ["raise", pytest.param("kill", marks=pytest.mark.slow)])
def test_lightning_launcher_ends_every_rank_and_names_the_failed_one(how, tmp_path):
    cmd = [sys.executable, *case(fail=how, rank=1, devices=2, timeout=TIMEOUT)]
    code, output, ended = run([*cmd, "--out", tmp_path], tmp_path)
    assert code != 0
    pids = assert_ended_in_time(output, ended, 2)
    if how == "raise":
        want = "[rank0]: RuntimeError: rank 1 failed first: ValueError: injected failure at step 3"
    else:
        want = f"[rank0]: RuntimeError: rank 1 (pid {pids[1]}) ended without reporting an error"
    assert want in output, output[-4000:]


@pytest.mark.slow  # test budget: the world-2 launchers name the failed rank in `make test`
def test_torchrun_world4_every_survivor_names_the_failed_rank(tmp_path):
    """dp=2 x tp=2: rank 2 shares no group with rank 1, yet ends too and names it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--monitor-interval", "0.5"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}"]
    cmd += case(fail="raise", rank=1, devices=4, tp=2, timeout=TIMEOUT)
    code, output, ended = run([*cmd, "--out", tmp_path], tmp_path)
    assert code != 0
    assert_ended_in_time(output, ended, 4)
    named = set(re.findall(r"\[rank(\d)\]: RuntimeError: rank 1 failed first: ValueError: injected", output))
    # the agent's SIGTERM to the survivors only sets the Preemption flag: each ends at its failed collective
    assert named == {"0", "2", "3"}, output[-6000:]
    assert "ValueError: injected failure at step 3" in output


@pytest.mark.parametrize("how", [pytest.param("raise", marks=pytest.mark.slow), "kill"])
def test_recipe_launcher_names_the_first_failure(how, tmp_path):
    """torch elastic's own "first observed failure" is the first exit the agent saw; the error names the
    rank that failed first by the workers' record (or the rank a signal killed)."""
    args = [*SHORT, "strategy=zero2", "trainer.devices=2", f"strategy.timeout_s={TIMEOUT}"]
    recipe = case(recipe=[str(tmp_path / "run"), *args], fail=how, rank=1, step=3)
    code, output, ended = run([sys.executable, *recipe, "--out", tmp_path], tmp_path)
    assert code != 0
    pids = assert_ended_in_time(output, ended, 2)
    if how == "raise":
        want = "RuntimeError: rank 1 failed first: ValueError: injected failure at step 3"
    else:
        want = f"RuntimeError: rank 1 failed first: killed by SIGKILL (pid {pids[1]})"
    assert want in output, output[-4000:]


# ----- no process group -----


def test_timeout_takes_seconds_or_a_timedelta_and_refuses_the_rest():
    assert to_timeout(20) == to_timeout(timedelta(seconds=20)) == timedelta(seconds=20)
    assert Hybrid3DStrategy(timeout=12.5).runtime.timeout == timedelta(seconds=12.5)
    with pytest.raises(ValueError, match=r"timeout=0: the collective timeout must be positive"):
        ZeroStrategy(stage=1, timeout=0)
    with pytest.raises(TypeError, match=r"timeout='20': give a datetime.timedelta or a number of seconds"):
        Hybrid3DStrategy(timeout="20")

    def conf(name, **kwargs):  # the recipe's strategy node
        return strategy_conf(name, **kwargs)

    assert build_strategy(conf(name="zero2", timeout_s=15)).runtime.timeout == timedelta(seconds=15)
    with pytest.raises(ValueError, match=r"strategy.timeout_s=-1"):
        build_strategy(conf(name="hybrid3d", timeout_s=-1))
    with pytest.raises(ConfigAttributeError, match=r"Key 'timeout_s' not in 'the keys of strategy=ddp"):
        conf(name="ddp", timeout_s=15)  # Lightning's ddp takes no timeout: its schema has no such key


def test_board_keeps_the_first_failure_and_finds_a_killed_rank(tmp_path):
    store = dist.HashStore()
    boards = [FailureBoard(store, rank, 3, tmp_path) for rank in range(3)]
    assert boards[0].first_failure() is None
    boards[2].record(ValueError("first\nsecond line"))
    boards[1].record(KeyError("later"))
    assert boards[0].first_failure() == (2, "ValueError: first")
    assert boards[0].explain() == "rank 2 failed first: ValueError: first"
    assert FailureBoard(None, 0, 3, tmp_path).first_failure() == (2, "ValueError: first")  # the folder alone
    assert FailureBoard(store, 0, 3).first_failure() == (2, "ValueError: first")  # the store alone

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    store2 = dist.HashStore()
    store2.set("lightning_parallel/failure/pid/1", f"{__import__('socket').gethostname()}:{victim.pid}")
    board = FailureBoard(store2, 0, 2)
    victim.kill()  # not reaped yet: a zombie counts as gone
    assert board.explain(wait_s=5) == (
        f"rank 1 (pid {victim.pid}) ended without reporting an error (killed by a signal: SIGKILL, the "
        "out-of-memory killer?)"
    )
    victim.wait()


def test_collective_failures_are_told_apart_from_the_cause():
    gloo = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:46794."
    assert is_collective_failure(RuntimeError(gloo))
    assert is_collective_failure(RuntimeError("... Timed out waiting 10000ms for recv operation to complete"))
    assert not is_collective_failure(ValueError("Connection closed by peer"))  # a user's error, not a collective
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))


def test_a_reported_failure_is_printed_once(monkeypatch, capsys):
    """report_now prints through sys.excepthook at once; the interpreter's own report at exit then skips it."""
    import sys

    from lightning_parallel.parallel.failure import report_now

    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: printed.append(str(value)))
    try:
        raise ValueError("boom")
    except ValueError as err:
        report_now(err)
        report_now(err)  # a second report of the same error prints nothing
        sys.excepthook(type(err), err, err.__traceback__)  # what Python does if it ends the process
    other = RuntimeError("another")
    sys.excepthook(RuntimeError, other, None)  # errors never reported still print as usual
    assert printed == ["boom", "another"]
