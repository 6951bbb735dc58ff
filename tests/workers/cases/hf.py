"""Case ``hf``: trains a Hugging Face causal LM (``HFCausalLM`` loaded from a save_pretrained folder) or, with case key
``library: litgpt``, LitGPT's GPT (``LitGPTCausalLM`` from a litgpt checkpoint folder) under one strategy for a
list of cases; rank 0 saves the gathered parameters as <name>_params.pt, as cases/gpt.py does (tests/conftest.py's
``Batch``, ``worker="hf"``).

Case keys: name, path (the model folder), steps, global_batch, seq_len, lr, tuple_batch (batches as
(input_ids, labels) instead of dicts), accumulate (micro-batches per optimizer step), clip (gradient norm), lora
(LoraConfig keyword arguments; with ``library: litgpt`` LitGPT's lora_* settings: LoRA adapters on the frozen
model; the result then says what each rank holds for the frozen weights, see ``frozen_report``), epoch_steps (steps
per epoch, default steps), save and save_step (a checkpoint written at the start of the epoch that begins after
save_step steps, see ``SaveAt``), resume (ckpt_path for fit), config (instead of path: a tiny transformers config,
``model_type`` and its fields, the weights drawn after seed 0; the result then says how each rank holds the experts),
optimizer ("muon": MuonAdamW, fp32 Newton-Schulz), precision ("fp8": Float8Precision with the case's ``fp8``
settings; the result's ``fp8_report`` is the plugin's report), flip_batch (each batch's samples reversed),
moe_one_group (HF MoE under pp: the old exchange of router sums on one group, ``hf/moe_pipeline.py``'s ``_ONE_GROUP``:
tests/test_hf_moe_pipeline_order.py shows strict mode failing on it).
"""

from __future__ import annotations

import types

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.data import Dataset

from lightning_parallel.hf import HFCausalLM, moe_pipeline
from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.mesh import TP
from lightning_parallel.parallel.optim.muon import MuonAdamW

from .common import ShardedData, batch_ranks, build_strategy, make_trainer, save_full_params
from .lora_memory import LoraMemoryProbe


class RandomTokens(Dataset):
    """Fixed random token rows; dict samples (``input_ids``, ``labels``) or (input_ids, labels) tuples."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, as_tuple: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)
        self.as_tuple = as_tuple

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        row = self.tokens[i]
        return (row, row) if self.as_tuple else {"input_ids": row, "labels": row}


def recording(module_class: type) -> type:
    """``module_class`` that keeps each training step's loss (``self.losses``)."""

    class Recording(module_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.losses: list[float] = []

            self.frozen_with_grad: set[str] = set()  # frozen parameters seen with a gradient before a step

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            self.frozen_with_grad |= {
                n for n, p in self.named_parameters() if not p.requires_grad and p.grad is not None
            }

    return Recording


class SaveAt(pl.Callback):
    """Saves a checkpoint at the start of the epoch that begins after ``step`` optimizer steps, or at the end.
    (Lightning 2.6 resumes such a checkpoint with one batch of the epoch it was saved in, then the next epoch:
    epochs of one step make that the uninterrupted order.)"""

    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)  # save_step = steps: at the end


def module_class(library: str) -> type:
    if library == "litgpt":
        from lightning_parallel.litgpt import LitGPTCausalLM

        return LitGPTCausalLM
    return HFCausalLM


def run_case(case: dict, ctx) -> dict:
    strategy, world, out = ctx.strategy, ctx.world, ctx.out
    pl.seed_everything(0, verbose=False)
    steps, global_batch, accumulate = case.get("steps", 10), case.get("global_batch", 8), case.get("accumulate", 1)
    strategy_obj = build_strategy(strategy)
    micro = global_batch // (accumulate * batch_ranks(strategy_obj, world))
    peft = {}
    if case.get("lora") and case.get("library") == "litgpt":
        peft = {"lora": case["lora"]}  # LitGPT's own settings (litgpt.lora.Config's lora_* fields)
    elif case.get("lora"):
        from peft import LoraConfig

        peft = {"peft_config": LoraConfig(**case["lora"])}
        # case keys base_dtype (HFCausalLM's) and memory (what each rank holds, from its tensors: cases/lora_memory.py)
        peft.update({"base_dtype": case["base_dtype"]} if case.get("base_dtype") else {})
    source = model_source(case)
    model = recording(module_class(case.get("library", "hf")))(source, lr=case.get("lr", 1e-3), eps=1e-6, **peft)
    if case.get("optimizer") == "muon":  # MuonAdamW in place of the module's AdamW, fp32 Newton-Schulz for parity
        model.configure_optimizers = types.MethodType(muon_optimizer, model)
    epoch = global_batch * case.get("epoch_steps", steps)
    data = RandomTokens(epoch, case.get("seq_len", 16), model.model.config.vocab_size)
    data.as_tuple = bool(case.get("tuple_batch"))
    probes = [LoraMemoryProbe(steps)] if case.get("memory") else []
    precision, plugins = case.get("precision", "32-true"), None
    if precision == "fp8":  # torchao float8 over bf16-mixed (tests/test_fp8_hf_parity.py); fp8: the plugin's settings
        from lightning_parallel.plugins.float8 import Float8Precision

        precision, plugins = None, [Float8Precision(device="cpu", **case.get("fp8", {}))]
    trainer = make_trainer(
        world,
        strategy_obj,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=case.get("clip"),
        precision=precision,
        plugins=plugins,
        callbacks=probes + ([SaveAt(case["save"], case["save_step"])] if case.get("save") else []),
    )
    moe_pipeline._ONE_GROUP = bool(case.get("moe_one_group"))
    datamodule = ShardedData(data, micro, flip=bool(case.get("flip_batch")))
    trainer.fit(model, datamodule=datamodule, ckpt_path=case.get("resume"))
    save_full_params(trainer, model, out / f"{case['name']}_params.pt")
    # one loss per optimizer step: the mean of its micro-batches' (equal token counts: the global batch's loss)
    losses = [sum(model.losses[i : i + accumulate]) / accumulate for i in range(0, len(model.losses), accumulate)]
    result = {"name": case["name"], "losses": losses, "bytes_read": getattr(model, "weight_bytes_read", 0)}
    optimizer = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0]) if trainer.optimizers else None
    result["muon_exchange"] = dict(getattr(optimizer, "exchange", {}))  # MuonAdamW: the last step's exchange
    result["fp8_report"] = dict(getattr(trainer.precision_plugin, "report", {}))  # fp8: Linear path -> float8 or why
    result.update(probes[0].result() if probes else {})
    result.update(experts_held(model) if case.get("config") else {})
    return {**result, **(frozen_report(model, trainer) if peft else {})}


def muon_optimizer(self) -> MuonAdamW:
    """Muon on the matrices (LoRA: the adapters' A and B), AdamW with the module's settings on the rest."""
    return MuonAdamW.from_module(self, lr=0.02, ns_dtype="float32", adamw_lr=self.lr, adamw_betas=self.betas,
                                 adamw_eps=self.eps, adamw_weight_decay=self.weight_decay)  # fmt: skip


def model_source(case: dict):
    """The case's model: its folder, or a transformers config built here (case key ``config``)."""
    if case.get("config"):
        import transformers

        return transformers.AutoConfig.for_model(**case["config"])
    return case["path"]


def experts_held(model: torch.nn.Module) -> dict:
    """How this rank holds each expert tensor: its local shape and the mesh axes it is split over."""
    held = {
        n: [list(local(p).shape), list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else []]
        for n, p in model.named_parameters()
        if ".experts." in n and not p.is_meta
    }
    return {"experts_held": held}


def frozen_report(model: torch.nn.Module, trainer: pl.Trainer) -> dict:
    """What this rank holds for the frozen base after training: gradients seen, optimizer-state and flat-buffer
    elements against the trainable elements, and a checksum of each adapter replicated over tp (equal on tp ranks)."""
    optimizer = trainer.optimizers[0]
    params = list(model.parameters())
    frozen = {id(p) for p in params if not p.requires_grad}  # ZeRO-1/2's optimizer holds flat slices, not these
    view = trainer.strategy.sharding.state_view(optimizer) if hasattr(trainer.strategy, "sharding") else None
    flat_slices = [s for group in view.slices for s in group] if view is not None else []  # ZeRO-1/2's flat buffers
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    replicated = {  # this rank's part of each adapter replicated over tp (its dp shard under ZeRO-3)
        n: local(p).double().sum().item() for n, p in model.named_parameters() if p.requires_grad and tp_replicated(p)
    }
    return {
        "frozen_with_grad": sorted(model.frozen_with_grad),
        "frozen_grads_now": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None],
        "trainable_numel": sum(p.numel() for p in params if p.requires_grad),
        "frozen_numel": sum(p.numel() for p in params if not p.requires_grad),
        "optimizer_params_frozen": sum(id(p) in frozen for g in optimizer.param_groups for p in g["params"]),
        "state_numel": sum(local(v).numel() for v in state),
        "flat_numel": sum(s.buffer.numel() for s in flat_slices),
        "flat_frozen": sum(not p.requires_grad for s in flat_slices for p in s.params),
        "replicated_sums": replicated,
    }


def tp_replicated(p: torch.Tensor) -> bool:
    names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
    return TP in names and isinstance(p.placements[names.index(TP)], Replicate)
