"""Muon for the weight matrices, AdamW for the rest, as one ``torch.optim.Optimizer``. Pure torch, no Lightning.

The split rule (:func:`split_params`): a parameter is stepped by Muon when it is the 2-D ``weight`` of an
``nn.Linear`` (a tensor-parallel or ZeRO-3 DTensor counts by its global shape) and that Linear is not the output
head. The output head is a Linear whose weight is an ``nn.Embedding``'s (tied), one named as heads are
(:data:`HEAD_NAMES`: ``lm_head``, ``output``, ``head``), or the module's last Linear when its ``out_features`` is the
vocabulary (the largest Embedding's ``num_embeddings``; on a pipeline stage without the embedding, the size the
layer standing for it keeps). A Linear elsewhere whose width happens to equal the vocabulary or a position
embedding's rows (an MLP's ``4 * d_model``, ``d_model == seq_len``) is a matrix like any other. ``GroupedExperts``'
stacked weights (E, in, out) go to Muon too, in a group of their own (``stacked_experts``) where each expert's
matrix is orthogonalized alone. Everything else is stepped by AdamW: embeddings, the head, norm weights, biases, any
other parameter that is not 2-D.

The Muon part is ``torch.optim.Muon``'s update (momentum by ``lerp``, Nesterov, a quintic Newton-Schulz
orthogonalization, decoupled weight decay, ``adjust_lr_fn``), with ``ns_dtype`` the dtype of the Newton-Schulz
iteration: ``torch.bfloat16`` as torch (the default), or ``torch.float32`` for exact parity between layouts. A
matrix split across ranks (a DTensor) is orthogonalized once, whole, on one owner rank (:mod:`.muon_exchange`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.adamw import adamw

from lightning_parallel.parallel.dtensor import local
from lightning_parallel.parallel.expert.experts import GroupedExperts
from lightning_parallel.parallel.optim.muon_exchange import FlatMatrices, orthogonalize_all, orthogonalize_flat

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype) -> Tensor:
    """The orthogonalized ``update`` (a whole 2-D matrix), computed in ``dtype``: torch.optim.Muon's iteration."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate scaling by the (global) matrix shape (rows: outputs, as a Linear's)."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


HEAD_NAMES = ("lm_head", "output", "head")  # the output head's usual names (the recipe GPT, HF, LitGPT, torchtitan)


def _heads(module: nn.Module) -> set[int]:
    """The ids of the output heads' weights by the split rule (module docstring)."""
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    # a pipeline stage without the embedding keeps its size on the layer standing for it (pipeline/split.py)
    sizes = [e.num_embeddings for e in embeddings]
    sizes += [n for m in module.modules() for n in getattr(m, "embedding_sizes", ())]
    vocabulary = max(sizes, default=None)
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    heads = {
        id(m.weight)
        for name, m in linears
        if name.rsplit(".", 1)[-1] in HEAD_NAMES or any(m.weight is e.weight for e in embeddings)
    }
    if linears and linears[-1][1].out_features == vocabulary:
        heads.add(id(linears[-1][1].weight))
    return heads


def split_params(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """The trainable parameters by the split rule (module docstring): (Muon's matrices, and the stacks of expert
    matrices (E, in, out) of ``GroupedExperts``; AdamW's with weight decay: the other parameters of 2 or more
    dimensions; AdamW's without: biases, norms, scalars)."""
    heads = _heads(module)
    matrices = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, nn.Linear) and m.weight.ndim == 2 and id(m.weight) not in heads
    }
    matrices |= {id(w) for m in module.modules() if isinstance(m, GroupedExperts) for w in (m.w1, m.w2, m.w3)
                 if w is not None and w.ndim == 3}  # fmt: skip
    muon, decay, no_decay = [], [], []
    for p in module.parameters():  # each shared parameter once
        if not p.requires_grad:
            continue
        (muon if id(p) in matrices else decay if p.ndim >= 2 else no_decay).append(p)
    return muon, decay, no_decay


class MuonAdamW(Optimizer):
    """Muon on the groups marked ``use_muon``, AdamW on the others (see the module docstring for the split rule
    and :meth:`from_module` to apply it). Each group may override any default below; a group's ``lr`` and
    ``weight_decay`` are the ones it steps with (an AdamW group's default to ``adamw_lr`` and ``adamw_weight_decay``).

    Args:
        params: parameter groups; a group with ``use_muon=True`` holds 2-D matrices only, or, with
            ``stacked_experts=True`` too, 3-D stacks (E, in, out) of expert matrices, each orthogonalized alone.
        lr: Muon's learning rate; weight_decay: Muon's decoupled weight decay; momentum, nesterov, ns_coefficients,
            ns_steps, eps, adjust_lr_fn: as ``torch.optim.Muon``.
        ns_dtype: the Newton-Schulz iteration's dtype (``torch.bfloat16`` or ``torch.float32``, or their names).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW's, for the other groups.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_steps: int = 5,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        adamw_lr: float = 3e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
    ) -> None:
        # kept by name in the groups: a checkpoint's param_groups hold plain values
        names = {dtype: name for name, dtype in NS_DTYPES.items()}
        ns_dtype = names.get(ns_dtype, ns_dtype)  # type: ignore[call-overload]
        if ns_dtype not in NS_DTYPES:
            raise ValueError(
                f"ns_dtype={ns_dtype!r}: set it to one of {', '.join(NS_DTYPES)} (torch.bfloat16, as torch's Muon, "
                "or torch.float32)"
            )
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: set it to None, 'original' or 'match_rms_adamw'")
        defaults = dict(
            use_muon=False, stacked_experts=False, lr=lr, weight_decay=weight_decay, momentum=momentum,
            nesterov=nesterov, ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, eps=eps,
            adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, betas=tuple(adamw_betas), adamw_eps=adamw_eps,
        )  # fmt: skip
        # each group's own lr and weight_decay are what it steps with (LR schedulers scale both parts alike): AdamW's
        # groups take adamw_lr and adamw_weight_decay unless they set their own
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        adamw_defaults = {"lr": adamw_lr, "weight_decay": adamw_weight_decay}
        groups = [g if g.get("use_muon") else {**adamw_defaults, **g} for g in groups]
        super().__init__(groups, defaults)
        # the last step's Muon exchange on this rank: elements and bytes sent, matrices orthogonalized here and their
        # Newton-Schulz cost (muon_exchange.ns_cost)
        self.exchange: dict[str, int] = {}
        # ZeRO-0 (set by the sharding): the data-parallel ranks holding the same whole matrices, among which each
        # matrix gets one owner (None: every rank orthogonalizes its whole matrices itself)
        self.replica_group = None
        # ZeRO-1/2 (flat_zero.py): a use_muon group's flat slice -> the matrices packed in its buffer
        self.flat_layouts: dict[int, FlatMatrices] = {}
        for group in self.param_groups:
            for p in group["params"] if group["use_muon"] else []:
                if p.ndim != (3 if group["stacked_experts"] else 2):
                    raise ValueError(
                        f"MuonAdamW: a use_muon group holds a parameter of shape {tuple(p.shape)}; Muon steps 2-D "
                        "matrices only (or, in a group with stacked_experts=True, 3-D stacks of expert matrices): "
                        "put it in a group with use_muon=False (AdamW), or build the optimizer with "
                        "MuonAdamW.from_module(module), which applies the split rule."
                    )

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> MuonAdamW:
        """The optimizer over ``module``'s trainable parameters split by :func:`split_params`: Muon's matrices,
        AdamW's with ``adamw_weight_decay`` (embeddings, the head) and AdamW's without (biases, norms)."""
        muon, decay, no_decay = split_params(module)
        groups = [
            {"params": [p for p in muon if p.ndim == 2], "use_muon": True},
            {"params": [p for p in muon if p.ndim == 3], "use_muon": True, "stacked_experts": True},
            {"params": decay, "use_muon": False},
            {"params": no_decay, "use_muon": False, "weight_decay": 0.0},
        ]
        return cls([g for g in groups if g["params"]], **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.exchange.clear()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon_step(group, params)
            elif params:
                self._adamw_step(group, params)
        return loss

    def _muon_step(self, group: dict, params: list[Tensor]) -> None:
        momentum = group["momentum"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf = local(p.grad), local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)

        ns_dtype = NS_DTYPES.get(group["ns_dtype"], group["ns_dtype"])  # a group may name it or give the dtype

        def orthogonalize(whole: Tensor) -> Tensor:  # a matrix, or a stack (E, in, out) of experts, each alone
            if whole.ndim == 3:
                return torch.stack([orthogonalize(w) for w in whole]) if len(whole) else whole.to(ns_dtype)
            return newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"], ns_dtype)

        flat = [i for i, p in enumerate(params) if id(p) in self.flat_layouts]
        whole = [i for i in range(len(params)) if id(params[i]) not in self.flat_layouts]
        orthogonal = orthogonalize_all([params[i] for i in whole], [updates[i] for i in whole], orthogonalize,
                                       ns_dtype, self.exchange, self.replica_group)  # fmt: skip
        lr = group["lr"]
        for i, update in zip(whole, orthogonal):
            param = local(params[i])
            param.mul_(1 - lr * group["weight_decay"])
            shape = params[i].shape  # a stack (E, in, out): each expert's lr by its (out, in), as a Linear's
            shape = torch.Size((shape[2], shape[1])) if group["stacked_experts"] else shape
            param.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], shape))
        for i in flat:  # ZeRO-1/2: this rank's slice of a flat buffer of matrices
            layout = self.flat_layouts[id(params[i])]
            pieces = orthogonalize_flat(layout, updates[i], orthogonalize, ns_dtype, self.exchange)
            params[i].mul_(1 - lr * group["weight_decay"])
            for m, start, end, piece in pieces:
                alpha = -adjusted_lr(lr, group["adjust_lr_fn"], layout.lr_shape(m))
                params[i][start:end].add_(piece, alpha=alpha)

    def _adamw_step(self, group: dict, params: list[Tensor]) -> None:
        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(
            params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, amsgrad=False, beta1=beta1, beta2=beta2,
            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["adamw_eps"], maximize=False,
        )  # fmt: skip


def is_muon(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is (or wraps) a :class:`MuonAdamW`, the one matrix optimizer the shardings accept."""
    return isinstance(getattr(optimizer, "_optimizer", optimizer), MuonAdamW)


def check_muon_precision(optimizer: Optimizer, precision: str) -> None:
    """Refuse :class:`MuonAdamW` under ``precision="16-mixed"`` (the strategies call this once the optimizer exists,
    on every rank, before the first step's collectives).

    Raises:
        ValueError: naming the precision and what works instead.
    """
    if is_muon(optimizer) and precision == "16-mixed":
        raise ValueError(
            "MuonAdamW with precision='16-mixed': fp16's loss scaling is not supported with Muon here (its parity "
            "is untested: a skipped step's momentum and the scaled Newton-Schulz input are unchecked). Use "
            "precision='bf16-mixed' (no loss scaling) or '32-true', or an elementwise optimizer such as AdamW."
        )


__all__ = [
    "NS_COEFFICIENTS",
    "MuonAdamW",
    "adjusted_lr",
    "check_muon_precision",
    "is_muon",
    "newton_schulz",
    "split_params",
]
