"""Case ``spatial``: spatial parallelism's pieces against one process (tests/test_spatial.py). Every rank builds
the same whole images and the same model; the reference runs them whole, the spatial version this rank's strip.
Recorded per case:

- ``conv``: one nn.Conv2d patched by apply_spatial_parallel (several kernels, strides, paddings, dilations): the
  largest difference of this rank's output rows and input-gradient rows, of the weight gradient summed over the ranks,
  and the halo bytes sent forward and backward with the formula's.
- ``gather``: gather_strips gives the whole images, its backward this rank's rows times grad_scale.
- ``vgg``: a VGG11 with BatchNorm (width 8) switched to strips: logits, loss, every parameter gradient (averaged over
  the ranks, as the strategy does), running statistics, eval logits; halo bytes of one training step against the
  formula, and the activation bytes a training forward leaves for backward against one process's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_parallel.models.vgg import VGG, VGGConfig
from lightning_parallel.parallel.measure.memory import measure_saved_activation_bytes
from lightning_parallel.parallel.spatial import SENT, apply_spatial_parallel, conv_halo, gather_strips, halo_bytes
from lightning_parallel.parallel.spatial.split import shard_height

PROCESS_GROUP = True


def _max(t: torch.Tensor) -> float:
    return t.detach().abs().max().item() if t.numel() else 0.0


def _sent() -> dict[str, int]:
    return dict(SENT)


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: SENT[k] - before[k] for k in SENT}


class _Trunk(nn.Module):
    """One conv, then a gather point: what apply_spatial_parallel needs."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.conv, self.head = conv, nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def run_conv(case: dict, group: dist.ProcessGroup, rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    height = case.get("height", 16)
    x = torch.randn(2, 3, height, 6, generator=g)
    conv = nn.Conv2d(3, 4, **case["conv"])
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
    whole = x.clone().requires_grad_(True)
    want = conv(whole)
    dout = torch.randn(want.shape, generator=g)
    want.backward(dout)
    want_wgrad = conv.weight.grad.clone()
    conv.weight.grad = None
    trunk = _Trunk(conv)
    apply_spatial_parallel(trunk, group, ["head"])
    mine = shard_height(x, world, rank).requires_grad_(True)
    before = _sent()
    got = trunk(mine)
    got.backward(shard_height(dout, world, rank))
    sent = _delta(before)
    wgrad = conv.weight.grad.clone()
    dist.all_reduce(wgrad, group=group)  # each strip's outputs give their part of the weight gradient
    top, bottom = conv_halo(conv)
    width = 6 + case.get("extra_width", 0)  # padding="same" with an even kernel pads the odd column first
    theory = {d: halo_bytes(2, 3, width, top, bottom, rank, world, 4, backward=d == "backward") for d in SENT}
    return {  # differences relative to the largest value of the reference
        "name": case["name"],
        "out": _max(got - shard_height(want, world, rank)) / _max(want),
        "input_grad": _max(mine.grad - shard_height(whole.grad, world, rank)) / _max(whole.grad),
        "weight_grad": _max(wgrad - want_wgrad) / _max(want_wgrad),
        "shape": list(got.shape),
        "sent": sent,
        "theory": theory,
    }


def run_gather(case: dict, group: dist.ProcessGroup, rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4 * world, 5, generator=g)
    dout = torch.randn(x.shape, generator=g)
    mine = shard_height(x, world, rank).requires_grad_(True)
    got = gather_strips(mine, group, grad_scale=float(world))
    got.backward(dout)
    return {
        "name": case["name"],
        "out": _max(got - x),
        "input_grad": _max(mine.grad - world * shard_height(dout, world, rank)),
    }


def _vgg(size: int, dtype: torch.dtype) -> VGG:
    torch.manual_seed(0)
    return VGG(VGGConfig(name="vgg11", width=8, image_size=size)).to(dtype)


def run_vgg(case: dict, group: dist.ProcessGroup, rank: int, world: int) -> dict:
    size, batch = case["image_size"], case.get("batch", 4)
    g = torch.Generator().manual_seed(2)
    dtype = getattr(torch, case.get("dtype", "float32"))
    x, y = torch.randn(batch, 3, size, size, generator=g, dtype=dtype), torch.randint(0, 10, (batch,), generator=g)
    one = _vgg(size, dtype)

    def step(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(images), y)

    loss_one, one_bytes = measure_saved_activation_bytes(step, one, x, exclude=one)
    loss_one.backward()
    split = _vgg(size, dtype)
    done = apply_spatial_parallel(split, group, ["head"], example=x)
    strip = done.shard_batch(x)
    before = _sent()
    loss, split_bytes = measure_saved_activation_bytes(step, split, strip, exclude=split)
    loss.backward()
    sent = _delta(before)
    grads = {}
    for (name, p), q in zip(split.named_parameters(), one.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        grads[name] = _max(grad / world - q.grad)  # the strategy's mean over the loss group
    buffers = max(_max(a - b) for a, b in zip(split.buffers(), one.buffers()) if a.is_floating_point())
    one.eval(), split.eval()
    with torch.no_grad():
        eval_diff = _max(split(done.shard_batch(x)) - one(x))
    # halo rows of every conv: 1 above, 1 below; forward for all, backward for all but the first (images need none)
    theory = {"forward": 0, "backward": 0}
    for i, (name, down, (top, bottom)) in enumerate(_conv_inputs(one, size)):
        conv = one.get_submodule(name)
        args = (batch, conv.in_channels, size // down, top, bottom, rank, world, 4)
        theory["forward"] += halo_bytes(*args)
        theory["backward"] += halo_bytes(*args, backward=True) if i else 0
    theory = {k: v * x.element_size() // 4 for k, v in theory.items()}
    return {
        "name": case["name"],
        "loss": abs(loss.item() - loss_one.item()) / loss_one.item(),
        "grad": max(grads.values()),
        "worst_grad": max(grads, key=grads.get),
        "buffer": buffers,
        "eval": eval_diff,
        "sent": sent,
        "theory": theory,
        "activation_bytes": split_bytes,
        "activation_bytes_one_process": one_bytes,
        "convs": done.convs,
        "norms": done.norms,
    }


def _conv_inputs(model: VGG, size: int) -> list:
    from lightning_parallel.parallel.spatial import trace_heights

    return trace_heights(model, torch.empty(1, 3, size, size), 1, ["head"]).convs


CASES = {"conv": run_conv, "gather": run_gather, "vgg": run_vgg}


def run_case(case: dict, ctx) -> dict:
    """Case key ``kind``: ``conv``, ``gather`` or ``vgg``."""
    return CASES[case["kind"]](case, dist.group.WORLD, ctx.rank, ctx.world)
