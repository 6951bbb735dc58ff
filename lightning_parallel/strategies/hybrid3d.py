"""hybrid3d: data x pipeline x tensor parallelism on one (pp, dp, tp) mesh, with ZeRO over dp."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from lightning_parallel.mesh import TP, ParallelDims, check_degree
from lightning_parallel.parallel.tensor import apply_tp, check_tp_plan
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.strategies.zero import check_zero_settings

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
PIPELINE_BALANCES = ("uniform", "params")


def _check_degree_arg(name: str, value: object, allow_auto: bool = False) -> None:
    if allow_auto and value == "auto":
        return
    try:
        check_degree(name, value)
    except ValueError:
        if not allow_auto:
            raise
        raise ValueError(
            f"{name}={value!r} is not a parallel degree: set {name} to a positive integer or 'auto'."
        ) from None


class Hybrid3DStrategy(MeshStrategy):
    """Train one LightningModule across any split of the world into (pp, dp, tp).

    Tensor parallelism applies the module's ``tensor_parallel_plan()`` (Megatron column/row splits) on
    the tp axis; data parallelism averages gradients over dp, or shards model states there with
    ``zero_stage`` 1-3. The logged loss, samplers and ``sync_dist`` use the dp axis.

    Args:
        dp: data-parallel degree; ``"auto"`` takes the ranks pp and tp leave.
        pp: pipeline-parallel degree (stages).
        tp: tensor-parallel degree.
        zero_stage: 0 (gradients averaged over dp), 1, 2 or 3 (ZeRO over dp).
        pp_schedule: one of ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble``.
        microbatches: microbatches per pipeline step (default: 2 * pp).
        pp_balance: ``uniform`` (layers per stage) or ``params`` (parameter count per stage).
        sequence_parallel: also split layer norms and the residual stream along the sequence over tp.
        activation_checkpointing: reserved; only ``None`` is accepted for now.
        offload: keep ZeRO-2/3 states on the host.
        **kwargs: passed to :class:`~lightning_parallel.strategies.base.MeshStrategy`.
    """

    strategy_name = "hybrid3d"

    def __init__(
        self,
        dp: int | Literal["auto"] = "auto",
        pp: int = 1,
        tp: int = 1,
        zero_stage: int = 0,
        pp_schedule: str = "1f1b",
        microbatches: int | None = None,
        pp_balance: str = "uniform",
        sequence_parallel: bool = False,
        activation_checkpointing: str | None = None,
        offload: bool = False,
        reshard_after_forward: bool = True,
        **kwargs: Any,
    ) -> None:
        _check_degree_arg("dp", dp, allow_auto=True)
        _check_degree_arg("pp", pp)
        _check_degree_arg("tp", tp)
        check_zero_settings(zero_stage, offload, stages=(0, 1, 2, 3), name="zero_stage")
        if pp_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pp_schedule={pp_schedule!r} is unknown: set it to one of {', '.join(PIPELINE_SCHEDULES)}."
            )
        if pp_balance not in PIPELINE_BALANCES:
            raise ValueError(f"pp_balance={pp_balance!r} is unknown: set it to one of {', '.join(PIPELINE_BALANCES)}.")
        if microbatches is not None:
            _check_degree_arg("microbatches", microbatches)
        if activation_checkpointing is not None:
            raise ValueError(
                f"activation_checkpointing={activation_checkpointing!r} is not available yet: leave it None."
            )
        if pp > 1:
            raise ValueError(
                f"pp={pp}: pipeline parallelism is not available in this version yet: set pp=1 and use dp and tp."
            )
        if pp == 1 and (pp_schedule != "1f1b" or microbatches is not None or pp_balance != "uniform"):
            rank_zero_warn("pp_schedule, microbatches and pp_balance only apply with pp > 1: ignored at pp=1.")
        if zero_stage != 3 and not reshard_after_forward:
            rank_zero_warn("reshard_after_forward only applies with zero_stage=3: ignored.")
        super().__init__(zero_stage=zero_stage, offload=offload, reshard_after_forward=reshard_after_forward, **kwargs)
        self._degrees = {"dp": dp, "pp": pp, "tp": tp}
        self.pp_schedule = pp_schedule
        self.microbatches = microbatches
        self.pp_balance = pp_balance
        self.sequence_parallel = sequence_parallel

    @override
    def _setting(self) -> str:
        d = self._degrees
        return f"strategy='hybrid3d' (dp={d['dp']!r}, pp={d['pp']}, tp={d['tp']}, zero_stage={self.zero_stage})"

    @override
    def _parallel_degrees(self, world_size: int) -> ParallelDims:
        return ParallelDims.from_degrees(world_size, **self._degrees)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        # runs in Trainer.fit before the process group exists: refuse a model the degrees cannot split
        dims = self.parallel_dims
        if dims.tp > 1:
            if not callable(getattr(model, "tensor_parallel_plan", None)):
                raise TypeError(
                    f"tp={dims.tp} needs {type(model).__name__}.tensor_parallel_plan(sequence_parallel) returning "
                    "{module path: ParallelStyle}: add it (see the README's bring-your-own-model section) or set tp=1."
                )
            check_tp_plan(model, model.tensor_parallel_plan(self.sequence_parallel), dims.tp)
        check = getattr(model, "check_parallel_degrees", None)
        if callable(check):
            check(pp=dims.pp, tp=dims.tp)
        super().connect(model)

    @override
    def _apply_model_parallel(self) -> None:
        module = self.lightning_module
        assert module is not None and self.model is not None
        if self.parallel_dims.tp > 1:
            apply_tp(self.model, self.device_mesh[TP], module.tensor_parallel_plan(self.sequence_parallel))
            if callable(getattr(module, "loss", None)):
                module.loss = _vocab_parallel(module.loss)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.parallel_dims.tp == 1:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        with loss_parallel():  # the vocabulary-parallel loss needs its own backward rules too
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hybrid3d", cls, description="data x pipeline x tensor parallelism", override=True)


def _vocab_parallel(loss_fn: Any) -> Any:
    """Run the module's loss so it accepts logits left sharded over the vocabulary by the head."""

    def loss(*args: Any, **kwargs: Any) -> Tensor:
        with loss_parallel():
            value = loss_fn(*args, **kwargs)
        return value.full_tensor() if isinstance(value, DTensor) else value

    return loss
