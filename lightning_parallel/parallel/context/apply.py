"""A model's attention and positions switched to context parallelism, and the batch split along the sequence.
Pure torch.

The model is not rewritten: it offers ``context_parallel(attention, positions)`` (the model protocol,
:class:`~lightning_parallel.protocol.ContextParallelModel`), which points its causal attention at this rank's
:meth:`ContextParallel.attention` (ring or Ulysses over the cp group) and makes its positions with
:meth:`ContextParallel.position_ids` (this rank's true positions); how is the model's business (the recipe GPT's
``attention_core`` attribute, Hugging Face's attention-function interface, LitGPT's
``scaled_dot_product_attention``). The strategy splits every batch with :meth:`ContextParallel.shard_batch`. Losses
need nothing: every cp rank holds the same number of tokens, so the mean of their token means is the mean over the
whole sequence, and gradients are averaged over dp x cp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel._compat import tree_map
from lightning_parallel.parallel.context.ring import ring_attention
from lightning_parallel.parallel.context.split import check_sequence, positions, shard_sequence
from lightning_parallel.parallel.context.ulysses import check_heads, ulysses_attention
from lightning_parallel.protocol import attention_heads, context_parallel

ATTENTION: dict[str, Callable[..., Tensor]] = {"ring": ring_attention, "ulysses": ulysses_attention}
CONTEXT_ATTR = "_lightning_parallel_context"  # the module's ContextParallel, for whole_sequence()


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

    def attention(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
        """Causal attention of this rank's chunks over the whole sequence, (B, H, T, D) each (``scale`` None:
        1 / sqrt(D)); a model's attention core under cp."""
        if dropout_p:
            raise ValueError(
                f"attention dropout ({dropout_p}) under cp={self.cp}: context-parallel attention has no dropout. "
                "Set the model's attention dropout to 0, or cp=1."
            )
        if not self.active:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return ATTENTION[self.mode](q, k, v, self.group, scale=scale)

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
def whole_sequence(module: Any) -> Generator[None, None, None]:
    """Within it, the context-parallel attention of ``module`` (if any) runs the whole sequences it is given on every
    rank (generation from a prompt); a no-op without cp."""
    context = getattr(module, CONTEXT_ATTR, None)
    with context.whole_sequence() if isinstance(context, ContextParallel) else contextlib.nullcontext():
        yield


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 2


def apply_context_parallel(module: Any, mesh: DeviceMesh, mode: str) -> tuple[ContextParallel, list[str]]:
    """Switch ``module``'s attention and positions to the context-parallel ones of ``mesh`` (its
    ``context_parallel(attention, positions)``).

    Returns:
        the :class:`ContextParallel` (the strategy splits batches with it) and the attention modules switched.

    Raises:
        TypeError: when ``module`` has no ``context_parallel``, or switched no attention.
    """
    context = ContextParallel(mesh.get_group(), mode)
    switched = context_parallel(module, mesh.size(), context.attention, context.position_ids)
    setattr(module, CONTEXT_ATTR, context)
    return context, switched


def check_context_layout(module: Any, cp: int, mode: str, tp: int, example: Any = None) -> None:
    """Before launch: the model offers context parallelism, its heads divide for Ulysses, the example sequence
    divides into ``2 * cp`` chunks (a ValueError or TypeError naming the setting and the fix). The model refuses
    what its attention cannot take (dropout, sliding windows) in its own ``check_parallel_degrees``."""
    heads = attention_heads(module, cp)
    if mode == "ulysses":
        check_heads(heads, cp, tp)
    if isinstance(example, Tensor) and example.dim() >= 2:
        check_sequence(example.shape[1], cp, setting="cp")
