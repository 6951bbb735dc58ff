"""``make bench``'s auto section: does ``strategy=auto`` pick a fast layout? For each model and world size, every
layout the planner finds valid (pp x dp x tp x ep x zero_stage, tp inside the node) is trained for a few steps and
timed; the pick (``planning/auto.py`` for this host) is set against the fastest measured one. The issue's bar: the
pick's median step time within 10% of the fastest.

    python benchmarks/bench.py --only auto                               # 4 models x worlds 2 and 4
    python benchmarks/bench.py --only auto --models gpt_moe_tiny --worlds 2 --auto-repeats 5  # re-measure one row
    python benchmarks/auto_sweep.py --models vgg_tiny --worlds 2 --steps 3  # one model, printed, nothing stored
    python benchmarks/auto_sweep.py --replan   # today's planner's picks against the stored measurements (no runs)

One launch per layout is noisy on a shared host: layouts with the same collectives and bytes (ZeRO-1 and ZeRO-2)
were measured a median 1.12x apart (at most 1.35x) in the stored sweep, so re-measure a row with repeats.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, when run as a script
from lightning_parallel.plan import load_model_config
from lightning_parallel.planning.auto import auto_settings, candidates, choose_layout, detect_machine
from lightning_parallel.recipes.model_kinds import MODEL_KINDS

# model -> (recipe, overrides, global batch): the recipes' own batches, gpt_long's smaller (1024-token windows)
MODELS = {
    "gpt_tiny": ("gpt", [], 32),
    "gpt_moe_tiny": ("gpt", [], 32),
    "gpt_long": ("gpt", [], 8),
    "vgg_tiny": ("vgg", ["data.num_train=2000"], 64),
}
WORLDS = (2, 4)
KEYS = ("pp", "dp", "tp", "ep", "zero_stage")


def layout_spec(layout: dict[str, int], microbatches: int) -> str:
    """benchmarks/worker.py's strategy spec of a layout."""
    spec = "hybrid3d:" + ",".join(f"{k}={layout[k]}" for k in KEYS)
    return spec + (f",microbatches={microbatches}" if layout["pp"] > 1 else "")


def sweep_model(
    name: str, world: int, out: Path, repeats: int, steps: int, launch: Callable[..., list], step_time: Callable
) -> dict[str, Any]:
    """Every valid layout's median step time at ``world``, the pick and its ratio to the fastest."""
    recipe, extra, batch = MODELS[name]
    kind, m = load_model_config(name)
    spec = MODEL_KINDS[kind].plan(m)
    machine = detect_machine(world, world, "cpu")
    choice = choose_layout(spec, machine, batch)
    pick = {k: getattr(choice.estimate, k) for k in KEYS}
    overrides = [f"model={name}", f"data.global_batch_size={batch}", *extra]
    rows = []
    for e in candidates(spec, machine, auto_settings(spec, machine, batch)):
        if not e.feasible:
            continue
        layout = {k: getattr(e, k) for k in KEYS}
        strategy = layout_spec(layout, e.microbatches)
        times = [step_time(launch(recipe, overrides, world, strategy, out, steps, tag=name)) for _ in range(repeats)]
        rows.append({"layout": layout, "step_s": median(times), "predicted_s": e.step_time, "samples": times})
        print(f"  {name} w{world} {strategy}: {rows[-1]['step_s'] * 1e3:.0f} ms", flush=True)
    fastest = min(rows, key=lambda r: r["step_s"])
    picked = next(r for r in rows if r["layout"] == pick)
    ratio = picked["step_s"] / fastest["step_s"]
    print(f"  {name} w{world}: pick {pick} {picked['step_s'] * 1e3:.0f} ms, fastest {fastest['layout']}, {ratio:.2f}x")
    return {"model": name, "world": world, "pick": pick, "fastest": fastest["layout"], "ratio": ratio, "rows": rows}


def run_auto(
    out: Path,
    repeats: int,
    steps: int,
    launch: Callable[..., list],
    step_time: Callable,
    models: list[str] | None = None,
    worlds: tuple[int, ...] = WORLDS,
) -> list[dict[str, Any]]:
    return [
        sweep_model(name, world, out, repeats, steps, launch, step_time)
        for name in models or list(MODELS)
        for world in worlds
    ]


def merge_auto(stored: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``stored`` with each (model, world) of ``new`` replaced by it (new ones appended): a re-measured row keeps
    the others."""
    fresh = {(r["model"], r["world"]): r for r in new}
    kept = [fresh.pop((r["model"], r["world"]), r) for r in stored]
    return kept + list(fresh.values())


def replan(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stored sweep with each pick and ratio as the current planner makes them on this host (no runs: the
    measured step times are the stored ones)."""
    out = []
    for r in results:
        kind, m = load_model_config(r["model"])
        spec = MODEL_KINDS[kind].plan(m)
        estimate = choose_layout(spec, detect_machine(r["world"], r["world"], "cpu"), MODELS[r["model"]][2]).estimate
        pick = {k: int(getattr(estimate, k)) for k in KEYS}
        times = {json.dumps(row["layout"]): row["step_s"] for row in r["rows"]}
        out.append({**r, "pick": pick, "ratio": times[json.dumps(pick)] / min(times.values())})
    return out


def auto_lines(results: list[dict[str, Any]]) -> list[str]:
    """BENCHMARKS.md's section: per model and world, the pick against the fastest measured layout."""
    lines = [
        "## strategy=auto against a sweep of every valid layout",
        "",
        "Median step time of each layout the planner finds valid; the pick is planning/auto.py's for this host. "
        "Ratio = the pick's step time / the fastest's (the bar: at most 1.10).",
        "",
        "| model | world | pick (pp, dp, tp, ep, zero) | fastest | pick ms | fastest ms | ratio | layouts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        times = {json.dumps(row["layout"]): row["step_s"] for row in r["rows"]}
        lines.append(
            f"| {r['model']} | {r['world']} | {fmt(r['pick'])} | {fmt(r['fastest'])} | "
            f"{times[json.dumps(r['pick'])] * 1e3:.0f} | {times[json.dumps(r['fastest'])] * 1e3:.0f} | "
            f"{r['ratio']:.2f} | {len(r['rows'])} |"
        )
    return [*lines, ""]


def fmt(layout: dict[str, int]) -> str:
    return "(" + ", ".join(str(layout[k]) for k in KEYS) + ")"


def main() -> None:
    import bench

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="steps per launch: 2 warm-up, then timed")
    parser.add_argument("--out", type=Path, default=bench.ROOT / "runs" / "bench")
    parser.add_argument("--replan", action="store_true", help="the stored sweep's rows picked by today's planner")
    args = parser.parse_args()
    if args.replan:
        stored = [r for r in json.loads(bench.RESULTS.read_text())["auto"] if r["model"] in args.models]
        results = replan([r for r in stored if r["world"] in args.worlds])
    else:
        results = run_auto(args.out, args.repeats, args.steps, bench.launch, bench.step_time, args.models, args.worlds)
    print("\n".join(auto_lines(results)))


if __name__ == "__main__":
    main()
