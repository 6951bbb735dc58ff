"""The simulator at the published runs' world sizes and at >= 1,024 ranks (issue 43's Must show).

    python benchmarks/simulate_scale.py --run published      # Megatron-LM Table 1, Llama 3 Table 4 rows
    python benchmarks/simulate_scale.py --run scale          # three layouts at 1,024+ ranks, dense and MoE
    python benchmarks/simulate_scale.py --table              # the Markdown tables of docs/simulate.md

``--run`` simulates each row (``lightning_parallel.simulate.simulate``: the real parallelize and training steps,
each chosen rank in its own process on the fake process group) and stores the report (every rank's states,
activations, peak, FLOPs and recorded collectives, the simulation's wall time) in
``benchmarks/simulate_scale.json``; a row that cannot be simulated yet (pipeline parallelism before the simulator
runs it) is stored with the reason. ``--table`` renders the tables from the stored reports, the step time
recomputed from each rank's recorded collectives and counted FLOPs with today's calibrated time model
(:mod:`lightning_parallel.simulate.timing`), beside the planner's figures for the same layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from lightning_parallel.planning.cluster import Cluster, get_device
from lightning_parallel.planning.hf_config import ModelShape
from lightning_parallel.planning.layout import Layout
from lightning_parallel.planning.published import RUNS, Run
from lightning_parallel.planning.search import complete
from lightning_parallel.simulate.timing import step_time
from lightning_parallel.simulate.trace import Collective

OUT = Path(__file__).with_name("simulate_scale.json")
LAYOUT_FIELDS = ("tp", "pp", "dp", "cp", "ep", "zero_stage", "dp_shard", "sequence_parallel")
LAYOUT_FIELDS += ("activation_checkpointing", "pp_schedule", "pp_virtual_stages", "microbatches")
LAYOUT_FIELDS += ("reshard_after_forward", "overlap_grad_reduce")


def model_of(shape: ModelShape) -> dict[str, Any]:
    """The model of a published shape: Llama 3 as a Hugging Face llama config, Megatron's GPTs as the recipe GPT."""
    if shape.gated:
        return {
            "model_type": "llama",
            "vocab_size": shape.vocab,
            "hidden_size": shape.hidden,
            "intermediate_size": shape.ffn,
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "max_position_embeddings": shape.seq_len,
            "tie_word_embeddings": False,
            "_name_or_path": shape.name,
        }
    # Megatron's GPT is the recipe GPT's architecture (GeLU 4h MLP, learned positions, tied embeddings)
    gpt = {"vocab_size": shape.vocab, "seq_len": shape.seq_len, "n_layer": shape.layers, "n_head": shape.heads}
    return {"gpt": {**gpt, "d_model": shape.hidden, "mlp_ratio": 4, "dropout": 0.0}, "_name_or_path": shape.name}


def two_ranks(gpus: int, tp: int, pp: int) -> list[int]:
    """Two ranks per row (minutes a row on a shared 2-core machine): rank 0 and the last data-parallel rank beside
    it (they share a data-parallel group, whose sequences are compared); under pp the first rank of the first and
    of the last stage instead."""
    return [0, (pp - 1) * gpus // pp] if pp > 1 else [0, gpus - tp]


def published_rows() -> list[dict[str, Any]]:
    """Each published run's layout as the planner completes it (the microbatches a paper leaves open)."""
    out = []
    for run in RUNS:
        est = complete(run.shape, run.cluster, run.layout, run.workload, run.free)
        x = est.layout
        layout = {f: getattr(x, f) for f in LAYOUT_FIELDS if getattr(x, f) != getattr(Layout(), f)}
        if run.shape.gated and x.pp > 1 and layout.get("sequence_parallel"):
            # sequence parallelism under pp is refused for Hugging Face models (SP_WITH_PP): simulated without it
            layout["sequence_parallel"] = False
        out.append(
            {
                "kind": "published",
                "label": run.label,
                "source": run.source,
                "model": model_of(run.shape),
                "gpus": run.cluster.gpus,
                "device": run.cluster.device.name,
                "layout": layout,
                "seq_len": run.workload.seq_len,
                "global_batch": run.workload.global_batch,
                "published_tflops": run.tflops,
                "ranks": two_ranks(run.cluster.gpus, x.tp, x.pp),
            }
        )
    return out


LLAMA_70B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "_name_or_path": "Llama 3 70B shape",
}
LLAMA_8B = {
    **LLAMA_70B,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "_name_or_path": "Llama 3 8B shape",
}
MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "_name_or_path": "Mixtral 8x7B shape",
}
# a recipe GPT with 64 routed experts of 1,408 in every block (a DeepSeek-MoE-16B-like width), top-2
MOE_GPT = {"gpt": {"vocab_size": 102400, "seq_len": 4096, "n_layer": 28, "n_head": 16, "d_model": 2048,
                   "mlp_ratio": 4, "dropout": 0.0, "moe_experts": 64, "moe_top_k": 2, "moe_every": 1,
                   "moe_hidden": 1408}, "_name_or_path": "GPT MoE 64 experts"}  # fmt: skip
# three layouts at >= 1,024 ranks: dense tp x ZeRO-3, dense plain ZeRO-3 (HSDP), MoE with ep
SCALE = [
    {"label": "Llama 70B tp=8 x ZeRO-3 dp=128", "model": LLAMA_70B, "gpus": 1024, "seq_len": 8192,
     "layout": {"tp": 8, "zero_stage": 3, "sequence_parallel": True, "activation_checkpointing": "full"},
     "ranks": [0, 1016]},
    {"label": "Llama 8B HSDP dp=2048 (shard 64)", "model": LLAMA_8B, "gpus": 2048, "seq_len": 8192,
     "layout": {"zero_stage": 3, "dp_shard": 64, "activation_checkpointing": "full"}, "ranks": [0, 63]},
    {"label": "GPT MoE 64 experts ep=8 x ZeRO-1 dp=1024", "model": MOE_GPT, "gpus": 1024, "seq_len": 4096,
     "layout": {"ep": 8, "zero_stage": 1}, "ranks": [0, 7]},
    {"label": "Mixtral 8x7B ep=8 x ZeRO-1 dp=1024", "model": MIXTRAL, "gpus": 1024, "seq_len": 4096,
     "layout": {"ep": 8, "zero_stage": 1}, "ranks": [0, 7]},
]  # fmt: skip


def run_rows(rows: list[dict[str, Any]], only: str | None, again: bool = False, first: bool = False) -> None:
    """Simulate ``rows`` (those whose label contains ``only``), skipping those stored simulated unless ``again``;
    ``first``: rank 0 of each row only."""
    from lightning_parallel.simulate import simulate

    for row in rows:
        stored = json.loads(OUT.read_text()) if OUT.is_file() else {}
        done = "simulation" in stored.get(row["label"], {})
        if (only and only not in row["label"]) or (done and not again):
            continue
        start = time.perf_counter()
        try:
            sim = simulate(
                _model(row["model"]),
                row["gpus"],
                row["layout"],
                device=row.get("device", "h100"),
                seq_len=row["seq_len"],
                global_batch_size=row.get("global_batch"),
                precision="bf16-mixed",
                steps=1,
                ranks=row["ranks"][:1] if first else row.get("ranks"),
            )
            report: dict[str, Any] = {"simulation": sim.to_dict()}
        except (ValueError, TypeError) as err:
            report = {"refused": str(err)}
        except RuntimeError as err:  # a rank's simulation failed: its traceback's last line
            report = {"failed": str(err).strip().splitlines()[-1]}
        report.update(row=row, wall_s=time.perf_counter() - start)
        stored = json.loads(OUT.read_text()) if OUT.is_file() else {}
        stored[row["label"]] = report
        OUT.write_text(json.dumps(stored, separators=(",", ":")))  # compact: every rank's collectives
        outcome = next((k for k in ("refused", "failed") if k in report), "simulated")
        print(f"{row['label']}: {outcome} in {report['wall_s']:.0f} s", flush=True)


def _model(spec: dict[str, Any]) -> Any:
    """A Hugging Face config dict, or ``{"gpt": GPTConfig's fields}`` for the recipe GPT."""
    if "gpt" in spec:
        from lightning_parallel.models import GPTConfig

        return GPTConfig(**spec["gpt"])
    return dict(spec)


def _collectives(rank: dict[str, Any]) -> list[Collective]:
    out = []
    for c in rank["collectives"]:
        c = dict(c, shape=tuple(c["shape"]), ranks=tuple(c["ranks"]))
        out.append(Collective(**{f.name: c[f.name] for f in dataclasses.fields(Collective) if f.name in c}))
    return out


def rank_time(sim: dict[str, Any], rank: dict[str, Any]) -> Any:
    """The step time of a stored rank under today's calibrated model."""
    cluster = Cluster(sim["world_size"], sim["gpus_per_node"], get_device(sim["device"]))
    layout = sim["row_layout"]
    zero3 = layout.get("zero_stage") == 3
    bubble = rank["step_time"]["bubble"]
    hide = zero3 or bool(layout.get("overlap_grad_reduce"))
    return step_time(rank["flops_per_step"], _collectives(rank), cluster, bubble, zero3, hide)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def table(kind: str) -> str:
    stored = json.loads(OUT.read_text())
    lines = [
        "| row | GPUs | layout | rank | states GB | activations GB | peak GB (card) | planner GB | sent per step GB "
        "| step s (planner) | TFLOP/s per GPU (published) | MFU | simulated in |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = [r.label for r in RUNS] if kind == "published" else [r["label"] for r in SCALE]
    for label in [k for k in order if k in stored]:
        rep = stored[label]
        row = rep["row"]
        shown = {
            k: v for k, v in row["layout"].items() if row["layout"].get("pp", 1) > 1 or not k.startswith(("mi", "pp_"))
        }
        lay = ",".join(f"{k}={v}" for k, v in shown.items())
        if "refused" in rep or "failed" in rep:
            why = (
                rep["refused"].split(":")[0] + ": not simulated yet" if "refused" in rep else f"failed: {rep['failed']}"
            )
            lines.append(f"| {label} | {row['gpus']:,} | `{lay}` | {why} |")
            continue
        sim = dict(rep["simulation"], row_layout=row["layout"])
        planner, planner_step = _planner(row)
        card = get_device(sim["device"]).memory
        for r in sim["ranks"]:
            t = rank_time(sim, r)
            sent = sum(c["sent_bytes"] * c.get("count", 1) for c in r["collectives"])
            tflops = r["flops_per_step"] / t.total / 1e12
            pub = f" ({row['published_tflops']:.0f})" if row.get("published_tflops") else ""
            lines.append(
                f"| {label} | {row['gpus']:,} | `{lay}` | {r['rank']} | {_gb(r['model_state_bytes']['total'])} | "
                f"{_gb(r['activation_bytes'])} | {_gb(r['peak_bytes'])} ({_gb(card)}) | {planner} | {_gb(sent)} | "
                f"{t.total:.2f} ({planner_step}) | {tflops:.0f}{pub} | {t.mfu:.1%} | {r['simulation_seconds']:.0f} s |"
            )
    return "\n".join(lines)


def _planner(row: dict[str, Any]) -> tuple[str, str]:
    """The analytic planner's states + activations per GPU for a published row's layout, at what the simulation
    runs: at pp=1 the dp rank's whole batch in one pass (the simulator does not accumulate microbatches); the
    activations without the layer a full checkpoint rebuilds in backward (after the simulator's reading)."""
    run: Run | None = next((r for r in RUNS if r.label == row["label"]), None)
    if run is None:
        return "-", "-"
    layout, free = run.layout, run.free
    if layout.pp == 1:
        layout, free = dataclasses.replace(layout, microbatches=1), tuple(f for f in free if f != "microbatches")
    est = complete(run.shape, run.cluster, layout, run.workload, free)
    # what the forward leaves for backward: without the layer a full checkpoint rebuilds during backward
    return f"{est.states / 1e9:.2f} + {(est.activations - est.recompute) / 1e9:.2f}", f"{est.step_time:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", choices=["published", "scale"])
    p.add_argument("--only", help="rows whose label contains this")
    p.add_argument("--again", action="store_true", help="simulate rows already stored again")
    p.add_argument("--first-rank", action="store_true", help="simulate rank 0 of each row only")
    p.add_argument("--table", action="store_true")
    args = p.parse_args(argv)
    if args.run:
        rows = published_rows() if args.run == "published" else SCALE
        run_rows(rows, args.only, args.again, args.first_rank)
    if args.table:
        print(table("published"), "\n", table("scale"), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
