"""Case ``simulate_ref``: the real run a simulation is held against (tests/test_simulate.py). The tiny GPT (or,
with ``hf_lora``, a tiny Hugging Face Llama with LoRA adapters on its frozen base) under the run's strategy on gloo,
a Fabric loop of ``steps`` steps (forward and loss, ``fabric.backward``, clipping by the whole model's norm,
``optimizer.step``) at ``global_batch`` samples and 32-true, as the simulator steps it (under pp,
``pipeline_step``: the schedule's forwards and backwards).
Each rank records the last step's collectives (lightning_parallel.simulate.trace's recorder, the mesh's groups
named as the simulator names them) and its model-state bytes after that step, before zero_grad."""

from __future__ import annotations

import lightning as L
import torch

from lightning_parallel.parallel.measure.memory import model_state_bytes
from lightning_parallel.simulate.trace import TraceRecorder
from lightning_parallel.simulate.world import mesh_groups

from .common import TINY, build_strategy


def run_case(case: dict, ctx) -> dict:
    fabric = L.Fabric(accelerator="cpu", devices=ctx.world, strategy=build_strategy(ctx.strategy, fabric=True))
    fabric.launch()
    torch.manual_seed(0)
    model, vocab, seq = _hf_lora(case["hf_lora"]) if "hf_lora" in case else _gpt(fabric, case)
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    samples = case["global_batch"] // fabric.strategy.parallel_dims.role_size("batch")
    recorder = TraceRecorder()
    for step in range(case["steps"]):
        idx = torch.randint(0, vocab, (samples, seq))
        targets = torch.randint(0, vocab, (samples, seq))
        idx, targets = getattr(fabric.strategy, "shard_batch", lambda b: b)((idx, targets))  # cp: this rank's chunks
        recorder.step = step
        with recorder:
            if fabric.strategy.parallel_dims.pp > 1:
                fabric.strategy.pipeline_step(model, idx, targets)
            else:
                fabric.backward(model.loss(model(idx), targets))
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
        states = model_state_bytes(model.module, [optimizer.optimizer])
        optimizer.zero_grad()
    last = [c.to_dict() for c in recorder.collectives(mesh_groups(fabric.strategy.mesh)) if c.step == case["steps"] - 1]
    return {"model_state_bytes": states, "collectives": last}


def _gpt(fabric: L.Fabric, case: dict) -> tuple:
    from lightning_parallel.models import GPTConfig, GPTModule

    with fabric.init_module(empty_init=True):
        model = GPTModule(config=GPTConfig(**case["gpt"]) if "gpt" in case else TINY)
    return model, model.config.vocab_size, model.config.seq_len


def _hf_lora(spec: dict) -> tuple:
    """``HFCausalLM`` of a Llama config with peft's LoRA on every linear layer but the head, as the simulator's
    ``lora_rank`` builds it (lightning_parallel/simulate/model.py ``Adapters``), built with values (its base
    hashed, as in any real run)."""
    import peft
    import transformers

    from lightning_parallel.hf import HFCausalLM

    config = transformers.LlamaConfig(**spec["llama"])
    rank = spec["rank"]
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    model = HFCausalLM(config, peft_config=lora, base_dtype=spec.get("base_dtype"))
    return model, config.vocab_size, spec["seq_len"]
