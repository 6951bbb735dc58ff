"""Strategy presets: a name for a layout's settings, in one table, found by both front doors and the recipes.

A row of :data:`PRESETS` is registered under its name in Lightning's registry (``Trainer(strategy="name")``) and
Fabric's (``Fabric(strategy="name")``) by the preset classes' ``register_strategies``
(:class:`~lightning_parallel.strategies.hybrid3d.Hybrid3DPreset`,
:class:`~lightning_parallel.strategies.zero.ZeroPreset`), and stored as a ``strategy/<name>`` option of the recipes'
Hydra config by :func:`store_strategy_presets` (``python recipes/train_gpt.py strategy=name``; its keys overridable
as any preset's: ``strategy.microbatches=8``). A new preset is one row here.

The ZeRO stages' own names (``zero1``-``zero3``, ``zero2_offload``, ``zero3_offload``) come from the table of
stages (:data:`~lightning_parallel.strategies.zero.ZERO_PRESETS`); ``conf/strategy/*.yaml`` holds the recipes'
Hydra-only presets. Imports nothing of Lightning's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_parallel.parallel.sections import recipe_key


@dataclass(frozen=True)
class Preset:
    """One preset.

    Args:
        strategy: the strategy it presets: ``"hybrid3d"`` (any :class:`ParallelConfig` setting) or ``"zero"``
            (``zero_stage`` 1-3 and the settings a ZeRO strategy takes, ``ZERO_SETTINGS``).
        settings: :class:`~lightning_parallel.parallel.config.ParallelConfig` fields by name; a user's own
            arguments (``Trainer(strategy=Hybrid3DStrategy(...))``) are not merged with them.
        description: what Lightning's registry shows for the name.
    """

    strategy: str
    settings: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def init_params(self) -> dict[str, Any]:
        """The preset class's keyword arguments (ZeRO's stage and offload are its own arguments)."""
        if self.strategy != "zero":
            return dict(self.settings)
        params = {k: v for k, v in self.settings.items() if k not in ("zero_stage", "offload")}
        return {"stage": self.settings["zero_stage"], "offload": self.settings.get("offload", False), **params}

    def recipe_name(self) -> str:
        """``strategy.name`` in the recipes' config: the strategy the recipe builds with these settings."""
        if self.strategy != "zero":
            return self.strategy
        return f"zero{self.settings['zero_stage']}{'_offload' if self.settings.get('offload') else ''}"


PRESETS: dict[str, Preset] = {
    "hybrid3d_pp2": Preset(
        "hybrid3d", {"pp": 2, "pp_schedule": "1f1b"}, "two pipeline stages (1F1B) x data parallelism on the rest"
    ),
}


def presets_of(strategy: str) -> dict[str, Preset]:
    """The rows of one strategy (``"hybrid3d"`` or ``"zero"``), as its ``register_strategies`` reads them."""
    unknown = sorted({p.strategy for p in PRESETS.values()} - {"hybrid3d", "zero"})
    if unknown:
        raise ValueError(f"Preset(strategy={unknown[0]!r}) is unknown: use 'hybrid3d' or 'zero'.")
    return {name: preset for name, preset in PRESETS.items() if preset.strategy == strategy}


def store_strategy_presets(config_store: Any) -> None:
    """Each row as the Hydra option ``strategy=<name>``: the recipes' strategy schema with the row's settings."""
    for name, preset in PRESETS.items():
        node: dict[str, Any] = {"defaults": [f"{preset.strategy}_schema"], "name": preset.recipe_name()}
        for setting, value in preset.settings.items():  # by the recipes' keys: pp_balance as pipeline.balance
            *sections, key = recipe_key(setting).split(".")
            inner = node
            for section in sections:
                inner = inner.setdefault(section, {})
            inner[key] = value
        config_store.store(group="strategy", name=name, node=node)
