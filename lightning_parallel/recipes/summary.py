"""At the end of a Hydra multirun: one table of its jobs, from each job's metrics.json (CSV and Markdown), and a
plot of throughput and peak memory per layout (PNG). A job that failed (its settings refused, or a worker died:
``sweep.py`` records why) is a row with status ``failed``, the layout it asked for and the reason; once the summary
is written, the multirun exits with status 1 if any job failed."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lightning_parallel.callbacks.preemption import PREEMPTED_FILE
from lightning_parallel.recipes.sweep import read_failure

# the layout of a job (metrics.json's "layout"; a failed job's as its config asked): every degree, the pipeline's
# schedule and microbatches (under pp), precision
LAYOUT = ["world_size", "dp", "pp", "tp", "cp", "ep", "dp_shard", "zero_stage", "pp_schedule", "microbatches"]
LAYOUT.append("precision")
COLUMNS = [
    "job",
    "status",  # ok or failed
    *LAYOUT,
    "trainable_params",  # with peft=lora: the adapters' (frozen_params: the base's)
    "frozen_params",
    "steps",
    "final_train_loss",
    "final_val_loss",
    "throughput",  # the steady rate (TrainingMonitor's), in throughput_unit: tokens/s (GPT) or samples/s (VGG)
    "throughput_unit",
    "mfu",  # model FLOPs utilization, on the GPUs whose peak is known (else empty)
    "max_peak_memory_bytes",  # the largest of the ranks' peaks
    "wall_seconds",
    "reason",  # why a failed job failed
]


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job folders (``0``, ``1``, ...), in job order."""
    jobs = (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit())
    return sorted(jobs, key=lambda p: int(p.name))


def job_row(job_dir: Path) -> dict[str, Any]:
    """One job's row: ``failed`` with the reason its folder records, else its figures from metrics.json (none:
    ``failed`` too)."""
    row: dict[str, Any] = {"job": _overrides(job_dir) or job_dir.name}
    metrics_file = job_dir / "metrics.json"
    failure = read_failure(job_dir)
    if failure is None and metrics_file.is_file():
        m = json.loads(metrics_file.read_text())
        row |= {"status": "ok", **{k: m["layout"].get(k) for k in LAYOUT}}
        row |= {k: m.get(k) for k in ("trainable_params", "frozen_params", "steps", "final_train_loss")}
        row |= {k: m.get(k) for k in ("final_val_loss", "throughput", "throughput_unit", "mfu", "wall_seconds")}
        row["max_peak_memory_bytes"] = max(m["peak_memory_bytes"])
        return row
    failure = failure or {}
    row |= {"status": "failed", **{k: failure.get("requested", {}).get(k) for k in LAYOUT}}
    row["reason"] = failure.get("reason") or _unrecorded_reason(job_dir)
    return row


def summarize(sweep_dir: Path) -> list[dict[str, Any]]:
    """Write ``summary.csv``, ``summary.md`` and ``summary.png`` into ``sweep_dir``; returns the rows, one per job
    (a failed job's with its reason and empty figures)."""
    rows = [job_row(job_dir) for job_dir in job_dirs(sweep_dir)]
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
    """``dp2 pp2 tp1 z1 bf16-mixed`` (cp, ep and the schedule when used; ``(failed)`` after a failed job's): what
    tells two jobs of a sweep apart."""
    if row.get("world_size") is None:
        return f"{row['job']} (failed)"
    label = f"dp{row['dp']} pp{row['pp']} tp{row['tp']}"
    label += "".join(f" {axis}{row[axis]}" for axis in ("cp", "ep") if (row.get(axis) or 1) != 1)
    label += f" {row['pp_schedule']}" if row.get("pp_schedule") else ""
    label += f" z{row['zero_stage']} {row['precision']}"
    return label + (" (failed)" if row.get("status") == "failed" else "")


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
    for x, row in enumerate(rows):
        if row.get("status") == "failed":  # no bars: say why there are none
            top.annotate("failed", (x, 0), ha="center", va="bottom", color="tab:red")
    failed = sum(row.get("status") == "failed" for row in rows)
    top.set_title(f"{path.parent.name}: {len(rows)} jobs" + (f", {failed} failed" if failed else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _overrides(job_dir: Path) -> str:
    hydra_overrides = job_dir / ".hydra" / "overrides.yaml"
    if not hydra_overrides.is_file():
        return ""
    from omegaconf import OmegaConf

    return " ".join(OmegaConf.load(hydra_overrides))


def _unrecorded_reason(job_dir: Path) -> str:
    """Why a job without metrics.json and without a recorded failure has no figures."""
    try:
        step = json.loads((job_dir / PREEMPTED_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError):
        return "no metrics.json and no recorded failure: the job stopped before the end (see its log in its folder)"
    return f"preempted (SIGTERM) after step {step}: run the job again with ckpt_path=last to continue"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return " ".join(str(value).split()).replace("|", "\\|")  # one line of a Markdown table cell


class SweepSummary(Callback):
    """Hydra callback: summarize the sweep when the multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = summarize(sweep_dir)
        print(f"Sweep summary of {len(rows)} jobs: {sweep_dir / 'summary.md'} (plot: summary.png)")
        print((sweep_dir / "summary.md").read_text())
        failed = [row for row in rows if row["status"] == "failed"]
        if failed:  # after the summary: the multirun's exit status says that a job failed (a SystemExit is not
            # turned into a warning by Hydra, as other errors of a callback are)
            jobs = "; ".join(row["job"] for row in failed)
            raise SystemExit(
                f"{len(failed)} of {len(rows)} jobs of the sweep failed ({jobs}): the reasons are in the summary "
                f"above ({sweep_dir / 'summary.md'}) and in each job's log."
            )
