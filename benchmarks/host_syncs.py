"""``make bench``'s host-sync section: per steady-state step and rank under ``bf16-mixed``, the calls that would
make the host wait for a GPU (``.item()``, ``int(tensor)``, ``.cpu()``, data-dependent shapes, blocking host-to-device
copies: lightning_parallel/parallel/measure/host_sync.py), counted on a CPU run with the recipe's callbacks and
Lightning's progress bar, for our layouts beside Lightning's own ``ddp`` and FSDP2 (``ModelParallelStrategy``), on
the recipe GPT and an HF Llama (tiny). No timing: counts only, exact on a loaded machine.

    python benchmarks/host_syncs.py                 # the whole matrix: 23 launches of 8 steps at world 2
    python benchmarks/bench.py --only host_syncs    # the same, merged into results.json and BENCHMARKS.md

Every remaining sync is named by its source line (``sites``) and, for the known ones, its reason (:data:`REASONS`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "worker.py"
# the recipe's GPT and an HF Llama, small enough for seconds per launch; bf16-mixed as a GPU user trains
COMMON = ["precision=bf16-mixed", "data.global_batch_size=4"]
GPT = ["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "data.global_batch_size=4"]
MODELS = {
    "gpt": [*GPT, "precision=bf16-mixed"],
    "hf_llama": ["model=hf_llama_tiny", "model.seq_len=32", *COMMON],
    "gpt_fp16": [*GPT, "precision=16-mixed"],  # the skip decision of a step with inf/NaN gradients
}
# (label, spec): Lightning's own first, then ours; all at world 2
LAYOUTS = [
    ("Lightning ddp", "ddp"),
    ("Lightning FSDP2", "model_parallel"),
    ("dp (ZeRO-0)", "hybrid3d"),
    ("ZeRO-1", "zero1"),
    ("ZeRO-2", "zero2"),
    ("ZeRO-3", "zero3"),
    ("tp=2 + SP", "hybrid3d:tp=2,sequence_parallel=true"),
    ("pp=2 1F1B", "hybrid3d:pp=2,pp_schedule=1f1b,microbatches=2"),
    ("cp=2 ring", "hybrid3d:cp=2"),
    ("cp=2 Ulysses", "hybrid3d:cp=2,cp_mode=ulysses"),
]
NOTES = {
    "gpt": "The recipe's GPT (`model=gpt_tiny`, 2 blocks, 32 tokens, 4 samples a step), `bf16-mixed`.",
    "hf_llama": "`model=hf_llama_tiny` (transformers' Llama, 2 decoder layers, 32 tokens), `bf16-mixed`.",
    "gpt_fp16": (
        "The same GPT under `16-mixed`. Lightning's precision flag turns `16-mixed` into `bf16-mixed` on a CPU: its "
        "`ddp` row is given Lightning's `MixedPrecision` plugin with torch's `GradScaler` directly (fp16 as on a GPU)."
    ),
}
FP16 = [("Lightning ddp", "ddp"), ("dp (ZeRO-0)", "hybrid3d"), ("ZeRO-2", "zero2")]  # ddp: torch's GradScaler
RUNS = {"gpt": LAYOUTS, "hf_llama": LAYOUTS, "gpt_fp16": FP16}  # model -> layouts
FAST = [("Lightning ddp", "ddp"), ("ZeRO-3", "zero3"), ("pp=2 1F1B", "hybrid3d:pp=2,pp_schedule=1f1b,microbatches=2")]
WARMUP, STEPS = 3, 2  # counted: batches 3 and 4 (after the first optimizer steps made every lazy state)
# why each remaining sync is there, by a part of its source line (or of its caller's)
REASONS = {
    "lightning/fabric/utilities/apply_func.py": (
        "Lightning: the logged `train_loss` (`prog_bar=True`) turned into a Python number for the progress-bar "
        "metrics at every batch end, and once more on rank 0 when its progress bar refreshes"
    ),
    "lightning_parallel/parallel/loss_scaler.py": (
        "ours, fp16 only: whether any rank found inf/NaN gradients, read to skip the step or not (Lightning's "
        "`GradScaler` reads the same with `.item()` in `step`)"
    ),
    "lightning/pytorch/plugins/precision/amp.py": (
        "Lightning's fp16 (torch's `GradScaler.step`): whether the gradients hold inf/NaN, read to skip the step"
    ),
    "lightning/pytorch/loops/training_epoch_loop.py": (
        "Lightning: its SIGTERM flag, a host list copied to the device, broadcast from rank 0 and read with "
        "`.item()` after every batch (world > 1)"
    ),
    "transformers/masking_utils.py": (
        "transformers: the model's forward looks for packed sequences in the position ids (`.all()`) when it has "
        "no attention mask"
    ),
}


def reason(site: str, via: str = "") -> str:
    return next((why for part, why in REASONS.items() if part in site or part in via), "")


def run_host_syncs(out: Path, launch: Callable[..., list], runs: dict | None = None) -> list[dict[str, Any]]:
    """Per model and layout of ``runs`` (default :data:`RUNS`): each rank's syncs per step, and the sites (the
    ranks' union, most per step first)."""
    rows = []
    for model, layouts in (runs or RUNS).items():
        overrides = MODELS[model]
        for label, spec in layouts:
            steps = WARMUP + STEPS + 3
            ranks = launch("gpt", overrides, 2, spec, out, steps, warmup=WARMUP, syncs=STEPS, tag=f"_syncs_{model}")
            sites: dict[tuple[str, str, str, str], float] = {}
            for r in ranks:
                for s in r["host_syncs"]["sites"]:
                    key = (s["kind"], s["site"], s["package"], s["via"])
                    sites[key] = max(sites.get(key, 0.0), s["per_step"])
            rows.append(
                {
                    "model": model,
                    "layout": label,
                    "spec": spec,
                    "per_step": [r["host_syncs"]["per_step"] for r in ranks],
                    "ours_per_step": [r["host_syncs"]["by_package"].get("lightning_parallel", 0.0) for r in ranks],
                    "sites": [
                        {"kind": k, "site": s, "package": p, "via": v, "per_step": n, "reason": reason(s, v)}
                        for (k, s, p, v), n in sorted(sites.items(), key=lambda kv: -kv[1])
                    ],
                }
            )
            print(f"  {model} {label}: {rows[-1]['per_step']} syncs/step by rank", flush=True)
    return rows


def host_sync_lines(rows: list[dict[str, Any]]) -> list[str]:
    """BENCHMARKS.md's section: per model, each layout's syncs per step by rank (ours: from lightning_parallel),
    then every source line that synced, with its reason."""
    lines = [
        "## Host syncs per step against Lightning's own strategies",
        "",
        "Calls that would make the host wait for a GPU (`.item()`, `int()`/`float()`/`bool()` of a tensor, "
        "`.tolist()`, `.cpu()`, data-dependent shapes such as `nonzero`, blocking host-to-device copies), per "
        "steady-state step (batches 3 and 4) and rank at world 2 under `bf16-mixed`, with the recipe's callbacks "
        "(preemption, exact resume, MoE figures, the training monitor) and Lightning's progress bar. Counted on "
        "the CPU run by lightning_parallel/parallel/measure/host_sync.py: every tensor counts as a device tensor "
        "but those that stay on the host on a GPU too (made without a device, torch optimizers' step counters); "
        "on a GPU, `torch.cuda.set_sync_debug_mode` is the check. Produced by benchmarks/host_syncs.py "
        "(`python benchmarks/bench.py --only host_syncs`). Ours = the calls from lightning_parallel.",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        lines += [f"### {model}", "", NOTES.get(model, ""), ""]
        lines += ["| layout | syncs / step (rank 0, 1) | ours |", "|---|---|---|"]
        for r in mine:
            total = ", ".join(f"{v:g}" for v in r["per_step"])
            lines.append(f"| {r['layout']} (`{r['spec']}`) | {total} | {max(r['ours_per_step']):g} |")
        sites: dict[str, tuple[str, dict[str, float]]] = {}
        for r in mine:
            for site in r["sites"]:
                key = f"`{site['site']}` ({site['kind']}, from `{site['via']}`)"
                per_layout = sites.setdefault(key, (site["reason"], {}))[1]
                per_layout[r["layout"]] = max(per_layout.get(r["layout"], 0.0), site["per_step"])
        lines += ["", "Every source line that synced (the innermost frame outside torch), its caller, and where:", ""]
        for key, (why, layouts) in sites.items():
            counts = set(layouts.values())
            if len(layouts) == len(mine) and len(counts) == 1:
                where = f"every layout, {counts.pop():g} per step at most"
            else:
                where = "; ".join(f"{name}: {n:g}" for name, n in layouts.items()) + " per step at most"
            lines.append(f"- {key}: {why or 'no reason recorded'} ({where})")
        lines.append("")
    return lines


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from harness import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "host_syncs")
    parser.add_argument("--fast", action="store_true", help="three layouts only")
    parser.add_argument("--models", nargs="+", choices=list(RUNS), help="these models only")
    parser.add_argument("--json", type=Path, default=ROOT / "runs" / "host_syncs.json", help="where the rows go")
    args = parser.parse_args()

    def launch(recipe: str, overrides: list, world: int, spec: str, out: Path, steps: int, **kw: Any) -> list:
        cli = ["--recipe", recipe, "--overrides", json.dumps(overrides), "--strategy", spec, "--steps", str(steps)]
        cli += ["--warmup", str(kw["warmup"]), "--syncs", str(kw["syncs"])]
        tag = spec.replace(":", "_").replace(",", "_").replace("=", "") + kw["tag"]
        return run_distributed(str(WORKER), world, cli, out / tag, timeout=600)

    runs = {model: FAST for model in ("gpt", "hf_llama")} if args.fast else dict(RUNS)
    runs = {m: v for m, v in runs.items() if not args.models or m in args.models}
    rows = run_host_syncs(args.out, launch, runs)
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
