"""Case ``powersgd`` (one per launch): PowerSGD on the data-parallel reduction of ZeRO 0 and 2, pure torch (no
Lightning; tests/test_powersgd.py). A small net (an embedding, three linear layers,
a LayerNorm) learns a token mapping; each rank trains on its slice of the same global batch with AdamW through the
sharding's ``shard_optimizer`` / ``reduce_gradients``. Recorded on every rank:

- ``full_rank_zero<s>`` (stages 0, 1, 2): PowerSGD factoring every matrix at full rank against one process on the
  global batch (built and trained in this rank too): the largest relative loss difference and parameter difference;
- ``low_rank_zero<s>`` and ``uncompressed_zero<s>`` (stages 0, 2): rank 2 and plain, their losses and the payload
  and sent bytes of one step's gradient reduction (counted at the dispatcher); ``expected_bytes``: P + Q + the rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_parallel.parallel.data.stages import stage_sharding
from lightning_parallel.parallel.measure.comm_volume import CommCounter

PROCESS_GROUP = True
VOCAB, WIDTH, GLOBAL_BATCH, STEPS = 32, 48, 16, 10


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.up = nn.Linear(24, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, VOCAB)
        h = torch.relu(self.up(self.embed(x)))
        return self.head(self.norm(torch.relu(self.mid(h))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=torch.Generator().manual_seed(step))
    return x, (7 * x + 3) % VOCAB


def fresh(sgd: bool) -> tuple[Net, torch.optim.Optimizer]:
    """SGD for parity: Adam's first steps turn a rounding-level gradient (1e-9 where the plain sum is exactly 0,
    the embedding rows of tokens not in the batch) into a step of lr * 1e-3."""
    torch.manual_seed(0)
    net = Net()
    if sgd:
        return net, torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-6)


def train(mesh: DeviceMesh, stage: int, compression: str, rank_: int, compress_all: bool, steps: int) -> dict:
    sharding = stage_sharding(stage)(mesh, grad_compression=compression, powersgd_rank=rank_, setting=f"zero{stage}")
    if sharding.powersgd is not None:
        sharding.powersgd.compress_all = compress_all
    net, optimizer = fresh(sgd=compress_all)
    sharding.shard_optimizer(optimizer)
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, reduce_bytes, sent, expected = [], 0, 0.0, 0
    for step in range(steps):
        x, y = batch(step)
        mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        loss = nn.functional.cross_entropy(net(x[mine]), y[mine])
        loss.backward()
        if step == 1:
            grads = [p.grad for p in net.parameters()]
            expected = sharding.powersgd.bytes_per_step(grads) if sharding.powersgd is not None else 0
            with CommCounter() as counter:
                sharding.reduce_gradients(optimizer)
            reduce_bytes = sum(row["payload_bytes"] for row in counter.by_kind().values())
            sent = counter.sent_bytes
        else:
            sharding.reduce_gradients(optimizer)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return {
        "losses": losses,
        "reduce_bytes": reduce_bytes,
        "sent_bytes": sent,
        "expected_bytes": expected,
        "params": params,
    }


def reference(steps: int) -> dict:
    net, optimizer = fresh(sgd=True)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in net.named_parameters()}}


def compare(got: dict, want: dict) -> dict:
    loss_diff = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"]))
    param_diff = max((got["params"][n] - p).abs().max().item() for n, p in want["params"].items())
    return {"loss_diff": loss_diff, "param_diff": param_diff, "losses": got["losses"], "want": want["losses"]}


def run_case(case: dict, ctx) -> dict:
    """Every result on this rank (no case keys)."""
    mesh = init_device_mesh("cpu", (ctx.world,), mesh_dim_names=("dp",))
    results = {}
    want = reference(STEPS)
    for stage in (0, 1, 2):
        results[f"full_rank_zero{stage}"] = compare(train(mesh, stage, "powersgd", 64, True, STEPS), want)
    for stage in (0, 2):
        for label, compression in (("low_rank", "powersgd"), ("uncompressed", "none")):
            run = train(mesh, stage, compression, 2, False, 3 * STEPS)
            results[f"{label}_zero{stage}"] = {k: v for k, v in run.items() if k != "params"}
    return results
