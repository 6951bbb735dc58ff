"""Shared fixtures: single-process references are computed once per session and reused."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_worker

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
    ranks = run_worker("gpt", world, ["--strategy", strategy, "--cases", json.dumps(cases)], out)
    return Run(ranks, out)


class Batch:
    """Independent runs of a case module of tests/workers/cases/ (``worker``, default "gpt"), ``label -> (world,
    strategy, cases)``, launched together: every run of one world size goes into one launch (one process start-up,
    one process group), the first time any of them is asked for. A run that fails fails the runs after it in its
    launch, with its traceback in the error."""

    def __init__(
        self,
        tmp_path_factory,
        runs: dict[str, tuple[int, str, list[dict]]],
        tag: str = "",
        worker: str = "gpt",
        seconds_per_run: float = 0.0,
    ) -> None:
        self.factory, self.runs, self.tag, self.worker = tmp_path_factory, runs, tag, worker
        self.seconds_per_run = seconds_per_run  # added to the launch's timeout per run (slow start-ups: compile)
        self._done: dict[str, Run] = {}

    def __getitem__(self, label: str) -> Run:
        if label not in self._done:
            self._launch(self.runs[label][0])
        return self._done[label]

    def _launch(self, world: int) -> None:
        mine = {label: run for label, run in self.runs.items() if run[0] == world}
        out = self.factory.mktemp(f"batch_w{world}{self.tag}")
        spec = [
            {"label": _safe(label), "strategy": strategy, "cases": cases}
            for label, (_, strategy, cases) in mine.items()
        ]
        runs_file = out / "runs.json"
        runs_file.write_text(json.dumps(spec))
        steps = sum(case.get("steps", 10) for _, _, cases in mine.values() for case in cases)
        timeout = 120 + 2 * world * steps + self.seconds_per_run * len(mine)
        run_worker(self.worker, world, ["--runs-file", str(runs_file)], out, timeout=timeout)
        for label in mine:
            folder = out / _safe(label)
            self._done[label] = Run([json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)], folder)


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--no-strict-collectives",
        action="store_true",
        help="run the multi-process workers without strict mode (LP_STRICT_COLLECTIVES=0; tests/harness.py turns it "
        "on by default: NCCL's point-to-point order on gloo, every group's collectives compared across its ranks)",
    )


def pytest_configure(config) -> None:
    if config.getoption("--no-strict-collectives"):
        os.environ["LP_STRICT_COLLECTIVES"] = "0"  # read by tests/harness.py's worker environment


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
