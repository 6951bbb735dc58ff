"""``make bench``'s Muon section: ``MuonAdamW`` (Muon on the weight matrices, AdamW on the rest; docs/muon.md)
against AdamW at the same layout, in the same run (``python benchmarks/bench.py --only muon``).

Per layout, AdamW and Muon launches interleave (A, B, A, B, ...). For each: the median step time (their ratio is
the figure to read on a loaded host), the median time of the optimizer step alone (Lightning's
``on_before_optimizer_step`` to the batch end), the bytes each rank sends in one
step (all collectives, parallel/measure/comm_volume.py's convention), the bytes of the optimizer step alone counted
at the dispatcher with every ``all_to_all_single`` counted exactly (benchmarks/muon_bytes.py), the Muon exchange's
bytes by its formula from the optimizer's own owner assignment, and the optimizer state bytes per rank counted from
the optimizer's state tensors after a step. Muon's exchange, counted, is its optimizer step's bytes less AdamW's at
the same layout (ZeRO-1/2 all-gather the parameters after both). Each time is also taken as the main thread's
CPU time (``time.thread_time``), which waits for other ranks and preemption by other processes do not inflate.

Then the GPT recipe (recipes/train_gpt.py) trains 200 steps (its default) with ``optimizer=adamw`` and with
``optimizer=muon`` on the same model, data and layout: the validation loss after each.

The model: the bench GPT with 64-token sequences (the split rule gives Muon its 24 block matrices at any sequence
length; 64 keeps the launches short and the numbers comparable with earlier runs).
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

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model=gpt_bench", "model.seq_len=64"]
BATCH = ["data.global_batch_size=16"]
LAYOUTS = [  # (label, world, spec); ddp and model_parallel: Lightning's DDP and FSDP2 (benchmarks/worker.py)
    ("ddp (Lightning's)", 2, "ddp"),
    ("ZeRO-0 (ours)", 2, "hybrid3d"),
    ("zero1", 2, "zero1"),
    ("zero2", 2, "zero2"),
    ("zero3", 2, "zero3"),
    ("FSDP2 (Lightning's)", 2, "model_parallel"),
    ("tp=2 + SP", 2, "hybrid3d:tp=2,sequence_parallel=true"),
    ("zero1", 4, "zero1"),
    ("zero2", 4, "zero2"),
    ("zero3", 4, "zero3"),
    ("dp2 x tp2 + SP", 4, "hybrid3d:tp=2,sequence_parallel=true"),
    ("dp2 x tp2 ZeRO-3", 4, "hybrid3d:tp=2,zero_stage=3"),
]
KINDS = ("adamw", "muon")
TIMES = ("step", "step_cpu", "opt_step", "opt_step_cpu")  # wall and main-thread CPU: whole step, optimizer step
RECIPE = [*MODEL, "strategy=zero3", "trainer.devices=2", "trainer.max_steps=200"]


def split_counts() -> dict[str, int]:
    """The model's parameters by the split rule: Muon's matrices (count, elements), AdamW's elements."""
    from hydra import compose, initialize_config_dir

    from lightning_parallel.models.gpt import RecipeGPT
    from lightning_parallel.parallel.optim.muon import split_params
    from lightning_parallel.recipes.config import register_configs
    from lightning_parallel.recipes.gpt_model import gpt_config

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_gpt", overrides=MODEL)
    with torch.device("meta"):
        model = RecipeGPT(gpt_config(cfg.model))
    muon, decay, no_decay = split_params(model)
    return {
        "muon_matrices": len(muon),
        "muon_elements": sum(p.numel() for p in muon),
        "adamw_elements": sum(p.numel() for p in decay + no_decay),
    }


def run_muon(out: Any, repeats: int, steps: int, launch: Callable[..., list], step_time: Callable) -> dict[str, Any]:
    split = split_counts()
    print(f"  split: {split}", flush=True)
    if not split["muon_matrices"]:
        raise RuntimeError(f"the benchmark's model gives Muon no matrix ({MODEL}): the section would measure AdamW")
    rows = []
    for label, world, spec in LAYOUTS:
        times: dict[str, dict[str, list[float]]] = {k: {t: [] for t in TIMES} for k in KINDS}
        ranks: dict[str, list[dict[str, Any]]] = {}
        for _ in range(repeats):
            for kind in KINDS:
                got = launch("gpt", [*MODEL, *BATCH, f"optimizer={kind}"], world, spec, out, steps, tag=kind)
                ranks.setdefault(kind, got)  # bytes do not depend on the repeat: the first launch's
                for name, value in _times(got, step_time).items():
                    times[kind][name].append(value)
                wall, cpu = times[kind]["step"][-1], times[kind]["step_cpu"][-1]
                print(f"  {label} w{world} {kind}: {wall * 1e3:.0f} ms/step, {cpu * 1e3:.0f} ms CPU", flush=True)
        row: dict[str, Any] = {"layout": label, "world": world, "strategy": spec}
        for kind in KINDS:
            row[kind] = _figures(ranks[kind], times[kind])
        row["exchange_counted"] = [m - a for m, a in zip(row["muon"]["step_sent"], row["adamw"]["step_sent"])]
        rows.append(row)
        print(f"  {label} w{world}: exchange counted {row['exchange_counted']}, formula {row['muon']['formula']}")
    return {"split": split, "layouts": rows, "losses": run_recipe_losses(Path(out) / "muon_recipe")}


def _times(ranks: list[dict[str, Any]], step_time: Callable) -> dict[str, float]:
    """One launch's step and optimizer-step times, wall and CPU: the slowest rank's medians."""
    return {
        "step": step_time(ranks),
        "step_cpu": max(r["median_step_cpu_s"] for r in ranks),
        "opt_step": max(r["optimizer_step"]["step_wall_s"] for r in ranks),
        "opt_step_cpu": max(r["optimizer_step"]["step_cpu_s"] for r in ranks),
    }


def _figures(ranks: list[dict[str, Any]], times: dict[str, list[float]]) -> dict[str, Any]:
    by_rank = sorted(ranks, key=lambda r: r["rank"])
    return {
        **{f"{name}_s": median(values) for name, values in times.items()},
        "samples": times,  # per launch, by TIMES
        "sent_per_step": [r["comm_sent_bytes_per_step"] or 0.0 for r in by_rank],
        "step_sent": [r["optimizer_step"]["step_sent_bytes"] for r in by_rank],
        "all_to_all": [r["optimizer_step"]["all_to_all_sent_bytes"] for r in by_rank],
        "formula": [r["optimizer_step"]["formula_bytes"] for r in by_rank],
        "reported": [r["optimizer_step"]["reported"].get("sent_bytes", 0) for r in by_rank],
        "state_bytes": [r["model_state_bytes"]["optimizer"] for r in by_rank],
        "optimizer": by_rank[0]["optimizer_step"]["optimizer"],
    }


def recipe_command(kind: str, run_dir: Path) -> list[str]:
    return [sys.executable, "recipes/train_gpt.py", *RECIPE, f"optimizer={kind}", "trainer.logger=none",
            "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]  # fmt: skip


def run_recipe_losses(out: Path) -> list[dict[str, Any]]:
    """The recipe's 200 steps under each optimizer: the validation loss, the learning rates it ran with."""
    from omegaconf import OmegaConf

    rows = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for kind in KINDS:
        run_dir = out / kind
        start = time.perf_counter()
        subprocess.run(recipe_command(kind, run_dir), cwd=ROOT, env=env, check=True, capture_output=True)
        metrics = json.loads((run_dir / "metrics.json").read_text())
        cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
        lr = cfg.optimizer.lr if cfg.optimizer.lr is not None else cfg.model.lr
        rows.append(
            {
                "optimizer": kind,
                "command": " ".join(["python", *recipe_command(kind, Path("RUN"))[1:-1]]),
                "val_loss": metrics["final_val_loss"],
                "train_loss": metrics["final_train_loss"],
                "lr": lr,
                "muon_lr": cfg.optimizer.muon_lr if kind == "muon" else None,
                "ns_dtype": cfg.optimizer.ns_dtype if kind == "muon" else None,
                "optimizer_state_bytes": metrics["model_state_bytes"][0]["optimizer"],
                "seconds": time.perf_counter() - start,
            }
        )
        print(f"  recipe {kind}: val loss {rows[-1]['val_loss']:.4f} ({rows[-1]['seconds']:.0f} s)", flush=True)
    return rows


def _kib(values: list[float]) -> str:
    return " / ".join(f"{v / 1024:.1f}" for v in values)


def _pair(adamw: dict[str, Any], muon: dict[str, Any], key: str, digits: int) -> str:
    return f"{adamw[key] * 1e3:.{digits}f} / {muon[key] * 1e3:.{digits}f}"


def _ratios(muon: list[float], adamw: list[float]) -> str:
    pairs = sorted(m / a for m, a in zip(muon, adamw))
    return f"{median(pairs):.2f}x ({pairs[0]:.2f}-{pairs[-1]:.2f}), {len(pairs)} pairs" if pairs else "-"


def muon_lines(result: dict[str, Any]) -> list[str]:
    split, rows = result["split"], result["layouts"]
    total = split["muon_elements"] + split["adamw_elements"]
    predicted = (4 * split["muon_elements"] + 8 * split["adamw_elements"]) / (8 * total)
    lines = [
        "## Muon against AdamW",
        "",
        f"`optimizer=muon` (`MuonAdamW`, Newton-Schulz in bf16, docs/muon.md) against `optimizer=adamw` at the same "
        f"layout; the bench GPT with 64-token sequences ({total:,} parameters: {split['muon_matrices']} matrices, "
        f"{split['muon_elements']:,} elements, get Muon; the embeddings, head, norms and biases AdamW), global batch "
        "16, gloo. Per rank in rank order (`a / b`), from one launch: the bytes sent per step by all collectives "
        "(ring convention); the Muon exchange counted (the optimizer step's collectives at the dispatcher, each "
        "`all_to_all_single` by its exact splits, less AdamW's optimizer step at the same layout) and by the formula "
        "(docs/muon.md; benchmarks/muon_bytes.py computes it from the matrices' shapes and placements with the "
        "optimizer's own `owners`, balanced by Newton-Schulz cost, and `chunk_sizes`, not from its counters). "
        "Lightning's `ddp` gives the optimizer no replica group, so each rank orthogonalizes every matrix and sends "
        "nothing; our ZeRO-0 (`hybrid3d`, dp=2) orthogonalizes each on one owner and sends the result to the other "
        "rank. The optimizer state "
        f"bytes per rank, counted from the state tensors (Muon keeps one momentum buffer per matrix element, AdamW "
        f"two moments per element: predicted ratio {predicted:.3f} when every rank holds an even share). Step "
        "times were measured on a loaded 2-core machine (other jobs running, load average above 2): read the "
        "ratios of the interleaved pairs (median, min-max), not the milliseconds; the CPU columns (the main "
        "thread's CPU time, which waits and preemption do not inflate) are the steadier figure. Opt. step: "
        "Lightning's `on_before_optimizer_step` to the batch end (slowest rank, median over the timed steps).",
        "",
        "| layout | world | strategy | step ms AdamW / Muon | Muon / AdamW step time | step CPU ms AdamW / Muon | "
        "Muon / AdamW step CPU | opt. step CPU ms AdamW / Muon | sent per step KiB, AdamW | Muon | "
        "Muon exchange KiB counted | formula | state KiB, AdamW | Muon | state ratio |",
        "|---|---:|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, m = r["adamw"], r["muon"]
        state = max(m["state_bytes"]) / max(a["state_bytes"])
        lines.append(
            f"| {r['layout']} | {r['world']} | `{r['strategy']}` | {_pair(a, m, 'step_s', 0)} | "
            f"{_ratios(m['samples']['step'], a['samples']['step'])} | {_pair(a, m, 'step_cpu_s', 0)} | "
            f"{_ratios(m['samples']['step_cpu'], a['samples']['step_cpu'])} | {_pair(a, m, 'opt_step_cpu_s', 1)} | "
            f"{_kib(a['sent_per_step'])} | {_kib(m['sent_per_step'])} | {_kib(r['exchange_counted'])} | "
            f"{_kib(m['formula'])} | {_kib(a['state_bytes'])} | {_kib(m['state_bytes'])} | {state:.3f} |"
        )
    lines += ["", *_loss_lines(result["losses"]), ""]
    return lines


def _loss_lines(losses: list[dict[str, Any]]) -> list[str]:
    lines = [
        "The GPT recipe, 200 steps (global batch 32, 64-token windows of Python's documentation, validation on 8 "
        "batches of the held-out 5%), `strategy=zero3` at world 2, each optimizer at the recipe's default rates:",
        "",
        "| optimizer | command | learning rates | validation loss after 200 steps | train loss | optimizer state KiB "
        "(rank 0) | wall s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for row in losses:
        rates = f"AdamW {row['lr']:g}"
        if row["optimizer"] == "muon":
            rates = f"Muon {row['muon_lr']:g} (Newton-Schulz in {row['ns_dtype']}), AdamW part {row['lr']:g}"
        lines.append(
            f"| {row['optimizer']} | `{row['command']}` | {rates} | {row['val_loss']:.4f} | {row['train_loss']:.4f} | "
            f"{row['optimizer_state_bytes'] / 1024:.1f} | {row['seconds']:.0f} |"
        )
    return lines
