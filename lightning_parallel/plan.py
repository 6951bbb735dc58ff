"""Which (pp, dp, tp, ep, zero_stage) layout to train a recipe model with: ``python -m lightning_parallel.plan``.

    python -m lightning_parallel.plan gpt_small --world-size 8 --device-memory 80GB
    python -m lightning_parallel.plan conf/model/vgg16.yaml --world-size 4 --device-memory 16GB --json
    python -m lightning_parallel.plan gpt2_350m --world-size 8 --device-memory 24GB --lora-rank 16 \
        --lora-base-dtype bfloat16  # LoRA: a frozen bf16 base, fp32 adapters
    python -m lightning_parallel.plan path/to/config.json --gpus 256 --device h100 --seq-len 8192 --top 5

With ``--gpus`` the analytic planner answers instead (:mod:`lightning_parallel.planning.scale_cli`): no profile,
any size, a cluster from the device table.

Builds the model on the meta device from its config (a name under ``conf/model/`` or a YAML path), measures
each pipeline layer as one tp rank runs it (see :mod:`lightning_parallel.planning.profile`), and prints one row
per layout: memory per rank, pipeline bubble, bytes communicated per step and the estimated step time, with the
reason for every layout that cannot run, then the recommended one.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.parallel.pipeline.schedules import SCHEDULES, schedule_spec
from lightning_parallel.planning.adapters import lora_params
from lightning_parallel.planning.estimate import (
    PRECISIONS,
    Estimate,
    Settings,
    element_bytes,
    recommend,
)
from lightning_parallel.planning.hf_config import ModelShape, from_recipe
from lightning_parallel.planning.layout import OPTIMIZERS
from lightning_parallel.planning.muon import states_per_param
from lightning_parallel.planning.profile import plan_layouts
from lightning_parallel.planning.published import published_table
from lightning_parallel.planning.scale_cli import add_scale_args, format_scale_table, make_scale_plan
from lightning_parallel.planning.search import Refusal
from lightning_parallel.recipes.config import ImageDataConf, TextDataConf
from lightning_parallel.recipes.family import family_refusal
from lightning_parallel.recipes.model_kinds import MODEL_KINDS
from lightning_parallel.recipes.specs import gpt_spec, parse_bytes, vgg_spec  # noqa: F401  (gpt_spec, vgg_spec: re-exported)

CONF = Path(__file__).resolve().parents[1] / "conf"


def load_model_config(model: str) -> tuple[str, DictConfig]:
    """("gpt" or "vgg", the model config merged over its recipe schema) for a conf/model name or a YAML path."""
    path = Path(model) if model.endswith((".yaml", ".yml")) else CONF / "model" / f"{model}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in (CONF / "model").glob("*.yaml")))
        raise ValueError(f"model {model!r} not found: give one of {names} or the path of a model YAML file.")
    raw = OmegaConf.to_container(OmegaConf.load(path))
    defaults = raw.pop("defaults", [])  # type: ignore[union-attr]
    planned = [kind for kind in MODEL_KINDS.values() if kind.plan is not None and kind.schema is not None]
    for kind in planned:  # the families the planner models (recipes/model_kinds.py: ModelKind.plan)
        if f"{kind.name}_schema" in defaults:
            return kind.name, OmegaConf.merge(OmegaConf.structured(kind.schema), raw)
    names = " nor ".join(f"{kind.name}_schema" for kind in planned)
    raise ValueError(f"{path} extends neither {names}: start it with `defaults: [gpt_schema]`.")


BASE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lightning_parallel.plan", description=__doc__.split("\n")[0])
    p.add_argument(
        "model",
        nargs="?",
        help="a conf/model name (gpt_small, vgg16, ...) or a model YAML path; with --gpus also a Hugging Face "
        "config.json or folder, or a LitGPT model name",
    )
    p.add_argument("--world-size", type=int, help="processes (devices) in the job (the profiling planner)")
    p.add_argument("--device-memory", type=parse_bytes, help="per device, e.g. 80GB or 24GiB")
    p.add_argument("--global-batch-size", type=int, help="samples per step (default: the recipe's data config)")
    p.add_argument("--microbatches", type=int, help="per pipeline step (default: 2 * pp, as hybrid3d)")
    p.add_argument("--pp-schedule", choices=list(SCHEDULES), default="1f1b")
    p.add_argument("--pp-virtual-stages", type=int, default=2, help="stages per rank for interleaved_1f1b")
    p.add_argument("--precision", choices=PRECISIONS, default="32-true", help="fp8: float8 linears over bf16-mixed")
    p.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="adamw",
        help="muon: MuonAdamW's state, owner exchange and Newton-Schulz (with --gpus)",
    )
    p.add_argument(
        "--fsdp-float8-all-gather",
        action="store_true",
        help="with --precision fp8 and ZeRO-3: the converted linears' weights gathered in fp8 (with --gpus)",
    )
    p.add_argument("--margin", type=float, default=0.1, help="fraction of device memory to keep free")
    p.add_argument("--device-flops", type=float, default=100e12, help="sustained FLOP/s per device (cost model)")
    p.add_argument("--bandwidth", type=float, default=50e9, help="bytes/s each rank sends (cost model)")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="LoRA adapters of this rank on the attention and MLP "
        "linears, the base frozen (GPT models; default 0: full fine-tuning)",
    )
    p.add_argument(
        "--lora-base-dtype",
        choices=list(BASE_DTYPE_BYTES),
        help="the frozen base's dtype with --lora-rank (default: the precision's parameters)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_scale_args(p)
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Every layout's estimate and the recommendation, as plain data (what ``--json`` prints)."""
    if args.world_size is None or args.device_memory is None or args.model is None:
        raise ValueError("give a model, --world-size and --device-memory (or --gpus for the analytic planner).")
    if args.world_size < 1:
        raise ValueError(f"--world-size={args.world_size} must be at least 1.")
    if args.fsdp_float8_all_gather:
        raise ValueError(
            "--fsdp-float8-all-gather: the profiling planner gathers by precision alone; plan it with the analytic "
            "planner: add --gpus N (and --device h100, ...)."
        )
    kind, m = load_model_config(args.model)
    _check_lora_args(args, kind)
    spec = MODEL_KINDS[kind].plan(m, args.lora_rank)
    if args.optimizer == "muon":  # Muon's states at the model's average per parameter (exact at pp=1)
        spec = replace(spec, optimizer_states=states_per_param(spec.model, spec.optimizer_states))
    default_batch = (TextDataConf if kind == "gpt" else ImageDataConf).global_batch_size
    virtual = schedule_spec(args.pp_schedule).stages_per_rank(args.pp_virtual_stages)
    settings = Settings(
        global_batch=args.global_batch_size or default_batch,
        microbatches=args.microbatches,
        schedule=args.pp_schedule,
        virtual_stages=virtual,
        precision=args.precision,
        optimizer_states=spec.optimizer_states,
        device_memory=args.device_memory,
        margin=args.margin,
        device_flops=args.device_flops,
        bandwidth=args.bandwidth,
        base_bytes_per_param=BASE_DTYPE_BYTES.get(args.lora_base_dtype),
    )
    estimates = plan_layouts(spec, args.world_size, settings)
    best = recommend(estimates, settings.device_memory, settings.margin)
    params = sum(p.numel() for p in spec.model.parameters())
    adapters = lora_params(spec.model, "", spec.lora_rank, spec.lora_targets) if spec.lora_rank else 0
    return {
        "model": args.model,
        "num_params": params,
        "lora_rank": spec.lora_rank,
        "adapter_params": adapters,  # besides num_params (then the frozen base's)
        "world_size": args.world_size,
        "settings": asdict(settings),
        "layouts": [_row(e) for e in estimates],
        "recommended": _row(best) if best else None,
    }


def recipe_shape(model: str) -> ModelShape | None:
    """A recipe GPT's shape for the analytic planner (None: ``model`` names no recipe model)."""
    if not model.endswith((".yaml", ".yml")) and not (CONF / "model" / f"{model}.yaml").is_file():
        return None
    kind, m = load_model_config(model)
    if kind != "gpt":
        raise ValueError(f"{model} is a {kind}: the analytic planner takes transformers (drop --gpus).")
    return from_recipe(m, model)


def model_family(model: str, lora: bool = False) -> Refusal | None:
    """Why a Hugging Face or LitGPT model's family refuses a layout, with LoRA adapters when ``lora`` (None for a
    recipe model: the planner's own checks are the recipe's)."""
    if model.endswith((".yaml", ".yml")) or (CONF / "model" / f"{model}.yaml").is_file():
        return None
    return family_refusal(model, lora)


def _check_lora_args(args: argparse.Namespace, kind: str) -> None:
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank={args.lora_rank} is not a rank: give 1 or more (0: full fine-tuning).")
    if args.lora_rank and kind != "gpt":
        raise ValueError(
            f"--lora-rank={args.lora_rank} puts adapters on attention and MLP linears, and {args.model} (a {kind}) "
            "has none: drop --lora-rank."
        )
    if args.lora_rank and args.optimizer == "muon":
        raise ValueError("--optimizer muon with --lora-rank: the planner counts Muon for full training; plan adamw.")
    if args.lora_base_dtype and not args.lora_rank:
        raise ValueError(f"--lora-base-dtype={args.lora_base_dtype} is the frozen base's dtype: add --lora-rank R.")


def _row(e: Estimate) -> dict[str, Any]:
    row = {k: v for k, v in asdict(e).items()}
    row["feasible"], row["memory"] = e.feasible, e.memory
    return row


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_table(plan: dict[str, Any]) -> str:
    s = plan["settings"]
    lines = [
        f"{plan['model']}: {plan['num_params'] / 1e6:.2f}M parameters, world size {plan['world_size']}, "
        f"device memory {_size(s['device_memory'])}, global batch {s['global_batch']}, {s['precision']}, "
        f"pp schedule {s['schedule']}"
        + (
            f", LoRA rank {plan['lora_rank']}: {plan['adapter_params'] / 1e6:.3f}M adapter parameters (16 bytes "
            f"each), the base frozen ({s['base_bytes_per_param'] or element_bytes(s['precision'])} bytes per "
            "parameter)"
            if plan["lora_rank"]
            else ""
        ),
        f"{'pp':>3} {'dp':>3} {'tp':>3} {'zero':>4} {'ep':>3} {'m':>3} {'mem/rank':>10} {'states':>10} "
        f"{'experts':>10} {'activ.':>10} {'bubble':>6} {'dp comm':>10} {'tp comm':>10} {'pp comm':>10} "
        f"{'ep comm':>10} {'step ms':>8}  note",
    ]
    best = plan["recommended"]
    for r in plan["layouts"]:
        head = f"{r['pp']:>3} {r['dp']:>3} {r['tp']:>3} {'*' if r['zero_stage'] is None else r['zero_stage']:>4}"
        if r["zero_stage"] is None:
            lines.append(f"{head} {'-':>3} {'infeasible: ' + r['reason']}")
            continue
        i = max(range(len(r["memory_per_rank"])), key=r["memory_per_rank"].__getitem__)
        c = r["comm"]
        note = "infeasible: " + r["reason"] if r["reason"] else ""
        if best and all(r[k] == best[k] for k in ("pp", "dp", "tp", "ep", "zero_stage")):
            note = "<- recommended"
        lines.append(
            f"{head} {r['ep']:>3} {r['microbatches']:>3} {_size(r['memory']):>10} "
            f"{_size(r['model_state_per_rank'][i]):>10} {_size(r['expert_state_per_rank'][i]):>10} "
            f"{_size(r['activation_per_rank'][i]):>10} {r['bubble']:>6.3f} {_size(c['dp']):>10} {_size(c['tp']):>10} "
            f"{_size(c['pp']):>10} {_size(c['ep']):>10} {r['step_time'] * 1e3:>8.2f}  {note}"
        )
    if best is None:
        lines.append("no layout fits: add devices, lower the batch or use a larger --device-memory")
    else:
        lines.append(
            f"recommended: strategy=hybrid3d strategy.pp={best['pp']} strategy.dp={best['dp']} "
            f"strategy.tp={best['tp']} strategy.zero_stage={best['zero_stage']}"
            + (f" strategy.ep={best['ep']}" if best["ep"] > 1 else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.published:
        print(published_table())
        return 0
    scale = args.gpus is not None
    try:
        if scale and args.model is None:
            raise ValueError("give a model: a Hugging Face config.json or folder, a LitGPT name or a recipe model.")
        family = functools.partial(model_family, lora=bool(args.lora_rank))  # LoRA's refusals with --lora-rank
        plan = make_scale_plan(args, recipe_shape, family) if scale else make_plan(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else (format_scale_table if scale else format_table)(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
