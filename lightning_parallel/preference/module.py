"""DPO on the package's causal LMs: :func:`as_dpo` turns an :class:`~lightning_parallel.hf.HFCausalLM` (or another
:class:`~lightning_parallel.causal_lm.CausalLM` whose ``self.model`` is the network) into one that trains on
preference pairs, its class a subclass of the module's own (every protocol method, plan and checkpoint hook stays).

A batch holds whole pairs: ``input_ids``, ``labels`` (answer tokens, else -100), ``attention_mask`` of shape
(B, 2, T), row 0 of each pair the chosen answer and row 1 the rejected one (:class:`.data.PreferencePairs`), and with
a precomputed reference ``reference_logps`` (B, 2). The step flattens them to (2B, T), chosen and rejected
alternating, so any split of the batch along its first dimension keeps each pair together.

Every piece of the global batch (a data-parallel rank's accumulated micro-batch) holds the same number of pairs, so
the mean over its pairs is its share of the global mean: the data-parallel average and Lightning's accumulation
give the mean over the global batch's pairs, however many answer tokens each micro-batch holds (log-probabilities
are sums, never token means). The logged rewards, margin and accuracy are means over the piece's pairs averaged over
the ranks (``sync_dist``): global means for the same reason.

Under pp the labels and the reference's log-probabilities travel as one tensor the schedule splits into microbatches
of whole pairs (``strategy.microbatches`` must divide a rank's pairs); the loss and the metrics are computed on the
last stage (the metrics' sums reduced over the stages); the reference (adapters off, the model as it starts for a
precomputation, or the frozen copy's stages, :func:`.reference.copy_pipeline`) is a forward-only pipeline run whose
last stage keeps the log-probabilities.

Under cp the pairs become rows with shifted labels before the strategy splits the sequences, and each rank's answer
log-probability sums are added over the cp group (:mod:`.context`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_parallel.parallel.context.apply import CONTEXT_ATTR
from lightning_parallel.preference.context import cp_rows, summed_over
from lightning_parallel.preference.litgpt import copy_logits, has_adapters
from lightning_parallel.preference.loss import (
    METRICS,
    answer_tokens,
    check_loss_settings,
    metric_sums,
    pair_losses,
    sequence_logps,
    split_pairs,
)
from lightning_parallel.preference.moe import enable_router_aux, router_logits_off, with_router_aux
from lightning_parallel.preference.reference import (
    COPY_NAME,
    REFERENCES,
    adapters_off,
    copy_pipeline,
    fill_from,
    frozen_copy,
    has_meta,
    hidden,
    split_like,
)


@dataclass(frozen=True)
class DPOSettings:
    """The recipe's ``dpo.*``.

    Args:
        beta: the KL weight (TRL's ``beta``, default 0.1).
        loss: ``sigmoid``, ``ipo`` or ``robust``.
        label_smoothing: ``robust``'s eps in [0, 0.5).
        reference: ``adapters``, ``copy`` or ``precomputed`` (:mod:`.reference`).
    """

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    reference: str = "adapters"

    def __post_init__(self) -> None:
        check_loss_settings(self.loss, self.beta, self.label_smoothing)
        if self.reference not in (*REFERENCES, "policy"):
            raise ValueError(f"dpo reference {self.reference!r} is unknown: one of {list(REFERENCES)}.")


def pair_rows(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor | None]:
    """(ids, labels, other inputs, reference log-probabilities or None), each (2B, ...) with the pairs' rows side by
    side (chosen, rejected, chosen, ...); a batch flattened already (:func:`.context.cp_rows`) as it is."""
    if batch["input_ids"].dim() == 2:  # under cp: rows, shifted labels, no mask
        ref = batch.get("reference_logps")
        return batch["input_ids"], batch["labels"], {}, (ref.float() if ref is not None else None)
    ids, labels = batch["input_ids"].flatten(0, 1), batch["labels"].flatten(0, 1)
    inputs = {"attention_mask": batch["attention_mask"].flatten(0, 1)} if "attention_mask" in batch else {}
    ref = batch.get("reference_logps")
    return ids, labels, inputs, (ref.flatten().float() if ref is not None else None)


def _packed(labels: Tensor, ref: Tensor) -> Tensor:
    """(labels (2B, T), reference log-probabilities (2B,)) as one float64 tensor (2B, T + 1): what a pipeline
    schedule splits into microbatches (ids below 2**53 stay exact)."""
    return torch.cat([labels.double(), ref.double().reshape(-1, 1).to(labels.device)], dim=1)


def _unpacked(target: Tensor) -> tuple[Tensor, Tensor]:
    return target[:, :-1].long(), target[:, -1].float()


def _check_microbatches(pairs: int, microbatches: int) -> None:
    """Under pp each pipeline microbatch must hold whole pairs (its chosen and rejected rows meet in its loss)."""
    if pairs % microbatches:
        raise ValueError(
            f"strategy.microbatches={microbatches} does not divide the {pairs} pairs of a rank's micro-batch: each "
            "pipeline microbatch holds whole pairs; make data.global_batch_size / (dp x accumulate_grad_batches) a "
            f"multiple of {microbatches}."
        )


def _logps(logits: Tensor, labels: Tensor, shifted: bool = False) -> Tensor:
    """Summed answer log-probabilities; logits split over the vocabulary (tp) inside ``loss_parallel``."""
    if isinstance(logits, DTensor):
        with loss_parallel():
            return sequence_logps(logits, labels, shifted)
    return sequence_logps(logits, labels, shifted)


class PreferenceTuning:
    """The DPO steps, mixed in before the module's own class by :func:`as_dpo`."""

    dpo: DPOSettings
    _stash: Tensor | None = None  # a pipelined reference forward's log-probabilities, on the last stage
    _sums: dict = {}  # the step's metric sums by microbatch (one entry outside pp)
    scoring: bool = False  # True: validation_step returns (loss, *METRICS) and logs nothing

    # ----- the reference -----

    @torch.no_grad()
    def reference_logps(self, ids: Tensor, labels: Tensor, inputs: dict[str, Tensor]) -> Tensor:
        """The reference's summed answer log-probabilities of the (2B, T) rows, without gradient. Under pp (the
        forward returns the pipeline's input) a forward-only pipeline run computes them on the last stage (zeros
        elsewhere: only the last stage's loss reads them)."""
        kind, group = self.dpo.reference, self._cp_group()
        if kind == "copy" and _pipelined(self) is None:
            logits = copy_logits(getattr(self, COPY_NAME), ids, inputs)
            return self._over_cp(_logps(logits, labels, group is not None), group)
        if kind not in ("adapters", "policy", "copy"):  # policy: a precomputation, the model as it starts
            raise RuntimeError("dpo.precompute_reference=true: the batch carries reference_logps (none here)")
        with adapters_off(self.model) if kind == "adapters" else contextlib.nullcontext():  # the base alone (pp: copy)
            output = self(ids, **inputs)
            if isinstance(output, Tensor):
                return self._over_cp(_logps(output, labels, group is not None), group).detach()
            self._stash = torch.zeros(ids.shape[0], device=ids.device)
            try:
                if kind == "copy":  # the copy's stages walked in order; their last stage's loss stashes them
                    self._copy_walk(output, _packed(labels, self._stash))
                else:
                    self.loss(output, _packed(labels, self._stash))  # the last stage's loss stashes them
            finally:
                stash, self._stash = self._stash, None
        return stash

    def _copy_walk(self, output: Any, target: Tensor) -> None:
        """Under pp: the reference copy's stages run forward on ``output``'s inputs (:func:`.reference.copy_pipeline`,
        made once), in the loss context the policy's schedule runs in (``loss_parallel`` under tp)."""
        step = _pipelined(self)
        if step not in _COPY_PIPELINES:  # kept by the step (no process group on the module: it is copied, pickled)
            _COPY_PIPELINES[step] = copy_pipeline(getattr(self, COPY_NAME), self.model, step.pipeline)
            policy, self._modules["model"] = self._modules["model"], getattr(self, COPY_NAME)
            try:
                self.pipeline_layers()  # the copy's layers get the hooks the policy's have (positions, mask)
            finally:
                self._modules["model"] = policy
        with step.context():
            _COPY_PIPELINES[step].eval_loss(output._args, output._kwargs, target)

    def materialize(self, device: torch.device | str = "cpu") -> None:
        """The policy's weights as the module gives them (its folder, its seeded init), the reference copy's then
        copied from them, shard by shard (the copy is split as the policy is: under pp, its layers of this rank's
        stages alone)."""
        with hidden(self, COPY_NAME) as ref:
            super().materialize(device)
        if ref is not None:
            split_like(ref, self.model)
        if ref is not None and has_meta(ref) and not has_meta(self.model):
            fill_from(ref, self.model, torch.device(device))

    def tensor_parallel_plan(self, sequence_parallel: bool = False) -> dict[str, Any]:
        """The policy's plan, and the same styles for the reference copy's layers."""
        plan = dict(super().tensor_parallel_plan(sequence_parallel))
        if COPY_NAME in self._modules:
            prefix = "model."
            plan |= {f"{COPY_NAME}.{k[len(prefix) :]}": v for k, v in plan.items() if k.startswith(prefix)}
        return plan

    def expert_parallel_plan(self) -> dict[str, Any]:
        """The policy's expert plan (a MoE's; none for a model without one), and the same styles for the reference
        copy's experts (split over ep as the policy's)."""
        own = getattr(super(), "expert_parallel_plan", None)
        plan = dict(own()) if own is not None else {}
        if COPY_NAME in self._modules:
            plan |= {f"{COPY_NAME}.{k[len('model.') :]}": v for k, v in plan.items() if k.startswith("model.")}
        return plan

    def configure_optimizers(self) -> Any:
        return super().configure_optimizers()  # requires_grad only: the reference copy is frozen

    # ----- context parallelism (:mod:`.context`) -----

    def context_parallel(self, attention: Any, positions: Any) -> list[str]:
        """The policy's attention and positions switched to the cp group's, and the reference copy's too."""
        switched = super().context_parallel(attention, positions)
        ref = self._modules.get(COPY_NAME)
        if ref is None:
            return switched
        policy, self._modules["model"] = self._modules["model"], ref
        try:
            copied = super().context_parallel(attention, positions)
        finally:
            self._modules["model"] = policy
        return switched + [COPY_NAME + path.removeprefix("model") for path in copied]

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Under cp, before the strategy splits the sequences: the pairs as rows with shifted labels."""
        if self._cp_group() is None:
            return super().on_after_batch_transfer(batch, dataloader_idx)
        return cp_rows(batch)

    def _cp_group(self) -> Any:
        """The cp group when the strategy splits each sequence over it, else None."""
        return self.trainer.strategy.mesh.group("context") if self._splits_sequences() else None

    @staticmethod
    def _over_cp(values: Tensor, group: Any) -> Tensor:
        return values if group is None else summed_over(values, group)

    # ----- the steps -----

    def loss(self, logits: Tensor, target: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        """The mean DPO loss over this piece's pairs. ``target``: (labels (2B, T), the reference's log-probabilities
        (2B,)), or both in one float64 tensor (2B, T + 1) under pp (the schedule splits one tensor into its
        microbatches, each a whole number of pairs); under tp the strategy runs it in ``loss_parallel`` with logits
        split over the vocabulary. Each call's rewards, margin and accuracy are summed into the step's."""
        labels, ref = _unpacked(target) if isinstance(target, Tensor) else target
        group = self._cp_group()  # under cp: this rank's pieces of the sequences, their sums added over cp
        logps = sequence_logps(logits, labels, group is not None)  # under tp the caller runs this in loss_parallel
        tokens = answer_tokens(labels, group is not None)
        if group is not None:
            logps, tokens = self._over_cp(torch.stack([logps, tokens.to(logps)]), group).unbind(0)
        if self._stash is not None:  # a forward-only pipeline run for the reference (reference_logps)
            self._stash = logps.detach()
            return logps.sum() * 0.0
        (c, r), (rc, rr), (tc, tr) = split_pairs(logps), split_pairs(ref.to(logps)), split_pairs(tokens)
        d = self.dpo
        pairs = pair_losses(
            c, r, rc, rr, beta=d.beta, loss=d.loss, label_smoothing=d.label_smoothing, chosen_tokens=tc,
            rejected_tokens=tr,
        )  # fmt: skip
        # keyed by the target's storage: a pipeline's shape inference may run a microbatch's loss twice
        key = (target.data_ptr(), target.storage_offset()) if isinstance(target, Tensor) else 0
        self._sums[key] = (metric_sums(pairs).detach(), len(c))
        return with_router_aux(self, pairs.losses.mean())  # a MoE's load-balancing loss, as TRL (.moe)

    def pair_scores(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(the mean loss over the batch's pairs, its rewards chosen / rejected, margin and accuracy means (4,)) on
        every rank; under pp the last stage's sums reduced over the stages."""
        ids, labels, inputs, ref = pair_rows(batch)
        if ref is None:
            with router_logits_off(self):
                ref = self.reference_logps(ids, labels, inputs)
        output = self(ids, **inputs)
        self._sums = {}
        pipelined = not isinstance(output, Tensor)
        if pipelined and torch.is_grad_enabled():
            _check_microbatches(ids.shape[0] // 2, self.trainer.strategy.config.microbatches)
        loss = self.loss(output, _packed(labels, ref) if pipelined else (labels, ref))
        sums = torch.zeros(len(METRICS) + 1, dtype=torch.float32, device=loss.device)
        for values, pairs in self._sums.values():
            sums += torch.cat([values.float(), values.new_tensor([pairs]).float()])
        if pipelined:
            dist.all_reduce(sums, group=self.trainer.strategy.mesh.group("stage"))  # the last stage's alone
        return loss, sums[:-1] / sums[-1].clamp(min=1)

    def _dpo_step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        loss, metrics = self.pair_scores(batch)
        if self.scoring:  # a pass outside the loops (the strategy routes it as a step): the values, unlogged
            return torch.cat([loss.detach().reshape(1).float(), metrics])
        self.log(f"{stage}_loss", loss, prog_bar=stage != "test", sync_dist=True)
        for name, value in zip(METRICS, metrics):
            self.log(f"{stage}_{name}", value, sync_dist=True)
        return loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._dpo_step(batch, "train")

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._dpo_step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._dpo_step(batch, "test")

    # ----- precomputed reference -----

    @torch.no_grad()
    def precompute_reference(self, dataset: Any, micro_batch: int, group: Any = None) -> Tensor:
        """(len(dataset), 2) summed answer log-probabilities by the model as it is now (adapters off under LoRA),
        each rank of ``group`` (the ranks reading different samples) its share, gathered; every rank runs the same
        number of forwards (the collectives of a split model agree)."""
        ranks = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        n = len(dataset)
        per_rank = -(-n // ranks)
        mine = [min(rank * per_rank + j, n - 1) for j in range(per_rank)]  # the last index repeats as padding
        kind, self.dpo = self.dpo, DPOSettings(**{**self.dpo.__dict__, "reference": _live(self)})
        was_training = self.training
        self.eval()
        out = []
        # under cp the cp ranks (reading the same pairs) split each batch's sequences as the steps do: the same numbers
        context = getattr(self, CONTEXT_ATTR, None) if self._cp_group() is not None else None
        try:
            for start in range(0, per_rank, micro_batch):
                items = [dataset[i] for i in mine[start : start + micro_batch]]
                keys = [k for k in items[0] if k != "reference_logps"]
                batch = {k: torch.stack([it[k] for it in items]).to(self.device) for k in keys}
                if context is not None:
                    batch = context.shard_batch(cp_rows(batch))
                ids, labels, inputs, _ = pair_rows(batch)
                with router_logits_off(self):
                    out.append(self.reference_logps(ids, labels, inputs).view(-1, 2))
        finally:
            self.dpo = kind
            self.train(was_training)
        local_logps = torch.cat(out)
        if group is None:
            return local_logps[:n].cpu()
        gathered = [torch.empty_like(local_logps) for _ in range(ranks)]
        dist.all_gather(gathered, local_logps, group=group)
        return torch.cat(gathered)[:n].cpu()


_COPY_PIPELINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pipelined step -> the copy's pipeline


def _pipelined(module: Any) -> Any:
    """The strategy's pipelined step driving ``module`` under pp (its ``forward`` is the step's capture), else
    None."""
    step = getattr(module.forward, "__self__", None)
    return step if step is not module and hasattr(step, "pipeline") else None


def _live(module: Any) -> str:
    """The reference a precomputation runs: the base (adapters off) under LoRA, else the policy as it starts."""
    return "adapters" if has_adapters(module) else "policy"


_CLASSES: dict[type, type] = {}


def dpo_class(base: type) -> type:
    """``base`` with :class:`PreferenceTuning`'s steps (made once per class, named ``DPO<base>``)."""
    if base not in _CLASSES:
        name = f"DPO{base.__name__}"
        cls = type(name, (PreferenceTuning, base), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls  # found by name, as pickle looks a class up
        _CLASSES[base] = cls
    return _CLASSES[base]


def as_dpo(module: Any, settings: DPOSettings) -> Any:
    """``module`` (built, not yet trained) training on preference pairs with ``settings``: its class becomes
    ``DPO<class>``; with ``reference="copy"`` a frozen copy of its model is added as ``reference_model``.

    Raises:
        ValueError: ``adapters`` without adapters on the module, ``copy`` with them (the reason given).
    """
    lora = has_adapters(module)
    if settings.reference == "adapters" and not lora:
        raise ValueError(
            "dpo reference 'adapters' needs LoRA adapters on the model (peft=lora): without them the policy has no "
            "base to fall back on; use peft=lora, or the frozen copy (peft=none) or dpo.precompute_reference=true."
        )
    if settings.reference == "copy" and lora:
        raise ValueError("dpo reference 'copy' with LoRA: the base with adapters off is the reference (no copy).")
    module.__class__ = dpo_class(type(module))
    module.dpo = settings
    enable_router_aux(module)  # a MoE's load-balancing loss as TRL adds it (.moe)
    if settings.reference == "copy":
        setattr(module, COPY_NAME, frozen_copy(module.model))
    return module
