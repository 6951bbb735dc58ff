"""The GPU path, checked on CPU where a check can be made (issue 28): on CUDA every process group is NCCL only,
so a collective on a host tensor fails ("No backend type associated with device type cpu"), generic backend
options are refused by NCCL's split, and gloo-only tricks deadlock.

A group whose backend serves CUDA only is stood in for by patching what the group reports
(``_compat.group_device_types``) and the current CUDA device: code that moves its host values to the group's device
then reaches for CUDA, which this CPU build refuses with "Torch not compiled with CUDA enabled". Without the fix
the same code all-reduces the host tensor over the real (gloo) group and succeeds, so each test fails on it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from harness import free_port, run_worker
from torch import nn

from lightning_parallel import _compat
from lightning_parallel.callbacks.monitor import TrainingMonitor
from lightning_parallel.parallel.clip import total_norm
from lightning_parallel.parallel.devices import collective_device, host_all_reduce
from lightning_parallel.parallel.failure import FailureWatch, needs_watch
from lightning_parallel.parallel.pipeline.runner import early_receives
from lightning_parallel.parallel.pipeline.tied import TiedGradients

NO_CUDA = "Torch not compiled with CUDA enabled|Found no NVIDIA driver|CUDA"


@pytest.fixture
def world():
    """A one-rank gloo world in this process (destroyed after the test)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def cuda_only(monkeypatch):
    """Every group reports a backend for CUDA tensors only (NCCL), current device 0. Returns a context manager for
    the call that must move its values to CUDA: where CUDA cannot run, reaching for it raises; where it can, the
    all-reduce must have been handed a CUDA tensor (gloo takes those too)."""
    monkeypatch.setattr(_compat, "group_device_types", lambda group=None: ["cuda"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    @contextmanager
    def reaches_for_cuda():
        if not torch.cuda.is_available():
            with pytest.raises((AssertionError, RuntimeError), match=NO_CUDA):
                yield
            return
        seen, real = [], dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device.type) or real(t, *a, **k))
        yield
        assert seen and set(seen) == {"cuda"}, seen

    return reaches_for_cuda


def test_collective_device_is_the_host_on_gloo_and_the_gpu_on_nccl(world, monkeypatch):
    assert collective_device(world) == torch.device("cpu")
    out = host_all_reduce(torch.tensor([1.5, 2.0]), world)
    assert out.device.type == "cpu" and out.tolist() == [1.5, 2.0]
    monkeypatch.setattr(_compat, "group_device_types", lambda group=None: ["cuda"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device(world) == torch.device("cuda", 3)
    monkeypatch.setattr(world, "bound_device_id", torch.device("cuda", 1), raising=False)
    assert collective_device(world) == torch.device("cuda", 1)  # NCCL's bound device, right in any thread


def test_host_values_reduced_over_nccl_go_to_the_device(world, cuda_only):
    with cuda_only():
        host_all_reduce(torch.ones(()), world)


def test_flop_total_goes_through_the_device(world, cuda_only):
    """G1: the TrainingMonitor's FLOP total at the measure step, a host number, on every multi-rank recipe run."""
    monitor = TrainingMonitor()
    module = SimpleNamespace(flops_per_sample=None)
    with cuda_only():
        monitor._set_flops(None, module, 1234)


def test_flop_total_on_gloo(world):
    monitor = TrainingMonitor()
    monitor._set_flops(None, SimpleNamespace(flops_per_sample=None), 1234)
    assert monitor.summary["flops_per_step"] == 1234.0


def test_offloaded_gradient_norms_are_reduced_on_the_device(world, cuda_only):
    """G7: gradients on the host (ZeRO offload) and clipping: the partial norms travel on the device."""
    grads = [(torch.ones(4), ("dp",)), (torch.ones(3), ())]
    with cuda_only():
        total_norm(grads, {"dp": world})


def test_offloaded_gradient_norm_on_gloo(world):
    grads = [(torch.ones(4), ("dp",)), (torch.full((3,), 2.0), ())]
    assert total_norm(grads, {"dp": world}).item() == pytest.approx((4 + 12) ** 0.5)


def test_tied_weight_placeholder_is_on_the_stage_device(world, cuda_only):
    """G6: a pp rank holding no copy of a tied weight (a middle stage) adds zeros: on the device, not the host."""
    tied = TiedGradients(nn.Linear(2, 2), [["elsewhere.weight"]], world)
    tied._shapes = [(torch.Size([3, 2]), torch.float32)]  # what the other stages said (skips the exchange)
    assert tied.device == torch.device("cuda", 0)
    with cuda_only():
        tied.reduce()


def test_tied_weight_placeholder_on_gloo(world):
    root = nn.Linear(2, 3)
    root.weight.grad = torch.ones(3, 2)
    tied = TiedGradients(root, [["weight"]], world)
    tied.reduce()
    assert tied.device == torch.device("cpu") and torch.equal(root.weight.grad, torch.ones(3, 2))


@pytest.mark.parametrize(
    ("schedule", "backend", "expected"),
    [
        ("1f1b", "gloo", True),
        ("gpipe", "gloo", True),
        ("1f1b", "nccl", False),  # every message between two ranks runs in issue order on one stream: deadlock
        ("gpipe", "nccl", False),
        ("interleaved_1f1b", "gloo", False),  # several stages per rank: two kinds of message per pair of ranks
        ("zero_bubble", "gloo", False),
    ],
)
def test_early_receives_only_on_gloo_with_one_stage_per_rank(schedule, backend, expected):
    assert early_receives(schedule, backend) is expected


def test_early_receives_read_the_group_backend(world):
    assert early_receives("1f1b", world) is True


def test_mesh_groups_take_the_timeout_on_every_backend(tmp_path):
    """G5: the timeout is set on each group once built (NCCL's split refuses generic backend options): every
    axis and every flattened role (``dp_cp`` here, which spans the world: torch hands out the world's group)."""
    for rank in run_worker("mesh", 4, ["--opts", '{"degrees": "dp=2,cp=2", "timeout": 77}'], tmp_path):
        assert set(rank.values()) == {77.0} and len(rank) == 16, rank


def test_failure_watch_only_where_collectives_hang():
    assert needs_watch("nccl") and needs_watch("cuda:nccl") and not needs_watch("gloo")


class _Board:
    def __init__(self, rank: int, first=None, gone=()) -> None:
        self.rank, self.first, self.gone_ranks = rank, first, list(gone)

    def first_failure(self):
        return self.first

    def gone(self):
        return self.gone_ranks


def test_failure_watch_names_the_failed_rank_and_aborts(capsys):
    aborted = []
    watch = FailureWatch(_Board(0), lambda: aborted.append(True), interval_s=0.05).start()
    try:
        watch.board.first = (1, "ValueError: boom")
        for _ in range(100):
            if aborted:
                break
            time.sleep(0.05)
    finally:
        watch.stop()
    assert aborted == [True] and watch.cause == "rank 1 failed first: ValueError: boom"
    assert "rank 1 failed first: ValueError: boom" in capsys.readouterr().err


def test_failure_watch_ignores_its_own_rank_and_names_a_killed_one():
    assert FailureWatch(_Board(1, first=(1, "ValueError: mine")), abort=None).check() is None
    watch = FailureWatch(_Board(0, gone=[(2, 4242)]), abort=None)
    assert watch.check().startswith("rank 2 (pid 4242) ended without reporting an error")
    assert FailureWatch(_Board(0), abort=None).check() is None


def test_world_timeout_is_kept(world):
    _compat.set_group_timeout(world, timedelta(seconds=55))
    assert _compat.group_timeout(world) == timedelta(seconds=55)


def test_async_ps_gradients_stay_on_their_device():
    """G10: a parameter with no gradient adds zeros on its own device (the meta device stands in for a GPU here:
    the host zeros before the fix made torch.cat mix devices), and a server's state loads on the host."""
    from lightning_parallel.parallel.async_ps import protocol
    from lightning_parallel.parallel.async_ps.layout import FlatLayout

    a, b = (nn.Parameter(torch.empty(n, device="meta")) for n in (3, 2))
    a.grad = torch.empty(3, device="meta")
    flat = FlatLayout.of(torch.optim.SGD([a, b], lr=0.1), num_servers=1).flat_grads()
    assert flat.device.type == "meta" and flat.shape == (5,)
    state = protocol.from_blob(protocol.to_blob({"x": torch.ones(2)}), map_location="cpu")
    assert state["x"].device.type == "cpu"
