"""The mesh's axes declared in tables the rest reads (ARCHITECTURE.md, "An axis"): a new axis whose size is its
setting needs its constant, its place in ``MESH_AXES``, its roles and a field; the arithmetic, the degrees, the
description, the recipes' metrics and strategy=auto's refusal read it from there. Single-process, no process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_parallel.parallel import mesh
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.mesh import MESH_AXES, PLAIN_AXES, ParallelDims
from lightning_parallel.parallel.parallelize import Parallelized
from lightning_parallel.parallel.step import reduce_step_gradients
from lightning_parallel.recipes.auto import CHOSEN, UNMODELED


def test_every_axis_is_a_field_and_every_plain_axis_a_setting():
    assert {"pp", "tp"} <= set(PLAIN_AXES) and set(MESH_AXES) == {*PLAIN_AXES, *mesh.DERIVED_AXES}
    assert set(MESH_AXES) <= {f.name for f in dataclasses.fields(ParallelDims)}
    assert set(PLAIN_AXES) <= set(ParallelConfig.names())
    assert set(PLAIN_AXES) <= {*CHOSEN, *UNMODELED}  # strategy=auto chooses pp and tp, and refuses an axis added since


@dataclasses.dataclass(frozen=True)
class DimsWithPods(ParallelDims):
    pod: int = 1  # an axis like the dry run's dpo: whole copies of the inner layout


@pytest.fixture
def pod_axis(monkeypatch):
    """The tables with a plain axis ``pod`` added outside the others, as the dry run's mesh.py adds ``dpo`` (nothing
    else in mesh.py)."""
    axes = ("pod", *mesh.MESH_AXES)
    monkeypatch.setattr(mesh, "MESH_AXES", axes)
    monkeypatch.setattr(mesh, "PLAIN_AXES", tuple(a for a in axes if a not in mesh.DERIVED_AXES))
    roles = {**mesh.ROLES, "pods": ("pod",)}
    roles["batch"], roles["loss"] = ("pod", *roles["batch"]), ("pod", *roles["loss"])
    monkeypatch.setattr(mesh, "ROLES", roles)


def test_a_plain_axis_needs_only_the_tables(pod_axis):
    dims = DimsWithPods.from_degrees(16, pod=2, tp=2, cp=2)
    assert (dims.dp, dims.pod) == (2, 2)
    assert list(dims.degrees)[:2] == ["pod", "pp"] and dims.degrees["pod"] == 2
    assert [dims.role_size(r) for r in ("batch", "loss", "shard", "pods")] == [4, 8, 4, 2]
    assert str(dims) == "pp=1 dp=2 tp=2 cp=2 pod=2 (world_size=16)"
    with pytest.raises(ValueError, match=r"pod\(2\) \* pp\(1\) \* dp\(3\) \* tp\(1\) = 6 != world_size\(8\)"):
        DimsWithPods.from_degrees(8, pod=2, dp=3)
    with pytest.raises(ValueError, match=r"divisible by pod\(3\) \* pp\(1\) \* tp\(2\) = 6: choose pod and pp and tp"):
        DimsWithPods.from_degrees(8, pod=3, tp=2)
    with pytest.raises(ValueError, match=r"pod=0 is not a parallel degree"):
        DimsWithPods.from_degrees(8, pod=0)


def test_the_arithmetic_of_layouts_without_new_axes_is_unchanged():
    with pytest.raises(TypeError, match=r"from_degrees\(\) got pod: not an axis of PLAIN_AXES \(pp, "):
        ParallelDims.from_degrees(8, pod=2)
    assert str(ParallelDims.from_degrees(8, pp=2, tp=2)) == "pp=2 dp=2 tp=2 (world_size=8)"
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp\(3\) \* tp\(2\) = 12 != world_size\(8\)"):
        ParallelDims.from_degrees(8, pp=2, dp=3, tp=2)
    with pytest.raises(ValueError, match=r"divisible by pp\(4\) \* spatial\(2\) \* tp\(1\) = 8"):
        ParallelDims.from_degrees(6, pp=4, spatial=2)


class _Sharding:
    """What reduce_step_gradients reads of a sharding: its reduction and this rank's gradient pieces."""

    def __init__(self, params: list[nn.Parameter], log: list[str]) -> None:
        self.params, self.log = params, log

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.log.append("reduce")

    def grad_pieces(self, optimizer: torch.optim.Optimizer) -> list:
        return [(p.grad, p, ()) for p in self.params]


def test_grad_hooks_run_after_the_reduction_on_the_pieces_in_place():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]
    for p in params:
        p.grad = torch.full_like(p, 4.0)
    log: list[str] = []

    def halve(grads: list[torch.Tensor]) -> None:
        log.append(f"hook {len(grads)}")
        torch._foreach_div_(grads, 2.0)

    optimizer = torch.optim.SGD(params, lr=0.1)
    reduce_step_gradients(Parallelized(grad_hooks=[halve]), _Sharding(params, log), optimizer)  # type: ignore[arg-type]
    assert log == ["reduce", "hook 2"]
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in params)
    reduce_step_gradients(Parallelized(), _Sharding(params, log), optimizer)  # type: ignore[arg-type]
    assert log == ["reduce", "hook 2", "reduce"]
