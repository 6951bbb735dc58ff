"""``make bench``'s context-parallel section: the long-sequence GPT (``model=gpt_long``, 1024 tokens) at world 2 with
its sequences split over cp=2 ranks (ring attention, and Ulysses' all-to-all) against plain data parallelism over
the same 2 ranks and global batch: the bytes one rank sends per step against the formulas, and the step time.

Ring: per attention layer, forward (cp - 1) hops of this rank's K and V, backward (cp - 1) hops of K, V and their
gradient accumulators plus the one hop that takes the accumulators home (``ring_bytes``). Ulysses: q, k, v and the
output cross once forward and once backward, (cp - 1)/cp of each.

    python benchmarks/bench.py --only context
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median
from typing import Any

from lightning_parallel.parallel.context.ring import ring_bytes

WORLD, CP, BATCH = 2, 2, 4
LONG = ["model=gpt_long", f"data.global_batch_size={BATCH}"]
LAYOUTS = {
    "dp=2": "hybrid3d",
    "cp=2 ring": f"hybrid3d:cp={CP}",
    "cp=2 ulysses": f"hybrid3d:cp={CP},cp_mode=ulysses",
}


def theory(model: dict[str, Any], mode: str) -> float:
    """Bytes one rank sends per step in the attention's exchanges (fp32)."""
    local_kv = 2 * BATCH * (model["seq_len"] // CP) * model["d_model"] * 4  # this rank's K and V, all samples
    if mode == "ring":
        per_layer = ring_bytes(local_kv, CP)
        return model["n_layer"] * (per_layer["forward"] + per_layer["backward"])
    # 4 tensors of local_kv / 2 bytes each, forward and backward, (cp - 1)/cp of them leave the rank
    return model["n_layer"] * 2 * 4 * (local_kv // 2) * (CP - 1) / CP


def run_context(out: Any, repeats: int, steps: int, launch: Callable[..., list], step_time: Callable) -> list[dict]:
    rows = []
    for label, spec in LAYOUTS.items():
        times, ranks = [], []
        for _ in range(repeats):
            ranks = launch("gpt", LONG, WORLD, spec, out, steps)
            times.append(step_time(ranks))
        comm = ranks[0]["comm_bytes_per_step"] or {}
        mode = "ulysses" if "ulysses" in spec else "ring" if "cp=" in spec else None
        kind = {"ring": "send", "ulysses": "all_to_all"}.get(mode or "")
        rows.append(
            {
                "layout": label,
                "strategy": spec,
                "step_s": median(times),
                "sent_bytes": comm.get(kind, {}).get("sent_bytes") if kind else None,
                "theory_bytes": theory(ranks[0]["model"], mode) if mode else None,
            }
        )
        print(f"  gpt_long {label}: {rows[-1]['step_s'] * 1e3:.0f} ms/step, bytes {rows[-1]['sent_bytes']}", flush=True)
    return rows


def context_lines(rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]["step_s"]
    lines = [
        "## Context parallelism: the long-sequence GPT",
        "",
        f"`model=gpt_long` (1024 tokens, 2 layers, d_model 64), world {WORLD}, global batch {BATCH}: plain data "
        f"parallelism against cp={CP} (each sample's sequence split, two mirrored chunks per rank). Bytes: what rank "
        "0 sent per step in the attention's exchanges (ring: send; Ulysses: all-to-all), against the formula.",
        "",
        "| layout | ms/step | vs dp=2 | attention bytes sent | theory | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        sent, want = r["sent_bytes"], r["theory_bytes"]
        cells = (f"{sent / 2**20:.2f} MiB", f"{want / 2**20:.2f} MiB", f"{sent / want:.3f}") if want else ("-",) * 3
        lines.append(f"| {r['layout']} | {r['step_s'] * 1e3:.0f} | {r['step_s'] / base:.2f}x | {' | '.join(cells)} |")
    return [*lines, ""]
