"""``make gpu-check``'s CPU dry run: every section through the same code as on a GPU (a tiny GPT, a few steps),
so the one prepared device check cannot rot untested; its watchdog, which must survive a section's failure; its
time budget and its offline installs; and (slow) the rehearsal of the device call: the dry run under torch 2.11 with
the network blocked and ``.whl/`` the only source of packages."""

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
from benchmarks.gpu_check import deps  # noqa: E402
from benchmarks.gpu_check.__main__ import GPU_TOTAL_S, main  # noqa: E402
from benchmarks.gpu_check.__main__ import SECTIONS as ALL_SECTIONS  # noqa: E402
from benchmarks.gpu_check.watchdog import GRACE_S, Section, _wait, run_section  # noqa: E402

SECTIONS = ["environment", "gpu_tier", "kernels", "mfu_plain", "mfu_lightning", "mfu_ours", "memory"]
# litgpt_fsdp (two LitGPT script runs, minutes on a CPU) has its own slow test: tests/test_litgpt_scripts.py; fp8
# (four emulated runs) its own slow dry run below


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


@pytest.mark.slow
def test_the_fp8_section_dry_run_compares_bf16_and_fp8_on_both_models(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path), "--only", "fp8"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["fp8"]
    assert section["status"] == "ok", section
    runs = section["result"]["runs"]
    assert [(r["model"], r["precision"]) for r in runs] == [
        (m, p) for m in ("gpt2", "llama_1b") for p in ("bf16-mixed", "fp8")
    ]
    for r in runs:  # fp8 converted the Linear layers (not the heads); both trained on the same batch
        assert (r["float8_linears"] > 0) == (r["precision"] == "fp8") and r["tokens_per_second"] > 0, r
    assert set(section["result"]["fp8_speedup"]) == {"gpt2", "llama_1b"}
    for model in ("gpt2", "llama_1b"):
        first = [r["losses"][0] for r in runs if r["model"] == model]
        assert abs(first[0] - first[1]) < 0.05 * first[0]  # the same model and batch: fp8 close to bf16 at step 0


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


def test_the_sections_fit_the_budget_the_docs_give():
    """On the H200: caps + grace within the 480 s the docs promise (the FP8 section's 40 s included); the dry run
    (the rehearsal's, in make test-full) within 445 s."""
    gpu = sum(s.gpu_cap_s for s in ALL_SECTIONS) + GRACE_S * len(ALL_SECTIONS)
    dry = sum(s.dry_cap_s for s in ALL_SECTIONS) + GRACE_S * len(ALL_SECTIONS)
    assert gpu <= GPU_TOTAL_S and dry <= 445, (gpu, dry)
    assert {s.name for s in ALL_SECTIONS} == set(deps.NEEDS)  # every section says what it imports
    docs = (ROOT / "docs" / "maintainers.md").read_text()  # the page for whoever runs the check
    assert f"{gpu:.0f} s" in docs, f"the docs do not give the true figure, {gpu:.0f} s"


def _wheel(folder: Path, name: str) -> Path:
    """A pure-Python wheel of one module ``name`` that sets ``VALUE = 42``, written by hand (no build, no index)."""
    import zipfile

    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_missing_packages_install_offline_from_whl_or_are_reported(tmp_path, monkeypatch):
    """A carried package with a wheel in .whl/ is installed with --no-index into the site folder; one without a
    wheel is reported with the fix, at once; the sections that need it are skipped with that reason."""
    root = tmp_path / "repo"
    (root / ".whl").mkdir(parents=True)
    _wheel(root / ".whl", "lp_carried_ok")
    carried = {"lp_carried_ok": ("lp_carried_ok", "lp_carried_ok>=1.0"), "lp_carried_gone": ("lp-carried-gone", "x")}
    monkeypatch.setattr(deps, "CARRIED", carried)
    monkeypatch.setattr(deps, "IMAGE", {"lp_image_gone": "lp-image-gone"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    began = time.monotonic()
    setup = deps.ensure_packages(root, tmp_path / "site")
    assert time.monotonic() - began < 60
    assert setup["missing"] == ["lp_carried_ok", "lp_carried_gone", "lp_image_gone"]
    assert setup["installed"]["lp_carried_ok"]["returncode"] == 0 and (tmp_path / "site" / "lp_carried_ok").is_dir()
    assert set(setup["still_missing"]) == {"lp_carried_gone", "lp_image_gone"}
    assert "make gpu-wheels" in setup["still_missing"]["lp_carried_gone"]
    monkeypatch.setitem(deps.NEEDS, "kernels", ["lp_carried_ok", "lp_carried_gone"])
    assert "lp_carried_gone: no lp-carried-gone wheel" in deps.skip_reason("kernels", setup["still_missing"])
    assert deps.skip_reason("environment", setup["still_missing"]) is None


def test_a_section_whose_packages_are_missing_is_skipped_with_the_reason(tmp_path, monkeypatch):
    import benchmarks.gpu_check.__main__ as entry

    gone = {"lightning": "no lightning wheel in .whl: run `make gpu-wheels` here, carry .whl"}
    monkeypatch.setattr(entry, "ensure_packages", lambda root, site: {"still_missing": gone, "site": str(site)})
    assert main(["--dry-run", "--out", str(tmp_path / "out"), "--only", "kernels", "--work", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    kernels = report["sections"]["kernels"]
    assert kernels["status"] == "skipped" and "make gpu-wheels" in kernels["error"], kernels
    assert "- missing: lightning" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_apis_torch_2_11_may_lack_degrade_with_the_reason(monkeypatch):
    """F.grouped_mm, FSDP2's set_force_sum_reduction_for_comms and DCP's StagingOptions are in torch 2.11's wheel
    (read from its Python files); on a torch without them each path says why instead of failing on a name."""
    import warnings

    import torch
    from torch import nn

    from lightning_parallel.parallel.data import fsdp
    from lightning_parallel.parallel.expert import experts
    from lightning_parallel.strategies import checkpointing

    monkeypatch.setattr(experts, "GROUPED_MM_MISSING", "torch 0 has no F.grouped_mm")
    w1 = torch.zeros(2, 16, 32)
    assert not experts.grouped_by_default(torch.device("cuda"), torch.bfloat16, w1)  # the padded twin instead
    x, counts = torch.randn(4, 16), torch.tensor([1, 3])
    with pytest.raises(RuntimeError, match="has no F.grouped_mm.*fused=None or False"):
        experts.expert_forward(x, counts, w1, torch.zeros(2, 32, 16), fused=True)
    assert experts.expert_forward(x, counts, w1, torch.zeros(2, 32, 16), fused=None).shape == (4, 16)

    calls = []
    unit = nn.Linear(2, 2)
    unit.set_force_sum_reduction_for_comms = calls.append  # type: ignore[attr-defined]
    fsdp.force_sum_reduction(unit)
    assert calls == [True]
    with pytest.warns(UserWarning, match="no set_force_sum_reduction_for_comms"):
        fsdp.force_sum_reduction(nn.Linear(2, 2))

    monkeypatch.setattr(checkpointing, "STAGING_MISSING", "torch 0 has no ...StagingOptions/DefaultStager")
    with pytest.raises(ValueError, match="StagingOptions.*async_save=False"):
        checkpointing.check_async_save(True, "sharded")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpointing.check_async_save(False, "sharded")  # async_save=False is untouched


@pytest.mark.slow
def test_the_device_call_rehearsed_under_torch_2_11_offline(tmp_path):
    """make gpu-check's dry run as the lent machine would run it: torch 2.11 (PyPI's CUDA 13 build, on the CPU),
    Python 3.12, the device image's packages, the network blocked, hydra/omegaconf/antlr4/litgpt/lightning from
    .whl/ alone. Builds the cached environment when it is missing (make gpu-rehearsal-env)."""
    from benchmarks.gpu_check.rehearsal import rehearse

    began = time.monotonic()
    record = rehearse(tmp_path / "out", tmp_path / "work")
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    print(
        f"rehearsal: {time.monotonic() - began:.0f} s (the check {record['check_seconds']} s; environment "
        f"{'built now' if record['env']['built_now'] else 'reused'}, {record['env']['build_seconds']} s to build): "
        f"{record['sections']}"
    )
    assert record["returncode"] == 0, (tmp_path / "out" / "rehearsal.log").read_text()[-4000:]
    probe = record["probe"]
    assert probe["pip_download_returncode"] != 0, probe  # the block blocks
    if record["block"].startswith("unshare"):
        assert probe["dns"] != "resolved", probe
    env = report["sections"]["environment"]["result"]
    assert env["torch"].startswith("2.11.0") and env["lightning_parallel_import"] == "ok", env
    setup = report["setup"]
    assert setup["still_missing"] == {} and {"hydra", "omegaconf", "antlr4", "litgpt"} <= set(setup["installed"])
    assert all(v["returncode"] == 0 for v in setup["installed"].values()), setup["installed"]
    for name, section in report["sections"].items():
        assert section["status"] == "ok", f"{name}: {section.get('error')}"
    assert list(report["sections"]) == [s.name for s in ALL_SECTIONS]
