"""gpt_worker's runs with the test's sharding variant registered (tests/test_sharding_registry.py), each case's
result adding how many gradient reductions went through the variant's class."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the variant's module

import gpt_worker  # noqa: E402
from test_sharding_registry import CountedShardGradients  # noqa: E402  (registers it)


def run_case(case: dict, strategy: str, world: int, out: Path) -> dict:
    CountedShardGradients.reductions = 0
    result = gpt_worker.run_case(case, strategy, world, out)
    return {**result, "variant_reductions": CountedShardGradients.reductions}


if __name__ == "__main__":
    gpt_worker.run_batches(run_case)
