"""Section fp8: bf16-mixed against precision=fp8 (torchao float8 Linear layers over the bf16 autocast), tokens/s and
MFU, on GPT-2 small and a ~1B Llama (TinyLlama 1.1B's shape, random weights) at sequence 2048, compiled, one GPU.

Each (model, precision) is a plain loop in this process: the model built on the GPU, converted for fp8 by
:func:`lightning_parallel.parallel.float8.convert` (the recipes' mechanism), ``torch.compile``d whole, fused AdamW,
``warmup`` steps (the compile) before the clock. MFU = FLOPs of a step (the repository's counter on the meta device) x
steps/s / the device's dense bf16 peak, for both precisions: fp8's figure above bf16's is its speed-up. The runs go in
the order GPT-2 bf16, GPT-2 fp8, Llama bf16, Llama fp8 while the section's time lasts; a run that would not fit is
reported as not run, with the reason. The dry run: a tiny GPT and a tiny Llama on the CPU (fp8 emulated), 2 steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.models.gpt import GPTConfig, RecipeGPT
from lightning_parallel.parallel.float8 import Float8Settings, convert
from lightning_parallel.parallel.measure.flops import LocalFlopCounter, peak_flops

from .mfu import adamw
from .section import log
from .workload import GPT2_VOCAB, Clock

SEQ = 2048
LLAMA_1B = {  # TinyLlama 1.1B's shape
    "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": SEQ,
}  # fmt: skip
TINY_LLAMA = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
GPT2 = {"vocab_size": GPT2_VOCAB, "seq_len": SEQ, "n_layer": 12, "n_head": 12, "d_model": 768}
TINY_GPT = {"vocab_size": 512, "seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 64}
NEEDED_S = {"gpt2": 25.0, "llama_1b": 60.0}  # a run's estimated seconds on the H200 (compile included)


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM that returns its logits (the loop's loss is the same for both models)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits


def build(name: str, shape: dict[str, int]) -> nn.Module:
    if name.startswith("gpt"):
        return RecipeGPT(GPTConfig(**shape))
    import transformers

    return LogitsOnly(transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape)))


def workloads(dry_run: bool) -> list[tuple[str, dict[str, int], int, int]]:
    """(model, shape, micro batch, sequence length)."""
    if dry_run:
        return [("gpt2", TINY_GPT, 2, 64), ("llama_1b", TINY_LLAMA, 2, 64)]
    return [("gpt2", GPT2, 8, SEQ), ("llama_1b", LLAMA_1B, 2, SEQ)]


def step_flops(name: str, shape: dict[str, int], idx: torch.Tensor) -> float:
    """Forward and backward FLOPs of one step, counted on the meta device (shapes only)."""
    with torch.device("meta"):
        model = build(name, shape)
    with LocalFlopCounter() as counter:
        logits = model(idx.to("meta"))
        F.cross_entropy(logits.flatten(0, 1).float(), idx.to("meta").flatten()).backward()
    return float(counter.flops)


def measure(name: str, shape: dict[str, int], micro: int, seq: int, precision: str, dry_run: bool) -> dict[str, Any]:
    device = "cpu" if dry_run else "cuda"
    warmup, steps = (1, 2) if dry_run else (3, 8)
    torch.manual_seed(0)
    model = build(name, shape).to(device)
    converted = 0
    if precision == "fp8":
        report = convert(model, Float8Settings(), torch.device(device))
        converted = sum(why == "float8" for why in report.values())
    step_model = model if dry_run else torch.compile(model)
    optimizer = adamw(model.parameters())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocab_size"], (micro, seq + 1), generator=g).to(device)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    clock, losses, began = Clock(device), [], time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            clock.start()
            clock.warmup_seconds = clock.began - began
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = step_model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    clock.stop()
    flops = step_flops(name, shape, idx.cpu())
    per_second = steps / clock.seconds
    peak = peak_flops(torch.cuda.get_device_name(0), "bf16") if device == "cuda" else None
    return {
        "model": name,
        "precision": precision,
        "params": sum(p.numel() for p in model.parameters()),
        "float8_linears": converted,
        "micro_batch": micro,
        "seq_len": seq,
        "compiled": not dry_run,
        "warmup_seconds": clock.warmup_seconds,
        "tokens_per_second": micro * seq * per_second,
        "flops_per_step": flops,
        "mfu_of_bf16_peak": flops * per_second / peak if peak else None,
        "losses": [float(v) for v in losses],
    }


def run(config: dict[str, Any]) -> dict[str, Any]:
    dry_run, runs = bool(config["dry_run"]), []
    for name, shape, micro, seq in workloads(dry_run):
        for precision in ("bf16-mixed", "fp8"):
            left = config["deadline"] - time.monotonic()
            if not dry_run and left < NEEDED_S[name]:
                runs.append({"model": name, "precision": precision, "not_run": f"{left:.0f} s left, needs ~"
                             f"{NEEDED_S[name]:.0f} s"})  # fmt: skip
                continue
            log(f"fp8: {name} {precision} ...")
            runs.append(measure(name, shape, micro, seq, precision, dry_run))
            if torch.cuda.is_available() and not dry_run:
                torch.cuda.empty_cache()
    speedups = {}
    for name in {r["model"] for r in runs}:
        pair = {r["precision"]: r.get("tokens_per_second") for r in runs if r["model"] == name}
        if pair.get("bf16-mixed") and pair.get("fp8"):
            speedups[name] = pair["fp8"] / pair["bf16-mixed"]
    return {"runs": runs, "fp8_speedup": speedups, "emulated": dry_run}
