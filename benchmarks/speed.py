"""``make bench``'s speed-settings section: overlapped gradient reduction, gradient compression and compiled layers,
each measured against its baseline in the same run, on the GPT bench model at world 2.

- Overlap: hybrid3d dp=2 (ZeRO 0), zero1 and zero2, ``overlap_grad_reduce`` off, on (default 25 MB buckets: the bench
  model's 3.2 MiB of gradients make one bucket) and on with 1 MB buckets; launches interleaved per strategy.
- Compression: hybrid3d dp=2 with ``grad_compression`` none, bf16, fp16, powersgd (default ``powersgd_rank``),
  interleaved: the all_reduce payload of the
  counted step and the step time; then one 200-step GPT recipe run each (``model=gpt_tiny``, default data) for the
  final train and validation loss.
- Compile: hybrid3d dp=2 with ``compile`` false and true, and Lightning's ``ddp`` eager and with the same layers
  compiled (benchmarks/worker.py's ``ddp:compile=true``), the four interleaved. Compiled and eager launches alike
  leave out the first ``COMPILE_WARMUP`` steps (compilation is the first step; the next ones settle), and run
  ``COMPILE_WARMUP - 2`` steps more, so the same number of steps is timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
OVERLAP = ("hybrid3d", "zero1", "zero2")
OVERLAP_SETTINGS = {
    "off": "",
    "on": "overlap_grad_reduce=true",
    "on, 1 MB buckets": "overlap_grad_reduce=true,bucket_mb=1",
}
COMPRESSION = ("none", "bf16", "fp16", "powersgd")
COMPILE = ("hybrid3d", "hybrid3d:compile=true", "ddp", "ddp:compile=true")
COMPILE_WARMUP = 4
RECIPE = ["model=gpt_tiny", "strategy=hybrid3d", f"trainer.devices={WORLD}", "trainer.max_steps=200"]


def _spec(base: str, setting: str) -> str:
    return f"{base}:{setting}" if setting else base


def _compression_spec(kind: str) -> str:
    return _spec("hybrid3d", "" if kind == "none" else f"grad_compression={kind}")


def _slowest_warmup_step(ranks: list[dict[str, Any]]) -> float:
    """Where compiled layers compile: the slowest warm-up step of any rank (the first batches run eagerly while
    the activation monitor measures them: compile_layers in lightning_parallel/parallel/parallelize.py)."""
    return max(max(r["step_times"][: r.get("warmup", 2)]) for r in ranks)


def _summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What the tables need from a launch's ranks."""
    return {
        "overlap": ranks[0]["overlap"],
        "comm_bytes_per_step": [r["comm_bytes_per_step"] for r in ranks],
        "num_params": ranks[0]["num_params"],
        "first_step_s": _slowest_warmup_step(ranks),
        "timed_steps": len(ranks[0]["step_times"]) - ranks[0].get("warmup", 2) - 2,
    }


def _interleaved(
    specs: list[str], repeats: int, run: Callable[[str], list[dict[str, Any]]], step_time: Callable
) -> dict[str, dict[str, Any]]:
    """Per spec: median step time over ``repeats`` launches run A, B, C, A, B, C, ..., and the launches' details."""
    times: dict[str, list[float]] = {s: [] for s in specs}
    first: dict[str, list[float]] = {s: [] for s in specs}
    launches: dict[str, dict[str, Any]] = {}
    for _ in range(repeats):
        for spec in specs:
            ranks = run(spec)
            launches.setdefault(spec, _summary(ranks))  # bytes and buckets do not depend on the repeat
            times[spec].append(step_time(ranks))
            first[spec].append(_slowest_warmup_step(ranks))
            print(f"  gpt {spec} w{WORLD}: {times[spec][-1] * 1e3:.0f} ms/step", flush=True)
    return {
        s: {**launches[s], "step_s": median(times[s]), "samples": times[s], "first_step_samples": first[s]}
        for s in specs
    }


def run_recipe(out: Path, compression: str) -> dict[str, Any]:
    """One GPT recipe run (``python recipes/train_gpt.py``) with ``strategy.grad_compression=compression``; one
    thread per rank, as the bench launches (the recipe leaves torch's default, which oversubscribes 2 cores)."""
    run_dir = out / f"speed_recipe_{compression}"
    (run_dir / "metrics.json").unlink(missing_ok=True)
    overrides = [f"strategy.grad_compression={compression}", "trainer.enable_progress_bar=false", "trainer.logger=none"]
    cmd = [sys.executable, str(ROOT / "recipes" / "train_gpt.py"), *RECIPE, *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    done = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    m = json.loads((run_dir / "metrics.json").read_text())
    print(f"  recipe {compression}: train {m['final_train_loss']:.4f}, val {m['final_val_loss']:.4f}", flush=True)
    return {
        "compression": compression,
        "final_train_loss": m["final_train_loss"],
        "final_val_loss": m["final_val_loss"],
        "steps": m["steps"],
        "comm_bytes_per_step": m["comm_bytes_per_step"],
        "train_seconds": m["wall_seconds"],
        "run_seconds": time.perf_counter() - start,
    }


def run_speed(
    out: Path, repeats: int, steps: int, gpt: list[str], launch: Callable[..., list], step_time: Callable
) -> dict[str, Any]:
    start = time.perf_counter()

    def plain(spec: str) -> list[dict[str, Any]]:
        return launch("gpt", gpt, WORLD, spec, out, steps)

    def compiled(spec: str) -> list[dict[str, Any]]:
        return launch("gpt", gpt, WORLD, spec, out, steps + COMPILE_WARMUP - 2, warmup=COMPILE_WARMUP)

    overlap = {
        base: _interleaved([_spec(base, s) for s in OVERLAP_SETTINGS.values()], repeats, plain, step_time)
        for base in OVERLAP
    }
    compression = _interleaved([_compression_spec(c) for c in COMPRESSION], repeats, plain, step_time)
    compile_ = _interleaved(list(COMPILE), repeats, compiled, step_time)
    recipes = [run_recipe(out, c) for c in COMPRESSION]
    return {
        "world": WORLD,
        "overlap": overlap,
        "compression": compression,
        "compile": compile_,
        "compile_warmup": COMPILE_WARMUP,
        "recipe": recipes,
        "recipe_overrides": RECIPE,
        "seconds": time.perf_counter() - start,
    }


# ----- report -----


def _all_reduce(comm: dict[str, Any] | None) -> dict[str, float]:
    return (comm or {}).get("all_reduce", {"calls": 0, "payload_bytes": 0})


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}"


def overlap_lines(results: dict[str, Any]) -> list[str]:
    lines = [
        "| strategy | overlap_grad_reduce | buckets (launched during backward) | ms/step | speed ratio vs off |",
        "|---|---|---:|---:|---:|",
    ]
    for base, runs in results["overlap"].items():
        off = runs[base]["step_s"]
        for label, setting in OVERLAP_SETTINGS.items():
            r = runs[_spec(base, setting)]
            stats = r["overlap"]
            buckets = f"{stats['buckets']} ({stats['launched_in_backward']})" if stats else "-"
            ratio = "" if not setting else f"**{off / r['step_s']:.2f}x**"
            lines.append(f"| `{base}` | {label} | {buckets} | {_ms(r['step_s'])} | {ratio} |")
    return lines


def compression_lines(results: dict[str, Any]) -> list[str]:
    runs = results["compression"]
    base = runs[_compression_spec("none")]
    params = base["num_params"]
    lines = [
        "| grad_compression | all_reduce payload KiB/step per rank (calls) | gradient bytes: 4P or 2P, KiB | "
        "payload / none | ms/step | speed ratio vs none |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base_bytes = max(_all_reduce(c)["payload_bytes"] for c in base["comm_bytes_per_step"])
    for kind in COMPRESSION:
        r = runs[_compression_spec(kind)]
        ar = max((_all_reduce(c) for c in r["comm_bytes_per_step"]), key=lambda x: x["payload_bytes"])
        width = {"none": 4, "bf16": 2, "fp16": 2}
        grads = f"{params * width[kind] / 1024:.1f}" if kind in width else "P + Q + rest"
        ratio = "" if kind == "none" else f"**{base['step_s'] / r['step_s']:.2f}x**"
        lines.append(
            f"| {kind} | {ar['payload_bytes'] / 1024:.1f} ({ar['calls']}) | {grads} | "
            f"{ar['payload_bytes'] / base_bytes:.3f} | {_ms(r['step_s'])} | {ratio} |"
        )
    return lines


def recipe_lines(results: dict[str, Any]) -> list[str]:
    rows = {r["compression"]: r for r in results["recipe"]}
    none = rows["none"]
    lines = [
        "| grad_compression | steps | all_reduce payload KiB/step per rank | final train loss | vs none | "
        "final val loss | vs none | run s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in COMPRESSION:
        r = rows[kind]
        payload = max(_all_reduce(c)["payload_bytes"] for c in r["comm_bytes_per_step"])
        dt, dv = (r[k] - none[k] for k in ("final_train_loss", "final_val_loss"))
        lines.append(
            f"| {kind} | {r['steps']} | {payload / 1024:.1f} | {r['final_train_loss']:.4f} | {dt:+.4f} | "
            f"{r['final_val_loss']:.4f} | {dv:+.4f} | {r['run_seconds']:.0f} |"
        )
    return lines


def compile_lines(results: dict[str, Any]) -> list[str]:
    runs = results["compile"]
    s = {spec: runs[spec]["step_s"] for spec in COMPILE}
    lines = [
        "| strategy | compile | ms/step | slowest warm-up step s (each launch) |",
        "|---|---|---:|---|",
    ]
    for spec in COMPILE:
        name, _, setting = spec.partition(":")
        firsts = ", ".join(f"{x:.1f}" for x in runs[spec]["first_step_samples"])
        lines.append(f"| `{name}` | {'yes' if setting else 'no'} | {_ms(s[spec])} | {firsts} |")
    pairs = [
        ("hybrid3d compiled vs hybrid3d eager", "hybrid3d", "hybrid3d:compile=true"),
        ("ddp compiled vs ddp eager", "ddp", "ddp:compile=true"),
        ("hybrid3d compiled vs ddp compiled", "ddp:compile=true", "hybrid3d:compile=true"),
        ("hybrid3d eager vs ddp eager", "ddp", "hybrid3d"),
    ]
    lines += ["", "| comparison | speed ratio |", "|---|---:|"]
    lines += [f"| {label} | **{s[base] / s[other]:.2f}x** |" for label, base, other in pairs]
    return lines


def speed_lines(results: dict[str, Any]) -> list[str]:
    world = results["world"]
    recipe = " ".join(f"`{o}`" for o in results["recipe_overrides"])
    return [
        "## Speed settings: overlapped reduction, gradient compression, compiled layers",
        "",
        f"GPT bench model, world {world} (dp={world}), fp32; each group's launches interleaved, medians of the "
        "per-launch median step times (the slowest rank's). Speed ratio = the baseline's step time / the "
        f"setting's (above 1: the setting is faster). This section took {results['seconds']:.0f} s.",
        "",
        "**Overlapped gradient reduction** (`overlap_grad_reduce=true`; default `bucket_mb=25`, and 1 MB buckets). "
        "Buckets: the reduction's buckets, and how many of them the counted step launched during backward.",
        "",
        *overlap_lines(results),
        "",
        "**Gradient compression** under `hybrid3d` dp=2: all_reduce payload of the counted step (the gradient "
        "buffer, and 4-byte all-reduces of the logged loss and the norm), against the gradient bytes 4P (fp32) or 2P "
        f"(16 bits), P = {results['compression']['hybrid3d']['num_params']:,}; powersgd sends each matrix's rank-r "
        "factors P and Q (fp32) and the biases, norms and embeddings whole, in three all-reduces.",
        "",
        *compression_lines(results),
        "",
        f"Final losses of one GPT recipe run each ({recipe}, default data; `python recipes/train_gpt.py`, one "
        "thread per rank): the last logged train loss (a 2-rank mean of one batch) and the validation loss after "
        "the last step (8 batches). Run s: the whole recipe launch, start-up included.",
        "",
        *recipe_lines(results),
        "",
        f"**Compiled layers** (`compile=true`: each pipeline layer's forward through `torch.compile`); Lightning's "
        "`ddp` compiled the same way (the same layers, compiled in `configure_model`, benchmarks/worker.py). Every "
        f"launch of this group leaves out its first {results['compile_warmup']} steps, so the compilation (the "
        "slowest of them, listed: the third step, since the first two run eagerly while the activation monitor "
        "measures them) is not in the step time; torch's compile cache, kept between launches on one machine, "
        "shortens the compilations after the first.",
        "",
        *compile_lines(results),
        "",
    ]
