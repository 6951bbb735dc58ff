"""PowerSGD gradient compression on the data-parallel reduction (Vogels et al., 2019). Pure torch, no Lightning.

``grad_compression="powersgd"`` sends a rank-``r`` factorization of each gradient matrix instead of the matrix.
Per local gradient ``G`` (n x m; a conv kernel or any tensor of 2+ dims is viewed as ``shape[0] x rest``):

    M = G + error             # error feedback: what earlier steps' approximations left out, per rank
    P = M Q                   # (n, r); every matrix's P in one flat all-reduce (sum over the dp ranks)
    P = orthonormalize(P)     # the same sum on every rank, so the same basis
    Q = M^T P                 # (m, r); one flat all-reduce (sum)
    G = P Q^T / divisor       # the dp mean of the sums' projection onto P's columns
    error = M - P Q^T / w     # per rank; summed over the w ranks: sum(M) - P Q^T
    Q = orthonormalize(Q)     # warm start: next step's power iteration begins from it

``n r + m r`` floats travel instead of ``n m``. The initial Q is random from a fixed seed (equal on every rank).
Tensors of one dim (biases, norms), matrices the factors would not shrink (``(n + m) r >= n m``) and embeddings
(:func:`embedding_weights`) are averaged whole in fp32, in one flat all-reduce. Embeddings because an embedding's
gradient has a row per token seen, a different few rows each step, and a tied output layer's is the model's
highest-rank gradient: on the 200-step GPT recipe, factoring the tied embedding too (at rank 4, or 8) ended 3.6-3.8%
above the uncompressed validation loss; sent whole, level with it. The strategy also keeps weights tied across
pipeline stages whole: each stage factors its own copy, and copies approximated differently would drift apart.

Both all-reduces are linear in the sum over ranks of ``M``, so the future depends on the ranks' errors only
through their mean: a checkpoint keeps each matrix's Q and the dp mean of its error (equal on every rank, the
same at any dp degree), and a resume gives every rank that mean (:meth:`PowerSGD.state_dict`,
:meth:`PowerSGD.load_state`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel.parallel.dtensor import local

POWERSGD_SEED = 0  # the initial Q's: the same on every rank
PREFIX = "powersgd."  # checkpoint keys: powersgd.<parameter name>[@<tp coordinate>].q / .error

Grads = list[tuple[nn.Parameter, Tensor]]  # (parameter, its local gradient: averaged in place)


def check_powersgd_settings(
    compression: str, rank: object, *, zero_stage: int, ep: int, overlap: bool, warn: Callable[[str], Any]
) -> None:
    """``powersgd_rank`` and what PowerSGD cannot run with, before any process group exists.

    Raises:
        ValueError: naming the setting and the fix.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(
            f"powersgd_rank={rank!r} is not a rank: set powersgd_rank to a positive integer (4 by default; higher "
            "sends more bytes and approximates the gradient more closely)."
        )
    if compression != "powersgd":
        if rank != 4:
            warn(f"powersgd_rank only applies with grad_compression='powersgd': ignored with {compression!r}.")
        return
    if zero_stage == 3:
        raise ValueError(
            "grad_compression='powersgd' cannot run with zero_stage=3 (zero3): FSDP2 reduce-scatters one flat buffer "
            "of every parameter's dim-0 shards inside backward, and PowerSGD needs whole gradient matrices; its error "
            "feedback would also keep a whole-model residual on every rank (each rank's differs, so it cannot be "
            "sharded), the memory ZeRO-3 exists to remove. Use zero_stage=2 (zero2) with powersgd, or "
            "grad_compression='bf16' with zero_stage=3."
        )
    if ep > 1:
        raise ValueError(
            f"grad_compression='powersgd' does not compress expert parameters (ep={ep}): use ep=1, or "
            "grad_compression='bf16' with expert parallelism."
        )
    if overlap:
        raise ValueError(
            "grad_compression='powersgd' reduces once after backward (each matrix needs its whole gradient and the "
            "previous step's Q): set overlap_grad_reduce=False, or grad_compression='bf16' to overlap."
        )


def embedding_weights(module: nn.Module) -> list[nn.Parameter]:
    """The weights of ``module``'s ``nn.Embedding`` layers (also when tied to an output layer): sent whole."""
    return [m.weight for m in module.modules() if isinstance(m, nn.Embedding)]


def as_matrix(t: Tensor) -> Tensor:
    """``t`` viewed as ``shape[0] x rest``."""
    return t.reshape(t.shape[0], -1)


def factor_rank(shape: torch.Size | tuple[int, ...], rank: int) -> int:
    """The rank of a ``shape`` matrix's factors: ``rank``, at most ``min(n, m)``."""
    n, m = shape[0], math.prod(shape[1:])
    return min(rank, n, m)


def worth_compressing(shape: torch.Size | tuple[int, ...], rank: int) -> bool:
    """A gradient of ``shape`` is factored when it is a matrix (2+ dims) whose factors are smaller than it."""
    if len(shape) < 2:
        return False
    n, m = shape[0], math.prod(shape[1:])
    return (n + m) * factor_rank(shape, rank) < n * m


AllReduce = Callable[[Tensor], Any]  # sums a flat tensor over the data-parallel ranks in place


def _sum(tensors: list[Tensor], all_reduce: AllReduce) -> list[Tensor]:
    """``tensors`` summed over the ranks in one flat all-reduce (new tensors, same shapes)."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat)
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def average_whole(grads: list[Tensor], all_reduce: AllReduce, divisor: int) -> None:
    """Average ``grads`` over the ranks in place, uncompressed, in fp32 (one flat all-reduce)."""
    summed = _sum([g.float() for g in grads], all_reduce)
    for g, s in zip(grads, summed):
        g.copy_(s.div_(divisor))


class PowerSGD:
    """PowerSGD state (each matrix's Q and error) and the compressed reduction over a data-parallel group.

    Args:
        rank: the factors' rank ``r`` (``powersgd_rank``).
        compress_all: factor every tensor of 2+ dims, also where the factors are not smaller (at full rank
            ``r = min(n, m)`` the reduction is then exact: the tests compare it with the plain average).
        seed: of the initial Q's.
    """

    def __init__(self, rank: int, *, compress_all: bool = False, seed: int = POWERSGD_SEED) -> None:
        self.rank, self.compress_all, self.seed = rank, compress_all, seed
        self.params: dict[int, tuple[int, nn.Parameter]] = {}  # id -> (index: its initial Q's seed, parameter)
        self.whole: set[int] = set()  # ids of parameters never factored (embeddings)
        self.q: dict[int, Tensor] = {}  # id(param) -> (m, r), kept between steps
        self.error: dict[int, Tensor] = {}  # id(param) -> (n, m) fp32, this rank's

    def compresses(self, t: Tensor) -> bool:
        return t.dim() >= 2 and (self.compress_all or worth_compressing(t.shape, self.rank))

    def keep_whole(self, params: list[nn.Parameter]) -> None:
        """Never factor these parameters' gradients (call before :meth:`track`)."""
        self.whole.update(id(p) for p in params)

    def track(self, params: list[nn.Parameter]) -> None:
        """Register the parameters whose gradients this factors (in the same order on every rank)."""
        for p in params:
            if id(p) not in self.params and id(p) not in self.whole and self.compresses(local(p)):
                self.params[id(p)] = (len(self.params), p)

    def _initial_q(self, p: nn.Parameter, m: Tensor) -> Tensor:
        index, _ = self.params[id(p)]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        r = factor_rank(m.shape, self.rank)
        return torch.randn(m.shape[1], r, generator=generator).to(m.device)

    def reduce(self, grads: Grads, group: dist.ProcessGroup | None, divisor: int, **simulated: Any) -> None:
        """Average the local gradients ``grads`` over ``group`` in place: tracked matrices through their
        factors, the rest whole. ``divisor``: what the sum is divided by (the data-parallel degree).
        ``simulated``: ``world`` and ``all_reduce`` (a flat in-place sum) instead of a group (unit tests)."""
        world = simulated["world"] if group is None else dist.get_world_size(group)
        all_reduce = simulated["all_reduce"] if group is None else lambda t: dist.all_reduce(t, group=group)
        if world == 1 and divisor == 1:
            return
        matrices = [(p, g) for p, g in grads if id(p) in self.params]
        average_whole([g for p, g in grads if id(p) not in self.params], all_reduce, divisor)
        if not matrices:
            return
        ms = [as_matrix(g).float() + self.error.get(id(p), 0) for p, g in matrices]
        qs = [self.q[id(p)] if id(p) in self.q else self._initial_q(p, m) for (p, _), m in zip(matrices, ms)]
        ps = _sum([m @ q for m, q in zip(ms, qs)], all_reduce)
        if not torch.stack([torch.isfinite(p).all() for p in ps]).all():  # one host sync
            # an fp16 overflow: the step is skipped (the loss scaler sees the non-finite gradient), the state restarts
            self.q.clear()
            self.error.clear()
            for _, g in matrices:
                g.fill_(float("nan"))
            return
        ps = [torch.linalg.qr(p).Q for p in ps]  # orthonormal columns
        qs = _sum([m.T @ p for m, p in zip(ms, ps)], all_reduce)
        for (p, g), m, basis, q in zip(matrices, ms, ps, qs):
            approx = basis @ q.T  # the projection of sum(M) onto P's columns
            self.error[id(p)] = m.sub_(approx, alpha=1 / world)
            # warm start from an orthonormal Q: the same span (so the same next P, up to its basis), but a Q of
            # lower rank than r (an embedding's gradient has a row per token seen) regains full rank
            self.q[id(p)] = torch.linalg.qr(q).Q
            g.copy_(approx.div_(divisor).view_as(g))

    def bytes_per_step(self, grads: list[Tensor], elem: int = 4) -> int:
        """Payload bytes one reduction all-reduces for ``grads`` (fp32): P and Q of factored ones, the rest whole."""
        total = 0
        for g in grads:
            if self.compresses(g):
                m = as_matrix(g)
                total += (m.shape[0] + m.shape[1]) * factor_rank(m.shape, self.rank)
            else:
                total += g.numel()
        return total * elem

    # ----- checkpoints -----

    def _keys(self, names: Mapping[int, str]) -> dict[int, str]:
        """Each tracked parameter's key prefix: its name, and its tensor-parallel coordinate (a shard's factors
        are its own)."""
        keys = {}
        for pid, (_, p) in self.params.items():
            if pid not in names:
                continue
            key = PREFIX + names[pid]
            if isinstance(p, DTensor):
                coordinate = p.device_mesh.get_coordinate() or []
                key += "@" + "_".join(f"{c}of{s}" for c, s in zip(coordinate, p.device_mesh.shape))
            keys[pid] = key
        return keys

    def state_dict(self, names: Mapping[int, str], group: dist.ProcessGroup) -> dict[str, Tensor]:
        """Q and the dp mean of the error of every matrix reduced so far (collective over ``group``; the same on
        every rank of it). ``names``: ``id(parameter)`` -> its name in the model."""
        keys = {pid: key for pid, key in self._keys(names).items() if pid in self.q}
        means = _sum([self.error[pid] for pid in keys], lambda t: dist.all_reduce(t, group=group))
        out = {}
        for (pid, key), mean in zip(keys.items(), means):
            out[key + ".q"] = self.q[pid].clone()
            out[key + ".error"] = mean.div_(dist.get_world_size(group))
        return out

    def load_targets(self, names: Mapping[int, str], saved: Mapping[str, Any]) -> dict[str, Tensor]:
        """Empty tensors for the saved state of this rank's matrices (``saved``: key -> metadata with ``size``);
        a matrix whose state is not there (another tp layout, a run without powersgd) starts afresh."""
        targets = {}
        for pid, key in self._keys(names).items():
            m = as_matrix(local(self.params[pid][1]))
            shapes = {".q": (m.shape[1], factor_rank(m.shape, self.rank)), ".error": tuple(m.shape)}
            if all(key + s in saved and tuple(saved[key + s].size) == shape for s, shape in shapes.items()):
                targets.update({key + s: torch.empty(shape) for s, shape in shapes.items()})
        if len(targets) < 2 * len(self.params) and any(k.startswith(PREFIX) for k in saved):
            warnings.warn(
                f"PowerSGD: the checkpoint has no state for {len(self.params) - len(targets) // 2} of this rank's "
                "matrices (saved under another tensor-parallel layout or powersgd_rank): they start afresh.",
                stacklevel=2,
            )
        return targets

    def load_state(self, names: Mapping[int, str], loaded: Mapping[str, Tensor]) -> None:
        """Take Q and the mean error of every matrix ``loaded`` holds (filled :meth:`load_targets`); every rank
        gets the mean, so the ranks' sum is the saved one."""
        self.q.clear()
        self.error.clear()
        for pid, key in self._keys(names).items():
            if key + ".q" in loaded:
                device = local(self.params[pid][1]).device
                self.q[pid] = loaded[key + ".q"].to(device)
                self.error[pid] = loaded[key + ".error"].to(device)
