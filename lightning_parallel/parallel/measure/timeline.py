"""What each pipeline rank did when: record, merge, draw, and measure the bubble. Pure torch (+ matplotlib).

While a :class:`TimelineRecorder` is active, the pipeline's stages (``_Stage`` in pipeline.py) note the start
and end of every forward (``F``), backward (``B``: full; ``I``: input gradient only, zero-bubble) and weight
gradient (``W``) of a microbatch, and the schedule's waits for sends and receives (``wait``). Nothing is
recorded, and nothing costs, when no recorder is active.

Times are wall-clock (``time.time``), so ranks on one machine share a clock; across machines they are as
close as the machines' clocks. On CUDA the device is synchronized around each recorded action (while
recording only), so a box spans the kernels, not their launch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as _schedules

COMPUTE = ("F", "B", "I", "W")  # forward, full backward, input-gradient backward, weight-gradient backward
COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#8FBC8F", "W": "#C44E52", "wait": "#DDDDDD"}


# overlap_grad_reduce (parallel/data/overlap.py): a gradient bucket from its launch in backward to the end of its wait,
# drawn as a thin bar under the boxes it overlaps; not compute, not a schedule wait: the bubble ignores it
COLORS["reduce"] = "#DD8452"


@dataclass
class TimelineEvent:
    """One action of one rank: ``kind`` in COMPUTE or ``"wait"``; times in seconds since the epoch."""

    kind: str
    stage: int  # -1 for waits (the schedule waits for all of this rank's stages at once)
    microbatch: int  # -1 for waits
    start: float
    end: float


_ACTIVE: TimelineRecorder | None = None


def active_recorder() -> TimelineRecorder | None:
    """The recorder now active in this process, if any (what the pipeline's stages check)."""
    return _ACTIVE


class TimelineRecorder:
    """Records this rank's pipeline actions while active (a context manager; one at a time per process).

    Args:
        pp_rank: this rank's position on the pipeline axis (the row it is drawn in).
        device: the stages' device; CUDA is synchronized around each action so boxes show execution time.

    Attributes:
        events: what was recorded, in order.
    """

    def __init__(self, pp_rank: int, device: torch.device | str = "cpu") -> None:
        self.pp_rank = pp_rank
        self.sync = torch.device(device).type == "cuda"
        self.events: list[TimelineEvent] = []
        self._wait = None

    def __enter__(self) -> TimelineRecorder:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("A TimelineRecorder is already active in this process: record one at a time.")
        _ACTIVE = self
        # the schedules wait for their P2P work through this module function: time it while recording
        self._wait = _schedules._wait_batch_p2p
        original = self._wait

        def timed_wait(work: Any) -> Any:
            with self.action("wait", -1, -1):
                return original(work)

        _schedules._wait_batch_p2p = timed_wait
        return self

    def __exit__(self, *exc: Any) -> None:
        global _ACTIVE
        _schedules._wait_batch_p2p = self._wait
        _ACTIVE = None

    @contextmanager
    def action(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        """Times the enclosed block as one event."""
        if self.sync:
            torch.cuda.synchronize()
        start = time.time()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.events.append(TimelineEvent(kind, stage, microbatch, start, time.time()))


def gather_timelines(recorder: TimelineRecorder, group: dist.ProcessGroup | None = None) -> list[dict] | None:
    """Every rank's events, gathered at the group's first rank (collective); None on the other ranks.

    Returns:
        On the first rank, one ``{"rank", "pp_rank", "events"}`` per rank of the group, in rank order.
    """
    mine = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "pp_rank": recorder.pp_rank,
        "events": [asdict(e) for e in recorder.events],
    }
    if not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out if dist.get_rank(group) == 0 else None


def _rows(timelines: Sequence[dict]) -> list[dict]:
    """One timeline per pp rank (the lowest global rank of each): the ranks of a pp rank run alike."""
    first: dict[int, dict] = {}
    for t in sorted(timelines, key=lambda t: t["rank"]):
        first.setdefault(t["pp_rank"], t)
    return [first[k] for k in sorted(first)]


def _origin(timelines: Sequence[dict]) -> float:
    starts = [e["start"] for t in timelines for e in t["events"]]
    return min(starts) if starts else 0.0


def chrome_trace(timelines: Sequence[dict]) -> dict:
    """A Chrome trace (chrome://tracing, Perfetto): one process row per pp rank, one thread per global rank."""
    t0, events = _origin(timelines), []
    for t in timelines:
        pid, tid = t["pp_rank"], t["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"pp rank {pid}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": f"rank {tid}"}})
        for e in t["events"]:
            name = e["kind"] if e["kind"] == "wait" else f"{e['kind']}{e['microbatch']}"
            events.append(
                {
                    "name": name,
                    "cat": e["kind"],
                    "ph": "X",
                    "ts": (e["start"] - t0) * 1e6,  # microseconds
                    "dur": (e["end"] - e["start"]) * 1e6,
                    "pid": pid,
                    "tid": tid,
                    "args": {"stage": e["stage"], "microbatch": e["microbatch"]},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def bubble_fractions(timelines: Sequence[dict]) -> dict[int, float]:
    """Idle fraction of each pp rank: 1 - (its busy compute time) / (the step's span over all ranks).

    The span runs from the first action of any rank to the last; busy is the time inside F, B, I and W
    boxes (waits and the gaps between actions are idle). The literature's GPipe/1F1B bubble with equal
    stage times is ``(p - 1) / (m + p - 1)``.
    """
    everything = [e for t in timelines for e in t["events"]]
    if not everything:
        return {}
    span = max(e["end"] for e in everything) - min(e["start"] for e in everything)
    out = {}
    for t in _rows(timelines):
        busy = sum(e["end"] - e["start"] for e in t["events"] if e["kind"] in COMPUTE)
        out[t["pp_rank"]] = 1.0 - busy / span if span > 0 else 0.0
    return out


def compute_order(timeline: dict) -> list[str]:
    """The compute actions of one rank in the order they ran, e.g. ``["F0", "F1", "B0", ...]``."""
    return [f"{e['kind']}{e['microbatch']}" for e in timeline["events"] if e["kind"] in COMPUTE]


def plot_timeline(timelines: Sequence[dict], path: str | Path, title: str = "") -> None:
    """Draws the schedule as the literature does: a row per pp rank, a box per action labelled with its
    microbatch (F blue, B green, I light green, W red; waits grey), idle time left blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows, t0 = _rows(timelines), _origin(timelines)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(rows) + 1.4))
    for row, t in enumerate(rows):
        for e in t["events"]:
            start, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
            wait, reduce = e["kind"] == "wait", e["kind"] == "reduce"
            height = 0.3 if wait else 0.12 if reduce else 0.8
            bottom = row + 0.4 if reduce else row - height / 2  # a bucket's reduction: under the backward boxes
            ax.broken_barh([(start, width)], (bottom, height), facecolors=COLORS.get(e["kind"], "k"))
            if not (wait or reduce):
                ax.text(start + width / 2, row, str(e["microbatch"]), ha="center", va="center", fontsize=7, color="w")
    fractions = bubble_fractions(timelines)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"pp {t['pp_rank']} (idle {fractions.get(t['pp_rank'], 0):.0%})" for t in rows])
    ax.invert_yaxis()  # stage 0 on top, as the papers draw it
    ax.set_xlabel("ms")
    ax.set_title(title or "pipeline schedule")
    kinds = sorted({e["kind"] for t in rows for e in t["events"]}, key=list(COLORS).index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_timeline(timelines: Sequence[dict], json_path: str | Path, png_path: str | Path | None = None) -> None:
    """The Chrome trace to ``json_path`` and, if given, the drawing to ``png_path``."""
    Path(json_path).write_text(json.dumps(chrome_trace(timelines)))
    if png_path is not None:
        plot_timeline(timelines, png_path)
