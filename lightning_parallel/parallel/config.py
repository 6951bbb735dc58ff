"""Every parallel setting, declared once: :class:`ParallelConfig` and its validation. Pure Python (+ torch's
schedule table).

The strategies take it (``Hybrid3DStrategy(pp=2, tp=2)`` builds one from its keyword arguments), the recipes'
Hydra schemas (``recipes/strategy_conf.py``, one per strategy) take its settings, the degrees top-level and the
others in sections (:data:`~lightning_parallel.parallel.sections.SECTIONS`: ``strategy.pipeline.balance`` is
``pp_balance``), the planner validates layouts with it, and the tests build strategies from it. A new setting is a
new field here, with its check in :meth:`ParallelConfig.validate`, and a key in the recipe schema of each strategy
that takes it; a new mesh axis whose size is its setting (``mesh.PLAIN_AXES``) is a field named as the axis, which
:meth:`ParallelConfig.dims`, ``describe`` and the degree checks pick up (its constraints against other settings go
in ``validate``).

May import: ``parallel.mesh``, ``parallel.pipeline.schedules``, ``parallel.data.stages``,
``parallel.activation_checkpoint``, ``parallel.fault_tolerance``, ``parallel.sections``. Never Lightning.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_parallel.parallel.activation_checkpoint import check_activation_checkpointing
from lightning_parallel.parallel.data.compression import check_grad_compression
from lightning_parallel.parallel.data.powersgd import check_powersgd_settings
from lightning_parallel.parallel.data.stages import check_sharding_name, check_zero_settings, sharding_class
from lightning_parallel.parallel.fault_tolerance import check_fault_tolerance
from lightning_parallel.parallel.mesh import PLAIN_AXES, ParallelDims, check_degree
from lightning_parallel.parallel.pipeline.schedules import ScheduleSpec, schedule_spec
from lightning_parallel.parallel.sections import SECTIONS, setting_in

PIPELINE_BALANCES = ("uniform", "params", "profile")
CONTEXT_MODES = ("ring", "ulysses")


def check_flag(name: str, value: object) -> None:
    """A boolean setting: refuse anything else (a string such as "false" would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False: set {name}=True or {name}=False.")


def check_degree_arg(name: str, value: object, allow_auto: bool = False) -> None:
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


@dataclass
class ParallelConfig:
    """How one model is laid out over the world. Field types are ones Hydra's structured configs accept.

    Attributes:
        dp: data-parallel degree; ``"auto"`` takes the ranks the other axes leave.
        pp: pipeline-parallel degree (stages; more per rank with ``pp_virtual_stages``).
        tp: tensor-parallel degree.
        ep: expert-parallel degree: the experts of every MoE layer split over ep of the dp ranks (ep divides dp).
        cp: context-parallel degree: each sample's sequence split over cp ranks (two mirrored chunks each, for
            causal load balance); they see the same samples, and their gradients are averaged with dp's.
        cp_mode: how attention spans the split sequence: ``ring`` (keys and values passed around the cp ranks,
            exact online-softmax merge) or ``ulysses`` (all-to-all to a split over heads; cp must divide them).
        spatial: spatial-parallel degree for conv nets: each image split into ``spatial`` strips of rows (height),
            convolutions borrowing halo rows from the neighbouring strips, BatchNorm statistics reduced over the
            strips, the strips gathered before the classifier. It takes the cp mesh axis (cp must stay 1): its ranks
            see the same samples, and their gradients are averaged with dp's. Not with tp, pp or ep.
        dp_shard: HSDP: the data-parallel ranks one replica shards model states over (a divisor of dp); the dp /
            dp_shard replicas hold the same shards and all-reduce them (gradients: reduce-scatter inside a replica,
            all-reduce of the shard across replicas). None: shard over all of dp. Needs zero_stage 1-3.
        zero_stage: what data parallelism shards over dp: 0 nothing (gradients averaged), 1 optimizer
            states, 2 also gradients, 3 also parameters (FSDP2).
        sharding: a data-parallel sharding by its registered name
            (:data:`~lightning_parallel.parallel.data.sharding.SHARDINGS`: ``replicate``, ``zero1``-``zero3`` or a
            variant registered with ``@register_sharding``); None: ``zero_stage``'s. It sets ``zero_stage`` to its
            class's stage (a zero_stage set otherwise is refused).
        offload: keep the sharded states on the host and step there (stages 2 and 3).
        reshard_after_forward: stage 3: free gathered parameters after each unit's forward (less memory) or
            keep them until backward (less communication).
        pp_schedule: the pipeline schedule, by its name in
            :data:`~lightning_parallel.parallel.pipeline.schedules.SCHEDULES`: ``gpipe``, ``1f1b``,
            ``interleaved_1f1b``, ``zero_bubble``, ``looped_bfs`` or ``interleaved_zero_bubble``.
        microbatches: per pipeline step; they must divide each dp rank's batch (None: 2 * pp).
        pp_balance: ``uniform`` (layers per stage), ``params`` (parameter count) or ``profile`` (timed
            forward+backward on the module's ``example_input_array``).
        pp_memory_budget: with ``pp_balance="profile"``, the most bytes one stage may hold. None: no limit.
        pp_virtual_stages: stages per rank for ``interleaved_1f1b`` (default 2).
        sequence_parallel: also split norms and the residual stream along the sequence over tp.
        grad_compression: how the data-parallel gradient reduction travels: ``none``, ``bf16``, ``fp16`` (its dtype)
            or ``powersgd`` (rank-``powersgd_rank`` factors of each gradient matrix, with error feedback).
        powersgd_rank: the rank of PowerSGD's factors (more: closer to the uncompressed gradient, more bytes).
        overlap_grad_reduce: ZeRO 0-2 reduce gradients bucket by bucket during the last backward of each step
            instead of once after it (under pp: during each stage's last microbatch), and ZeRO 1-2 gather the
            updated parameters bucket by bucket, each waited for by the forward that uses it (ZeRO-3's FSDP2
            overlaps by itself).
        bucket_mb: the buckets' size in MB for ``overlap_grad_reduce``.
        compile: ``torch.compile`` each layer (the pipeline layers, else the repeated blocks) after tensor
            parallelism and activation checkpointing, before data-parallel sharding (torchtitan's per-block way).
        activation_checkpointing: ``none``, ``full`` (recompute each layer in backward, keep its input) or
            ``selective`` (keep matmul, conv and attention outputs, recompute the rest).
        fault_tolerance: ``none`` or ``torchft``: ``ft_replicas`` replica groups, each launched on its own, average
            gradients through torchft and go on when one dies (:mod:`~lightning_parallel.parallel.fault_tolerance`).
        ft_replicas: with ``fault_tolerance="torchft"``, how many replica groups train together.
        ft_replica_id: this launch's index among the replica groups (0 to ``ft_replicas`` - 1).
        ft_min_replicas: the fewest replica groups a step may run with.
        ft_lighthouse: the torchft lighthouse's ``http://host:port`` (None: the ``TORCHFT_LIGHTHOUSE`` variable).
        ft_timeout: seconds for torchft's quorums, reductions and state transfers.
    """

    dp: Any = "auto"  # an int or "auto"
    pp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    spatial: int = 1
    dp_shard: int | None = None
    zero_stage: int = 0
    sharding: str | None = None
    offload: bool = False
    reshard_after_forward: bool = True
    pp_schedule: str = "1f1b"
    microbatches: int | None = None
    pp_balance: str = "uniform"
    pp_memory_budget: int | None = None
    pp_virtual_stages: int | None = None
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    grad_compression: str = "none"
    powersgd_rank: int = 4
    overlap_grad_reduce: bool = False
    bucket_mb: float = 25.0
    compile: bool = False
    fault_tolerance: str = "none"
    ft_replicas: int = 2
    ft_replica_id: int = 0
    ft_min_replicas: int = 1
    ft_lighthouse: str | None = None
    ft_timeout: float = 60.0

    # ----- building -----

    @classmethod
    def names(cls) -> list[str]:
        """The settings' names, in declaration order."""
        return [f.name for f in dataclasses.fields(ParallelConfig)]

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> ParallelConfig:
        """A config from the settings in ``settings``, by their flat names or in the recipes' sections
        (``{"pipeline": {"balance": ...}}``); other keys are ignored (a Hydra node may hold more)."""
        flat = {name: (name in settings, settings.get(name)) for name in cls.names() if name not in SECTIONS}
        found = {**flat, **{name: setting_in(settings, name) for name in SECTIONS}}  # top-level keys read here
        return ParallelConfig(**{name: value for name, (there, value) in found.items() if there})

    @classmethod
    def split_kwargs(cls, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(parallel settings, everything else) of a strategy's keyword arguments."""
        names = set(cls.names())
        return {k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names}

    def non_defaults(self, names: list[str] | None = None) -> dict[str, Any]:
        """The settings (among ``names``, default all) that differ from their defaults."""
        default = ParallelConfig()
        return {n: getattr(self, n) for n in names or self.names() if getattr(self, n) != getattr(default, n)}

    # ----- what it means -----

    @property
    def schedule(self) -> ScheduleSpec:
        return schedule_spec(self.pp_schedule)

    @property
    def stages_per_rank(self) -> int:
        return self.schedule.stages_per_rank(self.pp_virtual_stages) if self.pp > 1 else 1

    def dims(self, world_size: int) -> ParallelDims:
        """The degrees for ``world_size`` processes (``dp="auto"`` resolved); a ValueError with the arithmetic
        when they do not fit, or when ep or dp_shard does not divide the resolved dp."""
        self._check_spatial()
        degrees = {"cp": self.cp, "spatial": self.spatial} | {axis: getattr(self, axis) for axis in PLAIN_AXES}
        dp = ParallelDims.from_degrees(world_size, dp=self.dp, **degrees).dp  # "auto" resolved
        self._check_data_parallel(dp, resolved=self.dp == "auto")
        return ParallelDims.from_degrees(world_size, dp=dp, ep=self.ep, dp_shard=self.dp_shard, **degrees)

    def _check_data_parallel(self, dp: Any, resolved: bool = False) -> None:
        """ep and HSDP's dp_shard divide the data-parallel degree ``dp`` (``resolved``: from dp="auto"; "auto":
        not known yet)."""
        check_degree_arg("ep", self.ep)
        if isinstance(dp, int) and dp % self.ep:
            what, fix = ("the data-parallel degree dp", ", or change pp, tp or the devices") if resolved else ("dp", "")
            raise ValueError(
                f"ep={self.ep} must divide {what}={dp} (expert parallelism is carved out of the data-parallel "
                f"ranks): choose ep among the divisors of {dp}{fix}."
            )
        self._check_hybrid_shard(dp)

    def _check_hybrid_shard(self, dp: Any) -> None:
        """Validate ``dp_shard`` (HSDP) against the other settings (``dp``: an int, or "auto" before the world size
        is known)."""
        shard = self.dp_shard
        if shard is None:
            return
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
            raise ValueError(
                f"dp_shard={shard!r} is not a parallel degree: set dp_shard to a positive integer or None."
            )
        if isinstance(dp, int) and not isinstance(dp, bool) and dp % shard:
            raise ValueError(
                f"dp_shard={shard} must divide dp={dp} (HSDP: dp / dp_shard replicas, each sharded over dp_shard "
                f"ranks): choose dp_shard among the divisors of {dp}, or dp_shard=None to shard over all of dp."
            )
        stage = f"sharding={self.sharding!r}" if self.sharding is not None else f"zero_stage={self.zero_stage}"
        refused = {  # setting -> (refused?, the fix)
            stage: (not sharding_class(self).supports_hsdp, "set zero_stage to 1, 2 or 3 (HSDP shards model states)"),
            f"ep={self.ep}": (self.ep > 1, "set ep=1 (experts would need replica groups of their own)"),
            "grad_compression='powersgd'": (
                self.grad_compression == "powersgd",
                "use grad_compression='none', 'bf16' or 'fp16'",
            ),
            "overlap_grad_reduce=True": (self.overlap_grad_reduce is True, "set overlap_grad_reduce=False"),
        }
        for setting, (bad, fix) in refused.items():
            if bad:
                raise ValueError(
                    f"dp_shard={shard} (HSDP) with {setting} is not supported: {fix}, or set dp_shard=None."
                )

    def describe(self, name: str = "hybrid3d") -> str:
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        cp = f", cp={self.cp}, cp_mode={self.cp_mode!r}" if self.cp > 1 else ""
        cp += f", spatial={self.spatial}" if self.spatial > 1 else ""
        cp += f", dp_shard={self.dp_shard}" if self.dp_shard is not None else ""
        cp += f", sharding={self.sharding!r}" if self.sharding is not None else ""
        cp += "".join(f", {a}={getattr(self, a)}" for a in PLAIN_AXES if a not in ("pp", "tp") and getattr(self, a) > 1)
        return f"strategy={name!r} (dp={self.dp!r}, pp={self.pp}, tp={self.tp}{ep}{cp}, zero_stage={self.zero_stage})"

    # ----- validation -----

    def validate(self, warn: Callable[[str], Any] = warnings.warn) -> ParallelConfig:
        """Check every setting before any process group exists; returns the config itself, or a copy with the
        derived values filled in (``microbatches`` under pp). Settings that cannot apply are warned about through
        ``warn`` (Lightning's ``rank_zero_warn`` in the strategies).

        Raises:
            ValueError, TypeError: naming the setting and the fix.
        """
        if self.sharding is not None:
            stage = check_sharding_name(self.sharding).stage
            if self.zero_stage not in (0, stage):
                raise ValueError(
                    f"sharding={self.sharding!r} is ZeRO stage {stage}, and zero_stage={self.zero_stage}: drop "
                    "zero_stage (the sharding sets it), or sharding=None."
                )
            if self.zero_stage != stage:
                return dataclasses.replace(self, zero_stage=stage).validate(warn)
        check_degree_arg("dp", self.dp, allow_auto=True)
        for axis in PLAIN_AXES:  # pp, tp and any axis whose size is its setting
            check_degree_arg(axis, getattr(self, axis))
        self._check_context(warn)
        check_zero_settings(self.zero_stage, self.offload, name="zero_stage", allow_zero=True)
        if self.offload and not sharding_class(self).supports_offload:
            raise ValueError(f"offload=True: sharding={self.sharding!r} has no offload. Set offload=False.")
        self._check_data_parallel(self.dp)
        check_flag("sequence_parallel", self.sequence_parallel)
        check_flag("reshard_after_forward", self.reshard_after_forward)
        check_grad_compression(self.grad_compression)
        check_flag("overlap_grad_reduce", self.overlap_grad_reduce)
        check_flag("compile", self.compile)
        check_fault_tolerance(self, warn)
        check_powersgd_settings(
            self.grad_compression,
            self.powersgd_rank,
            zero_stage=self.zero_stage,
            ep=self.ep,
            overlap=self.overlap_grad_reduce,
            warn=warn,
        )
        bucket = self.bucket_mb
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or bucket <= 0:
            raise ValueError(f"bucket_mb={bucket!r} is not a size: set it to a positive number of megabytes (25).")
        if not self.overlap_grad_reduce and self.bucket_mb != ParallelConfig.bucket_mb:
            warn("bucket_mb only applies with overlap_grad_reduce=True: ignored.")
        if self.overlap_grad_reduce and self.zero_stage == 3:
            warn(
                "overlap_grad_reduce=True applies to zero_stage 0-2: ignored with zero_stage=3, whose FSDP2 overlaps "
                "its reduce-scatters by itself. Set overlap_grad_reduce=False to silence this."
            )
        if self.sequence_parallel and self.tp == 1:
            warn(
                "sequence_parallel=True splits along the sequence over tp, and tp=1: ignored. "
                "Set tp > 1 to use it, or sequence_parallel=False."
            )
        spec = schedule_spec(self.pp_schedule)
        if self.pp_balance not in PIPELINE_BALANCES:
            raise ValueError(
                f"pp_balance={self.pp_balance!r} is unknown: set it to one of {', '.join(PIPELINE_BALANCES)}."
            )
        if self.microbatches is not None:
            check_degree_arg("microbatches", self.microbatches)
        self._check_memory_budget(warn)
        spec.check_virtual_stages(self.pp_virtual_stages)
        done = dataclasses.replace(self)
        pipeline_set = self.non_defaults(["pp_schedule", "microbatches", "pp_balance", "pp_virtual_stages"])
        if self.pp == 1 and pipeline_set:
            warn("pp_schedule, microbatches, pp_balance and pp_virtual_stages only apply with pp > 1: ignored at pp=1.")
        if self.pp > 1:
            done.microbatches = 2 * self.pp if self.microbatches is None else self.microbatches
            setting = f"strategy='hybrid3d' (pp={self.pp}, pp_schedule={self.pp_schedule!r})"
            spec.check_microbatches(done.microbatches, self.pp, setting)
        done.activation_checkpointing = check_activation_checkpointing(self.activation_checkpointing)
        split_backward = self.pp > 1 and spec.split_backward
        gathers_params = "params" in sharding_class(self).sharded  # reshard_after_forward is its setting
        if split_backward and done.activation_checkpointing == "selective":
            raise ValueError(
                f"activation_checkpointing='selective' cannot run under pp_schedule={self.pp_schedule!r}: its split "
                "backward recomputes each layer twice (input, then weight gradients) and selective checkpointing keeps "
                "what it saved for one backward only. Use activation_checkpointing='full' or another pp_schedule."
            )
        if split_backward and gathers_params and self.reshard_after_forward:
            # resharding between a split backward's two passes gives wrong weight gradients (seen: 0.6-0.7x)
            warn(
                f"pp_schedule={self.pp_schedule!r} with zero_stage={self.zero_stage} keeps parameters gathered "
                "after forward."
            )
            done.reshard_after_forward = False
        if not gathers_params and not self.reshard_after_forward:
            warn("reshard_after_forward only applies with zero_stage=3: ignored.")
        return self if done == self else done  # nothing derived: the one object, carried on

    def _check_context(self, warn: Callable[[str], Any]) -> None:
        check_degree_arg("cp", self.cp)
        if self.cp_mode not in CONTEXT_MODES:
            raise ValueError(f"cp_mode={self.cp_mode!r} is unknown: set it to one of {', '.join(CONTEXT_MODES)}.")
        if self.cp == 1 and self.cp_mode != ParallelConfig.cp_mode:
            warn(f"cp_mode={self.cp_mode!r} only applies with cp > 1: ignored at cp=1.")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(
                f"cp={self.cp} with ep={self.ep}: context and expert parallelism together are not supported yet "
                "(expert gradients would need averaging over cp too). Set cp=1 or ep=1."
            )
        self._check_spatial()

    def _check_spatial(self) -> None:
        check_degree_arg("spatial", self.spatial)
        if self.spatial == 1:
            return
        if self.cp > 1:
            raise ValueError(
                f"spatial={self.spatial} with cp={self.cp}: both split each sample over the cp mesh axis (images into "
                "strips, sequences into chunks). Set spatial=1 or cp=1."
            )
        why = {
            "tp": "the strips' halo exchange and gather do not run on channel shards yet: use spatial or channel tp",
            "pp": "strips do not cross pipeline stages yet: use spatial with dp and ZeRO only",
            "ep": "a conv net has no experts to split",
        }
        for name, reason in why.items():
            if getattr(self, name) > 1:
                raise ValueError(
                    f"spatial={self.spatial} with {name}={getattr(self, name)}: not supported ({reason}). "
                    f"Set {name}=1 or spatial=1."
                )

    def _check_memory_budget(self, warn: Callable[[str], Any]) -> None:
        budget = self.pp_memory_budget
        if budget is None:
            return
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
            raise ValueError(f"pp_memory_budget={budget!r} is not a byte count: set it to a positive number or None.")
        if self.pp_balance != "profile":
            warn(f"pp_memory_budget only applies with pp_balance='profile': ignored with {self.pp_balance!r}.")
