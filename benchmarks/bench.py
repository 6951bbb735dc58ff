"""``make bench``: throughput, model-state memory, communication volume and pipeline bubble of our
strategies against Lightning's own, in one run, on the GPT and VGG recipes; writes BENCHMARKS.md and
benchmarks/results.json.

    python benchmarks/bench.py                 # the whole suite (9 minutes on 2 CPU cores at 3 repeats; 5 now)
    python benchmarks/bench.py --repeats 1     # one pass: quicker, noisier
    python benchmarks/bench.py --only moe      # one section, merged into the last results.json (and report)
    python benchmarks/bench.py --only overhead --pairs 5  # host cost: step and setup time against ddp and FSDP2
    python benchmarks/bench.py --only speed    # overlap, gradient compression, compile (about 4 minutes)
    python benchmarks/bench.py --only hsdp     # HSDP's bytes across nodes against plain ZeRO-3's (bytes, no timing)
    python benchmarks/bench.py --only context  # cp=2 ring and Ulysses on the 1024-token GPT: bytes vs theory, time
    python benchmarks/bench.py --only async    # parameter servers, one slowed worker: sync vs stale vs async
    python benchmarks/bench.py --only spatial  # VGG on 128 x 128 images: spatial=2 vs channel tp=2 vs dp=2
    python benchmarks/bench.py --only lora     # HF Llama, LoRA vs full fine-tuning at zero2, zero3, tp=2
    python benchmarks/bench.py --only muon     # Muon vs AdamW at 12 layouts (world 2, 4); the recipe's loss, 200 steps
    python benchmarks/bench.py --only host_syncs  # host syncs per step, ours beside ddp and FSDP2 (counts, 23 launches)
    python benchmarks/bench.py --only auto     # strategy=auto's pick against every valid layout, 4 models x 2 worlds
    python benchmarks/bench.py --only auto --models gpt_moe_tiny --worlds 2 --auto-repeats 5  # one row, merged

Throughput pairs run interleaved (A, B, A, B, ...) so drifting machine load hits both alike; each figure is
the median step time over the timed steps of a launch (the first two steps are warm-up, four where layers are
compiled: benchmarks/speed.py), then the median over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_ps import run_async  # noqa: E402
from auto_sweep import MODELS as AUTO_MODELS  # noqa: E402
from auto_sweep import WORLDS as AUTO_WORLDS  # noqa: E402
from auto_sweep import merge_auto, run_auto  # noqa: E402
from context import run_context  # noqa: E402
from harness import run_distributed  # noqa: E402
from host_syncs import run_host_syncs  # noqa: E402
from hsdp import run_hsdp  # noqa: E402
from lora import run_lora  # noqa: E402
from moe import run_moe  # noqa: E402
from muon import run_muon  # noqa: E402
from overhead import run_overhead  # noqa: E402
from pipeline_split import run_pipeline_split  # noqa: E402
from report import write_report  # noqa: E402
from spatial import run_spatial  # noqa: E402
from speed import run_speed  # noqa: E402

from lightning_parallel.parallel.measure.timeline import (  # noqa: E402
    bubble_breakdown,
    replayed_bubble,
    timelines_from_trace,
)

WORKER = Path(__file__).resolve().parent / "worker.py"
RESULTS = Path(__file__).resolve().parent / "results.json"
GPT = ["model=gpt_bench", "data.global_batch_size=16"]
VGG = ["model=vgg_tiny", "model.width=32", "data.global_batch_size=32", "data.num_train=2000"]
DEEP_GPT = [*GPT, "model.n_layer=6"]  # 8 pipeline layers: 2 virtual stages on each of 4 pp ranks

# (section, recipe, overrides, world, ours, Lightning's): the comparisons the issue asks for
THROUGHPUT = [
    ("dp only vs ddp", "gpt", GPT, 2, "hybrid3d", "ddp"),
    ("zero2 vs FSDP2", "gpt", GPT, 2, "zero2", "model_parallel"),
    ("zero3 vs FSDP2", "gpt", GPT, 2, "zero3", "model_parallel"),
    ("dp2 x tp2 vs ModelParallel", "gpt", GPT, 4, "hybrid3d:tp=2,zero_stage=3", "model_parallel:tp=2"),
    ("dp only vs ddp", "vgg", VGG, 2, "hybrid3d", "ddp"),
    ("zero3 vs FSDP2", "vgg", VGG, 2, "zero3", "model_parallel"),
]
# model-state bytes and bytes communicated per step (one launch each, world 2)
MEMORY = [("gpt", GPT, 2, spec) for spec in ("ddp", "hybrid3d", "zero1", "zero2", "zero3", "model_parallel")]
COMM = [("gpt", GPT, 2, spec) for spec in ("hybrid3d:tp=2", "hybrid3d:pp=2,pp_schedule=gpipe,microbatches=4")]
# (world, pp, schedule, microbatches, virtual stages per rank, pp_balance, global batch): measured idle fraction
# against the formula; ZB-V also with the split that balances ranks (its rank 0 runs both light ends of the GPT):
# by parameter count, which needs no timing on a busy host. The schedule's own work and the send/recv round trips
# cost a fixed time per microbatch, so two rows run 4x larger microbatches (8 samples): the same schedule with
# compute per box closer to what a GPU step has against its overheads
BUBBLE = [
    (2, 2, "gpipe", 4, 1, "uniform", 16),
    (2, 2, "1f1b", 4, 1, "uniform", 16),
    (2, 2, "1f1b", 8, 1, "uniform", 16),
    (2, 2, "1f1b", 8, 1, "uniform", 64),
    (2, 2, "interleaved_1f1b", 4, 2, "uniform", 16),
    (2, 2, "zero_bubble", 4, 2, "uniform", 16),
    (2, 2, "zero_bubble", 8, 2, "uniform", 16),
    (2, 2, "zero_bubble", 8, 2, "params", 16),
    (2, 2, "zero_bubble", 8, 2, "params", 64),
    (4, 4, "1f1b", 8, 1, "uniform", 16),
    (4, 4, "interleaved_1f1b", 8, 2, "uniform", 16),
]


def _tag(recipe: str, spec: str, world: int) -> str:
    return f"{recipe}_{spec.replace(':', '_').replace(',', '_').replace('=', '')}_w{world}"


def launch(
    recipe: str,
    overrides: list[str],
    world: int,
    spec: str,
    out: Path,
    steps: int,
    timeline: bool = False,
    warmup: int = 2,
    tag: str = "",
    count: int = 0,
    syncs: int = 0,
) -> list[dict[str, Any]]:
    args = ["--recipe", recipe, "--overrides", json.dumps(overrides), "--strategy", spec, "--steps", str(steps)]
    args += ["--warmup", str(warmup), "--count", str(count), "--syncs", str(syncs)]
    return run_distributed(
        str(WORKER), world, args + ["--timeline"] * timeline, out / (_tag(recipe, spec, world) + tag), timeout=600
    )


def step_time(ranks: list[dict[str, Any]]) -> float:
    """The slowest rank's median step: a step ends when every rank is done."""
    return max(r["median_step_s"] for r in ranks)


def run_throughput(out: Path, repeats: int, steps: int) -> list[dict[str, Any]]:
    rows = []
    for section, recipe, overrides, world, ours, theirs in THROUGHPUT:
        times: dict[str, list[float]] = {ours: [], theirs: []}
        phases: dict[str, list[dict[str, float]]] = {ours: [], theirs: []}  # rank 0's, per launch
        for _ in range(repeats):
            for spec in (ours, theirs):
                ranks = launch(recipe, overrides, world, spec, out, steps)
                times[spec].append(step_time(ranks))
                phases[spec].append(ranks[0].get("phases_s") or {})
                print(f"  {recipe} {spec} w{world}: {times[spec][-1] * 1e3:.0f} ms/step", flush=True)
        ours_s, theirs_s = median(times[ours]), median(times[theirs])
        rows.append(
            {
                "comparison": section,
                "recipe": recipe,
                "world": world,
                "ours": ours,
                "lightning": theirs,
                "ours_step_s": ours_s,
                "lightning_step_s": theirs_s,
                "ratio": theirs_s / ours_s,  # > 1: ours is faster
                "samples": {k: v for k, v in times.items()},
                # where the step goes (rank 0, median over the launches): forward, backward, reduce, step
                "phases_s": {
                    side: {k: median(p[k] for p in phases[spec] if k in p) for k in phases[spec][0]}
                    for side, spec in (("ours", ours), ("lightning", theirs))
                    if phases[spec] and phases[spec][0]
                },
            }
        )
    return rows


def run_memory_and_comm(out: Path) -> list[dict[str, Any]]:
    rows = []
    for recipe, overrides, world, spec in MEMORY + COMM:
        ranks = launch(recipe, overrides, world, spec, out, steps=5)
        rows.append({"recipe": recipe, "world": world, "strategy": spec, "overrides": overrides, "ranks": ranks})
    return rows


def _bubble_parts(path: Path) -> dict[str, dict[int, float]]:
    """From a recorded timeline: the bubble replayed on CPU times (with and without the schedule's own work
    between boxes), compute wall over CPU time, and the CPU milliseconds spent between boxes, per pp rank."""
    timelines = timelines_from_trace(json.loads(path.read_text()))
    parts = bubble_breakdown(timelines)
    return {
        "replayed": replayed_bubble(timelines),
        "replayed_shape": replayed_bubble(timelines, overhead=False),
        "wall_over_cpu": {r: p["compute"] / max(p["compute_cpu"], 1e-9) for r, p in parts.items()},
        "between_cpu_ms": {r: p["between_cpu"] * 1e3 for r, p in parts.items()},
        "wait_ms": {r: p["wait"] * 1e3 for r, p in parts.items()},
        "compute_ms": {r: p["compute"] * 1e3 for r, p in parts.items()},  # the stage's boxes: its balance
    }


def run_bubble(out: Path, steps: int, repeats: int) -> list[dict[str, Any]]:
    """One recorded step per launch; per pp rank the median idle fraction over ``repeats`` launches."""
    rows = []
    for world, pp, schedule, microbatches, virtual, balance, batch in BUBBLE:
        spec = f"hybrid3d:pp={pp},pp_schedule={schedule},microbatches={microbatches}"
        if schedule == "interleaved_1f1b":
            spec += f",pp_virtual_stages={virtual}"
        if balance != "uniform":
            spec += f",pp_balance={balance}"
        idle: dict[int, list[float]] = {}
        parts: dict[str, dict[int, list[float]]] = {}
        times = []
        timeline = out / (_tag("gpt", spec, world) + f"b{batch}") / "timeline"
        for _ in range(repeats):
            overrides = [*DEEP_GPT, f"data.global_batch_size={batch}"]
            ranks = launch("gpt", overrides, world, spec, out, steps, timeline=True, tag=f"b{batch}")
            for rank, value in ranks[0]["pipeline_bubble"].items():  # rank 0 gathers every pp rank's timeline
                idle.setdefault(int(rank), []).append(value)
            for key, values in _bubble_parts(timeline / "timeline.json").items():
                for rank, value in values.items():
                    parts.setdefault(key, {}).setdefault(rank, []).append(value)
            times.append(step_time(ranks))
        measured = {rank: median(values) for rank, values in sorted(idle.items())}
        rows.append(
            {
                "world": world,
                "pp": pp,
                "schedule": schedule,
                "microbatches": microbatches,
                "virtual": virtual,
                "balance": balance,
                "global_batch": batch,
                "measured": measured,
                "samples": idle,
                **{key: {r: median(v) for r, v in sorted(by_rank.items())} for key, by_rank in parts.items()},
                "step_s": median(times),
                "timeline": str(timeline / "timeline.png"),
            }
        )
        label = f"pp={pp} {schedule} m={microbatches} {balance} batch {batch}"
        print(f"  {label}: idle {measured}, replayed {rows[-1]['replayed']}")
    return rows


def describe_machine() -> str:
    import lightning

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return (
        f"{cpu}, {os.cpu_count()} CPU cores, no GPU, gloo, one thread per rank; torch {torch.__version__}, "
        f"lightning {lightning.__version__}"
    )


def run_sections(args: argparse.Namespace) -> dict[str, Any]:
    """Each section's figures by its results.json key, the sections of ``--only`` (default: all) in order."""
    sections = {
        "throughput": ("throughput", lambda: run_throughput(args.out, args.repeats, args.steps)),
        "memory": ("memory and communication", lambda: run_memory_and_comm(args.out)),
        "bubble": ("pipeline bubble", lambda: run_bubble(args.out, args.steps, args.repeats)),
        "pipeline_split": ("profile-guided pipeline split", run_pipeline_split),
        "overhead": (
            "host overhead (negligible compute)",
            lambda: run_overhead(args.out, max(5, args.pairs), args.steps, launch, step_time),
        ),
        "moe": ("mixture-of-experts", lambda: run_moe(args.out, args.repeats, args.steps, launch, step_time)),
        "speed": ("speed settings", lambda: run_speed(args.out, args.repeats, args.steps, GPT, launch, step_time)),
        "hsdp": ("HSDP bytes across nodes", lambda: run_hsdp(args.out, GPT, launch)),
        "context": ("context parallelism", lambda: run_context(args.out, args.repeats, args.steps, launch, step_time)),
        "spatial": ("spatial parallelism", lambda: run_spatial(args.out, args.repeats, args.steps, launch, step_time)),
        "async": ("parameter servers, one slowed worker", lambda: run_async(args.out, run_distributed)),
        "lora": (
            "LoRA against full fine-tuning",
            lambda: run_lora(args.out, args.repeats, args.steps, launch, step_time),
        ),
        "muon": ("Muon against AdamW", lambda: run_muon(args.out, args.repeats, args.steps, launch, step_time)),
        "auto": ("strategy=auto against every layout", lambda: run_auto_section(args)),
        "host_syncs": ("host syncs per step", lambda: run_host_syncs(args.out, launch)),
    }
    results = {}
    for key, (title, run) in sections.items():
        if not args.only or key in args.only:
            print(title, flush=True)
            results[key] = run()
    return results


def run_auto_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The auto sweep of ``--models`` x ``--worlds`` (default: all), merged into the stored one."""
    worlds = tuple(args.worlds or AUTO_WORLDS)
    new = run_auto(args.out, args.auto_repeats, args.steps, launch, step_time, args.models, worlds)
    stored = json.loads(RESULTS.read_text()).get("auto", []) if RESULTS.exists() else []
    return merge_auto(stored, new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="launches per configuration (interleaved pairs: 5+)")
    parser.add_argument("--steps", type=int, default=10, help="steps per launch: 2 warm-up, then timed, 2 measured")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs of the overhead section (at least 5)")
    parser.add_argument("--models", nargs="+", choices=list(AUTO_MODELS), help="auto: these models only (merged)")
    parser.add_argument("--worlds", nargs="+", type=int, choices=[2, 4], help="auto: these world sizes only (merged)")
    parser.add_argument("--auto-repeats", type=int, default=1, help="auto: launches per layout (the median is kept)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--report", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[
            "throughput",
            "overhead",
            "memory",
            "bubble",
            "pipeline_split",
            "moe",
            "speed",
            "hsdp",
            "context",
            "spatial",
            "async",
            "lora",
            "muon",
            "auto",
            "host_syncs",
        ],
        help="run these sections alone; the others' figures are kept from the last results.json",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    if args.only:
        results = json.loads(RESULTS.read_text())
        results.update(run_sections(args))
        earlier = results.get("rerun", {}).get("sections", [])  # sections rerun since the last full run
        machines = results.get("rerun", {}).get("machines", [])  # where the reruns ran, when not where the full run did
        machines = sorted({*machines, describe_machine()})
        results["rerun"] = {
            "sections": sorted({*earlier, *args.only}),
            "seconds": time.perf_counter() - start,
            "machines": machines,
        }
    else:
        results = {"machine": describe_machine(), **run_sections(args)}
        results["wall_seconds"] = time.perf_counter() - start
    RESULTS.write_text(json.dumps(results, indent=1))
    write_report(results, args.report)
    print(f"wrote {args.report} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
