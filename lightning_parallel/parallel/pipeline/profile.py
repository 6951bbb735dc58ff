"""Per-layer forward and backward times and memory, measured on one sample microbatch; the split into pipeline
stages they give. Pure torch.

In the spirit of PipeDream (Narayanan et al., 2019): time each pipeline layer's forward and backward on a
sample microbatch, each layer fed the previous layer's output, then cut the layers into contiguous stages so
that the slowest stage is as fast as possible, every stage within a byte budget. Hand-written: torch's
pipelining splits only where it is told to.

Layers are timed on a temporary copy, so the model's weights, buffers (BatchNorm running statistics),
gradients and the random number generators are as they were. A layer on the meta device (built in
``configure_model`` under pp) is copied onto the device and initialized with its ``reset_parameters()``.
The copies and their gradients live while the profile runs: twice the model's parameter bytes more on each rank
(the whole model, also for a meta build), given back when it returns.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel._compat import tree_leaves, tree_map
from lightning_parallel.parallel.measure.memory import ActivationMemory
from lightning_parallel.parallel.pipeline.partition import balanced_partition


@dataclass
class LayerProfile:
    """What each pipeline layer costs on one microbatch (index: layer)."""

    forward_s: list[float]  # median forward seconds
    backward_s: list[float]  # median backward seconds (input and weight gradients)
    activation_bytes: list[int]  # what its forward leaves alive for backward (its output included)
    param_bytes: list[int]  # its parameters' bytes

    @property
    def times(self) -> list[float]:
        """Forward plus backward seconds per layer: the cost the stages are balanced on."""
        return [f + b for f, b in zip(self.forward_s, self.backward_s)]


def profile_layers(
    layers: Sequence[nn.Module],
    example: Any,
    device: torch.device | str = "cpu",
    *,
    warmup: int = 1,
    repeats: int = 5,
    group: dist.ProcessGroup | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> LayerProfile:
    """Time forward and backward of each layer on ``example``, chaining each layer's output into the next.

    Args:
        layers: the pipeline layers, in the order forward runs them.
        example: one microbatch for the first layer: a tensor, or a tuple of positional arguments.
        device: where to run the layers (the example is moved there).
        warmup: untimed rounds over the layers before the timed ones (after one more that measures memory).
        repeats: timed rounds over the layers; each layer's median is kept.
        group: when given, every number is reduced to its maximum over this process group, so that all its
            ranks hold the same profile (and choose the same split).
        clock: seconds now; wall time by default (``time.process_time`` counts only this process's CPU work,
            which other processes sharing the cores do not disturb; CPU only).

    Returns:
        The per-layer :class:`LayerProfile`.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"profile_layers needs repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # dropout draws leave no trace
        works = [_working_copy(layer, device) for layer in layers]
        inputs, activation, params = _chain(works, tree_map(lambda t: _to(t, device), example))
        forward_s: list[list[float]] = [[] for _ in layers]
        backward_s: list[list[float]] = [[] for _ in layers]
        # whole rounds over the layers, not one layer's runs after another's: a change in the machine's load
        # then slows every layer alike instead of a few
        for round_ in range(warmup + repeats):
            for index, work in enumerate(works):
                f, b = _time_once(work, _fresh(inputs[index], index > 0), device, clock)
                if round_ >= warmup:
                    forward_s[index].append(f)
                    backward_s[index].append(b)
    rows = [
        (statistics.median(f), statistics.median(b), a, p)
        for f, b, a, p in zip(forward_s, backward_s, activation, params)
    ]
    values = torch.tensor(rows, dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    fwd, bwd, act, param_bytes = values.cpu().T.tolist()
    return LayerProfile(fwd, bwd, [int(a) for a in act], [int(p) for p in param_bytes])


def example_microbatch(module: nn.Module) -> Any:
    """``module.example_input_array`` (Lightning's convention; here one microbatch) as the first pipeline
    layer's positional inputs: a tensor or a tuple of them."""
    example = getattr(module, "example_input_array", None)
    if example is None or isinstance(example, dict):
        got = "has none" if example is None else "is a dict (pipeline layers take positional inputs)"
        raise TypeError(
            f"pp_balance='profile' times every pipeline layer on one sample microbatch, but "
            f"{type(module).__name__}.example_input_array {got}: set self.example_input_array in its __init__ to "
            "one microbatch (a tensor, or a tuple of forward's positional arguments), or use pp_balance='params'."
        )
    return example


def _working_copy(layer: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``layer`` on ``device`` in training mode, with real values even when ``layer`` is on meta."""
    work = copy.deepcopy(layer)
    if any(t.is_meta for t in (*work.parameters(), *work.buffers())):
        reset = getattr(work, "reset_parameters", None)
        if not callable(reset):
            raise TypeError(
                f"pp_balance='profile' times each pipeline layer, but {type(layer).__name__} is on the meta device "
                "and has no reset_parameters() to give it values: add one that initializes all its weights, or "
                "build the model in __init__ instead of configure_model."
            )
        work.to_empty(device=device)
        reset()
    else:
        work.to(device)
    return work.train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_args(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _to(t: Any, device: torch.device) -> Any:
    return t.to(device) if isinstance(t, Tensor) else t


def _fresh(inputs: Any, input_grad: bool) -> tuple:
    """A layer's positional inputs, detached; floating ones need a gradient when ``input_grad``."""

    def leaf(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        t = t.detach()
        return t.requires_grad_() if input_grad and t.is_floating_point() else t

    return tuple(leaf(t) for t in _as_args(inputs))


def _backward(out: Any) -> None:
    # gradients accumulate from run to run, as over a pipeline's microbatches: a backward that allocated
    # them every time was timed a third slower for VGG's 512-channel convs
    outs = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def _chain(layers: Sequence[nn.Module], example: Any) -> tuple[list[Any], list[int], list[int]]:
    """One pass through the layers: each layer's input, the bytes its forward leaves for backward, and its
    parameter bytes (a pass that also warms up the allocator)."""
    inputs, activation, params = [example], [], []
    for index, work in enumerate(layers):
        # the model's own input needs no gradient (the first stage computes none); later inputs do
        args = _fresh(inputs[-1], index > 0)  # outside the meter: a detached input is no activation
        with ActivationMemory(exclude=work) as meter:
            out = work(*args)
        activation.append(meter.sample())
        _backward(out)
        params.append(sum(p.numel() * p.element_size() for p in work.parameters()))
        if index + 1 < len(layers):
            inputs.append(tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, out))
    return inputs, activation, params


def _time_once(layer: nn.Module, args: tuple, device: torch.device, clock: Callable[[], float]) -> tuple[float, float]:
    """Seconds of one forward and of its backward."""
    _sync(device)
    start = clock()
    out = layer(*args)
    _sync(device)
    middle = clock()
    _backward(out)
    _sync(device)
    return middle - start, clock() - middle


@dataclass
class ProfiledSplit:
    stages: list[range]
    stage_seconds: list[float]  # predicted forward+backward seconds of each stage on one microbatch
    stage_bytes: list[float] | None  # predicted bytes each stage holds (with a budget)

    def describe(self) -> str:
        parts = [f"{r.start}-{r.stop - 1}: {t * 1e3:.3g} ms" for r, t in zip(self.stages, self.stage_seconds)]
        line = "layers per stage (predicted forward+backward per microbatch) " + ", ".join(parts)
        if self.stage_bytes is not None:
            line += "; bytes per stage " + ", ".join(f"{b:.3g}" for b in self.stage_bytes)
        return line


def profiled_partition(
    profile: LayerProfile,
    num_stages: int,
    *,
    budget: float | None = None,
    in_flight: Sequence[int] | None = None,
    state_bytes: Sequence[float] | None = None,
    setting: str = "pp_memory_budget",
    stage_ranks: Sequence[int] | None = None,
) -> ProfiledSplit:
    """The split minimizing the slowest stage's forward+backward time, every stage within ``budget``.

    Args:
        profile: the per-layer measurements.
        num_stages: contiguous stages to cut the layers into.
        budget: the most bytes a stage may hold: its layers' ``state_bytes`` plus their activation bytes times
            the stage's ``in_flight`` microbatches. None: no limit.
        in_flight: microbatches whose activations each stage holds at once (default 1 each).
        state_bytes: per-layer parameter, gradient and optimizer bytes (default 4x the parameter bytes).
        setting: the name ``budget`` goes by, for the error when no split fits.
        stage_ranks: the pp rank of each stage: where a rank runs several, the heaviest rank is balanced.
    """
    n = len(profile.times)
    in_flight = list(in_flight) if in_flight is not None else [1] * num_stages
    states = list(state_bytes) if state_bytes is not None else [4.0 * p for p in profile.param_bytes]
    memory = [[states[i] + k * profile.activation_bytes[i] for i in range(n)] for k in in_flight]
    stages = balanced_partition(
        profile.times, num_stages, memory=memory, budget=budget, setting=setting, stage_ranks=stage_ranks
    )
    seconds = [sum(profile.times[i] for i in r) for r in stages]
    held = [sum(memory[s][i] for i in r) for s, r in enumerate(stages)] if budget is not None else None
    return ProfiledSplit(stages, seconds, held)
