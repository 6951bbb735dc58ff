"""Case ``fabric``: the tiny GPT trained by a Fabric loop under the run's strategy (tests/test_fabric*.py).

The loop is the one a Fabric user writes (``fabric.setup``, ``no_backward_sync`` over accumulated micro-batches,
``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step``), on the same model, data and optimizer as
cases/gpt.py's Trainer runs, so its losses compare with the Trainer path's too. Strategy specs: "auto" (one
process, Lightning's own), a registered name ("zero3"), or "hybrid3d:tp=2,..." / "zero3:offload=1" (the class
with those settings).

Case keys: name, moe (GPTConfig overrides: moe_experts, ...), steps, accumulate, clip, global_batch, epoch_steps
(steps per pass over the data: every pass repeats the same batches), meta (build under
``fabric.init_module(empty_init=True)``), load (a checkpoint folder to fill the model and optimizer from first, a
Fabric or a Trainer one), save (a folder written after the last step), expect_error (set up an MLP the layout
cannot split; record the error), separately (``fabric.setup_module`` then ``fabric.setup_optimizers``), optimizer
("muon": MuonAdamW, fp32 Newton-Schulz), precision (default "32-true"), refused (record fabric.setup's ValueError).
Each rank records its micro-batches' local losses (``losses``), their ``fabric.all_reduce`` (``reduced``), and the
collectives' answers; rank 0 saves the gathered parameters as <name>_params.pt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import lightning as L
import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel.models import GPTModule, SyntheticTokens
from lightning_parallel.parallel.checkpoint.full import full_model_state_dict
from lightning_parallel.parallel.optim.muon import MuonAdamW

from .common import TINY, build_strategy


def passes(loader: DataLoader) -> Iterator:
    """The loader's batches, pass after pass (the sampler's epoch stays 0: every pass gives the same batches)."""
    while True:
        yield from loader


def fabric_loader(fabric: L.Fabric, case: dict, steps: int, accumulate: int, global_batch: int) -> DataLoader:
    """The tiny GPT's synthetic tokens split as the strategy's sampler arguments say (one process: whole), in
    micro-batches of the global batch over the batch ranks and accumulation; ``epoch_steps`` steps per pass."""
    sampler_kwargs = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    micro = global_batch // (accumulate * sampler_kwargs["num_replicas"])
    epoch_steps = case.get("epoch_steps", steps)
    data = SyntheticTokens(num_samples=global_batch * epoch_steps, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    return DataLoader(data, batch_size=micro, sampler=DistributedSampler(data, shuffle=True, seed=0, **sampler_kwargs))


def run_case(case: dict, ctx) -> dict:
    spec, world, out = ctx.strategy, ctx.world, ctx.out
    steps, accumulate = case.get("steps", 10), case.get("accumulate", 1)
    global_batch = case.get("global_batch", 16)
    precision, plugins = case.get("precision", "32-true"), None
    if precision == "16-mixed":  # Fabric would run bf16 on CPU: fp16 autocast asked for explicitly, as cases/gpt.py
        precision, plugins = None, [MixedPrecision("16-mixed", "cpu")]
    strategy = build_strategy(spec, fabric=True)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=precision, plugins=plugins)
    fabric.launch()
    pl.seed_everything(case.get("seed", 0), verbose=False)
    if case.get("expect_error"):  # a plain MLP (no tensor-parallel plan): the Trainer's refusal, on every rank
        try:
            fabric.setup(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
        except (TypeError, ValueError) as err:
            return {"name": case["name"], "error": f"{type(err).__name__}: {err}"}
        raise AssertionError("fabric.setup accepted a model the layout cannot split")
    with fabric.init_module(empty_init=bool(case.get("meta")) and spec != "auto"):
        config = dataclasses.replace(TINY, **case["moe"]) if case.get("moe") else TINY  # moe_experts, ...
        model = GPTModule(config=config, lr=1e-3, eps=1e-6)  # eps as cases/models.py's (see there)
    if case.get("optimizer") == "muon":  # MuonAdamW as cases/models.py's, over the unsplit parameters
        muon = MuonAdamW.from_module(model, lr=0.02, ns_dtype="float32", adamw_lr=model.lr, adamw_eps=model.eps)
        model.configure_optimizers = lambda: muon
    if case.get("separately"):  # setup_module, then the optimizer over the split model's parameters
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(model.configure_optimizers())
    else:  # the optimizer over the unsplit parameters: the strategy re-points it
        optimizer = model.configure_optimizers()
        try:
            model, optimizer = fabric.setup(model, optimizer)
        except ValueError as err:  # case key refused: a refusal of the optimizer's settings expected
            if not case.get("refused"):
                raise
            return {"name": case["name"], "error": f"{type(err).__name__}: {err}"}
    if case.get("load"):
        fabric.load(case["load"], {"model": model, "optimizer": optimizer}, strict=False)
    loader = fabric_loader(fabric, case, steps, accumulate, global_batch)
    losses, reduced, batches = [], [], passes(loader)
    for _ in range(steps):
        for i in range(accumulate):
            batch = next(batches)
            # cp: this rank's chunks of every sequence (the identity under other layouts)
            idx, targets = fabric.to_device(getattr(fabric.strategy, "shard_batch", lambda b: b)(batch))
            with fabric.no_backward_sync(model, enabled=i < accumulate - 1):
                loss = model.loss(model(idx), targets)
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
            reduced.append(fabric.all_reduce(loss.detach()).item())
        if case.get("clip"):
            fabric.clip_gradients(model, optimizer, max_norm=case["clip"])
        optimizer.step()
        optimizer.zero_grad()
    result = {"name": case["name"], "losses": losses, "reduced": reduced, "device": str(fabric.device)}
    fabric.barrier()
    result["broadcast"] = fabric.broadcast(fabric.global_rank * 10 + 7, src=world - 1)
    state = model.module.state_dict() if world == 1 else full_model_state_dict(model.module)
    if fabric.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / f"{case['name']}_params.pt")
    if case.get("save"):
        fabric.save(case["save"], {"model": model, "optimizer": optimizer, "steps": steps})
    return result
