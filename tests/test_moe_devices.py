"""Where MoE's collectives take their tensors, in one process: on a gloo world of one the monitor's statistics
and the setup check are reduced on the host and give what the layer counted; with a group whose backend serves
CUDA only (NCCL) they would travel on CUDA; the expert-parallel exchange reads its counts on the host once."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from test_moe_kernels import host_syncs
from torch import nn

from lightning_parallel import _compat
from lightning_parallel.callbacks.moe import MoEMonitor, summed_over
from lightning_parallel.parallel.expert import MoE
from lightning_parallel.parallel.expert.apply import require_moe_layers
from lightning_parallel.parallel.expert.dispatch import exchange


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process (the world), torn down afterwards."""
    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def reductions(monkeypatch):
    """Every all_reduce: the device its tensor was on (the real reduction still runs)."""
    seen: list[torch.device] = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append(tensor.device)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)
    return seen


@pytest.fixture
def cuda_only_group(monkeypatch):
    """Pretend every group's backend serves CUDA only (NCCL): collectives record the device of their tensor, and
    moving a tensor to CUDA (which this CPU torch cannot) records the move and keeps it where it is."""
    moves: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(_compat, "group_device_types", lambda group=None: ["cuda"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (torch.device, str)) and torch.device(target).type == "cuda":
            moves.append(("to", torch.device(target)))
            return self.clone() if kwargs.get("copy") else self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: moves.append(("all_reduce", tensor.device)))
    return moves


def test_statistics_reduce_on_the_device_a_cuda_only_group_serves(cuda_only_group):
    values = torch.arange(5, dtype=torch.float64)
    out = summed_over(values, None)
    assert cuda_only_group[0] == ("to", torch.device("cuda", 0))
    assert cuda_only_group[1][0] == "all_reduce"
    assert out.device == values.device


def test_setup_check_reduces_on_the_device_a_cuda_only_group_serves(cuda_only_group, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    require_moe_layers(1, 2, "Model")
    assert cuda_only_group[0] == ("to", torch.device("cuda", 0))
    assert [kind for kind, _ in cuda_only_group] == ["to", "all_reduce"]


def test_setup_check_on_a_gloo_world(world_of_one, reductions):
    require_moe_layers(2, 2, "Model")
    with pytest.raises(ValueError, match=r"ep=2 splits the experts of MoE layers, and Model has none"):
        require_moe_layers(0, 2, "Model")
    assert reductions == [torch.device("cpu")] * 2


class _Module(nn.Module):
    """A LightningModule's part the monitor uses: the layers and ``log``."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE(8, 16, 4, 2, capacity_factor=1.0, z_loss_coeff=0.1)
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **kwargs) -> None:
        self.logged[name] = value


def test_monitor_reduces_on_the_group_device_and_reads_the_host_only_when_logging(world_of_one, reductions):
    torch.manual_seed(0)
    module, monitor = _Module(), MoEMonitor()
    seen = []
    for step in range(3):  # two forwards a batch; steps 0 and 2 log
        for _ in range(2):
            module.moe(torch.randn(3, 5, 8))
        seen.append(module.moe.stats())
        trainer = SimpleNamespace(strategy=None, global_step=step, log_every_n_steps=2)
        module.logged.clear()
        with host_syncs() as syncs:
            monitor.on_train_batch_end(trainer, module)
        assert syncs == (["Tensor.tolist"] if step % 2 == 0 else []), f"step {step}: {syncs}"
        assert bool(module.logged) == (step % 2 == 0)
    assert reductions == [torch.device("cpu")] * 3  # one per layer and batch, where gloo takes it

    got = monitor.summary(SimpleNamespace())["moe"]
    tokens = [sum(s["tokens_per_expert"][e] for s in seen) for e in range(4)]
    assert got["tokens_per_expert"] == tokens and sum(tokens) > 0
    assert got["min_tokens"] == min(tokens) and got["max_tokens"] == max(tokens)
    assert got["aux_loss"] == pytest.approx(sum(s["aux_loss"] for s in seen) / 3, rel=1e-12)
    assert got["dropped_fraction"] == pytest.approx(sum(s["dropped_fraction"] for s in seen) / 3, rel=1e-12)
    assert 0 < got["dropped_fraction"] < 1
    imbalance = [max(s["tokens_per_expert"]) / (sum(s["tokens_per_expert"]) / 4) for s in seen]
    assert got["max_over_mean_per_batch"] == pytest.approx(sum(imbalance) / 3, rel=1e-12)
    assert got["worst_max_over_mean"] == pytest.approx(max(imbalance), rel=1e-12)
    last = seen[-1]["tokens_per_expert"]
    assert module.logged["moe/moe/max_tokens"] == max(last) and module.logged["moe/moe/min_tokens"] == min(last)
    assert module.logged["moe/moe/aux_loss"] == pytest.approx(seen[-1]["aux_loss"], rel=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_expert_parallel_exchange_reads_its_counts_on_the_host_once(world_of_one, fused):
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, 2)
    moe.experts.fused = fused
    rows = torch.randn(9, 16, requires_grad=True)
    counts = torch.tensor([2, 0, 4, 3])
    with host_syncs() as syncs:
        out = exchange(rows, counts, world_of_one, moe.experts)
    assert syncs == ["Tensor.tolist"], syncs  # the split sizes, and nothing else
    out.sum().backward()
    direct_rows = rows.detach().clone().requires_grad_()
    direct = moe.experts(direct_rows, counts)
    direct.sum().backward()
    torch.testing.assert_close(out, direct, rtol=0, atol=0)
    torch.testing.assert_close(rows.grad, direct_rows.grad, rtol=0, atol=0)


class _StageMesh:
    """A mesh's part the monitor asks for under pp: two stages; every role's group the world of one here."""

    def size(self, role: str) -> int:
        return 2 if role == "stage" else 1

    def group(self, role: str):
        return dist.group.WORLD


def test_monitor_under_pp_reports_the_layers_this_stage_holds(world_of_one, monkeypatch):
    """A model that keeps another stage's MoE layer on the meta device (no statistics, no data): the monitor skips
    it instead of copying meta tensors ("Cannot copy out of meta tensor"), and gathers the figures of a logging step
    over the stage group (one gather; rank 0 logs every stage's)."""
    torch.manual_seed(0)
    module = _Module()
    with torch.device("meta"):
        module.elsewhere = MoE(8, 16, 4, 2)
    gathers = []
    real = dist.all_gather_object
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: gathers.append(k.get("group")) or real(*a, **k))
    trainer = SimpleNamespace(strategy=SimpleNamespace(mesh=_StageMesh()), global_step=0, log_every_n_steps=1)
    monitor = MoEMonitor()
    monitor.on_train_start(trainer, module)
    module.moe(torch.randn(3, 5, 8))
    tokens = module.moe.stats()["tokens_per_expert"]
    monitor.on_train_batch_end(trainer, module)
    assert gathers == [dist.group.WORLD]
    assert sorted(module.logged) == [f"moe/moe/{k}" for k in ("aux_loss", "max_over_mean", "max_tokens", "min_tokens")]
    assert module.logged["moe/moe/max_tokens"] == max(tokens)
    assert list(monitor.summary()) == ["moe"]
