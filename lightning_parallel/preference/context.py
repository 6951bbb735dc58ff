"""DPO under context parallelism (cp): each sample's sequence split over the cp ranks, the pair still meeting in one
loss. Pure torch.

Before the strategy splits the sequences (the module's ``on_after_batch_transfer``) the batch becomes
:func:`cp_rows`: the pairs' rows flattened to (2B, T) (the split cuts dim 1, which must be the sequence, not the pair),
the labels shifted to each position's target (a rank's last token predicts the first token of the next chunk, which
another rank holds), the reference's log-probabilities (2B,) (one dimension: left whole), and no attention mask (the
rows are padded on the right, so under causal attention no answer token sees a pad: the mask changes no answer
log-probability, and context-parallel attention takes none). Each cp rank then sums its answer tokens'
log-probabilities, and :func:`summed_over` adds the ranks' sums: every rank holds the whole sequences' sums, computes
the same loss, and the gradient reaching each rank's tokens is that loss's (the all-reduce's backward sums the cp
ranks' identical gradients, which the strategy's average over dp x cp divides again).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from lightning_parallel.preference.loss import IGNORE_INDEX


def cp_rows(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The (B, 2, T) pairs as (2B, T) rows (chosen, rejected, ...) with labels shifted to targets, the reference's
    log-probabilities as (2B,), no attention mask (see the module docstring)."""
    labels = batch["labels"].flatten(0, 1)
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    rows = {"input_ids": batch["input_ids"].flatten(0, 1), "labels": targets}
    if "reference_logps" in batch:
        rows["reference_logps"] = batch["reference_logps"].flatten()
    return rows


def summed_over(values: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``values`` summed over ``group``'s ranks, differentiably (the backward sums the gradients over the group)."""
    return funcol.all_reduce(values, "sum", group)
