"""``make bench``'s Muon section (benchmarks/muon.py): its smallest case, ``zero3`` at world 2 with
``optimizer=muon``, sends per rank in the optimizer step exactly the bytes the exchange's formula gives
(benchmarks/muon_bytes.py: counted at the dispatcher, each ``all_to_all_single`` by its splits; the formula from
the optimizer's own owner assignment), and the same as the optimizer's own record; AdamW's step there sends none."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.muon import BATCH, MODEL, split_counts  # noqa: E402

WORKER = ROOT / "benchmarks" / "worker.py"


def _launch(tmp_path: Path, optimizer: str) -> list[dict]:
    overrides = [*MODEL, *BATCH, f"optimizer={optimizer}"]
    cli = ["--recipe", "gpt", "--overrides", json.dumps(overrides), "--strategy", "zero3", "--steps", "4"]
    return run_distributed(str(WORKER), 2, cli, tmp_path / optimizer, timeout=600)


@pytest.mark.slow
def test_muon_bench_counted_bytes_equal_the_formula(tmp_path):
    split = split_counts()
    assert split["muon_matrices"] == 24, split  # every block's q, k, v, proj, fc and mlp.proj
    ranks = _launch(tmp_path, "muon")
    for rank in ranks:
        step = rank["optimizer_step"]
        assert step["optimizer"] == "MuonAdamW", step
        assert step["formula_bytes"] > 0, step
        # the whole optimizer step is the exchange under zero3: counted == formula == the optimizer's own record
        assert step["step_sent_bytes"] == step["all_to_all_sent_bytes"] == step["formula_bytes"], step
        assert step["reported"]["sent_bytes"] == step["formula_bytes"], step
    # balanced owners, even slices: 2 b (W-1) P / W^2 with b = 2 (bf16), W = 2
    assert sum(r["optimizer_step"]["formula_bytes"] for r in ranks) == 2 * 2 * split["muon_elements"] // 2
    adamw = _launch(tmp_path, "adamw")
    assert [r["optimizer_step"]["step_sent_bytes"] for r in adamw] == [0.0, 0.0]
    assert [r["optimizer_step"]["formula_bytes"] for r in adamw] == [0, 0]
