"""``python -m benchmarks.gpu_check --out DIR [--dry-run] [--budget S] [--only NAME,...]`` (from the repository root;
``make gpu-check OUT=DIR`` runs it): the sections of :mod:`benchmarks.gpu_check`, each under its time limit."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from .deps import ensure_packages, skip_reason
from .report import Report
from .watchdog import GRACE_S, Section, progress, run_section

# name, seconds on the lent H200 (one device call: 600 s at most), seconds in the CPU dry run. A section that ends
# early leaves its time to the ones after it; each also gets GRACE_S (5 s) to stop its children and write its result.
# On the GPU: 400 s of caps + 8 x 5 s of grace = 440 s, plus the start-up (the offline install from .whl: 9 s in the
# rehearsal) within the 480 s the check is given, which leaves 120 s of the 600 s device call for the machine's start
# and the transfers; 40 s (35 + 5 of grace) of the 480 go to the FP8 section, which runs what fits of its four runs
# (the earlier sections' savings roll over to it). The GPU caps are
# estimates until the first device run: its `seconds` column sets them.
# The dry run: 340 s + 40 s of grace = 380 s (was 780 + 40); it took 94 s here under torch 2.13 on 2 CPU cores, and
# 306 s under torch 2.11 (the rehearsal) with other test runs on the same 2 cores (load average 14-18), when
# litgpt_fsdp took 104 s and lived on the earlier sections' savings.
SECTIONS = [
    Section("environment", 15, 40),
    Section("gpu_tier", 120, 60),  # 8 world-1 launches (one compiled), 2 recipe runs, all at once on one GPU
    Section("kernels", 40, 35),
    Section("mfu_plain", 60, 30),  # GPT-2 small compiled whole: most of it is the compile
    Section("mfu_lightning", 55, 25),
    Section("mfu_ours", 55, 25),
    Section("memory", 15, 25),
    Section("litgpt_fsdp", 40, 100),  # LitGPT's full.py under Lightning's FSDPStrategy and ours, 5 steps each
    Section("fp8", 35, 60),  # bf16 vs fp8 (torchao): GPT-2 small and a ~1B Llama, compiled; lives on earlier savings
]
GPU_TOTAL_S = 480  # what the docs promise for the sections, their grace included (tests/test_gpu_check.py holds it)
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where gpu_check.json, .md and .log go")
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny GPT, a few steps: every section's code path")
    p.add_argument("--budget", type=float, default=None, help="seconds for all sections (default: their sum)")
    p.add_argument("--only", default=None, help="comma-separated section names (default: all)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = [s for s in SECTIONS if args.only is None or s.name in args.only.split(",")]
    if not sections:
        raise SystemExit(f"--only={args.only}: no such section; use some of {', '.join(s.name for s in SECTIONS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:  # CPU even on a GPU machine: the sections' children inherit it (the tier's ranks too)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    caps = [s.cap(args.dry_run) for s in sections]
    budget = args.budget if args.budget is not None else sum(caps)
    report = Report(args.out, dry_run=args.dry_run, budget_s=budget)
    progress(
        f"gpu-check{' (dry run, CPU)' if args.dry_run else ''}: {len(sections)} sections, {budget:.0f} s budget "
        f"(+{GRACE_S:.0f} s grace each)"
    )
    setup = ensure_packages(ROOT, work / "site")  # offline, from .whl/ only
    report.set_setup(setup)
    config = {"dry_run": args.dry_run, "work": str(work), "root": str(ROOT), "site": setup["site"]}
    config_file = work / "config.json"
    config_file.write_text(json.dumps(config))
    deadline = time.monotonic() + budget
    for i, section in enumerate(sections):
        reason = skip_reason(section.name, setup["still_missing"])
        if reason:
            progress(f"section {i + 1}/{len(sections)} {section.name}: skipped: {reason}")
            report.add(section.name, {"status": "skipped", "seconds": 0.0, "limit_s": 0, "error": reason})
            continue
        later = sum(caps[i + 1 :])
        limit = max(min(caps[i], 10.0), deadline - time.monotonic() - later)  # earlier sections' savings roll over
        result = run_section(section, i + 1, len(sections), limit, config_file, report.log_file)
        report.add(section.name, result)  # json and markdown rewritten after every section
    progress(f"gpu-check done: {report.counts()}; {args.out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
