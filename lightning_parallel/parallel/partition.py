"""Which pipeline stage runs which layers, and which pp rank runs which stage. Pure functions.

Stages are contiguous runs of layers. ``uniform`` gives every stage the same number of layers (the first
stages one more when they do not divide); ``balanced`` minimizes the heaviest stage for any per-layer
cost (parameter count today, measured time later) by dynamic programming over the split points.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_stage_count(num_layers: int, num_stages: int, setting: str) -> None:
    """Every stage needs at least one layer."""
    if num_stages > num_layers:
        raise ValueError(
            f"{setting} needs {num_stages} pipeline stages but the model has only {num_layers} pipeline layers: "
            f"lower pp (or the virtual stages per rank) to at most {num_layers} stages, or give the model more layers."
        )


def uniform_partition(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous stages whose layer counts differ by at most one."""
    check_stage_count(num_layers, num_stages, f"splitting into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        stages.append(range(start, start + size))
        start += size
    return stages


def balanced_partition(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous stages minimizing the largest stage cost (ties: the earliest split points).

    O(L^2 * S) for L layers and S stages: fine for the hundreds of layers models have.
    """
    n = len(costs)
    check_stage_count(n, num_stages, f"splitting into {num_stages} stages")
    prefix = [0.0]
    for c in costs:
        if c < 0:
            raise ValueError(f"layer costs must be non-negative, got {c}")
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest possible heaviest stage when the first i layers form s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):  # the last stage is layers j..i-1
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    stages, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        stages.append(range(start, end))
        end = start
    return stages[::-1]


def stage_to_rank(num_stages: int, pp: int, style: str = "loop") -> list[int]:
    """The pp rank that runs each stage: ``loop`` deals stages round-robin (interleaved 1F1B), ``v`` goes
    down the ranks and back up (ZB-V: rank r runs stages r and 2*pp-1-r)."""
    if num_stages % pp:
        raise ValueError(f"{num_stages} stages do not divide evenly over pp={pp} ranks")
    if style == "loop":
        return [s % pp for s in range(num_stages)]
    if style == "v":
        if num_stages != 2 * pp:
            raise ValueError(f"a V schedule runs exactly 2 stages per rank, got {num_stages} over pp={pp}")
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    raise ValueError(f"unknown stage placement {style!r}: use 'loop' or 'v'")
