"""At the end of a Hydra multirun: one table of its jobs, from each job's metrics.json (CSV and Markdown),
and a plot of throughput and peak memory per layout (PNG)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

COLUMNS = [
    "job",
    "world_size",
    "dp",
    "pp",
    "tp",
    "zero_stage",
    "precision",
    "trainable_params",  # with peft=lora: the adapters' (frozen_params: the base's)
    "frozen_params",
    "steps",
    "final_train_loss",
    "final_val_loss",
    "throughput",
    "max_peak_memory_bytes",
    "wall_seconds",
]


def summarize(sweep_dir: Path) -> list[dict[str, Any]]:
    """Write ``summary.csv``, ``summary.md`` and ``summary.png`` into ``sweep_dir``; returns the rows (jobs
    without metrics are listed with their overrides and empty figures: they failed)."""
    rows = []
    for job_dir in sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    ):
        row: dict[str, Any] = {"job": _overrides(job_dir) or job_dir.name}
        metrics_file = job_dir / "metrics.json"
        if metrics_file.is_file():
            m = json.loads(metrics_file.read_text())
            row |= {k: m["layout"][k] for k in ("world_size", "dp", "pp", "tp", "zero_stage", "precision")}
            row |= {k: m.get(k) for k in ("trainable_params", "frozen_params", "steps", "final_train_loss")}
            row |= {k: m.get(k) for k in ("final_val_loss", "throughput", "wall_seconds")}
            row["max_peak_memory_bytes"] = max(m["peak_memory_bytes"])
            row["throughput_unit"] = m.get("throughput_unit", "")
        rows.append(row)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |" for row in rows]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    plot(rows, sweep_dir / "summary.png")
    return rows


def layout_label(row: dict[str, Any]) -> str:
    """``dp2 pp2 tp1 z1 bf16-mixed``: what tells two jobs of a sweep apart."""
    if row.get("world_size") is None:
        return f"{row['job']} (failed)"
    return f"dp{row['dp']} pp{row['pp']} tp{row['tp']} z{row['zero_stage']} {row['precision']}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of throughput and of the largest per-rank peak memory, one pair per job."""
    import matplotlib

    matplotlib.use("Agg")  # files only: sweeps run on machines without a display
    import matplotlib.pyplot as plt

    labels = [layout_label(r) for r in rows]
    throughput = [r.get("throughput") or 0.0 for r in rows]
    memory_gib = [(r.get("max_peak_memory_bytes") or 0) / 2**30 for r in rows]
    unit = next((r["throughput_unit"] for r in rows if r.get("throughput_unit")), "items/s")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.9 * len(rows) + 2), 6.5), sharex=True)
    top.bar(labels, throughput, color="tab:blue")
    top.set_ylabel(f"throughput ({unit})")
    bottom.bar(labels, memory_gib, color="tab:orange")
    bottom.set_ylabel("peak memory per rank (GiB, max)")
    bottom.tick_params(axis="x", labelrotation=30)
    for label in bottom.get_xticklabels():
        label.set_horizontalalignment("right")
    top.set_title(f"{path.parent.name}: {len(rows)} jobs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _overrides(job_dir: Path) -> str:
    hydra_overrides = job_dir / ".hydra" / "overrides.yaml"
    if not hydra_overrides.is_file():
        return ""
    from omegaconf import OmegaConf

    return " ".join(OmegaConf.load(hydra_overrides))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class SweepSummary(Callback):
    """Hydra callback: summarize the sweep when the multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = summarize(sweep_dir)
        print(f"Sweep summary of {len(rows)} jobs: {sweep_dir / 'summary.md'} (plot: summary.png)")
        print((sweep_dir / "summary.md").read_text())
