"""Case ``sync_bn``: SyncBatchNorm over the dp group against torch's BatchNorm on the concatenated batch
(tests/test_sync_batchnorm.py). Every rank builds the same global batch and
a plain BatchNorm copy of the layer; the synced layer sees only this rank's slice (ranks may hold different
numbers of samples), the plain one the whole batch. A weighted sum of the outputs is the loss (each rank's
share of it over its own slice), so gradients flow through the shared statistics. Recorded per step: the
largest errors of the output slice, the input gradient slice, the parameter gradients (summed over the
ranks, as data parallelism sums them), the running statistics, and the eval-mode output. An error is
``|got - want| / (1 + |want|)``: absolute for small values, relative for large sums.

Case keys: name, dims (1, 2 or 3: BatchNorm1d/2d/3d), channels, sizes (samples per rank), affine, momentum
(null: cumulative average), steps, from_sync (convert torch's nn.SyncBatchNorm instead of BatchNormNd), dtensor
(run the layer on a (dp, tp=1) mesh under ChannelNormParallel, so input, parameters and running statistics are
DTensors), batch_split_input (record the error a DTensor input split on the batch gets).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from lightning_parallel.parallel.data.sync_batchnorm import convert_sync_batchnorm
from lightning_parallel.parallel.tensor.conv import ChannelNormParallel

PROCESS_GROUP = True
_PLAIN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_SPATIAL = {1: (5,), 2: (3, 4), 3: (2, 3, 2)}


def full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: Tensor, b: Tensor) -> float:
    a, b = full(a).detach().double(), full(b).detach().double()
    assert a.shape == b.shape, f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    return ((a - b).abs() / (1 + b.abs())).max().item() if a.numel() else 0.0


def run_case(case: dict, ctx) -> dict:
    rank, world = ctx.rank, ctx.world
    dims, channels, sizes = case.get("dims", 2), case.get("channels", 4), case.get("sizes", [3, 5])
    assert len(sizes) == world
    g = torch.Generator().manual_seed(0)  # the same global batch and layer on every rank
    ref = _PLAIN[dims](channels, affine=case.get("affine", True), momentum=case.get("momentum", 0.1))
    if ref.affine:
        with torch.no_grad():
            ref.weight.copy_(torch.rand(channels, generator=g) + 0.5)
            ref.bias.copy_(torch.randn(channels, generator=g))
    source = nn.SyncBatchNorm if case.get("from_sync") else _PLAIN[dims]
    sync = convert_sync_batchnorm(source(channels, affine=ref.affine, momentum=ref.momentum))
    sync.load_state_dict(ref.state_dict())
    assert type(sync).__name__ == ("SyncBatchNormXd" if case.get("from_sync") else f"SyncBatchNorm{dims}d")
    if case.get("batch_split_input"):
        return {"name": case["name"], "error": batch_split_error(sync, world)}
    if case.get("dtensor"):
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
        sync.process_group = mesh["dp"].get_group()
        parallelize_module(sync, mesh["tp"], ChannelNormParallel(use_local_output=False))
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    result: dict = {"name": case["name"], "train": []}
    for _ in range(case.get("steps", 2)):
        # mean far from zero: E[x^2] - E[x]^2 must not lose the variance
        x = torch.randn(sum(sizes), channels, *_SPATIAL[dims], generator=g) * 2 + 3
        weights = torch.randn(x.shape, generator=g)  # loss = sum(weights * out): every output counts differently
        sync.train(), ref.train()
        sync.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
        mine = x[start:stop].clone().requires_grad_(True)
        out = sync(mine)
        (full(out) * weights[start:stop]).sum().backward()
        whole = x.clone().requires_grad_(True)
        ref_out = ref(whole)
        (ref_out * weights).sum().backward()
        step = {"out": max_diff(out, ref_out[start:stop]), "input_grad": max_diff(mine.grad, whole.grad[start:stop])}
        step["out_scale"] = ref_out.abs().max().item()
        step["grad_scale"] = whole.grad.abs().max().item()
        params = dict(ref.named_parameters())
        for name, p in sync.named_parameters():  # data parallelism sums each rank's share
            grad = full(p.grad).clone()
            dist.all_reduce(grad)
            step[f"{name}.grad"] = max_diff(grad, params[name].grad)
        buffers = dict(ref.named_buffers())
        for name, b in sync.named_buffers():
            step[name] = max_diff(b, buffers[name])
        result["train"].append(step)
    sync.eval(), ref.eval()
    with torch.no_grad():
        result["eval_out"] = max_diff(sync(x[start:stop]), ref(x)[start:stop])
    result["dtensor_params"] = all(isinstance(p, DTensor) for p in sync.parameters()) and case.get("dtensor", False)
    return result


def batch_split_error(sync: nn.Module, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sync.process_group = mesh.get_group()
    x = DTensor.from_local(torch.randn(2, sync.num_features, 3, 3), mesh, (Shard(0),), run_check=False)
    try:
        sync(x)
    except ValueError as err:
        return str(err)
    return ""
