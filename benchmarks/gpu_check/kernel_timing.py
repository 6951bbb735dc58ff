"""Differences and timings for the kernels section: CUDA events on a GPU, the host clock on CPU."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _scalar(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum(o.float().sum() for o in outputs if o.is_floating_point() and o.requires_grad)


def time_ms(
    call: Callable[[], Sequence[torch.Tensor]], backward: bool = True, warmup: int = 3, iters: int = 10
) -> float:
    """Mean milliseconds of ``call()`` (and a backward through the sum of its outputs)."""

    def once() -> None:
        outputs = call()
        if backward:
            _scalar(outputs).backward()

    for _ in range(warmup):
        once()
    if not torch.cuda.is_available():
        began = time.perf_counter()
        for _ in range(iters):
            once()
        return (time.perf_counter() - began) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        once()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def forward_backward(
    fn: Callable[..., Sequence[torch.Tensor]],
    choice: Any,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
) -> dict[str, list[torch.Tensor]]:
    """Outputs of ``fn(choice, *inputs)`` and the gradients of ``inputs`` and ``params`` under seeded random output
    gradients (the same for every choice)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outputs = fn(choice, *leaves)
    gen = torch.Generator().manual_seed(0)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outputs)
    grads = torch.autograd.grad(loss, [*leaves, *params], allow_unused=True)
    return {"outputs": [o.detach() for o in outputs], "grads": [g for g in grads if g is not None]}


def compare(got: dict[str, list[torch.Tensor]], want: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """The largest difference of each output and gradient, relative to the largest magnitude of the reference."""
    diffs = {}
    for kind in ("outputs", "grads"):
        assert len(got[kind]) == len(want[kind]), f"{kind}: {len(got[kind])} vs {len(want[kind])}"
        for i, (g, w) in enumerate(zip(got[kind], want[kind])):
            scale = w.float().abs().max().clamp_min(1e-12)
            diffs[f"{kind[:-1]}{i}_rel"] = float((g.float() - w.float()).abs().max() / scale)
    return diffs
