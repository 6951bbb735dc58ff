"""Which pipeline stage runs which layers, and which pp rank runs which stage. Pure functions.

Stages are contiguous runs of layers. ``uniform`` gives every stage the same number of layers (the first
stages one more when they do not divide); ``balanced`` minimizes the heaviest stage for any per-layer
cost (parameter count, or measured forward+backward time: ``pp_balance="profile"``) by dynamic programming
over the split points, optionally keeping each stage's bytes within a budget.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence


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


def balanced_partition(
    costs: Sequence[float],
    num_stages: int,
    memory: Sequence[float] | Sequence[Sequence[float]] | None = None,
    budget: float | None = None,
    setting: str = "budget",
    stage_ranks: Sequence[int] | None = None,
) -> list[range]:
    """Contiguous stages minimizing the largest stage cost, each stage's memory within ``budget``
    (ties: the earliest split points). Hand-written: torch's pipelining has no stage partitioner.

    O(L^2 * S) for L layers and S stages: fine for the hundreds of layers models have.

    Args:
        costs: per-layer cost (time, parameter count), non-negative.
        num_stages: how many contiguous stages to cut the layers into.
        memory: per-layer bytes, the same in every stage; or one such list per stage (``memory[s][l]``: what
            layer ``l`` costs when stage ``s`` holds it, e.g. activations times that stage's in-flight
            microbatches). None: no memory constraint.
        budget: the most bytes one stage may hold (needs ``memory``).
        setting: the setting ``budget`` comes from, named in the error when no split fits.

    Returns:
        One ``range`` of layer indices per stage, in order.

    Raises:
        ValueError: no split keeps every stage within ``budget``; the message gives the smallest budget that fits.
    """
    n = len(costs)
    check_stage_count(n, num_stages, f"splitting into {num_stages} stages")
    for c in costs:
        if c < 0:
            raise ValueError(f"layer costs must be non-negative, got {c}")
    cost = _stage_sums([costs] * num_stages)
    if memory is None or budget is None:
        by_rank = rank_balanced_partition(costs, stage_ranks) if stage_ranks is not None else None
        return by_rank or _min_max_split(n, num_stages, cost)[1]
    rows = _memory_rows(memory, n, num_stages)
    held = _stage_sums(rows)
    if stage_ranks is not None:
        by_rank = rank_balanced_partition(costs, stage_ranks, lambda s, j, i: held(s, j, i) <= budget)
        if by_rank:
            return by_rank
    value, stages = _min_max_split(n, num_stages, cost, lambda s, j, i: held(s, j, i) <= budget)
    if stages:
        return stages
    least, tight = _min_max_split(n, num_stages, held)
    per_stage = ", ".join(_count(held(s, r.start, r.stop)) for s, r in enumerate(tight))
    raise ValueError(
        f"{setting}={_count(budget)} bytes per stage fits no split of the {n} layers into {num_stages} stages: the "
        f"smallest budget any split fits is {_count(least)} bytes (stages of layers "
        f"{', '.join(f'{r.start}-{r.stop - 1}' for r in tight)} hold {per_stage}). Raise {setting} to at least "
        f"that, use more pipeline stages, or hold less per stage (smaller microbatches, activation checkpointing)."
    )


def rank_balanced_partition(
    costs: Sequence[float],
    stage_ranks: Sequence[int],
    allowed: Callable[[int, int, int], bool] = lambda s, j, i: True,
    limit: int = 100_000,
    slack: float = 0.05,
) -> list[range] | None:
    """The contiguous split into ``len(stage_ranks)`` stages whose heaviest rank (its stages' costs summed) is
    within ``slack`` of the lightest possible, and whose heaviest stage is the lightest among those (then the
    earliest split points); only splits whose every stage is ``allowed(stage, start, stop)``.

    The slack keeps a measured profile's noise from buying a rank balance a few percent better with one stage
    far heavier than the rest: torch's V and interleaved orders assume stages of equal time.

    Returns:
        None when no rank runs two stages (balancing stages is the same), when there are more than ``limit``
        splits to try, or when none is allowed.
    """
    n, num_stages = len(costs), len(stage_ranks)
    if len(set(stage_ranks)) == num_stages or math.comb(n - 1, num_stages - 1) > limit:
        return None
    prefix = list(itertools.accumulate(costs, initial=0))
    candidates = []  # (heaviest rank, heaviest stage, bounds), in the order of the split points
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        if not all(allowed(s, bounds[s], bounds[s + 1]) for s in range(num_stages)):
            continue
        stage_costs = [prefix[bounds[s + 1]] - prefix[bounds[s]] for s in range(num_stages)]
        per_rank: dict[int, float] = {}
        for rank, c in zip(stage_ranks, stage_costs):
            per_rank[rank] = per_rank.get(rank, 0.0) + c
        candidates.append((max(per_rank.values()), max(stage_costs), bounds))
    if not candidates:
        return None
    lightest = min(c[0] for c in candidates)
    near = [c for c in candidates if c[0] <= lightest * (1 + slack)]
    chosen = min(near, key=lambda c: (c[1], c[0]))[2]
    return [range(chosen[s], chosen[s + 1]) for s in range(num_stages)]


def _count(value: float) -> str:
    """Bytes as an exact integer when they are one (a budget one byte short must not read as enough)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _memory_rows(memory: Sequence[float] | Sequence[Sequence[float]], n: int, num_stages: int) -> list[list[float]]:
    rows = [list(memory)] * num_stages if not isinstance(memory[0], Sequence) else [list(r) for r in memory]
    if len(rows) != num_stages or any(len(r) != n for r in rows):
        raise ValueError(f"memory must hold {n} per-layer values, or {num_stages} rows of them (one per stage)")
    return rows


def _stage_sums(rows: Sequence[Sequence[float]]) -> Callable[[int, int, int], float]:
    """``sums(s, j, i)``: the sum of ``rows[s][j:i]``, from prefix sums."""
    prefixes = [list(itertools.accumulate(row, initial=0)) for row in rows]
    return lambda s, j, i: prefixes[s][i] - prefixes[s][j]


def _min_max_split(
    n: int,
    num_stages: int,
    cost: Callable[[int, int, int], float],
    allowed: Callable[[int, int, int], bool] = lambda s, j, i: True,
) -> tuple[float, list[range]]:
    """The contiguous split of ``n`` layers into stages minimizing the largest ``cost(stage, start, stop)`` over
    splits where every stage is ``allowed``; ``(inf, [])`` when none is."""
    inf = float("inf")
    # best[s][i]: the smallest possible heaviest stage when the first i layers form s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):  # stage s - 1 is layers j..i-1
                if best[s - 1][j] == inf or not allowed(s - 1, j, i):
                    continue
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    if best[num_stages][n] == inf:
        return inf, []
    stages, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        stages.append(range(start, end))
        end = start
    return best[num_stages][n], stages[::-1]


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
