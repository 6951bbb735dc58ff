"""At the end of a Hydra multirun: one table of its jobs, from each job's metrics.json (CSV and Markdown)."""

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
    "steps",
    "final_train_loss",
    "final_val_loss",
    "throughput",
    "max_peak_memory_bytes",
    "wall_seconds",
]


def summarize(sweep_dir: Path) -> list[dict[str, Any]]:
    """Write ``summary.csv`` and ``summary.md`` into ``sweep_dir``; returns the rows (jobs without metrics
    are listed with their overrides and empty figures: they failed)."""
    rows = []
    for job_dir in sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    ):
        row: dict[str, Any] = {"job": _overrides(job_dir) or job_dir.name}
        metrics_file = job_dir / "metrics.json"
        if metrics_file.is_file():
            m = json.loads(metrics_file.read_text())
            row |= {k: m["layout"][k] for k in ("world_size", "dp", "pp", "tp", "zero_stage", "precision")}
            row |= {k: m.get(k) for k in ("steps", "final_train_loss", "final_val_loss", "throughput", "wall_seconds")}
            row["max_peak_memory_bytes"] = max(m["peak_memory_bytes"])
        rows.append(row)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |" for row in rows]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return rows


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
        print(f"Sweep summary of {len(rows)} jobs: {sweep_dir / 'summary.md'}")
        print((sweep_dir / "summary.md").read_text())
