"""``make bench``'s HSDP section: what crosses nodes under HSDP (ZeRO-3 sharded over the 2 ranks of a node,
replicated across 2 nodes) against plain ZeRO-3 over all 4 data-parallel ranks, from each rank's bytes by mesh axis
in one measured step (``comm_bytes_by_axis``, the counter convention of parallel/measure/comm_volume.py).

On 2 nodes of 2 ranks, plain ZeRO-3's data-parallel group spans both nodes: every byte of its all-gathers and
reduce-scatters travels on a group that crosses nodes. HSDP's only cross-node group is the replicas' (``dpr``): one
all-reduce of each rank's shard, ``replica_bytes`` (2 (P / dp_shard) (r-1)/r); its all-gathers and reduce-scatters
stay inside a node (``dp``). One launch each, bytes do not depend on timing.

    python benchmarks/bench.py --only hsdp
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_parallel.parallel.data.hybrid_shard import replica_bytes

WORLD, DP_SHARD = 4, 2
LAYOUTS = {
    "zero3 (dp=4)": "zero3",
    f"HSDP zero3 ({WORLD // DP_SHARD} x {DP_SHARD})": "hybrid3d:dp_shard=2,zero_stage=3",
}
CROSSING = {"zero3": ("dp",), "hybrid3d:dp_shard=2,zero_stage=3": ("dpr",)}  # axes spanning both nodes


def _crosses(axes: str, spec: str) -> bool:
    """A group spans nodes when one of its axes (``"dpr_dp"``: dpr and dp) does."""
    return bool(set(axes.split("_")) & set(CROSSING[spec]))


def run_hsdp(out: Any, overrides: list[str], launch: Callable[..., list], steps: int = 5) -> list[dict[str, Any]]:
    rows = []
    for label, spec in LAYOUTS.items():
        ranks = launch("gpt", overrides, WORLD, spec, out, steps)
        by_axis = [r["comm_bytes_by_axis"] or {} for r in ranks]
        crossing = max(sum(row["sent_bytes"] for a, row in axes.items() if _crosses(a, spec)) for axes in by_axis)
        inside = max(sum(row["sent_bytes"] for a, row in axes.items() if not _crosses(a, spec)) for axes in by_axis)
        param_bytes = 4 * ranks[0]["num_params"]
        theory = replica_bytes(param_bytes, DP_SHARD, WORLD // DP_SHARD) if "dp_shard" in spec else None
        rows.append(
            {
                "layout": label,
                "strategy": spec,
                "world": WORLD,
                "param_bytes": param_bytes,
                "cross_node_sent_bytes": crossing,  # the busiest rank's
                "in_node_sent_bytes": inside,
                "theory_cross_node_bytes": theory,
                "by_axis": by_axis,
            }
        )
        print(f"  {label}: {crossing / 2**20:.2f} MiB across nodes, {inside / 2**20:.2f} MiB inside", flush=True)
    return rows


def hsdp_lines(rows: list[dict[str, Any]]) -> list[str]:
    plain = rows[0]["cross_node_sent_bytes"]
    lines = [
        "## HSDP: bytes across nodes",
        "",
        f"GPT recipe, world {WORLD} as 2 nodes of 2 ranks, one measured step, the busiest rank's bytes sent (MiB) on "
        "the groups that span nodes (plain ZeRO-3: its whole data-parallel group; HSDP: the replicas' group `dpr`) "
        "and on the others. Theory for HSDP: one ring all-reduce of the shard, 2 (P / dp_shard) (r-1)/r.",
        "",
        "| layout | across nodes | inside a node | theory across | across vs zero3 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        theory = f"{r['theory_cross_node_bytes'] / 2**20:.2f}" if r["theory_cross_node_bytes"] is not None else "-"
        lines.append(
            f"| {r['layout']} | {r['cross_node_sent_bytes'] / 2**20:.2f} | {r['in_node_sent_bytes'] / 2**20:.2f} | "
            f"{theory} | {r['cross_node_sent_bytes'] / plain:.2f}x |"
        )
    return [*lines, ""]
