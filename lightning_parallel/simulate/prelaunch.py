"""``strategy=auto strategy.simulate=true``: the planner's pick simulated at its full world size before launch
(:func:`lightning_parallel.simulate.simulate`), refused with the figures when a rank does not fit. The recipe
scripts hand :func:`simulate_pick` to :func:`lightning_parallel.recipes.auto.resolve_auto` (the simulator sits
above the recipes in the package's layers)."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.recipes.config import GPTModelConf
from lightning_parallel.recipes.gpt import gpt_config
from lightning_parallel.simulate.api import simulate

log = logging.getLogger(__name__)


def simulate_pick(cfg: DictConfig, choice: Any) -> dict[str, Any]:
    """``strategy.simulate=true``: the pick run at its full world size on the fake process group
    (:func:`lightning_parallel.simulate.simulate`, the recipe's model, batch and precision, its default ranks); a
    rank whose peak (model states, activations, temporaries, torch's MemTracker) exceeds the memory per device it
    was planned for refuses the pick with the figures. Returns what metrics.json's ``planned["simulated"]`` holds."""
    if OmegaConf.get_type(cfg.model) is not GPTModelConf:
        raise ValueError(
            "strategy.simulate=true simulates the recipe GPTs (model=gpt_*); the simulator runs causal language "
            "models: drop strategy.simulate for this model."
        )
    t, memory = cfg.trainer, choice.machine.device_memory
    layout = ",".join(f"{k}={v}" for k, v in choice.planned()["layout"].items())
    sim = simulate(
        gpt_config(cfg.model),
        t.devices * t.num_nodes,
        choice.config,
        gpus_per_node=t.devices,
        global_batch_size=cfg.data.global_batch_size,
        precision=cfg.precision.value,
        steps=1,
    )
    ranks = [
        {
            "rank": r.rank,
            "model_state_bytes": r.model_state_bytes["total"],
            "activation_bytes": r.activation_bytes,
            "peak_bytes": r.peak_bytes,
        }
        for r in sim.ranks
    ]
    over = [r for r in ranks if r["peak_bytes"] > memory]
    if sim.mismatches:
        raise ValueError(f"strategy=auto: the simulated pick {layout} would hang: {sim.mismatches[0].describe()}")
    if over:
        worst = max(over, key=lambda r: r["peak_bytes"])
        raise ValueError(
            f"strategy=auto: the simulated pick {layout} does not fit: rank {worst['rank']} peaks at "
            f"{_mb(worst['peak_bytes'])} (model states {_mb(worst['model_state_bytes'])}, activations "
            f"{_mb(worst['activation_bytes'])}) of {_mb(memory)} per device; the planner predicted "
            f"{_mb(choice.planned()['memory_per_rank_bytes'])}. Give more devices, a smaller data.global_batch_size, "
            "or the real memory per device (strategy.auto_device_memory)."
        )
    log.info(
        "simulated at world %d: peak %s of %s per device (rank %d), collectives consistent over %d group(s)",
        sim.world_size,
        _mb(max(r["peak_bytes"] for r in ranks)),
        _mb(memory),
        max(ranks, key=lambda r: r["peak_bytes"])["rank"],
        sim.groups_compared,
    )
    return {"ranks": ranks, "device_memory_bytes": memory, "groups_compared": sim.groups_compared}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"
