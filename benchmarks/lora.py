"""``make bench``'s LoRA section: fine-tuning a Hugging Face Llama with peft's LoRA adapters against training every
weight, at the same layout, in the same run (``python benchmarks/bench.py --only lora``).

Per layout, LoRA and full fine-tuning launches interleave (A, B, A, B, ...); for each: the median step time, the
largest rank's model-state bytes (parameters, gradients, AdamW states, from the tensors after an optimizer step)
against the formula (full: ZeRO's; LoRA: :func:`~lightning_parallel.planning.adapters.adapter_model_state_bytes`:
the frozen base at its own bytes, sharded as ZeRO-3 and tp shard it, plus 16 bytes per adapter parameter sharded
as the ZeRO stage shards them), and the bytes each rank sends in one step by collective: under ZeRO-3 the frozen
base's all-gathers stay, the gradient reduction shrinks to the adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median
from typing import Any

from lightning_parallel.parallel.data.stages import stage_sharding
from lightning_parallel.planning.adapters import adapter_model_state_bytes

# a Llama of about 2.5M parameters (grouped-query attention), byte-level vocabulary, 128-token sequences
LLAMA = [
    "model=hf_llama_tiny",
    "model.seq_len=128",
    "model.config.hidden_size=256",
    "model.config.intermediate_size=512",
    "model.config.num_hidden_layers=4",
    "model.config.num_attention_heads=8",
    "model.config.num_key_value_heads=4",
    "model.config.max_position_embeddings=128",
    "data.global_batch_size=16",
]
RANK = 8
LORA = ["peft=lora", f"peft.r={RANK}", f"peft.alpha={2 * RANK}"]  # every linear layer of the blocks (the default)
WORLD = 2
LAYOUTS = {  # label: (strategy spec, zero stage, dp, tp)
    "zero2": ("zero2", 2, 2, 1),
    "zero3": ("zero3", 3, 2, 1),
    "tp=2": ("hybrid3d:tp=2", 0, 1, 2),
}


def run_lora(out: Any, repeats: int, steps: int, launch: Callable[..., list], step_time: Callable) -> list[dict]:
    rows = []
    for label, (spec, stage, dp, tp) in LAYOUTS.items():
        times: dict[str, list[float]] = {"full": [], "lora": []}
        ranks: dict[str, list[dict[str, Any]]] = {}
        for _ in range(repeats):
            for kind, extra in (("lora", LORA), ("full", [])):
                got = launch("gpt", [*LLAMA, *extra], WORLD, spec, out, steps, tag=kind)
                ranks.setdefault(kind, got)  # bytes do not depend on the repeat: the first launch's
                times[kind].append(step_time(got))
                print(f"  llama {label} {kind}: {times[kind][-1] * 1e3:.0f} ms/step", flush=True)
        row: dict[str, Any] = {"layout": label, "strategy": spec, "world": WORLD, "zero_stage": stage, "tp": tp}
        for kind in ("full", "lora"):
            row[kind] = _figures(ranks[kind], times[kind], kind, stage, dp, tp)
        rows.append(row)
    return rows


def _figures(ranks: list[dict[str, Any]], times: list[float], kind: str, stage: int, dp: int, tp: int) -> dict:
    worst = max(ranks, key=lambda r: r["model_state_bytes"]["total"])
    sent = max(ranks, key=lambda r: r["comm_sent_bytes_per_step"] or 0)
    counts = ranks[0]["param_counts"]
    trainable, frozen = counts["trainable"], counts["frozen"]
    if kind == "full":
        formula = stage_sharding(stage).state_bytes_exact(trainable, dp) / tp
    else:
        formula = adapter_model_state_bytes(frozen, trainable, zero_stage=stage, dp=dp, tp=tp, pp=1,
                                            base_bytes_per_param=4)  # fmt: skip
    return {
        "step_s": median(times),
        "samples": times,
        "trainable": trainable,
        "frozen": frozen,
        "model_state_bytes": worst["model_state_bytes"],
        "formula_bytes": formula,
        "sent_bytes": sent["comm_sent_bytes_per_step"] or 0,
        "by_op": {k: v["sent_bytes"] for k, v in sorted((sent["comm_bytes_per_step"] or {}).items())},
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def lora_lines(rows: list[dict[str, Any]]) -> list[str]:
    first = rows[0]["lora"]
    lines = [
        "## LoRA against full fine-tuning",
        "",
        f"A Hugging Face Llama of {first['trainable'] + first['frozen']:,} parameters (4 layers, width 256, grouped-"
        f"query attention); LoRA r={RANK} on every linear layer of the blocks: {first['trainable']:,} adapter "
        f"parameters ({first['trainable'] / (first['trainable'] + first['frozen']):.1%} of the model's). World "
        f"{WORLD}, the same batches, launches interleaved, median step times. Model states: the largest rank's, "
        "counted from the tensors after an optimizer step, against the formula (full: ZeRO's 16P split as the stage "
        "splits it; LoRA: the frozen base's 4 bytes per parameter split as ZeRO-3 and tp split it, plus 16 bytes per "
        "adapter parameter split as the stage splits them). Sent: the busiest rank's bytes in one step (ring "
        "convention).",
        "",
        "| layout | run | step ms | speed vs full | model states MiB | formula MiB | ratio | sent KiB | by op KiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        full = row["full"]
        for kind in ("full", "lora"):
            f = row[kind]
            ops = ", ".join(f"{k} {v / 1024:.0f}" for k, v in f["by_op"].items())
            total = f["model_state_bytes"]["total"]
            lines.append(
                f"| `{row['strategy']}` | {kind} | {f['step_s'] * 1e3:.0f} | {full['step_s'] / f['step_s']:.2f} | "
                f"{_mib(total)} | {_mib(f['formula_bytes'])} | {total / f['formula_bytes']:.3f} | "
                f"{f['sent_bytes'] / 1024:.0f} | {ops} |"
            )
    return [*lines, ""]
