"""What the MFU and memory sections train: GPT-2 small on the GPU, a tiny GPT in the dry run; the batch, the step
counts, the FLOPs of one step and the clock.

``conf/model/gpt2_124m.yaml`` is GPT-2 small's shape on byte tokens (vocabulary 256); here the vocabulary is GPT-2's,
padded to 50304 (a multiple of 64), so the head and the embedding weigh what they do in GPT-2 and the MFU compares
with published figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_parallel.models.gpt import GPTConfig, RecipeGPT
from lightning_parallel.parallel.measure.flops import LocalFlopCounter

GPT2_VOCAB = 50304
TINY = {"vocab_size": 512, "seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 64}  # the dry run's


@dataclass(frozen=True)
class Workload:
    model: dict[str, int]  # GPTConfig fields
    micro_batch: int  # samples per step (one process)
    warmup: int  # steps before the clock starts: compilation, allocator warm-up
    steps: int  # timed steps
    device: str
    compile: bool
    precision: str = "bf16-mixed"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Workload:
        if config["dry_run"]:
            return cls(TINY, micro_batch=4, warmup=1, steps=2, device="cpu", compile=False)
        raw = yaml.safe_load((Path(config["root"]) / "conf" / "model" / "gpt2_124m.yaml").read_text())
        shape = {k: raw[k] for k in ("seq_len", "n_layer", "n_head", "d_model")} | {"vocab_size": GPT2_VOCAB}
        return cls(shape, micro_batch=16, warmup=4, steps=12, device="cuda", compile=True)

    @property
    def gpt_config(self) -> GPTConfig:
        return GPTConfig(**self.model)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.model["seq_len"]

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same (inputs, targets) token batch for every variant, on the host."""
        g = torch.Generator().manual_seed(0)
        shape = (self.micro_batch, self.model["seq_len"] + 1)
        tokens = torch.randint(0, self.model["vocab_size"], shape, generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def model_yaml(self, folder: Path) -> Path:
        """This model as a conf/model-style YAML (what the planner reads)."""
        path = folder / "gpu_check_model.yaml"
        path.write_text(yaml.safe_dump({"defaults": ["gpt_schema"], **self.model}))
        return path


def flops_per_step(work: Workload) -> dict[str, float]:
    """Forward and backward FLOPs of one step, counted by the repository's counter on the meta device (shapes only),
    and the 6 N T + 12 L T^2 d rule of thumb beside it (N parameters without the position embedding)."""
    with torch.device("meta"):
        model = RecipeGPT(work.gpt_config)
    idx, targets = (t.to("meta") for t in work.batch())
    with LocalFlopCounter() as counter:
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
    m = work.model
    params = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name)
    rule = 6 * params * work.tokens_per_step + 12 * m["n_layer"] * work.tokens_per_step * m["seq_len"] * m["d_model"]
    return {"counted": float(counter.flops), "rule_of_thumb": float(rule), "params": float(params)}


class Clock:
    """Seconds between :meth:`start` and :meth:`stop`, the device drained at both (host overhead counts)."""

    def __init__(self, device: str) -> None:
        self.device, self.began, self.seconds = device, 0.0, 0.0
        self.warmup_seconds: float | None = None  # from the start of training to start(): compiling

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def start(self) -> None:
        self._sync()
        self.began = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        self.seconds = time.perf_counter() - self.began
        return self.seconds
