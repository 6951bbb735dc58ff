"""``make gpu-check``'s CPU dry run: every section through the same code as on a GPU (a tiny GPT, a few steps),
so the one prepared device check cannot rot untested; and its watchdog, which must survive a section's failure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_check.watchdog import Section, _wait, run_section  # noqa: E402

SECTIONS = ["environment", "gpu_tier", "kernels", "mfu_plain", "mfu_lightning", "mfu_ours", "memory"]
# litgpt_fsdp (two LitGPT script runs, minutes on a CPU) has its own slow test: tests/test_litgpt_scripts.py


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu_check")
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out), "--only", ",".join(SECTIONS)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    return report, (out / "gpu_check.md").read_text(), done.stdout


def test_every_section_ran_and_reported(dry_run):
    report, markdown, stdout = dry_run
    assert report["dry_run"] is True and list(report["sections"]) == SECTIONS
    for name, section in report["sections"].items():
        assert section["status"] == "ok", f"{name}: {section.get('error')}"
        assert f"## {name}" in markdown and f"section {SECTIONS.index(name) + 1}/7 {name}: ok" in stdout
    assert report["sections"]["environment"]["result"]["lightning_parallel_import"] == "ok"


def test_the_gpu_tier_is_collected_and_skipped_without_cuda(dry_run):
    tier = dry_run[0]["sections"]["gpu_tier"]["result"]
    assert tier["returncode"] == 0 and not tier["timed_out"]
    assert tier["counts"].get("skipped", 0) >= 20 and set(tier["counts"]) == {"skipped"}, tier["counts"]
    assert all("CUDA device" in t["message"] for t in tier["tests"]), tier["tests"][:3]


def test_kernels_compare_or_say_why_not(dry_run):
    kernels = dry_run[0]["sections"]["kernels"]["result"]
    for part in ("ring_attention", "moe_experts"):
        status = kernels[part]["status"]
        assert status == "ok" or "not available" in status, f"{part}: {status}"
        for row in kernels[part].get("rows", []):
            assert row.get("status", "ok") in ("ok",) or "Error" in row["status"], row
            if row.get("status") == "ok":  # compared against the math twin: every difference under its bar
                diffs = [v for k, v in row.items() if k.endswith("_rel")]
                assert diffs and max(diffs) <= row["bar"], row
    moe_layer = [r for r in kernels["moe_experts"]["rows"] if r["kernel"].startswith("GroupedExperts")]
    assert len(moe_layer) == 2 and all(r["forward_ms"] > 0 for r in moe_layer)


def test_the_three_mfu_runs_train_the_same_model_on_the_same_batch(dry_run):
    sections = dry_run[0]["sections"]
    plain, lightning, ours = (sections[f"mfu_{v}"]["result"] for v in ("plain", "lightning", "ours"))
    for run in (plain, lightning, ours):
        assert run["tokens_per_second"] > 0 and run["mfu"] is None and run["peak_memory_bytes"] is None  # CPU
        assert len(run["losses"]) == 3 and all(math.isfinite(v) for v in run["losses"])
        flops = run["flops_per_step"]
        assert abs(flops["counted"] - flops["rule_of_thumb"]) <= 0.1 * flops["rule_of_thumb"], flops
        for got, want in zip(run["losses"], plain["losses"]):  # same init, batch, optimizer and bf16 autocast
            assert abs(got - want) <= 1e-3 * want, (run["variant"], run["losses"], plain["losses"])
    assert "| run | tokens/s | MFU |" in dry_run[1]


def test_memory_compares_the_planner_estimate(dry_run):
    memory = dry_run[0]["sections"]["memory"]["result"]
    assert memory["estimate"]["total_bytes"] > memory["estimate"]["model_state_bytes"] > 0
    assert memory["measured_peak_bytes"] is None and "CUDA only" in memory["note"]
    assert memory["planner_row"]["pp"] == memory["planner_row"]["dp"] == 1


def test_a_failing_section_is_recorded_and_the_check_goes_on(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"dry_run": True, "work": str(tmp_path), "root": str(ROOT)}))
    log = tmp_path / "gpu_check.log"
    entry = run_section(Section("no_such_section", 5, 5), 1, 1, 30.0, config, log)
    assert entry["status"] == "failed" and "KeyError: 'no_such_section'" in entry["error"]


def test_a_hung_section_is_killed_at_its_limit():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    began = time.monotonic()
    assert _wait(proc, 1.0) is True and proc.returncode is not None and time.monotonic() - began < 10
