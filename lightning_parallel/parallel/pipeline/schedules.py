"""The pipeline schedules, one row each: everything the runtime, the profiler and the planner need to know.

Choosing or adding a schedule happens here and nowhere else: its torch class (``get_schedule_class``), how
many stages each pp rank runs, how stages are placed on ranks (looped or V), how many microbatches a rank keeps
in flight, the bubble the literature gives it, and what it needs of the microbatch count. Pure torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from lightning_parallel.parallel.pipeline.partition import stage_to_rank


def _every_microbatch(pp: int, m: int, rank: int, v: int) -> float:
    return float(m)


def _warmup_then_one(pp: int, m: int, rank: int, v: int) -> float:
    return float(min(m, pp - rank))


def _interleaved(pp: int, m: int, rank: int, v: int) -> float:
    # torch's Interleaved1F1B: (v-1) rounds plus 2 * (pp-1-rank) warmup forwards, plus one; each forward goes
    # through one of the rank's v stages, so 1/v of its layers
    per_round = m // max(1, m // pp)
    warmup = (v - 1) * per_round + 2 * (pp - 1 - rank)
    return min(m * v, warmup + 1) / v


def _first_rank_of_1f1b(pp: int, m: int, rank: int, v: int) -> float:
    # ZB-V is built to hold what 1F1B's first rank holds (Qi et al., 2024); an estimate, not measured here
    return float(min(m, pp))


def _textbook(pp: int, m: int, v: int) -> float:
    return (pp - 1) / (m + pp - 1)


def _interleaved_bubble(pp: int, m: int, v: int) -> float:
    return (pp - 1) / (m + pp - 1) / v  # Narayanan et al., 2021


def _zero(pp: int, m: int, v: int) -> float:
    return 0.0  # the zero-bubble ideal: a lower bound


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule.

    Attributes:
        name: the ``pp_schedule`` value.
        torch_name: its name for ``torch.distributed.pipelining.schedules.get_schedule_class``.
        fixed_stages: stages per pp rank it always runs; None when ``pp_virtual_stages`` chooses (default 2).
        placement: ``"loop"`` (stage s on rank s % pp) or ``"v"`` (down the ranks, then back up).
        microbatches_rule: what it needs of the microbatch count: ``"any"``, ``"at_least_pp"`` (one per stage)
            or ``"rounds_of_pp"`` (also whole rounds of pp).
        in_flight_fn: microbatches whose activations a pp rank holds at its peak, in units of one microbatch
            through all of the rank's layers: ``(pp, microbatches, pp_rank, stages_per_rank) -> float``.
        bubble_fn: the idle fraction of a step: ``(pp, microbatches, stages_per_rank) -> float``.
        summary: one line for docs and errors.
        split_backward: backward runs as two passes (input gradients, then weight gradients), as zero-bubble
            schedules do: selective checkpointing cannot run under it, and ZeRO-3 must keep parameters gathered
            between the passes.
    """

    name: str
    torch_name: str
    fixed_stages: int | None
    placement: str
    microbatches_rule: str
    in_flight_fn: Callable[[int, int, int, int], float]
    bubble_fn: Callable[[int, int, int], float]
    summary: str
    split_backward: bool = False

    @property
    def schedule_class(self) -> type:
        return get_schedule_class(self.torch_name)

    @property
    def multi_stage(self) -> bool:
        """Whether torch's class drives several stages per rank (it then takes a list of stages)."""
        return issubclass(self.schedule_class, PipelineScheduleMulti)

    def stages_per_rank(self, virtual_stages: int | None = None) -> int:
        if self.fixed_stages is not None:
            return self.fixed_stages
        return 2 if virtual_stages is None else virtual_stages

    def stage_ranks(self, num_stages: int, pp: int) -> list[int]:
        """The pp rank that runs each stage."""
        return stage_to_rank(num_stages, pp, self.placement)

    def in_flight(self, pp: int, microbatches: int, pp_rank: int, stages_per_rank: int = 1) -> float:
        return 1.0 if pp == 1 else self.in_flight_fn(pp, microbatches, pp_rank, stages_per_rank)

    def bubble(self, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
        return 0.0 if pp == 1 else self.bubble_fn(pp, microbatches, stages_per_rank)

    def check_virtual_stages(self, virtual_stages: int | None) -> None:
        """``pp_virtual_stages`` must fit the schedule (checked before any process starts)."""
        if virtual_stages is None:
            return
        if self.fixed_stages is not None and virtual_stages != self.fixed_stages:
            raise ValueError(
                f"pp_virtual_stages={virtual_stages} does not fit pp_schedule={self.name!r}, which runs "
                f"{self.fixed_stages} stage(s) per rank: leave pp_virtual_stages unset, or use "
                "pp_schedule='interleaved_1f1b' for more stages per rank."
            )
        if self.fixed_stages is None and virtual_stages < 2:
            raise ValueError(
                f"pp_virtual_stages={virtual_stages} makes {self.name} plain 1F1B: set it to 2 or more, or use "
                "pp_schedule='1f1b'."
            )

    def check_microbatches(self, microbatches: int, pp: int, setting: str) -> None:
        """What torch's schedule needs of the microbatch count, checked before any process starts."""
        if self.microbatches_rule == "any" or pp == 1:
            return
        if microbatches < pp:
            raise ValueError(
                f"{setting}: pp_schedule={self.name!r} needs at least one microbatch per stage, but microbatches="
                f"{microbatches} < pp={pp}: set microbatches to {pp} or more (2*pp keeps the bubble small)."
            )
        rounds = max(1, microbatches // pp)
        if self.microbatches_rule == "rounds_of_pp" and microbatches % rounds:
            raise ValueError(
                f"{setting}: pp_schedule={self.name!r} runs microbatches in rounds of pp={pp}, so microbatches="
                f"{microbatches} must be a multiple of {rounds}: set microbatches to a multiple of {pp}."
            )

    def build(self, stages: Sequence[Any], microbatches: int, **kwargs: Any) -> Any:
        """Torch's schedule over this rank's stages (``PipelineStage`` objects, in stage order)."""
        stages = list(stages)
        if self.multi_stage:
            return self.schedule_class(stages, microbatches, **kwargs)
        assert len(stages) == 1, f"{self.name} runs one stage per rank"
        return self.schedule_class(stages[0], microbatches, **kwargs)


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            "gpipe", "GPipe", 1, "loop", "any", _every_microbatch, _textbook, "all forwards, then all backwards"
        ),
        ScheduleSpec(
            "1f1b",
            "1F1B",
            1,
            "loop",
            "at_least_pp",
            _warmup_then_one,
            _textbook,
            "one forward, one backward (PipeDream-flush)",
        ),
        ScheduleSpec(
            "interleaved_1f1b",
            "Interleaved1F1B",
            None,
            "loop",
            "rounds_of_pp",
            _interleaved,
            _interleaved_bubble,
            "1F1B over several looped stages per rank (Megatron's interleaving)",
        ),
        ScheduleSpec(
            "zero_bubble",
            "ZBVZeroBubble",
            2,
            "v",
            "rounds_of_pp",
            _first_rank_of_1f1b,
            _zero,
            "ZB-V: two stages per rank in a V, backward split into input and weight gradients",
            split_backward=True,
        ),
        ScheduleSpec(
            "looped_bfs",
            "LoopedBFS",
            None,
            "loop",
            "any",
            _every_microbatch,
            _interleaved_bubble,
            "breadth-first over several looped stages per rank: every microbatch through one stage, then the next",
        ),
        ScheduleSpec(
            "interleaved_zero_bubble",
            "InterleavedZeroBubble",
            None,
            "loop",
            "rounds_of_pp",
            _interleaved,  # its warmup taken as Interleaved1F1B's: an estimate, not measured here
            _zero,
            "interleaved 1F1B with the backward split into input and weight gradients (zero-bubble, looped)",
            split_backward=True,
        ),
    )
}


def schedule_spec(name: str) -> ScheduleSpec:
    """The row for ``pp_schedule=name``, or a ValueError listing the names."""
    if name not in SCHEDULES:
        raise ValueError(f"pp_schedule={name!r} is unknown: set it to one of {', '.join(SCHEDULES)}.")
    return SCHEDULES[name]
