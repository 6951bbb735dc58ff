"""The data-parallel shardings on a GPU's terms, checked on the CPU: on CUDA every group is NCCL only (no backend for
host tensors), offload's host buffers are pinned and copied asynchronously, a bucket's pieces travel in one grouped
call, and a bucket's wait does not block the host.

Unit level (no process group): which collectives a backend gets, when host buffers are pinned and copies
asynchronous (and the waits that order them), where a bucket's timeline bar ends on CUDA. Distributed
(tests/workers/cases/data_paths.py, worlds 2 and 4): HSDP ZeRO-2 with offload while every group pretends to be
device-only, the three ways a bucket's pieces travel (bitwise at 2 ranks, within rounding at 4), ZeRO-0's bounded
buckets.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_worker

from lightning_parallel.parallel.data import offload, overlap
from lightning_parallel.parallel.data.flat_overlap import PieceCollectives, even, piece_collectives, serving_backend
from lightning_parallel.parallel.data.offload import HostSlice, host_buffer, pinned_transfers

STEPS = 6  # tests/workers/cases/data_paths.py


# ----- which collectives, by backend -----


@pytest.mark.parametrize(
    ("backend", "device", "want"),
    [
        ("nccl", "cuda", "nccl"),
        ("gloo", "cpu", "gloo"),
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
        ("cuda:nccl", "cpu", ""),
        ("NCCL", "cuda", "nccl"),
    ],
)
def test_the_backend_serving_a_device(backend, device, want):
    assert serving_backend(backend, device) == want


def test_nccl_groups_a_buckets_pieces_and_gloo_keeps_one_call_per_piece():
    grouped, per_owner = PieceCollectives(True, True), PieceCollectives(False, False)
    assert piece_collectives("nccl", "cuda") == grouped
    assert piece_collectives("cpu:gloo,cuda:nccl", "cuda") == grouped
    assert piece_collectives("gloo", "cpu") == per_owner
    assert piece_collectives("gloo", "cuda") == per_owner  # gloo's CUDA tensors: still its own path
    assert piece_collectives("cpu:gloo,cuda:nccl", "cpu") == per_owner
    assert piece_collectives("mpi", "cpu") == per_owner


def test_a_bucket_is_even_only_when_every_rank_holds_a_piece_of_one_size():
    assert even([(0, 0, 4), (1, 4, 8)], 2)
    assert even([(0, 6, 8), (1, 8, 10)], 2)  # the end of rank 0's range and the start of rank 1's
    assert not even([(0, 0, 4), (1, 4, 7)], 2)
    assert not even([(1, 4, 8)], 2)  # rank 0 owns none of it
    assert not even([(0, 0, 4), (1, 4, 8)], 4)


# ----- offload's host buffers -----


def test_pinned_and_asynchronous_only_with_an_accelerator(monkeypatch):
    assert not pinned_transfers(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not pinned_transfers(torch.device("cuda", 0))  # a CUDA device named, no runtime: pinning would fail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pinned_transfers(torch.device("cuda", 0))
    assert not pinned_transfers(torch.device("cpu"))
    assert not host_buffer(torch.ones(3), pinned=False).is_pinned()


def test_on_the_cpu_the_host_slice_is_a_plain_copy_with_nothing_in_flight():
    device_slice = torch.arange(4.0)
    host = HostSlice(device_slice)
    assert not host.pinned and not host.param.is_pinned() and host.param.device.type == "cpu"
    assert torch.equal(host.param, device_slice) and host.param.data_ptr() != device_slice.data_ptr()
    grad = torch.full((4,), 2.0)
    got = host.grad_from(grad)
    assert got is host.grad and torch.equal(got, grad) and got.data_ptr() != grad.data_ptr()
    grad.fill_(7.0)  # a copy: the device buffer is reused by the next step
    assert torch.equal(host.grad, torch.full((4,), 2.0))
    host.param.add_(1.0)
    host.param_to(device_slice)
    assert torch.equal(device_slice, torch.arange(4.0) + 1) and host._in_flight == []


class _Event:
    log: list[str] = []

    def __init__(self) -> None:
        self.synchronized = False

    def record(self) -> None:
        _Event.log.append("record")

    def synchronize(self) -> None:
        self.synchronized = True
        _Event.log.append("synchronize")


def test_with_an_accelerator_copies_are_asynchronous_and_waited_for_before_the_host_touches_them(monkeypatch):
    """CUDA simulated (pinning itself needs the CUDA runtime): every copy between host and device is non_blocking and
    followed by an event; the host waits for them before it reads the gradients or writes the slice again."""
    monkeypatch.setattr(offload, "pinned_transfers", lambda device: True)
    monkeypatch.setattr(offload, "host_buffer", lambda like, pinned: torch.empty_like(like))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    copies: list[bool] = []
    original = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):  # noqa: ANN001, ANN202
        copies.append(non_blocking)
        return original(self, src, non_blocking=non_blocking)

    _Event.log = []
    host = HostSlice(torch.zeros(4))
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    host.grad_from(torch.ones(4))
    assert copies == [True] and _Event.log == ["record"] and len(host._in_flight) == 1
    host.wait()  # FlatZero.reduce_gradients, before clipping and the step read the host gradients
    assert _Event.log == ["record", "synchronize"] and host._in_flight == []
    host.param_to(torch.zeros(4))
    assert copies == [True, True] and len(host._in_flight) == 1
    host.param_from(torch.zeros(4))  # a checkpoint load writes the host slice: the copy reading it is done first
    assert _Event.log[-2:] == ["record", "synchronize"] and host._in_flight == []
    assert copies[-1] is False  # device -> host into the slice: synchronous


# ----- a bucket's bar on the timeline -----


class _Recorder:
    def __init__(self, log: list[str]) -> None:
        self.log, self.added, self.clock = log, [], 0

    def mark(self) -> int:
        self.clock += 1
        self.log.append(f"mark{self.clock}")
        return self.clock

    def add(self, kind, stage, microbatch, start, end) -> None:  # noqa: ANN001
        self.added.append((kind, stage, microbatch, start, end))


class _Work:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def wait(self) -> None:
        self.log.append("wait")


def test_without_a_timeline_a_bucket_costs_no_marks(monkeypatch):
    monkeypatch.setattr(overlap, "active_recorder", lambda: None)
    launched = overlap.launch_mark()
    assert launched.mark is None
    overlap.record_waited(0, launched, [], torch.device("cuda", 0))  # nothing touches CUDA


def test_on_the_cpu_a_bucket_ends_when_its_wait_returned(monkeypatch):
    log: list[str] = []
    recorder = _Recorder(log)
    monkeypatch.setattr(overlap, "active_recorder", lambda: recorder)
    launched = overlap.launch_mark()
    overlap.record_waited(3, launched, [_Work(log)], torch.device("cpu"))
    assert log == ["mark1", "mark2"]  # gloo's wait already blocked: not waited again
    assert recorder.added == [("reduce", -1, 3, 1, 2)]


def test_on_cuda_a_bucket_ends_with_its_collective_not_with_the_host(monkeypatch):
    """On CUDA ``wait()`` returns at once: the end is marked on a side stream made to wait for the works."""
    log: list[str] = []
    recorder = _Recorder(log)

    class Stream:
        def __init__(self, device) -> None:  # noqa: ANN001
            log.append("new stream")

    class stream:  # noqa: N801  (torch.cuda.stream)
        def __init__(self, s) -> None:  # noqa: ANN001
            pass

        def __enter__(self) -> None:
            log.append("side stream")

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            log.append("current stream")

    monkeypatch.setattr(overlap, "active_recorder", lambda: recorder)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    launched = overlap.launch_mark()
    overlap.record_waited(1, launched, [_Work(log), _Work(log)], torch.device("cuda", 0))
    assert log == ["mark1", "new stream", "side stream", "wait", "wait", "mark2", "current stream"]
    assert recorder.added == [("reduce", -1, 1, 1, 2)]


# ----- distributed: world 2 -----


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["world2", "world4"])
def ranks(request, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"data-device-paths-{request.param}")
    return run_worker("data_paths", request.param, [], out, timeout=300)


def test_hsdp_offload_reduces_across_replicas_on_the_device(ranks):
    """With every group device-only, no collective gets a host buffer (before: the replica all-reduce ran on the
    offloaded gradient), and offload trains bitwise as without it."""
    for rank, result in enumerate(ranks):
        run = result["hsdp_offload"]
        assert run["calls"]["all_reduce@tracked"] == STEPS, (rank, run["calls"])  # the replica all-reduce, guarded
        assert run["vs_device"] == 0.0, (rank, run)
        assert run["vs_reference"] <= 1e-6 and run["zero1_vs_reference"] <= 1e-6, (rank, run)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_buckets_pieces_give_the_same_numbers_on_every_path(ranks, stage):
    bitwise = len(ranks) == 2  # a + b; at 4 ranks gloo's reduce_scatter and reduce order the additions differently
    for rank, result in enumerate(ranks):
        run = result[f"pieces_zero{stage}"]
        paths = ["per_owner", "grouped", "even", *(["per_owner_offload"] if stage == 2 else [])]
        assert sorted(run["vs_per_owner"]) == sorted(paths), run
        for path, diff in run["vs_per_owner"].items():  # offload: overlapped, stepped on the host
            assert diff == 0.0 if bitwise or path == "per_owner_offload" else diff <= 1e-6, (rank, path, run)
        assert run["vs_reference"] <= 1e-6, (rank, run)
        calls = run["calls"]
        assert "all_gather" not in calls["per_owner"] and "reduce_scatter" not in calls["per_owner"]
        if stage == 2:  # one reduce per piece, or one reduce_scatter per bucket
            assert calls["per_owner"]["reduce"] > calls["grouped"]["reduce_scatter"] > 0, calls
            assert "reduce" not in calls["grouped"], calls
            assert calls["even"]["reduce_scatter_single"] == STEPS, calls
        assert calls["even"]["all_gather_single"] == STEPS and "broadcast" not in calls["even"], calls


def test_zero0_reduces_in_bounded_buckets(ranks):
    for result in ranks:
        run = result["replicate"]
        assert run["buckets"] > 2, run
        assert run["diff"] == 0.0 if len(ranks) == 2 else run["diff"] <= 1e-6, run  # a ring of 4: order by position
        assert run["largest_bucket"] == 48 * 48 < run["whole"][0], run  # a larger gradient alone, never all at once
