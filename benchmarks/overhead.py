"""``make bench``'s overhead section: the host cost of a step and of setting up, per strategy, against Lightning's
``ddp`` and FSDP2 (``model_parallel``), on a GPT whose compute is negligible (2 blocks of width 32, 16 tokens, 4
samples a step), so what a step costs is the framework's host work and the collectives' latency.

- ``run_overhead``: each strategy's launch paired with its baseline's, the pairs interleaved (A, B, A, B, ...) and
  repeated ``pairs`` times (at least 5): per launch the median step time and the setup time (``trainer.fit``'s wall
  minus its steps at that median rate); reported as the median and the min-max over the pairs of each ratio.
- ``run_counts`` (``python benchmarks/overhead.py --counts``): no timing at all, for a loaded machine: per step, the
  Python calls, torch operators and collectives of each strategy (benchmarks/host_counts.py), as in
  benchmarks/findings.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

TINY = ["model=gpt_tiny", "model.n_layer=2", "model.d_model=32", "model.seq_len=16", "data.global_batch_size=4"]
COUNTED = ["model=gpt_tiny"]  # the issue's gpt_tiny at its recipe defaults
# (ours, baseline, world): dp-only against ddp, ZeRO-3 against FSDP2, tp and pp against ddp (their setup)
PAIRS = [
    ("hybrid3d", "ddp", 2),
    ("zero1", "ddp", 2),
    ("zero2", "ddp", 2),
    ("zero3", "model_parallel", 2),
    ("hybrid3d:tp=2", "model_parallel:tp=2", 2),
    ("hybrid3d:pp=2", "ddp", 2),
    # world 4: the setup of each axis beside dp (issue 32: setup at world 2 and 4 for pp, tp and dp against ddp)
    ("hybrid3d", "ddp", 4),
    ("hybrid3d:tp=2", "ddp", 4),
    ("hybrid3d:pp=2,microbatches=2", "ddp", 4),  # 4 samples over dp=2: 2 per rank
]
COUNT_SPECS = ["ddp", "model_parallel", "hybrid3d", "zero1", "zero2", "zero3"]
COUNT_SPECS += ["model_parallel:tp=2", "hybrid3d:tp=2", "hybrid3d:pp=2", "model_parallel:tp=2@4", "hybrid3d:tp=2@4"]


def _setup_s(rank: dict[str, Any]) -> float:
    """Setup (and teardown): what ``trainer.fit`` took beyond its steps at the steady rate."""
    return rank["fit_s"] - len(rank["step_times"]) * rank["median_step_s"]


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": median(values), "min": min(values), "max": max(values)}


def run_overhead(out: Path, pairs: int, steps: int, launch: Callable[..., list], step_time: Callable) -> list[dict]:
    """Per pair of :data:`PAIRS`: step and setup times of both sides and their ratios over ``pairs`` repeats."""
    rows = []
    for ours, theirs, world in PAIRS:
        runs: dict[str, list[tuple[float, float]]] = {ours: [], theirs: []}
        for _ in range(pairs):
            for spec in (ours, theirs):
                ranks = launch("gpt", TINY, world, spec, out, steps, tag="_overhead")
                runs[spec].append((step_time(ranks), max(_setup_s(r) for r in ranks)))
                print(f"  {spec} w{world}: {runs[spec][-1][0] * 1e3:.1f} ms/step, setup {runs[spec][-1][1]:.2f} s")
        step = [t[0] / o[0] for o, t in zip(runs[ours], runs[theirs])]  # > 1: ours is faster
        setup = [o[1] - t[1] for o, t in zip(runs[ours], runs[theirs])]  # > 0: ours takes longer
        rows.append(
            {
                "ours": ours,
                "baseline": theirs,
                "world": world,
                "pairs": pairs,
                "ours_step_s": _spread([r[0] for r in runs[ours]]),
                "baseline_step_s": _spread([r[0] for r in runs[theirs]]),
                "step_ratio": _spread(step),
                "ours_setup_s": _spread([r[1] for r in runs[ours]]),
                "baseline_setup_s": _spread([r[1] for r in runs[theirs]]),
                "extra_setup_s": _spread(setup),
            }
        )
    return rows


def _range(s: dict[str, float], scale: float = 1.0, fmt: str = ".2f") -> str:
    return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}})"


def overhead_lines(rows: list[dict[str, Any]]) -> list[str]:
    """BENCHMARKS.md's overhead table: medians with min-max over the interleaved pairs."""
    if not rows:
        return []
    lines = [
        "",
        "## Host overhead (negligible compute)",
        "",
        f"GPT of 2 blocks, width 32, 16 tokens, 4 samples a step ({' '.join(TINY)}); each strategy's launch paired "
        f"with its baseline's, {rows[0]['pairs']} pairs interleaved; median (min-max) over the pairs. Step ratio: "
        "the baseline's step time over ours (> 1: ours faster). Setup: `trainer.fit`'s wall minus its steps at the "
        "steady rate.",
        "",
        "| ours | baseline | world | ours ms/step | baseline ms/step | step ratio | ours setup s | baseline setup s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ours']} | {r['baseline']} | {r['world']} | {_range(r['ours_step_s'], 1e3, '.1f')} | "
            f"{_range(r['baseline_step_s'], 1e3, '.1f')} | {_range(r['step_ratio'])} | {_range(r['ours_setup_s'])} | "
            f"{_range(r['baseline_setup_s'])} |"
        )
    return lines


def run_counts(
    out: Path, launch: Callable[..., list], specs: list[str], window: int = 3
) -> dict[str, list[dict[str, Any]]]:
    """Each spec at world 2 (``@4`` appended: at world 4, e.g. dp 2 x tp 2): every rank's per-step counts
    (benchmarks/host_counts.py)."""
    steps = 2 + 3 * window + 3  # warm-up, three windows, the monitor's measured steps
    results = {}
    for spec in specs:
        name, _, world = spec.partition("@")
        ranks = launch("gpt", COUNTED, int(world or 2), name, out, steps, tag="_counts", count=window)
        results[spec] = [r["host_counts"] for r in ranks]
        c = ranks[0]["host_counts"]
        print(f"{spec}: {c['python_calls']:.0f} py calls, {c['torch_ops']:.0f} ops, {c['collectives']}", flush=True)
    return results


def count_lines(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["| strategy | Python calls | of them ours | torch ops | collectives (kind@group size: calls) |"]
    lines.append("|---|---|---|---|---|")
    for spec, ranks in results.items():
        c = ranks[0]
        ours = c["python_calls_by_package"].get("lightning_parallel", 0)
        coll = ", ".join(f"{k}: {v:g}" for k, v in c["collectives_by_group_size"].items()) or "none"
        lines.append(f"| {spec} | {c['python_calls']:.0f} | {ours:.0f} | {c['torch_ops']:.0f} | {coll} |")
    return lines


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import ROOT, launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", action="store_true", help="count host work per step (no timing)")
    parser.add_argument("--specs", nargs="+", default=COUNT_SPECS, help="the strategies counted")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    args = parser.parse_args()
    if args.counts:
        results = run_counts(args.out, launch, args.specs)
        (args.out / "host_counts.json").write_text(json.dumps(results, indent=1))
        print("\n".join(count_lines(results)))


if __name__ == "__main__":
    main()
