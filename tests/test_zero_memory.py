"""Per-rank model-state bytes, counted from the tensors, match the ZeRO formulas for fp32 Adam."""

from __future__ import annotations

import pytest
from conftest import Batch

from lightning_parallel.parallel.data.stages import stage_sharding

WORLD = 4
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory):
    case = [{"name": "mem", "steps": 2, "memory": True}]
    batch = Batch(tmp_path_factory, {f"zero{stage}": (WORLD, f"zero{stage}", case) for stage in (1, 2, 3)}, tag="mem")
    return {stage: batch[f"zero{stage}"] for stage in (1, 2, 3)}


def test_model_state_bytes_match_zero_formulas(memory_runs):
    rows = []
    for stage, run in memory_runs.items():
        for rank in range(WORLD):
            result = run.case("mem", rank)
            measured, P = result["memory"]["total"], result["num_params"]
            expected = stage_sharding(stage).state_bytes_exact(P, WORLD)
            rows.append((stage, rank, result["memory"], expected))
            assert abs(measured - expected) <= TOLERANCE * expected, (
                f"zero{stage} rank {rank}: {measured} bytes of model states, formula says {expected}"
            )
    print(f"\nmodel-state bytes per rank, world {WORLD}, P = {P} parameters (fp32 AdamW)")
    print(f"{'stage':>5} {'rank':>4} {'params':>9} {'grads':>9} {'optim':>9} {'total':>9} {'formula':>9} {'ratio':>6}")
    for stage, rank, m, expected in rows:
        print(
            f"{stage:>5} {rank:>4} {m['params']:>9} {m['grads']:>9} {m['optimizer']:>9} {m['total']:>9} "
            f"{expected:>9} {m['total'] / expected:>6.3f}"
        )
