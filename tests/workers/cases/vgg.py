"""Case ``vgg``: channel-split tensor parallelism of VGG against a single-process copy (tests/test_vgg_tp.py).

For each case it builds a VGG, keeps a
plain copy, shards the original over a 1-D tp mesh of all ranks with ``vgg_tp_plan``, runs the same batch
through both in train mode (BatchNorm batch statistics) and in eval mode (running statistics), and records
the largest differences of the outputs, the input gradient, every parameter's gradient and every buffer.

Case keys: name, model ("vgg11" or "vgg16"), width, batch_norm, batch (images per step), steps (train-mode
steps before the eval step: running statistics move each one).
"""

from __future__ import annotations

import copy
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_parallel.models.vgg import VGG, VGGConfig, vgg_tp_plan
from lightning_parallel.parallel.tensor.plan import apply_tp


def full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: Tensor, b: Tensor) -> float:
    a, b = full(a).detach(), full(b).detach()
    assert a.shape == b.shape, f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    return (a.float() - b.float()).abs().max().item()


def step(model: nn.Module, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """One forward and backward; returns the logits and the input gradient."""
    x = x.clone().requires_grad_(True)
    logits = model(x)
    F.cross_entropy(logits, target).backward()
    return logits, x.grad


def compare(tp_model: nn.Module, ref: nn.Module, x: Tensor, target: Tensor) -> dict[str, float]:
    tp_model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    tp_logits, tp_xgrad = step(tp_model, x, target)
    ref_logits, ref_xgrad = step(ref, x, target)
    ref_params = dict(ref.named_parameters())
    grads = {name: max_diff(p.grad, ref_params[name].grad) for name, p in tp_model.named_parameters()}
    ref_buffers = dict(ref.named_buffers())
    buffers = {name: max_diff(b, ref_buffers[name]) for name, b in tp_model.named_buffers()}
    assert grads.keys() == ref_params.keys() and buffers.keys() == ref_buffers.keys()
    return {
        "logits": max_diff(tp_logits, ref_logits),
        "logits_scale": ref_logits.abs().max().item(),
        "input_grad": max_diff(tp_xgrad, ref_xgrad),
        "grad": max(grads.values()),
        "worst_grad": max(grads, key=grads.get),
        "grad_scale": max(p.grad.abs().max().item() for p in ref.parameters()),
        "buffer": max(buffers.values(), default=0.0),
        "params_checked": len(grads),
    }


PROCESS_GROUP = True


@cache
def tp_mesh(world: int):
    """A 1-D tp mesh of all ranks, built once."""
    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def run_case(case: dict, ctx) -> dict:
    mesh = tp_mesh(ctx.world)
    torch.manual_seed(case.get("seed", 0))
    cfg = VGGConfig(name=case["model"], width=case.get("width", 8), batch_norm=case.get("batch_norm", True))
    model = VGG(cfg)
    ref = copy.deepcopy(model)
    apply_tp(model, mesh, vgg_tp_plan("", cfg))
    sharded = [name for name, p in model.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()]
    generator = torch.Generator().manual_seed(1)  # the same batch on every rank: tp ranks share their input
    batch = case.get("batch", 4)
    result: dict = {
        "name": case["name"],
        "sharded_params": len(sharded),
        # elements this rank holds against the whole model's: what tensor parallelism saves
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()),
        "full_numel": sum(p.numel() for p in ref.parameters()),
        "train": [],
        "eval": None,
    }
    for _ in range(case.get("steps", 2)):
        x = torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=generator)
        target = torch.randint(0, cfg.num_classes, (batch,), generator=generator)
        model.train(), ref.train()
        result["train"].append(compare(model, ref, x, target))
    model.eval(), ref.eval()
    result["eval"] = compare(model, ref, x, target)
    return result
