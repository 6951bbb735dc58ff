"""The analytic planner's half of ``python -m lightning_parallel.plan`` (``--gpus``): a model from a Hugging Face
config, a LitGPT name or a recipe model, a cluster from the device table, one ``--layout`` or a search.

    python -m lightning_parallel.plan path/to/config.json --gpus 256 --gpus-per-node 8 --device h100 \
        --seq-len 8192 --global-batch-tokens 4M --top 5
    python -m lightning_parallel.plan Llama-3.1-70B --gpus 64 --device h100 --seq-len 8192 \
        --global-batch-size 512 --layout tp=8,pp=4,dp=2,zero_stage=1
    python -m lightning_parallel.plan --published   # the planner against published runs
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_parallel.planning.analytic import AnalyticEstimate, evaluate
from lightning_parallel.planning.cluster import DEVICES, Cluster, get_device
from lightning_parallel.planning.fp8 import FP8, check_fp8_device, fp8_flop_share
from lightning_parallel.planning.hf_config import ModelShape, from_litgpt, load_hf_config
from lightning_parallel.planning.layout import Layout, Workload, layout_error, parse_layout, recipe_overrides
from lightning_parallel.planning.search import SEARCHED, Refusal, complete, search


def add_scale_args(p: argparse.ArgumentParser) -> None:
    """The cluster, workload and layout options (they apply with ``--gpus``)."""
    g = p.add_argument_group("analytic planner (with --gpus)")
    g.add_argument("--gpus", type=int, help="devices in the job: switches to the analytic planner")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--device", choices=list(DEVICES), default="h100")
    g.add_argument("--peak-flops", type=float, help="override: dense bf16 FLOP/s per device")
    g.add_argument("--fp8-peak-flops", type=float, help="override: dense fp8 FLOP/s per device (0: none)")
    g.add_argument("--intra-node-bw", type=float, help="override: bytes/s per device inside a node")
    g.add_argument("--inter-node-bw", type=float, help="override: bytes/s per node across nodes")
    g.add_argument("--hbm-bw", type=float, help="override: device memory bytes/s")
    g.add_argument("--seq-len", type=int, help="tokens per sample (default: the model's context)")
    g.add_argument("--global-batch-tokens", type=_tokens, help="tokens per step, e.g. 4M (K, M, G: powers of 2)")
    g.add_argument("--attention", choices=["flash", "materialized"], default="flash")
    g.add_argument("--layout", type=parse_layout, help="evaluate one layout, e.g. tp=8,pp=8,dp=12,zero_stage=1")
    g.add_argument("--top", type=int, default=5, help="layouts to list from the search")
    g.add_argument("--published", action="store_true", help="print the table against published runs and exit")


def _tokens(text: str) -> int:
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def load_shape(model: str, recipe: Callable[[str], ModelShape | None] | None = None) -> ModelShape:
    """A Hugging Face config.json or folder, a recipe model (``recipe`` returns its shape, None if ``model`` is no
    recipe model), or a LitGPT model name."""
    if Path(model).is_dir() or model.endswith(".json"):
        return load_hf_config(model)
    shape = recipe(model) if recipe else None
    return shape or from_litgpt(model)


def make_scale_plan(
    args: argparse.Namespace,
    recipe: Callable[[str], ModelShape | None] | None = None,
    family: Callable[[str], Refusal | None] | None = None,
) -> dict[str, Any]:
    """The analytic planner's answer as plain data (what ``--json`` prints); ``recipe`` as :func:`load_shape`'s;
    ``family(model)`` says why the model's family refuses a layout (None: it refuses nothing the planner allows)."""
    shape = load_shape(args.model, recipe)
    refuses = family(args.model) if family else None
    device = get_device(
        args.device,
        peak_flops=args.peak_flops,
        fp8_flops=getattr(args, "fp8_peak_flops", None),
        intra_node_bw=args.intra_node_bw,
        inter_node_bw=args.inter_node_bw,
        hbm_bandwidth=args.hbm_bw,
        memory=args.device_memory,
    )
    cluster = Cluster(args.gpus, min(args.gpus_per_node, args.gpus), device)
    seq = args.seq_len or shape.seq_len
    if args.global_batch_tokens:
        batch = max(1, args.global_batch_tokens // seq)
    else:
        batch = args.global_batch_size or args.gpus
    base_bytes = {"float32": 4, "bfloat16": 2}.get(args.lora_base_dtype or "")
    work = Workload(
        seq,
        batch,
        precision=args.precision,
        attention=args.attention,
        margin=args.margin,
        lora_rank=args.lora_rank,
        base_bytes_per_param=base_bytes,
        optimizer=getattr(args, "optimizer", "adamw"),
        fsdp_float8_all_gather=getattr(args, "fsdp_float8_all_gather", False),
    )
    check_fp8_device(device, work.precision)
    plan: dict[str, Any] = {"model": shape.name or args.model, "shape": asdict(shape), "params": shape.num_params()}
    plan.update(active_params=shape.active_params(), cluster=asdict(cluster), workload=asdict(work))
    plan["fp8_flop_share"] = fp8_flop_share(shape, seq, device) if work.precision == FP8 else 0.0
    if args.layout is not None:
        error = layout_error(shape, args.layout, work, cluster.gpus, cluster.gpus_per_node)
        error = error or (refuses(args.layout) if refuses else "")
        if error:
            raise ValueError(f"--layout {args.layout.describe()}: {error}.")
        fixed = _given_fields(args.layout)
        best = complete(shape, cluster, args.layout, work, tuple(f for f in SEARCHED if f not in fixed), refuses)
        found = [best or evaluate(shape, cluster, args.layout, work)]
    else:
        found = search(shape, cluster, work, top=args.top, refuses=refuses)
    plan["layouts"] = [_row(e, work, cluster) for e in found]
    return plan


def _given_fields(layout: Layout) -> set[str]:
    default = Layout()
    return {k for k, v in asdict(layout).items() if v != getattr(default, k)}


def _row(e: AnalyticEstimate, work: Workload, cluster: Cluster) -> dict[str, Any]:
    return {
        "layout": asdict(e.layout),
        "describe": e.layout.describe(),
        "overrides": recipe_overrides(e.layout, work, cluster.gpus_per_node),
        "reason": e.reason,
        "memory": e.memory,
        "states": e.states,
        "activations": e.activations,
        "step_time": e.step_time,
        "times": e.times,
        "tokens_per_s": e.tokens_per_s,
        "mfu": e.mfu,
        "tflops_per_gpu": e.tflops_per_gpu,
        "bound": e.bound,
        "counts": e.counts,
    }


def format_scale_table(plan: dict[str, Any]) -> str:
    w, c = plan["workload"], plan["cluster"]
    lines = [
        f"{plan['model']}: {plan['params'] / 1e9:.2f}B parameters ({plan['active_params'] / 1e9:.2f}B active), "
        f"{c['gpus']} x {c['device']['name']} ({c['gpus_per_node']} per node), seq {w['seq_len']}, global batch "
        f"{w['global_batch']} samples, {w['precision']}"
        + (f" ({plan['fp8_flop_share']:.1%} of the FLOPs in fp8 linears)" if w["precision"] == FP8 else "")
        + (f", optimizer {w['optimizer']}" if w["optimizer"] != "adamw" else ""),
        f"{'mem/GPU':>9} {'step s':>8} {'tokens/s':>12} {'MFU':>5} {'TFLOP/s':>8} {'bound':>9}  layout",
    ]
    if not plan["layouts"]:
        lines.append("no layout fits: add devices, lower the batch or the sequence")
    for r in plan["layouts"]:
        lines.append(
            f"{r['memory'] / 1e9:>7.1f}GB {r['step_time']:>8.3f} {r['tokens_per_s']:>12,.0f} {r['mfu']:>5.1%} "
            f"{r['tflops_per_gpu']:>8.1f} {r['bound']:>9}  {r['describe']}"
            + (f"  (infeasible: {r['reason']})" if r["reason"] else "")
        )
        lines.append(f"{'':>9} recipe: {' '.join(r['overrides'])}")
    return "\n".join(lines)
