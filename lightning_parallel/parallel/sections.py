"""The recipes' sections of the parallel settings: :class:`~lightning_parallel.parallel.config.ParallelConfig` declares
each setting by a flat name (``pp_balance``, the Python constructors' keyword); the recipes' ``strategy`` schemas
(``recipes/strategy_conf.py``) keep the degrees and the stable keys top-level and put the others in sections
(``strategy.pipeline.balance``). Pure Python; imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The recipes' section and key of each setting that is not a top-level ``strategy.*`` key
# (``strategy.pipeline.balance`` is ``pp_balance``); the degrees and the stable keys stay top-level. The Python
# constructors take the flat names.
SECTIONS: dict[str, tuple[str, str]] = {
    "cp_mode": ("context", "mode"),
    "sharding": ("sharding", "name"),
    "offload": ("sharding", "offload"),
    "reshard_after_forward": ("sharding", "reshard_after_forward"),
    "pp_balance": ("pipeline", "balance"),
    "pp_memory_budget": ("pipeline", "memory_budget"),
    "pp_virtual_stages": ("pipeline", "virtual_stages"),
    "sequence_parallel": ("tensor", "sequence_parallel"),
    "powersgd_rank": ("grad_reduce", "powersgd_rank"),
    "overlap_grad_reduce": ("grad_reduce", "overlap"),
    "bucket_mb": ("grad_reduce", "bucket_mb"),
    "ft_replicas": ("torchft", "replicas"),
    "ft_replica_id": ("torchft", "replica_id"),
    "ft_min_replicas": ("torchft", "min_replicas"),
    "ft_lighthouse": ("torchft", "lighthouse"),
    "ft_timeout": ("torchft", "timeout"),
}


def recipe_key(name: str) -> str:
    """The recipes' key of the setting ``name`` below ``strategy.``: ``pipeline.balance`` for ``pp_balance``."""
    return ".".join(SECTIONS.get(name, (name,)))


def setting_in(settings: Mapping[str, Any], name: str) -> tuple[bool, Any]:
    """(found, value) of the setting ``name`` in a flat or sectioned mapping."""
    if name in SECTIONS:
        section, key = SECTIONS[name]
        inner = settings.get(section)
        if isinstance(inner, Mapping):
            return (key in inner, inner[key] if key in inner else None)
    return (name in settings, settings[name] if name in settings else None)
