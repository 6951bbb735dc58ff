"""``python -m lightning_parallel.simulate MODEL --gpus N --layout k=v,...``: a layout simulated at its real world
size (:func:`lightning_parallel.simulate.simulate`), one line per simulated rank, or ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_parallel.planning.cluster import DEVICES
from lightning_parallel.simulate.api import Simulation, simulate
from lightning_parallel.simulate.rank import PRECISIONS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_parallel.simulate", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a conf/model name, a Hugging Face config.json or folder, or a LitGPT model name")
    p.add_argument("--gpus", type=int, required=True, help="the world size")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--device", choices=list(DEVICES), default="h100", help="for the step-time estimate")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the model's context)")
    p.add_argument("--global-batch-size", type=int, help="samples per step (default: one per data-parallel rank)")
    # 16-mixed is taken so that simulate() refuses it with its reason and the fix (argparse would only list these)
    p.add_argument("--precision", choices=[*PRECISIONS, "16-mixed"], default="bf16-mixed")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on a frozen base (HF models)")
    p.add_argument("--lora-base-dtype", choices=["bfloat16", "float32"], help="the frozen base's dtype (LoRA)")
    p.add_argument("--layout", default="", help="ParallelConfig settings, e.g. tp=8,pp=4,zero_stage=1")
    p.add_argument("--ranks", help="global ranks to simulate, e.g. 0,7,255 (default: one per distinct position)")
    p.add_argument("--steps", type=int, default=2, help="training steps per rank")
    p.add_argument(
        "--full-schedule",
        action="store_true",
        help="under pp run every microbatch (default: a 1F1B or interleaved step of more than 2*pp microbatches runs "
        "2*pp of them and its collectives and FLOPs are extended to the configured count)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p.parse_args(argv)


def format_report(sim: Simulation) -> str:
    lines = [
        f"{sim.model} on {sim.world_size} x {sim.cluster.device.name} ({sim.cluster.gpus_per_node} per node): "
        f"{sim.layout}, seq {sim.seq_len}, global batch {sim.global_batch}, {sim.precision}{_lora(sim)}",
        f"{'rank':>6} {'states':>10} {'acts':>10} {'peak':>10} {'sent/step':>10} {'FLOP':>9} {'step':>9} "
        f"{'MFU':>6} {'sim s':>6}  position",
    ]
    for r, t in zip(sim.ranks, sim.times):
        sent = sum(c.sent_bytes * c.count for c in r.collectives)
        where = ",".join(f"{a}{i}" for a, i in r.coordinates.items() if sim.config_degree(a) > 1) or "-"
        lines.append(
            f"{r.rank:>6} {_gb(r.model_state_bytes['total']):>10} {_gb(r.activation_bytes):>10} "
            f"{_gb(r.peak_bytes):>10} {_gb(sent):>10} {_flop(r.flops):>9} {_seconds(t.total):>9} {t.mfu:>6.1%} "
            f"{r.seconds:>6.1f}  {where}"
        )
    lines.append(_consistency(sim))
    lines.append(f"simulated in {sim.seconds:.1f} s, peak RSS of a rank's process {_gb(sim.peak_rss_bytes)}")
    return "\n".join(lines)


def _lora(sim: Simulation) -> str:
    a = sim.adapters
    return f", LoRA rank {a.rank} on a frozen {a.base_dtype + ' ' if a.base_dtype else ''}base" if a.rank else ""


def _consistency(sim: Simulation) -> str:
    if sim.mismatches:
        return "INCONSISTENT collectives (would hang): " + "; ".join(m.describe() for m in sim.mismatches)
    return f"collectives consistent: {sim.groups_compared} group(s) shared by simulated ranks issue the same sequence"


def _flop(n: float) -> str:
    return f"{n / 1e12:.1f} T" if n >= 1e11 else f"{n / 1e9:.2f} G"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.1 else f"{s * 1e3:.3f} ms"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    try:
        sim = simulate(
            args.model,
            args.gpus,
            args.layout,
            gpus_per_node=args.gpus_per_node,
            device=args.device,
            seq_len=args.seq_len,
            global_batch_size=args.global_batch_size,
            precision=args.precision,
            ranks=ranks,
            steps=args.steps,
            lora_rank=args.lora_rank,
            lora_base_dtype=args.lora_base_dtype,
            full_schedule=args.full_schedule,
        )
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out: Any = sim.to_dict()
    print(json.dumps(out, indent=1) if args.json else format_report(sim))
    return 1 if sim.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
