"""``make bench``'s host-sync section: per steady-state step and rank under ``bf16-mixed``, the calls that would
make the host wait for a GPU (``.item()``, ``int(tensor)``, ``.cpu()``, data-dependent shapes, blocking host-to-device
copies: lightning_parallel/parallel/measure/host_sync.py), counted on a CPU run with the recipe's callbacks and
Lightning's progress bar, for our layouts beside Lightning's own ``ddp`` and FSDP2 (``ModelParallelStrategy``), on
the recipe GPT and an HF Llama (tiny). No timing: counts only, exact on a loaded machine.

    python benchmarks/host_syncs.py                 # the whole matrix (about 5 minutes on 2 busy CPU cores)
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
MODELS = {
    "gpt": ["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", *COMMON],
    "hf_llama": ["model=hf_llama_tiny", "model.seq_len=32", *COMMON],
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
]
FAST = [("Lightning ddp", "ddp"), ("ZeRO-3", "zero3"), ("pp=2 1F1B", "hybrid3d:pp=2,pp_schedule=1f1b,microbatches=2")]
WARMUP, STEPS = 3, 2  # counted: batches 3 and 4 (after the first optimizer steps made every lazy state)
# why each remaining sync is there, by a part of its source line
REASONS = {
    "lightning/pytorch/trainer/connectors/logger_connector/result.py": (
        "Lightning: the logged train_loss turned into a Python number for the progress bar (`prog_bar=True`)"
    ),
    "lightning/pytorch/loops/training_epoch_loop.py": (
        "Lightning: its SIGTERM flag broadcast from rank 0 and read with `.item()` (world > 1)"
    ),
    "lightning/pytorch/callbacks/progress/tqdm_progress.py": "Lightning: the progress bar's refresh",
}


def reason(site: str) -> str:
    return next((why for part, why in REASONS.items() if part in site), "")


def run_host_syncs(out: Path, launch: Callable[..., list], layouts: list | None = None) -> list[dict[str, Any]]:
    """Per model and layout: each rank's syncs per step, and the sites (the ranks' union, most per step first)."""
    rows = []
    for model, overrides in MODELS.items():
        for label, spec in layouts or LAYOUTS:
            ranks = launch("gpt", overrides, 2, spec, out, WARMUP + STEPS + 3, warmup=WARMUP, syncs=STEPS)
            sites: dict[tuple[str, str, str], float] = {}
            for r in ranks:
                for s in r["host_syncs"]["sites"]:
                    key = (s["kind"], s["site"], s["package"])
                    sites[key] = max(sites.get(key, 0.0), s["per_step"])
            rows.append(
                {
                    "model": model,
                    "layout": label,
                    "spec": spec,
                    "per_step": [r["host_syncs"]["per_step"] for r in ranks],
                    "ours_per_step": [r["host_syncs"]["by_package"].get("lightning_parallel", 0.0) for r in ranks],
                    "sites": [
                        {"kind": k, "site": s, "package": p, "per_step": n, "reason": reason(s)}
                        for (k, s, p), n in sorted(sites.items(), key=lambda kv: -kv[1])
                    ],
                }
            )
            print(f"  {model} {label}: {rows[-1]['per_step']} syncs/step by rank", flush=True)
    return rows


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from harness import run_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "host_syncs")
    parser.add_argument("--fast", action="store_true", help="three layouts only")
    args = parser.parse_args()

    def launch(recipe: str, overrides: list, world: int, spec: str, out: Path, steps: int, **kw: Any) -> list:
        cli = ["--recipe", recipe, "--overrides", json.dumps(overrides), "--strategy", spec, "--steps", str(steps)]
        cli += ["--warmup", str(kw["warmup"]), "--syncs", str(kw["syncs"])]
        tag = f"{overrides[0].split('=')[1]}_{spec.replace(':', '_').replace(',', '_').replace('=', '')}"
        return run_distributed(str(WORKER), world, cli, out / tag, timeout=600)

    rows = run_host_syncs(args.out, launch, FAST if args.fast else None)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
