"""``make bench``'s async section: parameter-server training (strategy='async_ps', 2 workers + 1 server) with
one worker slowed by a sleep in every step, synchronous (staleness 0) against stale-synchronous (4) and fully
asynchronous (1000).

1. The same wall-time budget each (every worker stops by itself after ``BUDGET_S`` seconds of training): the
   servers' updates per second and the validation loss the final parameters reach (the tiny GPT of the tests on
   its synthetic bigram data, tests/workers/cases/async_ps.py). One *update* is one optimizer step on the
   servers: at staleness 0 the mean of both workers' gradients of a step (a global batch), above 0 one worker's
   push (half a global batch); samples per second count both.
2. Convergence after the same number of updates of the same size, through the GPT recipe (``gpt_tiny``, no
   slowed worker): at staleness 4 and fully asynchronous (global batch 16: each push of 8 samples is an update)
   against synchronous runs with global batch 8 (updates of 8 samples) and 16.

    python benchmarks/bench.py --only async
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STALENESS = (0, 4, 1000)
BUDGET_S, SLOW_SLEEP_S, GLOBAL_BATCH = 20.0, 0.1, 16
UPDATES = 300
RECIPE = ["model=gpt_tiny", "data.global_batch_size=16", "trainer.enable_progress_bar=false", "sample_tokens=0"]
RECIPE += ["trainer.logger=none", "trainer.limit_val_batches=16", "strategy=async_ps", "trainer.devices=3"]


def run_budget(out: Path, run_distributed: Any) -> list[dict[str, Any]]:
    rows = []
    for s in STALENESS:
        case = {"staleness": s, "steps": 100000, "epoch_steps": 200, "global_batch": GLOBAL_BATCH, "d_model": 64}
        case |= {"slow_sleep": SLOW_SLEEP_S, "max_seconds": BUDGET_S, "val_every": 100000}
        args = ["async_ps", "--opts", json.dumps(case)]  # tests/workers/run.py's case
        ranks = run_distributed("run.py", 3, args, out / f"async_budget_s{s}", timeout=600)
        (server,) = ranks[0]["counters"]
        per_update = GLOBAL_BATCH // (1 if s == 0 else 2)
        rate = server["updates_per_second"]
        rows.append(
            {
                "staleness": s,
                "updates": server["updates"],
                "updates_per_second": rate,
                "samples_per_second": rate * per_update,
                "pushes": server["pushes"],
                "final_val_loss": ranks[0]["final_val_loss"],
                "max_clock_gap": server["max_clock_gap"],
                "mean_staleness": server["mean_staleness"],
            }
        )
        print(f"  staleness {s}: {rate:.1f} updates/s, val loss {ranks[0]['final_val_loss']:.3f}", flush=True)
    return rows


def _recipe(out: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    run_dir = out / name
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(ROOT / "recipes" / "train_gpt.py"), *RECIPE, *overrides, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads((run_dir / "metrics.json").read_text())


def run_convergence(out: Path) -> list[dict[str, Any]]:
    """Updates of equal size compared at equal counts: a synchronous update with global batch 8 averages both
    workers' 4 samples, a push at staleness > 0 with global batch 16 is one worker's 8."""
    runs = [
        ("sync, batch 16", 0, 16, UPDATES),
        ("sync, batch 8", 0, 8, 2 * UPDATES),
        ("staleness 4", 4, 16, UPDATES),
        ("fully async", 1000, 16, UPDATES),
    ]
    rows = []
    for label, s, batch, steps in runs:
        overrides = [f"strategy.staleness={s}", f"data.global_batch_size={batch}", f"trainer.max_steps={steps}"]
        name = "async_recipe_" + label.replace(" ", "_").replace(",", "")
        m = _recipe(out, name, [*overrides, f"trainer.val_check_interval={steps}"])  # validated once, at the end
        rows.append(
            {
                "run": label,
                "staleness": s,
                "global_batch": batch,
                "steps_per_worker": steps,
                "updates": m["async_ps"]["updates"],
                "samples_per_update": m["async_ps"]["samples_per_update"],
                "final_val_loss": m["final_val_loss"],
                "wall_seconds": m["wall_seconds"],
            }
        )
        print(f"  {label}: {rows[-1]['updates']} updates, val loss {m['final_val_loss']:.4f}", flush=True)
    # against the synchronous run with updates of the same size and count
    same = {r["samples_per_update"]: r["final_val_loss"] for r in rows if r["staleness"] == 0}
    for row in rows:
        row["vs_sync_same_updates"] = row["final_val_loss"] / same[row["samples_per_update"]] - 1
    return rows


def run_async(out: Path, run_distributed: Any) -> dict[str, Any]:
    return {"budget": run_budget(out, run_distributed), "convergence": run_convergence(out)}


def async_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        "## Parameter servers (async_ps): one slowed worker",
        "",
        f"2 workers + 1 server, worker 1 sleeps {SLOW_SLEEP_S} s every step. Same wall budget each ({BUDGET_S:.0f} s "
        "of training per worker), tiny GPT (d_model 64) on synthetic bigram data: an update is one optimizer step on "
        "the server (staleness 0: both workers' mean gradient, a global batch of "
        f"{GLOBAL_BATCH}; above 0: one push, half of it). Validation loss of the final parameters.",
        "",
        "| staleness | updates | updates/s | samples/s | pushes (w0, w1) | largest clock gap | val loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["budget"]:
        pushes = ", ".join(str(v) for v in r["pushes"].values())
        lines.append(
            f"| {r['staleness']} | {r['updates']} | {r['updates_per_second']:.1f} | {r['samples_per_second']:.0f} | "
            f"{pushes} | {r['max_clock_gap']} | {r['final_val_loss']:.3f} |"
        )
    lines += [
        "",
        "Convergence, GPT recipe (`gpt_tiny`, no slowed worker), validation loss at the end; each run against the "
        "synchronous run whose updates have as many samples, after as many updates:",
        "",
        "| run | global batch | steps per worker | updates | samples per update | val loss | vs sync, same updates |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["convergence"]:
        lines.append(
            f"| {r['run']} | {r['global_batch']} | {r['steps_per_worker']} | {r['updates']} | "
            f"{r['samples_per_update']} | {r['final_val_loss']:.4f} | {100 * r['vs_sync_same_updates']:+.1f}% |"
        )
    return [*lines, ""]
