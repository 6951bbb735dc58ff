"""``make bench``'s spatial section: the VGG recipe on larger generated images (``model.image_size=128``) at world 2,
each image split into two strips of rows (``spatial=2``) against its channels split (channel tensor parallelism,
``tp=2``) and plain data parallelism (``dp=2``) over the same 2 ranks and global batch: bytes one rank sends per step
(the halo rows against the formula), step time, and the activations one rank keeps for backward.

Halo formula, per convolution on strips: forward, this rank's rows the neighbouring strip borrows (one row each way
for a 3x3 convolution; an edge strip has one neighbour), x batch x input channels x width x 4 bytes; backward the same
rows' gradients go home (none for the first convolution: the images need no gradient).

    python benchmarks/bench.py --only spatial
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median
from typing import Any

import torch

from lightning_parallel.models.vgg import VGG, VGGConfig
from lightning_parallel.parallel.spatial import halo_bytes, trace_heights

WORLD, SIZE, WIDTH, BATCH = 2, 128, 16, 16
OVERRIDES = [
    "model=vgg_tiny",
    f"model.width={WIDTH}",
    f"model.image_size={SIZE}",
    f"data.global_batch_size={BATCH}",
    "data.num_train=256",
]
LAYOUTS = {"dp=2": "hybrid3d", "channel tp=2": "hybrid3d:tp=2", "spatial=2": "hybrid3d:spatial=2"}


def halo_theory(rank: int, spatial: int = WORLD) -> int:
    """Bytes ``rank`` sends per step in halo rows (fp32), forward and backward."""
    model = VGG(VGGConfig(width=WIDTH, image_size=SIZE))
    total = 0
    convs = trace_heights(model, torch.empty(1, 3, SIZE, SIZE), 1, ["head"]).convs
    for i, (name, down, (top, bottom)) in enumerate(convs):
        args = (BATCH, model.get_submodule(name).in_channels, SIZE // down, top, bottom, rank, spatial, 4)
        total += halo_bytes(*args) + (halo_bytes(*args, backward=True) if i else 0)
    return total


def run_spatial(out: Any, repeats: int, steps: int, launch: Callable[..., list], step_time: Callable) -> list[dict]:
    rows = []
    for label, spec in LAYOUTS.items():
        times, ranks = [], []
        for _ in range(repeats):
            ranks = launch("vgg", OVERRIDES, WORLD, spec, out, steps)
            times.append(step_time(ranks))
        worst = max(ranks, key=lambda r: r["comm_sent_bytes_per_step"] or 0)
        rows.append(
            {
                "layout": label,
                "strategy": spec,
                "step_s": median(times),
                "sent_bytes": worst["comm_sent_bytes_per_step"],
                "by_kind": {k: v["sent_bytes"] for k, v in (worst["comm_bytes_per_step"] or {}).items()},
                "halo_bytes": [(r["comm_bytes_per_step"] or {}).get("send", {}).get("sent_bytes") for r in ranks]
                if "spatial" in spec
                else None,
                "halo_theory": [halo_theory(rank) for rank in range(WORLD)] if "spatial" in spec else None,
                "activation_bytes": [r["activation_bytes"] for r in ranks],
            }
        )
        r = rows[-1]
        print(f"  vgg {SIZE}px {label}: {r['step_s'] * 1e3:.0f} ms/step, sent {r['sent_bytes']}", flush=True)
    return rows


def spatial_lines(rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]
    lines = [
        "## Spatial parallelism against channel tensor parallelism: VGG on larger images",
        "",
        f"VGG11 with BatchNorm, width {WIDTH}, generated {SIZE} x {SIZE} images, global batch {BATCH}, world {WORLD}: "
        "plain data parallelism, channel tensor parallelism (`tp=2`: conv channels split in Megatron pairs) and "
        "spatial parallelism (`spatial=2`: each image split into two strips of rows, halo rows exchanged). Bytes: what "
        "the busiest rank sent in the measured step, by op; halo: the point-to-point sends against the formula "
        "(benchmarks/spatial.py). Activations: what one training forward leaves for backward on each rank.",
        "",
        "| layout | ms/step | vs dp=2 | KiB sent/step | by op (KiB) | halo KiB (theory) | activations MiB/rank "
        "| vs dp=2 |",
        "|---|---:|---:|---:|---|---|---:|---:|",
    ]
    base_act = max(base["activation_bytes"])
    for r in rows:
        ops = ", ".join(f"{k} {v / 1024:.0f}" for k, v in sorted(r["by_kind"].items()))
        halo = "-"
        if r["halo_bytes"]:
            halo = ", ".join(f"{g / 1024:.1f} ({w / 1024:.1f})" for g, w in zip(r["halo_bytes"], r["halo_theory"]))
        act = max(r["activation_bytes"])
        lines.append(
            f"| {r['layout']} | {r['step_s'] * 1e3:.0f} | {r['step_s'] / base['step_s']:.2f}x | "
            f"{(r['sent_bytes'] or 0) / 1024:.0f} | {ops} | {halo} | {act / 2**20:.2f} | {act / base_act:.2f} |"
        )
    return [*lines, ""]
