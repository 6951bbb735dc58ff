"""What every next-token LightningModule of this package shares (:class:`~lightning_parallel.hf.HFCausalLM`,
:class:`~lightning_parallel.litgpt.LitGPTCausalLM`): the loss, the steps and the optimizer. The subclass holds
the model (``self.model``), its forward and how it reads a batch (``unpack``); the parallel protocol stays with it.
Pure torch + Lightning; no transformers, no litgpt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.materialize import SeededInit, fill_meta_tensors
from lightning_parallel.parallel.mesh import ParallelDims
from lightning_parallel.protocol import strategy_calls_materialize

IGNORE_INDEX = -100  # HF's label for "no loss here" (padding, prompts)


def shift_labels(labels: Tensor) -> Tensor:
    """Each position's target: the next token's label (-100 at the last position, which predicts nothing)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # (B, T)


def causal_lm_loss(logits: Tensor, labels: Tensor, shifted: bool = False) -> Tensor:
    """HF's causal-LM loss: labels shifted one token left here (unless ``shifted``: they are targets already),
    token-mean cross-entropy over labels that are not -100. ``logits`` (B, T, V) may be split over V (inside
    ``loss_parallel``)."""
    targets = labels if shifted else shift_labels(labels)
    return F.cross_entropy(
        logits.flatten(0, -2).float(), targets.reshape(-1).to(logits.device), ignore_index=IGNORE_INDEX
    )


def real_tokens(labels: Tensor, shifted: bool = False) -> Tensor:
    """How many tokens :func:`causal_lm_loss` averages over: the shifted labels that are not -100 (int64)."""
    return ((labels if shifted else labels[..., 1:]) != IGNORE_INDEX).sum()


def _context_parallel(strategy: Any) -> int:
    dims = getattr(strategy, "parallel_dims", None)
    return dims.context if dims is not None else 1


def _loss_pieces(strategy: Any) -> tuple[dist.ProcessGroup | None, int, int]:
    """(the group of the ranks that hold different tokens, its size, the pipeline microbatches of a batch): what a
    step's gradient is averaged over: the ``batch`` role, under cp the ``loss`` role (dp x cp: the cp ranks hold
    pieces of the same samples). A strategy it does not know: one rank, one piece (a token mean per rank's batch)."""
    dims = getattr(strategy, "parallel_dims", None)
    if dims is not None and getattr(strategy, "mesh", None) is not None:
        micro = strategy.config.microbatches if dims.pp > 1 else 1
        role = "loss" if dims.context > 1 else "batch"
        size = dims.role_size(role)
        return (strategy.mesh.group(role) if size > 1 else None), size, micro
    from lightning.pytorch.strategies import DDPStrategy

    if isinstance(strategy, DDPStrategy) and strategy.world_size > 1:
        return dist.group.WORLD, strategy.world_size, 1
    return None, 1, 1


def refuse_adapter_layouts(not_yet: tuple[str, ...], module: str, works: str, dims: ParallelDims) -> None:
    """The layouts adapters on ``module`` (``HFCausalLM(peft_config=...)``, ``LitGPTCausalLM(lora=...)``) cannot
    take yet, refused by the degree's setting name before any process group exists; ``works``: what they run under.

    Raises:
        ValueError: naming the setting and the fix.
    """
    for name in not_yet:
        if getattr(dims, name) > 1:
            raise ValueError(
                f"{name}={getattr(dims, name)} with {module} is not supported yet: {works} for now; set {name}=1."
            )


class CausalLM(pl.LightningModule):
    """Next-token training: the training loss a mean over the global batch's real tokens (:meth:`loss`), validation
    and test losses :func:`causal_lm_loss` per batch, ``train_loss`` / ``val_loss`` / ``test_loss`` logged over the
    data-parallel ranks, AdamW over the trainable parameters, without decay on those of dimension < 2 (biases, norm
    weights). Override ``configure_optimizers`` for another optimizer.

    Args:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
    """

    def __init__(
        self, lr: float = 3e-4, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8
    ) -> None:
        super().__init__()
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        # the global token mean (see loss()): (pieces, global real tokens of the accumulation window's first
        # micro-step), and this rank's real tokens over the window; None outside training steps
        self._token_norm: tuple[int, Tensor] | None = None
        self._window_tokens: Tensor | None = None
        self._window_factor: Tensor | None = None  # the last optimizer step's gradient factor (None: 1)

    # ----- a model built from its config alone: on the meta device, initialized once split -----

    _seeded_init: SeededInit | None = None  # set while such a model waits for its values

    def build_on_meta(
        self, build: Callable[[], nn.Module], init_of: Callable[[nn.Module], Callable[[nn.Module], None]]
    ) -> nn.Module:
        """``build()`` on the meta device (no memory), to be initialized by :meth:`materialize`: each module that owns
        tensors by ``init_of(model)(module)`` (the library's own rule), from the global generator seeded by the seed
        now (``torch.initial_seed()``) and the module's name in the model
        (:class:`~lightning_parallel.parallel.materialize.SeededInit`), so the values are the same in every layout
        and in one process."""
        with torch.device("meta"):
            model = build()
        self._seeded_init = SeededInit(model, init_of(model))
        return model

    @property
    def awaits_materialize(self) -> bool:
        """Whether the model's values are still to come (:meth:`materialize`)."""
        return self._seeded_init is not None

    def materialize(self, device: torch.device | str = "cpu") -> None:
        """Give the model built on meta storage on ``device`` and its initial values. The strategies of this package
        call it once the model is split, so each rank allocates and initializes only the pieces it holds, one module's
        whole tensors at a time on the host at most; nothing to do when the values are there."""
        if self._seeded_init is not None:
            fill_meta_tensors(self, self, torch.device(device), init=self._seeded_init)
            self._seeded_init = None

    def configure_model(self) -> None:
        """Under a strategy that does not split the model through :meth:`materialize` (Lightning's own): the whole
        model, on the strategy's device."""
        if self.awaits_materialize and not strategy_calls_materialize(self.trainer.strategy):
            self.materialize(self.trainer.strategy.root_device)

    def require_values(self, hint: str = "") -> None:
        """A RuntimeError when the model's values are still to come (a forward before :meth:`materialize`)."""
        if self.awaits_materialize:
            raise RuntimeError(
                f"{type(self).__name__}'s weights are not there yet (built on the meta device{hint}): train or test "
                "it with a Trainer, or call .materialize() first."
            )

    def unpack(self, batch: Any) -> tuple[Tensor, Tensor, dict[str, Tensor] | Tensor | None]:
        """(input_ids, labels, the model's other keyword inputs) of a batch: a dict (``attention_mask``,
        ``position_ids``), an attention mask, or None."""
        raise NotImplementedError

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """The loss of one piece of the global batch: :func:`causal_lm_loss`, in training scaled so that the
        optimizer step's gradient is that of the mean over the global batch's real tokens (labels not -100),
        however the batch is cut into dp ranks, accumulated micro-batches and pipeline microbatches, also when
        they hold different numbers of real tokens.

        Every step's gradient is averaged over P = dp x microbatches pieces (the dp reduction's mean, the pipeline's
        1 / microbatches) and over the A micro-batches of gradient accumulation (Lightning's 1 / A). At the window's
        first micro-step the training step counts N0, the real tokens of its global batch (one all-reduce over the
        dp ranks, before the forward); each piece of n real tokens then returns its token mean times n * P / N0,
        i.e. its summed loss / N0 * P, so the window's gradient is the sum of all its token losses / (A * N0). Once
        the window ends (``on_before_optimizer_step``: after the dp reduction, before clipping), the gradients are
        multiplied by A * N0 / N, N the window's real tokens (one more all-reduce, only when A > 1): the sum over
        N. When every piece holds the same number of real tokens both factors are exactly 1 and nothing changes.
        The returned (and logged) training loss is the piece's scaled one; ``window_factor`` times the mean of the
        window's step losses over micro-steps and dp ranks is the global token mean. Validation and test losses
        are token means per batch. Under cp the labels were shifted before the strategy split the sequence
        (:meth:`on_after_batch_transfer`: a rank's last token predicts the first token of the next chunk, which
        another rank holds) and each cp rank is one of the P pieces; validation and test losses are token means per
        rank's piece.
        """
        shifted = self._splits_sequences()
        loss = causal_lm_loss(logits, labels, shifted)
        if self._token_norm is None or not torch.is_grad_enabled():
            return loss
        pieces, first = self._token_norm
        # on the device, no host sync: integers, one division in float64 (exactly 1.0 when all pieces are equal)
        # rounded to the loss's dtype, as a Python float would be
        mine = real_tokens(labels, shifted).to(first.device)
        return loss * ((mine * pieces).double() / first).to(loss)

    def _splits_sequences(self) -> bool:
        """Whether the strategy splits each sequence over cp ranks (the labels arrive shifted, see :meth:`loss`)."""
        return self._trainer is not None and _context_parallel(self._trainer.strategy) > 1

    def _inputs(self, batch: Any) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        ids, labels, inputs = self.unpack(batch)
        inputs = {"attention_mask": inputs} if isinstance(inputs, Tensor) else dict(inputs or {})
        if inputs and self._splits_sequences():
            raise ValueError(
                f"cp={_context_parallel(self._trainer.strategy)} does not take {' or '.join(sorted(inputs))} yet "
                "(padded or packed batches: each rank holds pieces of the samples): use cp=1 (tp, pp and ZeRO take "
                "them), or unpadded hf_text blocks."
            )
        return ids, labels, inputs

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Under cp, before the strategy splits the sequence: ``{"input_ids", "labels"}`` with the labels shifted
        (each position's target), so every rank's pieces keep their targets."""
        batch = super().on_after_batch_transfer(batch, dataloader_idx)
        if not self._splits_sequences():
            return batch
        ids, labels, _ = self._inputs(batch)
        return {"input_ids": ids, "labels": shift_labels(labels)}

    def _step_loss(self, batch: Any) -> Tensor:
        ids, labels, inputs = self._inputs(batch)
        output = self(ids, **inputs)
        return self.loss(output, labels)

    def _count_tokens(self, batch: Any, batch_idx: int) -> None:
        """Before a training step's forward: N0 at an accumulation window's first micro-step, this rank's real
        tokens added to the window's (see :meth:`loss`)."""
        trainer = self._trainer
        group, ranks, micro = _loss_pieces(trainer.strategy) if trainer is not None else (None, 1, 1)
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        labels = self.unpack(batch)[1]
        mine = real_tokens(labels, self._splits_sequences())  # a device tensor: counted and reduced there, unread
        if batch_idx % accumulate == 0 or self._token_norm is None:
            total = mine.clone()
            if group is not None:
                dist.all_reduce(total, group=group)
            first = total.clamp(min=1)  # a batch without real tokens: its loss is 0 anyway
            self._token_norm, self._window_tokens = (ranks * micro, first), torch.zeros_like(mine)
        self._window_tokens = self._window_tokens + mine

    @property
    def window_factor(self) -> float:
        """The last optimizer step's gradient factor A * N0 / N (see :meth:`loss`; 1.0 without accumulation).
        Reading it is a host sync (the factor lives on the device): for tests and reports, not inside a step."""
        return 1.0 if self._window_factor is None else float(self._window_factor)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """The accumulation window's factor A * N0 / N on the reduced gradients (see :meth:`loss`)."""
        trainer, norm = self._trainer, self._token_norm
        self._token_norm = None
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        self._window_factor = None
        if norm is None or accumulate == 1:
            return
        group = _loss_pieces(trainer.strategy)[0]
        total = self._window_tokens.clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        # on the device (no host sync), float64 as a Python float: exactly 1.0 when every micro-step held N0
        factor = (accumulate * norm[1]).double() / total.clamp(min=1)
        self._window_factor = factor
        cast: dict[tuple[torch.device, torch.dtype], Tensor] = {}  # the factor once per gradients' device and dtype
        for group_ in optimizer.param_groups:  # what the optimizer steps: ZeRO-1/2's flat slices, DTensors
            for p in group_["params"]:
                if p.grad is not None:
                    grad = local(p.grad)  # a DTensor's shard in place: no redistribution of a plain factor
                    key = (grad.device, grad.dtype)
                    if key not in cast:
                        cast[key] = factor.to(device=grad.device, dtype=grad.dtype)
                    grad.mul_(cast[key])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self._count_tokens(batch, batch_idx)
        loss = self._step_loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._step_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        # only what trains: a frozen base (LoRA) gets no optimizer state, and no gradient buffer under ZeRO 1-2
        trainable = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # LoRA's factors are all matrices; a pipeline stage holding no adapter keeps one empty group (torch refuses
        # an optimizer without any)
        groups = [g for g in groups if g["params"]] or groups[:1]
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps)
