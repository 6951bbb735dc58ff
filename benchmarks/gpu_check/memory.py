"""Section 5: the measured peak of ``mfu_ours`` (``torch.cuda.max_memory_allocated``: hybrid3d, ZeRO-1, world 1)
against the planner's estimate for the same model, batch, precision and layout (``python -m lightning_parallel.plan``
through its functions: model states + activations of the one rank)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .workload import Workload

LAYOUT = {"pp": 1, "dp": 1, "tp": 1, "zero_stage": 1}  # mfu_ours's


def run(config: dict[str, Any]) -> dict[str, Any]:
    from lightning_parallel.plan import make_plan, parse_args

    work = Workload.from_config(config)
    folder = Path(config["work"])
    device_memory = _device_memory(work)
    argv = [str(work.model_yaml(folder)), "--world-size", "1", "--device-memory", str(device_memory)]
    argv += ["--global-batch-size", str(work.micro_batch), "--precision", work.precision]
    plan = make_plan(parse_args(argv))
    # at dp=1 the planner lists one stage (ZeRO shards nothing over one rank): the row of our pp, dp, tp
    rows = [r for r in plan["layouts"] if all(r.get(k) == LAYOUT[k] for k in ("pp", "dp", "tp"))]
    if not rows or rows[0]["zero_stage"] is None:
        raise ValueError(f"the planner has no row for {LAYOUT} at world 1: {[_key(r) for r in plan['layouts']]}")
    row = next((r for r in rows if r["zero_stage"] == LAYOUT["zero_stage"]), rows[0])
    estimate = {
        "total_bytes": row["memory"],
        "model_state_bytes": row["model_state_per_rank"][0],
        "activation_bytes": row["activation_per_rank"][0],
    }
    measured_file = folder / "mfu_ours.json"
    measured = json.loads(measured_file.read_text()) if measured_file.is_file() else None
    peak = measured.get("peak_memory_bytes") if measured else None
    return {
        "layout": LAYOUT,
        "planner_row": _key(row),
        "planner_command": "python -m lightning_parallel.plan " + " ".join(argv),
        "estimate": estimate,
        "measured_peak_bytes": peak,
        "measured_over_estimate": peak / estimate["total_bytes"] if peak and estimate["total_bytes"] else None,
        "note": None if peak else "no measured peak: mfu_ours did not run on a GPU (CUDA only)",
    }


def _device_memory(work: Workload) -> int:
    if work.device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return 80 * 10**9


def _key(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in LAYOUT}
