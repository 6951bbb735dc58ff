"""Stage partitioning: uniform counts, the balanced split against brute force, stage placement."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_parallel.parallel.partition import balanced_partition, stage_to_rank, uniform_partition


def brute_force_best(costs: list[float], stages: int) -> float:
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_uniform_sizes_differ_by_at_most_one():
    parts = uniform_partition(10, 4)
    assert [len(r) for r in parts] == [3, 3, 2, 2]
    assert [i for r in parts for i in r] == list(range(10))


@pytest.mark.parametrize("seed", range(40))
def test_balanced_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    stages = rng.randint(1, n)
    costs = [rng.choice([0.0, 1.0, rng.uniform(0, 10)]) for _ in range(n)]
    parts = balanced_partition(costs, stages)
    assert len(parts) == stages and all(len(r) >= 1 for r in parts)
    assert [i for r in parts for i in r] == list(range(n)), "stages must be contiguous and cover every layer"
    heaviest = max(sum(costs[i] for i in r) for r in parts)
    assert heaviest == pytest.approx(brute_force_best(costs, stages))


def test_balanced_puts_a_heavy_layer_alone():
    parts = balanced_partition([1, 1, 1, 1, 10, 1], 3)
    assert [list(r) for r in parts] == [[0, 1, 2, 3], [4], [5]]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="needs 5 pipeline stages but the model has only 4 pipeline layers"):
        uniform_partition(4, 5)


def test_stage_placement():
    assert stage_to_rank(8, 4, "loop") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_to_rank(8, 4, "v") == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_to_rank(12, 4, "v")
