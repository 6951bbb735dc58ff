"""``make bench``'s Muon section (benchmarks/muon.py): ``zero3`` and our ZeRO-0 (``hybrid3d``, dp=2) at world 2
with ``optimizer=muon`` send per rank in the optimizer step exactly the bytes the exchange's formula gives
(benchmarks/muon_bytes.py: counted at the dispatcher, each ``all_to_all_single`` by its splits; the formula from
the shapes and the optimizer's ``owners``/``ns_cost``), and the same as the optimizer's own record; AdamW's step
under zero3 sends none."""

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


def _launch(tmp_path: Path, optimizer: str, strategy: str = "zero3") -> list[dict]:
    overrides = [*MODEL, *BATCH, f"optimizer={optimizer}"]
    cli = ["--recipe", "gpt", "--overrides", json.dumps(overrides), "--strategy", strategy, "--steps", "4"]
    return run_distributed(str(WORKER), 2, cli, tmp_path / f"{strategy}_{optimizer}", timeout=600)


def _check_counted(ranks: list[dict]) -> None:
    for rank in ranks:
        step = rank["optimizer_step"]
        assert step["optimizer"] == "MuonAdamW", step
        assert step["formula_bytes"] > 0, step
        # the whole optimizer step is the exchange: counted == formula == the optimizer's own record
        assert step["step_sent_bytes"] == step["all_to_all_sent_bytes"] == step["formula_bytes"], step
        assert step["reported"]["sent_bytes"] == step["formula_bytes"], step


@pytest.mark.slow
def test_muon_bench_counted_bytes_equal_the_formula(tmp_path):
    split = split_counts()
    assert split["muon_matrices"] == 24, split  # every block's q, k, v, proj, fc and mlp.proj
    ranks = _launch(tmp_path, "muon")
    _check_counted(ranks)
    # balanced owners, even slices: 2 b (W-1) P / W^2 with b = 2 (bf16), W = 2
    assert sum(r["optimizer_step"]["formula_bytes"] for r in ranks) == 2 * 2 * split["muon_elements"] // 2
    adamw = _launch(tmp_path, "adamw")
    assert [r["optimizer_step"]["step_sent_bytes"] for r in adamw] == [0.0, 0.0]
    assert [r["optimizer_step"]["formula_bytes"] for r in adamw] == [0, 0]


@pytest.mark.slow
def test_muon_bench_zero0_counted_bytes_equal_the_formula(tmp_path):
    """ZeRO-0: every rank holds the whole matrices; each is orthogonalized on one owner (balanced by ns_cost) and
    its result sent to the other rank: the owners' matrices once each, b P in all (b = 2, bf16)."""
    split = split_counts()
    ranks = _launch(tmp_path, "muon", "hybrid3d")
    _check_counted(ranks)
    assert sum(r["optimizer_step"]["formula_bytes"] for r in ranks) == 2 * split["muon_elements"]
    done = [r["optimizer_step"]["reported"]["orthogonalized"] for r in ranks]
    assert sum(done) == split["muon_matrices"] and min(done) > 0, done
