"""Case ``sharding_registry``: cases/gpt.py's runs with the test's sharding variant registered
(tests/test_sharding_registry.py), each case's result adding how many gradient reductions went through the variant's
class."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the variant's module

from test_sharding_registry import CountedShardGradients  # noqa: E402  (registers it)

from . import gpt  # noqa: E402


def run_case(case: dict, ctx) -> dict:
    CountedShardGradients.reductions = 0
    result = gpt.run_case(case, ctx)
    return {**result, "variant_reductions": CountedShardGradients.reductions}
