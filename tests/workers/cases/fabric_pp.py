"""Worker: the tiny GPT trained by a Fabric loop that runs each micro-batch with ``strategy.pipeline_step`` (pipeline
parallelism in Fabric); writes rank<N>.json. One process ("auto", Lightning's own strategy, no pipeline_step) runs
the plain Fabric loop (``model.loss(model(x), y)``, ``fabric.backward``): the reference.

Strategy specs as cases/fabric.py's ("hybrid3d:pp=2,tp=2,pp_schedule=gpipe"). Case keys: name, steps, accumulate,
clip, global_batch, fp16 (16-mixed; the loss scale after each step in ``scales``; fp16 > 1: the first scale),
epoch_steps (steps per pass over the data), meta (build under
``fabric.init_module(empty_init=True)``), load (a checkpoint folder, Fabric's or the Trainer's, filled in first),
save (a folder written after the last step). Each rank records its micro-batches' losses; rank 0 saves the whole
model's parameters as <name>_params.pt.
"""

from __future__ import annotations

import lightning as L
import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision import MixedPrecision

from lightning_parallel.models import GPTModule
from lightning_parallel.parallel.checkpoint.full import full_model_state_dict

from .common import TINY, build_strategy
from .fabric import fabric_loader, passes


def whole_state(fabric: L.Fabric, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on rank 0 (every stage's layers under pp; the Trainer's gathering)."""
    if fabric.world_size == 1:
        return module.state_dict()
    if getattr(fabric.strategy, "_pipeline", None) is None:
        return full_model_state_dict(module)
    everyone: list = [None] * fabric.strategy.parallel_dims.pp
    local = full_model_state_dict(module, every_rank=True)
    torch.distributed.all_gather_object(everyone, local, group=fabric.strategy.mesh.group("stage"))
    return {key: value for part in everyone for key, value in part.items()}


def micro_step(fabric: L.Fabric, model, idx, targets, accumulate: int) -> float:
    """One micro-batch's forward and backward; its loss."""
    if hasattr(fabric.strategy, "pipeline_step"):
        return fabric.strategy.pipeline_step(model, idx, targets, scale=1 / accumulate).item()
    loss = model.loss(model(idx), targets)
    fabric.backward(loss / accumulate)
    return loss.item()


def run_case(case: dict, ctx) -> dict:
    spec, world, out = ctx.strategy, ctx.world, ctx.out
    steps, accumulate = case.get("steps", 10), case.get("accumulate", 1)
    global_batch = case.get("global_batch", 16)
    # fp16: Lightning's own plugin with torch's GradScaler (precision="16-mixed" alone runs bf16 on CPU)
    first_scale = float(case["fp16"]) if case.get("fp16", 0) > 1 else 2.0**16
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=first_scale))
    precision = {"plugins": [plugin]} if case.get("fp16") else {"precision": "32-true"}
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=build_strategy(spec, fabric=True), **precision)
    fabric.launch()
    pl.seed_everything(0, verbose=False)
    with fabric.init_module(empty_init=bool(case.get("meta")) and spec != "auto"):
        model = GPTModule(config=TINY, lr=1e-3, eps=1e-6)  # eps as cases/models.py's (see there)
    optimizer = model.configure_optimizers()
    model, optimizer = fabric.setup(model, optimizer)
    if case.get("load"):
        fabric.load(case["load"], {"model": model, "optimizer": optimizer}, strict=False)
    loader = fabric_loader(fabric, case, steps, accumulate, global_batch)
    losses, scales, batches = [], [], passes(loader)
    for _ in range(steps):
        for i in range(accumulate):
            batch = next(batches)
            idx, targets = fabric.to_device(batch)
            with fabric.no_backward_sync(model, enabled=i < accumulate - 1):
                losses.append(micro_step(fabric, model, idx, targets, accumulate))
        if case.get("clip"):
            fabric.clip_gradients(model, optimizer, max_norm=case["clip"])
        optimizer.step()
        optimizer.zero_grad()
        if case.get("fp16"):
            scales.append(fabric.strategy.precision.scaler.get_scale())
    state = whole_state(fabric, model.module)
    if fabric.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / f"{case['name']}_params.pt")
    if case.get("save"):
        fabric.save(case["save"], {"model": model, "optimizer": optimizer, "steps": steps})
    return {"name": case["name"], "losses": losses, "scales": scales}
