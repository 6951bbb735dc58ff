"""A model's attention and positions switched to context parallelism, and the batch split along the sequence.
Pure torch.

The model is not rewritten: a module whose attention may be context-parallel keeps its attention core in an
attribute, ``attention_core(q, k, v, dropout_p=0.0)`` on (B, H, T, D) tensors, and a module that makes position
ids keeps ``position_ids(T, device)``. :func:`apply_context_parallel` points those attributes at the cp group's
attention (ring or Ulysses) and at this rank's true positions; the strategy splits every batch with
:meth:`ContextParallel.shard_batch`. Losses need nothing: every cp rank holds the same number of tokens, so the mean
of their token means is the mean over the whole sequence, and gradients are averaged over dp x cp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel._compat import tree_map
from lightning_parallel.parallel.context.ring import ring_attention
from lightning_parallel.parallel.context.split import check_sequence, positions, shard_sequence
from lightning_parallel.parallel.context.ulysses import check_heads, ulysses_attention

ATTENTION_HOOK = "attention_core"  # (q, k, v, dropout_p=0.0) -> out, on (B, H, T, D)
POSITION_HOOK = "position_ids"  # (T, device) -> (T,) positions
ATTENTION: dict[str, Callable[..., Tensor]] = {"ring": ring_attention, "ulysses": ulysses_attention}


@dataclass
class ContextParallel:
    """This rank's part of the context-parallel group: its attention, positions and batch split.

    Args:
        group: the cp ranks (the mesh's ``context`` role), in the order the sequence is split.
        mode: ``"ring"`` or ``"ulysses"``.
    """

    group: dist.ProcessGroup
    mode: str
    active: bool = True  # False: every rank runs whole sequences (generation), see whole_sequence()

    @property
    def cp(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
        if dropout_p:
            raise ValueError(
                f"attention dropout ({dropout_p}) under cp={self.cp}: context-parallel attention has no dropout. "
                "Set the model's attention dropout to 0, or cp=1."
            )
        if not self.active:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        return ATTENTION[self.mode](q, k, v, self.group)

    def position_ids(self, local_len: int, device: torch.device) -> Tensor:
        if not self.active:
            return torch.arange(local_len, device=device)
        return positions(local_len, self.cp, self.rank, device)

    @contextlib.contextmanager
    def whole_sequence(self) -> Generator[None, None, None]:
        """Inputs not split over cp (generation from a prompt of any length): each rank attends over the whole
        sequence it is given, as one process would (the parameters are the same on every cp rank)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def shard_batch(self, batch: Any) -> Any:
        """This rank's two chunks of every tensor of two or more dims in ``batch``, split along dim 1 (the
        sequence); other values unchanged."""
        cp, rank = self.cp, self.rank
        return tree_map(lambda t: shard_sequence(t, cp, rank, dim=1) if _is_sequence(t) else t, batch)


@contextlib.contextmanager
def whole_sequence(root: nn.Module) -> Generator[None, None, None]:
    """Within it, the context-parallel attention of ``root`` (if any) runs the whole sequences it is given on every
    rank (generation from a prompt); a no-op without cp."""
    cores = (getattr(m, ATTENTION_HOOK) for _, m in hooked_modules(root, ATTENTION_HOOK))
    contexts = {id(c): c for core in cores if isinstance(c := getattr(core, "__self__", None), ContextParallel)}
    with contextlib.ExitStack() as stack:
        for context in contexts.values():
            stack.enter_context(context.whole_sequence())
        yield


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 2


def hooked_modules(root: nn.Module, hook: str) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in root.named_modules() if callable(getattr(m, hook, None))]


def attention_modules(root: nn.Module, cp: int) -> list[tuple[str, nn.Module]]:
    """The modules of ``root`` whose attention cp switches.

    Raises:
        TypeError: when there is none: nothing would attend across the split sequence.
    """
    attention = hooked_modules(root, ATTENTION_HOOK)
    if not attention:
        raise TypeError(
            f"cp={cp} needs attention modules with an {ATTENTION_HOOK}(q, k, v, dropout_p) attribute (the recipe "
            "GPT's CausalSelfAttention has one) to attend across the split sequence: add it, or set cp=1."
        )
    return attention


def apply_context_parallel(root: nn.Module, mesh: DeviceMesh, mode: str) -> tuple[ContextParallel, list[str]]:
    """Point every ``attention_core`` and ``position_ids`` in ``root`` at the context-parallel ones of ``mesh``.

    Returns:
        the :class:`ContextParallel` (the strategy splits batches with it) and the attention modules switched.

    Raises:
        TypeError: when ``root`` has no module with an ``attention_core``: nothing would attend across ranks.
    """
    context = ContextParallel(mesh.get_group(), mode)
    attention = attention_modules(root, mesh.size())
    for _, module in attention:
        setattr(module, ATTENTION_HOOK, context.attention)
    for _, module in hooked_modules(root, POSITION_HOOK):
        setattr(module, POSITION_HOOK, context.position_ids)
    return context, [name for name, _ in attention]


def check_context_layout(root: nn.Module, cp: int, mode: str, tp: int, example: Any = None) -> None:
    """Before launch: the heads divide for Ulysses, the example sequence divides into ``2 * cp`` chunks, and
    there is attention to switch (a ValueError or TypeError naming the setting and the fix)."""
    for _, module in attention_modules(root, cp):
        heads = getattr(module, "n_head", None)
        if mode == "ulysses" and isinstance(heads, int):
            check_heads(heads, cp, tp)
        if getattr(module, "dropout", 0.0):
            raise ValueError(
                f"cp={cp}: context-parallel attention has no dropout, and the model's attention dropout is "
                f"{module.dropout}: set it to 0 (GPTConfig.dropout), or cp=1."
            )
    if isinstance(example, Tensor) and example.dim() >= 2:
        check_sequence(example.shape[1], cp, setting="cp")
