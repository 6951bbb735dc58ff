"""Sweeps that survive a bad job: a job whose settings are refused (or whose workers fail) is recorded as failed with
its reason, the other jobs go on, the summary lists every job with its degrees, and the multirun exits non-zero after
writing it (lightning_parallel/recipes/sweep.py, summary.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from recipe_runs import GPT, run
from test_recipe_configs import compose_gpt

from lightning_parallel.recipes import sweep as sweep_module
from lightning_parallel.recipes.summary import COLUMNS, SweepSummary, summarize
from lightning_parallel.recipes.sweep import JOB_FAILED_FILE, checked_run, read_failure

ENTRY = "lightning_parallel.recipes.gpt.train"
DEGREES = ("world_size", "dp", "pp", "tp", "cp", "ep", "dp_shard", "zero_stage", "pp_schedule", "microbatches")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def no_launch(monkeypatch):
    """launch.run replaced: any call is recorded (a refused job must never reach it)."""
    calls = []
    monkeypatch.setattr("lightning_parallel.recipes.launch.run", lambda *a, **k: calls.append(a))
    return calls


def refuse(cfg):
    raise ValueError("strategy.tp=3 does not divide model.n_head=4: pick a divisor of 4.")


def test_a_refused_job_of_a_sweep_is_recorded_without_launching(tmp_path, no_launch):
    cfg = compose_gpt("strategy=hybrid3d", "strategy.pp=2", "strategy.tp=3", "trainer.devices=6")
    assert checked_run(cfg, refuse, ENTRY, tmp_path, sweep=True) is None and no_launch == []
    record = read_failure(tmp_path)
    assert record["reason"] == "Error in the config (ValueError): strategy.tp=3 does not divide model.n_head=4: " + (
        "pick a divisor of 4."
    )
    assert record["requested"] == {
        "world_size": 6,
        "dp": "auto",
        "pp": 2,
        "tp": 3,
        "cp": 1,
        "ep": 1,
        "dp_shard": None,
        "zero_stage": 0,
        "pp_schedule": "1f1b",
        "microbatches": None,  # as asked: the default (2 * pp) is filled in by the validated config
        "precision": "32-true",
    }
    # alone (not in a sweep) the same refusal ends the run with its message, and records nothing
    with pytest.raises(SystemExit, match="Error in the config \\(ValueError\\): strategy.tp=3"):
        checked_run(cfg, refuse, ENTRY, tmp_path, sweep=False)
    assert not (tmp_path / JOB_FAILED_FILE).exists() and no_launch == []


def test_a_sweep_job_whose_workers_fail_is_recorded(tmp_path, monkeypatch):
    def crash(cfg, run_dir, entry):
        raise RuntimeError("rank 1 failed first: killed by SIGKILL (pid 7)")

    monkeypatch.setattr("lightning_parallel.recipes.launch.run", crash)
    monkeypatch.setattr("lightning_parallel.recipes.launch.launched_externally", lambda: False)
    cfg = compose_gpt("strategy=zero3", "trainer.devices=2")
    checked_run(cfg, lambda cfg: None, ENTRY, tmp_path, sweep=True)
    assert read_failure(tmp_path)["reason"] == "RuntimeError: rank 1 failed first: killed by SIGKILL (pid 7)"
    with pytest.raises(RuntimeError, match="rank 1 failed first"):  # alone: raised as before
        checked_run(cfg, lambda cfg: None, ENTRY, tmp_path / "alone", sweep=False)

    def faulty_check(cfg):  # not a refusal (a fault of the checks): recorded as well in a sweep, raised alone
        raise KeyError("model")

    checked_run(cfg, faulty_check, ENTRY, tmp_path, sweep=True)
    assert read_failure(tmp_path)["reason"] == "KeyError: 'model'"
    with pytest.raises(KeyError):
        checked_run(cfg, faulty_check, ENTRY, tmp_path / "alone", sweep=False)


def fabricate_sweep(sweep_dir: Path) -> None:
    """Job 0 finished (metrics.json as the recipe writes it, pp=2), job 1 refused (recorded), job 2 stopped early
    (neither file)."""
    layout = {"world_size": 4, "dp": 1, "pp": 2, "tp": 2, "cp": 1, "ep": 1, "dp_shard": 1, "zero_stage": 1}
    layout |= {"pp_schedule": "interleaved_1f1b", "microbatches": 4, "precision": "bf16-mixed", "cp_mode": None}
    metrics = {"layout": layout, "peak_memory_bytes": [300, 700, 500, 200], "steps": 6, "throughput": 1234.5}
    metrics |= {"throughput_unit": "tokens/s", "mfu": 0.41, "final_train_loss": 3.2, "wall_seconds": 9.0}
    for job in range(3):
        (sweep_dir / str(job) / ".hydra").mkdir(parents=True)
        (sweep_dir / str(job) / ".hydra" / "overrides.yaml").write_text(f"- strategy.tp={2 + job}\n")
    (sweep_dir / "0" / "metrics.json").write_text(json.dumps(metrics))
    cfg = compose_gpt("strategy=hybrid3d", "strategy.tp=3", "trainer.devices=4")
    sweep_module.record_failure(cfg, sweep_dir / "1", "Error in the config (ValueError): strategy.tp=3 | no")


def test_the_summary_lists_every_job_with_its_degrees_and_a_failed_one_with_its_reason(tmp_path):
    fabricate_sweep(tmp_path)
    rows = summarize(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "failed", "failed"]
    got = read_csv(tmp_path / "summary.csv")
    assert list(got[0]) == COLUMNS and set(DEGREES) <= set(COLUMNS)
    assert [got[0][k] for k in DEGREES] == ["4", "1", "2", "2", "1", "1", "1", "1", "interleaved_1f1b", "4"]
    assert (got[0]["throughput"], got[0]["mfu"], got[0]["max_peak_memory_bytes"]) == ("1234.5", "0.41", "700")
    assert got[0]["reason"] == "" and got[1]["throughput"] == got[1]["max_peak_memory_bytes"] == ""
    assert [got[1][k] for k in ("job", "world_size", "dp", "tp")] == ["strategy.tp=3", "4", "auto", "3"]
    assert got[1]["reason"] == "Error in the config (ValueError): strategy.tp=3 | no"
    assert got[2]["reason"].startswith("no metrics.json and no recorded failure")
    markdown = (tmp_path / "summary.md").read_text().splitlines()
    assert len(markdown) == 2 + 3 and markdown[0].startswith("| job | status | world_size | dp | pp | tp | cp |")
    assert "| failed |" in markdown[3] and "strategy.tp=3 \\| no |" in markdown[3]  # the cell stays one cell
    assert all(line.count(" | ") == len(COLUMNS) - 1 for line in markdown[2:])
    assert (tmp_path / "summary.png").stat().st_size > 10_000


def test_the_multirun_exits_non_zero_after_writing_the_summary(tmp_path, capsys):
    fabricate_sweep(tmp_path)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit, match="2 of 3 jobs of the sweep failed \\(strategy.tp=3; strategy.tp=4\\)"):
        SweepSummary().on_multirun_end(config)
    assert "| failed |" in capsys.readouterr().out and (tmp_path / "summary.csv").is_file()
    (tmp_path / "1" / JOB_FAILED_FILE).unlink()
    for job in ("1", "2"):
        (tmp_path / job / "metrics.json").write_text((tmp_path / "0" / "metrics.json").read_text())
    SweepSummary().on_multirun_end(config)  # every job ok: no exit


def test_a_sweep_of_refused_jobs_writes_its_summary_and_exits_1(tmp_path):
    """The recipe as a user runs it: no worker starts, every job is listed with its reason, status 1."""
    sweep = tmp_path / "sweep"
    args = ["-m", "strategy=hybrid3d", "trainer.devices=2", "strategy.tp=3,5", f"hydra.sweep.dir={sweep}"]
    result = run(tmp_path, GPT, *args, timeout=180, ok=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "2 of 2 jobs of the sweep failed" in output, output[-3000:]
    assert "Initializing distributed" not in output
    rows = read_csv(sweep / "summary.csv")
    assert [(r["status"], r["tp"]) for r in rows] == [("failed", "3"), ("failed", "5")]
    assert all("choose pp and tp whose product divides 2" in r["reason"] for r in rows)


@pytest.mark.slow
def test_a_real_sweep_with_one_refused_combination_runs_the_others_and_records_it(tmp_path):
    """pp=1, 2 and 3 at world 2: pp=3 is refused before any worker starts; the other two train, and the summary has
    all three with their figures, the failure with its reason; the multirun then exits with status 1."""
    sweep = tmp_path / "sweep"
    args = ["-m", "trainer=debug", "trainer.max_steps=2", "sample_tokens=0", "strategy=hybrid3d"]
    args += ["trainer.devices=2", "strategy.pp=1,2,3", f"hydra.sweep.dir={sweep}"]
    result = run(tmp_path, GPT, *args, timeout=900, ok=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "1 of 3 jobs of the sweep failed" in output, output[-3000:]
    rows = read_csv(sweep / "summary.csv")
    assert [(r["status"], r["pp"], r["dp"]) for r in rows] == [
        ("ok", "1", "2"),
        ("ok", "2", "1"),
        ("failed", "3", "auto"),
    ]
    assert [(r["pp_schedule"], r["microbatches"]) for r in rows] == [("", ""), ("1f1b", "4"), ("1f1b", "")]
    for row in rows[:2]:
        assert row["world_size"] == "2" and row["steps"] == "2" and row["throughput_unit"] == "tokens/s"
        assert float(row["throughput"]) > 0 and int(row["max_peak_memory_bytes"]) > 0 and row["reason"] == ""
    assert "pp(3)" in rows[2]["reason"] and rows[2]["throughput"] == ""
    assert not (sweep / "2" / "metrics.json").exists() and (sweep / "summary.png").stat().st_size > 10_000
    assert "| failed |" in (sweep / "summary.md").read_text()
