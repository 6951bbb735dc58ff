"""Shared fixtures: single-process references are computed once per session and reused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_distributed

# 10 steps of AdamW on the tiny GPT, plain, with clipping, and with accumulation (validation on one).
PARITY_CASES = [
    {"name": "plain", "steps": 10, "validate": True},
    {"name": "clip", "steps": 10, "clip": 0.05},
    {"name": "accumulate", "steps": 10, "accumulate": 2},
]


class Run:
    """One launch's per-rank results and saved parameters, with global (dp-mean) losses per case."""

    def __init__(self, ranks: list[list[dict[str, Any]]], out: Path) -> None:
        self.ranks, self.out = ranks, out

    def case(self, name: str, rank: int = 0) -> dict[str, Any]:
        return next(c for c in self.ranks[rank] if c["name"] == name)

    def losses(self, name: str, ranks: list[int] | None = None) -> list[float]:
        """Per-step mean over ``ranks`` (default all): give one rank per dp index when tp > 1."""
        ranks = list(range(len(self.ranks))) if ranks is None else ranks
        per_rank = [self.case(name, r)["losses"] for r in ranks]
        return [sum(step) / len(step) for step in zip(*per_rank)]

    def params(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"{name}_params.pt", weights_only=True)


def launch(tmp_path_factory, strategy: str, world: int, cases: list[dict], tag: str = "") -> Run:
    safe = strategy.replace(":", "_").replace(",", "_").replace("=", "")
    out = tmp_path_factory.mktemp(f"{safe}_w{world}{tag}")
    ranks = run_distributed("gpt_worker.py", world, ["--strategy", strategy, "--cases", json.dumps(cases)], out)
    return Run(ranks, out)


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Run:
    """The single-process run every parity test compares against."""
    return launch(tmp_path_factory, "auto", 1, PARITY_CASES)


@pytest.fixture(scope="session")
def deep_reference(tmp_path_factory) -> Run:
    """The single-process run for the 6-block GPT (8 pipeline layers) of the world-8 matrix."""
    return launch(tmp_path_factory, "auto", 1, deep(PARITY_CASES), tag="deep")


def deep(cases: list[dict]) -> list[dict]:
    return [{**case, "deep": True} for case in cases]
