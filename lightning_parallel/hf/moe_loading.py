"""Parameters a ``save_pretrained`` folder stores under other names, read through transformers' own weight
conversions: a Mixture-of-Experts model's ``experts.gate_up_proj`` (E, 2f, d) is saved as one ``gate_proj`` /
``up_proj`` (``w1`` / ``w3``) matrix per expert and fused at load by ``transformers.conversion_mapping``'s
``WeightConverter`` (``MergeModulelist`` stacks the experts, ``Concatenate`` joins gate and up); renamings such as
Mixtral's ``block_sparse_moe`` -> ``mlp`` come from the same table.

A converter that stacks experts on dim 0 first (``MergeModulelist(dim=0)``) lets a rank read only the experts it
holds: its slice of dim 0 (an expert-parallel split, a ZeRO-3 shard) picks which per-expert tensors are opened.

Pure torch + transformers; no process group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn


@dataclass
class ConvertedWeight:
    """How one model parameter is made from the folder: transformers' converter (None: one tensor, renamed) and
    the checkpoint keys of each of its source patterns, in transformers' order (expert 0, 1, ...)."""

    converter: Any
    keys: dict[str, list[str]] = field(default_factory=dict)

    @property
    def stacks_experts(self) -> bool:
        """Whether dim 0 of the result is the position in each pattern's key list (experts stacked first)."""
        from transformers.core_model_loading import MergeModulelist

        ops = self.converter.operations if self.converter is not None else []
        return bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0

    def read(self, name: str, model: nn.Module, read: Callable[[str], Tensor], rows: slice | None = None) -> Tensor:
        """The parameter ``name``'s whole value (or, for a converter that stacks experts, its ``rows`` of dim 0
        only), each checkpoint tensor read through ``read(key)``."""
        if self.converter is None:
            ((key,),) = self.keys.values()
            return read(key)
        converter = deepcopy(self.converter)  # transformers gives each target its own converter
        for pattern, keys in self.keys.items():
            for key in keys[rows] if rows is not None and self.stacks_experts else keys:
                converter.add_tensor(name, key, pattern, lambda key=key: read(key))  # called by convert()
        out = converter.convert(name, model=model, config=getattr(model, "config", None))
        return out[name] if name in out else next(iter(out.values()))

    def read_box(
        self, name: str, model: nn.Module, read: Callable[[str], Tensor], box: tuple[slice, ...] | None
    ) -> Tensor:
        """``box`` of the parameter ``name`` (None or empty: all of it): where the conversion stacks experts on
        dim 0, only the experts of the box's first slice are read."""
        if not box:
            return self.read(name, model, read)
        if self.stacks_experts:
            return self.read(name, model, read, rows=box[0])[(slice(None), *box[1:])]
        return self.read(name, model, read)[box]


def converted_weights(model: nn.Module, checkpoint_keys: Iterable[str], wanted: Iterable[str]) -> dict[str, Any]:
    """Parameter name -> :class:`ConvertedWeight`, for the ``wanted`` names the folder holds under other names.

    Args:
        model: the Hugging Face model (split or not): its class and config pick transformers' conversions.
        checkpoint_keys: every tensor name in the folder.
        wanted: the parameter names this rank reads that the folder does not hold as they are.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    wanted = set(wanted)
    if not wanted or not hasattr(model, "config"):
        return {}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    names = dict.fromkeys(n for n, _ in model.named_parameters(remove_duplicate=False))
    targets = {n: True for n in (*names, *wanted)}  # rename_source_key adds or strips base_model_prefix by these
    prefix = getattr(model, "base_model_prefix", None)
    found: dict[str, ConvertedWeight] = {}
    for key in sorted(checkpoint_keys, key=dot_natural_key):  # transformers' order: expert 10 after expert 9
        target, pattern = rename_source_key(key, renamings, converters, prefix, targets)
        if target not in wanted:
            continue
        weight = found.setdefault(target, ConvertedWeight(by_pattern[pattern] if pattern is not None else None))
        weight.keys.setdefault(pattern or key, []).append(key)
    return found
