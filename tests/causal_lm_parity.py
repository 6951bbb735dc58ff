"""Shared by tests/test_hf_parity.py and tests/test_litgpt_parity.py: the cases tests/workers/cases/hf.py trains (labels
say "clip", "accum", "tuple"), the single-process reference loop, and the check of a run against it.

Runs are ``label -> (world, strategy spec, model name, tp)``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from conftest import Batch
from parity import assert_same_losses, assert_same_params
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

STEPS, GLOBAL_BATCH, SEQ_LEN, LR, EPS = 10, 8, 16, 1e-3, 1e-6
# "clip" clips the gradient norm at 0.05 (below the norms these steps have), "accum" accumulates 2 micro-batches
CLIP, ACCUMULATE = 0.05, 2


def options(label: str) -> dict:
    return {"clip": CLIP if "clip" in label else None, "accumulate": ACCUMULATE if "accum" in label else 1}


def launch(
    tmp_path_factory, folders: dict[str, str], runs: dict, tag: str, library: str, extra: dict | None = None
) -> Batch:
    """Every run of one world size in one launch of cases/hf.py; ``library`` "hf" or "litgpt"; ``extra``: more case
    keys per model name (``lora``: adapters)."""
    case = {"name": "train", "steps": STEPS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ_LEN, "lr": LR}
    extra = extra or {}
    spec = {
        label: (world, strategy, [{**case, "path": folders[model], "library": library, "tuple_batch": "tuple" in label,
                                   **options(label), **extra.get(model, {})}])
        for label, (world, strategy, model, _) in runs.items()
    }  # fmt: skip
    return Batch(tmp_path_factory, spec, tag=tag, worker="hf")


def train_reference(
    model: nn.Module,
    vocab_size: int,
    loss_of: Callable[[nn.Module, Tensor], Tensor],
    defaults: tuple,
    clip=None,
    accumulate: int = 1,
) -> tuple[list[float], dict[str, Tensor]]:
    """``STEPS`` AdamW steps of ``model`` in this process: torch's AdamW with the workers' two groups (``defaults``:
    the module class's lr, weight_decay, betas), the batches in the order the workers' sampler gives the whole
    world, ``clip`` with torch's norm clipping. (Accumulated micro-batches make up the same global batch, with
    equal token counts: one batch here, unless ``accumulate`` > 1 asks for the workers' global micro-batches, each
    loss / ``accumulate`` in the gradient: a loss that is no token mean, such as HF's MoE auxiliary loss, needs them.)
    Returns the losses per step (the mean of its micro-batches') and the final state."""
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": defaults[1]},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=defaults[2], eps=EPS)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (GLOBAL_BATCH * STEPS, SEQ_LEN), generator=g)
    sampler = DistributedSampler(range(len(tokens)), num_replicas=1, rank=0, shuffle=True, seed=0)
    micro = []
    for i, idx in enumerate(
        DataLoader(list(range(len(tokens))), batch_size=GLOBAL_BATCH // accumulate, sampler=sampler)
    ):
        loss = loss_of(model, tokens[idx])
        (loss / accumulate if accumulate > 1 else loss).backward()
        micro.append(loss.item())
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    losses = [sum(micro[i : i + accumulate]) / accumulate for i in range(0, len(micro), accumulate)]
    return losses, {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


def check(runs: Batch, label: str, spec: tuple, references: dict) -> None:
    """The run ``label`` against ``references[(model, clip)]``: losses per step (one rank per dp index: tp ranks
    see the same batch) and the final parameters."""
    world, strategy, model, tp = spec
    run = runs[label]
    want_losses, want_params = references[model, options(label)["clip"]]
    dp = world // tp // (2 if "pp=2" in strategy else 1)
    leaders = [d * tp for d in range(dp)]
    loss_rel = assert_same_losses(run.losses("train", leaders), want_losses, label)
    param_abs = assert_same_params(run.params("train"), want_params, label)
    print(f"{label}: max loss rel diff {loss_rel:.1e}, max param abs diff {param_abs:.1e}")


def assert_clipping_active(references: dict, model: str) -> None:
    """The "clip" cases test something: clipping at CLIP changes where the reference ends."""
    plain, clipped = references[model, None][1], references[model, CLIP][1]
    assert max((plain[k] - clipped[k]).abs().max().item() for k in plain) > 1e-3


def layout_of(strategy: str, world: int, tp: int) -> tuple[int, int]:
    """(pp, the ranks ZeRO 1-3 shard optimizer states over, 1 without ZeRO) of a worker's strategy spec."""
    name, _, items = strategy.partition(":")
    settings = dict(item.split("=") for item in items.split(",") if item)
    pp = int(settings.get("pp", 1))
    zero = name != "hybrid3d" or int(settings.get("zero_stage", 0)) > 0  # the registered zero1-3 shard
    return pp, int(settings.get("dp_shard", world // pp // tp)) if zero else 1


def check_frozen_base(runs: Batch, label: str, spec: tuple, adapters: list[Tensor]) -> None:
    """What every rank of a LoRA run holds for the frozen base (cases/hf.py's ``frozen_report``): no frozen parameter
    ever had a gradient before a step, none is in the optimizer or a ZeRO-1/2 flat buffer, the trainable elements
    are the ``adapters``' (under pp: over the stages of one (dp, tp) position; a stage may hold none, and then no
    state), optimizer state covers at most this rank's share of them (ZeRO 1-3), the frozen base is most of the
    model (so a frozen weight in the state would show); adapters replicated over tp equal on the tp ranks."""
    world, strategy, _, tp = spec
    pp, shards = layout_of(strategy, world, tp)
    total = sum(p.numel() for p in adapters)
    # the most one rank's share can be: ZeRO-3 splits each tensor on dim 0, the first ranks a row more when the
    # rows do not divide (at dp=8 a rank holds a quarter of A's 4 rows)
    padded = sum(math.ceil(p.shape[0] / shards) * p[0].numel() for p in adapters)
    reports = [runs[label].case("train", rank) for rank in range(world)]
    for rank, r in enumerate(reports):
        where = f"{label} rank {rank}"
        stages = [reports[rank % (world // pp) + s * (world // pp)] for s in range(pp)]
        held = sum(stage["trainable_numel"] for stage in stages)
        assert held == total, f"{where}: {held} trainable over the stages, {total} adapters"
        assert r["frozen_with_grad"] == [] and r["frozen_grads_now"] == [], where
        assert r["optimizer_params_frozen"] == 0 and r["flat_frozen"] == 0, where
        assert sum(stage["frozen_numel"] for stage in stages) > 5 * held, where
        share = min(r["trainable_numel"], padded)
        assert (r["state_numel"] > 0) == (share > 0), f"{where}: {r['state_numel']} optimizer-state elements"
        assert r["state_numel"] <= 2 * (share + world), f"{where}: {r['state_numel']} optimizer-state elements"
        assert r["flat_numel"] <= r["trainable_numel"] + world, f"{where}: flat buffer {r['flat_numel']}"
        if tp > 1 and share:
            assert r["replicated_sums"], f"{where}: no replicated adapter factor"
            assert r["replicated_sums"] == reports[rank - rank % tp]["replicated_sums"], where
