"""The DPO losses as TRL 1.16 computes them (``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss``), pure
torch, no Lightning. Line numbers are those of trl 1.16.0's file:

- log-probabilities: per token of the answer only (labels -100 on the prompt and the padding, lines 1296-1300),
  summed over the sequence (line 1304, ``per_token_logps.sum(dim=1)``);
- ``chosen_logratios = chosen_logps - ref_chosen_logps`` (line 1350), ``delta_score`` their difference (1381, with
  ``f_divergence_type="reverse_kl"``, the standard DPO of lines 1353-1355);
- ``sigmoid``: ``-logsigmoid(beta * delta)`` (1387-1388);
- ``ipo``: each score divided by its answer's token count (``completion_mask.sum(1).clamp(min=1)``), then
  ``(delta - 1 / (2 beta)) ** 2`` (1393-1404);
- ``robust``: ``(-(1 - eps) logsigmoid(beta delta) + eps logsigmoid(-beta delta)) / (1 - 2 eps)`` with
  ``eps = label_smoothing`` (1428-1431), ``0 <= eps < 0.5`` (824-828);
- the loss: the mean over pairs (line 1498); rewards ``beta * logratio`` detached, accuracy ``chosen_reward >
  rejected_reward`` (0 where both are 0), margin their difference (1578-1597).

Here the mean over pairs is a sum over this piece's pairs divided by the global batch's pairs (``pairs``), so the
gradient does not depend on how the batch is split over data-parallel ranks, accumulated micro-batches and
pipeline microbatches (the caller gives the scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_TYPES = ("sigmoid", "ipo", "robust")
IGNORE_INDEX = -100


def check_loss_settings(loss: str, beta: float, label_smoothing: float) -> None:
    """``dpo.loss``, ``dpo.beta`` and ``dpo.label_smoothing`` as TRL accepts them.

    Raises:
        ValueError: naming the setting and the fix.
    """
    if loss not in LOSS_TYPES:
        raise ValueError(f"dpo.loss={loss!r} is unknown: use one of {list(LOSS_TYPES)}.")
    if not beta > 0:
        raise ValueError(f"dpo.beta={beta} must be above 0 (TRL's default: 0.1).")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"dpo.label_smoothing={label_smoothing} must lie in [0, 0.5) (TRL's bound for the robust loss): e.g. 0.1."
        )
    if label_smoothing and loss != "robust":
        raise ValueError(
            f"dpo.label_smoothing={label_smoothing} is used by dpo.loss=robust only: set dpo.loss=robust, or "
            "dpo.label_smoothing=0."
        )


def token_logps(logits: Tensor, labels: Tensor, shifted: bool = False) -> Tensor:
    """Each position's log-probability of its next token, 0 where the next label is -100: (B, T - 1) float32.

    ``labels`` (B, T) are the input ids with -100 off the answers (unshifted, as HF's; with ``shifted`` each
    position's target already, and the result (B, T)). ``logits`` (B, T, V) may be a DTensor split over V inside
    ``loss_parallel`` (tensor parallelism): cross-entropy is what that supports.
    """
    targets = labels if shifted else labels[:, 1:]
    flat = (logits if shifted else logits[:, :-1]).flatten(0, 1).float()
    per = F.cross_entropy(flat, targets.reshape(-1).to(flat.device), ignore_index=IGNORE_INDEX, reduction="none")
    if hasattr(per, "full_tensor"):
        per = per.full_tensor()
    return -per.view(targets.shape)


def sequence_logps(logits: Tensor, labels: Tensor, shifted: bool = False) -> Tensor:
    """Log-probabilities summed over each sequence's answer tokens: (B,) float32 (TRL's line 1304)."""
    return token_logps(logits, labels, shifted).sum(dim=1)


def answer_tokens(labels: Tensor, shifted: bool = False) -> Tensor:
    """Each sequence's answer tokens (labels not -100 after the first position; ``shifted``: targets): (B,)
    float32."""
    return ((labels if shifted else labels[:, 1:]) != IGNORE_INDEX).sum(dim=1).float()


@dataclass
class PairLosses:
    """Per pair: the loss and the rewards (``beta * logratio``, detached), all (P,)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor

    @property
    def margins(self) -> Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> Tensor:
        """1 where the chosen reward is above the rejected one (0 at the start, where both are 0), as TRL."""
        return (self.chosen_rewards > self.rejected_rewards).float()


def pair_losses(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> PairLosses:
    """The per-pair DPO loss of TRL's ``loss_type`` (see the module docstring for the lines).

    Args:
        chosen_logps, rejected_logps: the policy's summed answer log-probabilities (P,).
        ref_chosen_logps, ref_rejected_logps: the reference's (P,), without gradient.
        beta: ``dpo.beta``.
        loss: ``sigmoid``, ``ipo`` or ``robust``.
        label_smoothing: ``robust``'s eps.
        chosen_tokens, rejected_tokens: ``ipo``: each answer's token count (P,).
    """
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo.loss=ipo needs each answer's token count (chosen_tokens, rejected_tokens).")
        chosen_avg = chosen_logratios / chosen_tokens.clamp(min=1.0)
        ipo_delta = chosen_avg - rejected_logratios / rejected_tokens.clamp(min=1.0)
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    elif loss == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    else:
        raise ValueError(f"dpo.loss={loss!r} is unknown: use one of {list(LOSS_TYPES)}.")
    return PairLosses(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


def split_pairs(values: Tensor) -> tuple[Tensor, Tensor]:
    """(chosen, rejected) of a (2P, ...) tensor whose rows alternate chosen, rejected (each pair side by side, so
    any split of whole pairs keeps them together)."""
    return values[0::2], values[1::2]


METRICS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy")


def metric_sums(pairs: PairLosses) -> Tensor:
    """(4,) sums over this piece's pairs of the chosen and rejected rewards, the margins and the accuracies: summed
    over every piece and divided by the global pairs, they are TRL's means over the gathered batch."""
    return torch.stack(
        [pairs.chosen_rewards.sum(), pairs.rejected_rewards.sum(), pairs.margins.sum(), pairs.accuracies.sum()]
    )
