"""What each pipeline rank did when: record, merge, draw, and measure the bubble. Pure torch (+ matplotlib).

While a :class:`TimelineRecorder` is active, the pipeline's stages (``_Stage`` in pipeline.py) note the start
and end of every forward (``F``), backward (``B``: full; ``I``: input gradient only, zero-bubble) and weight
gradient (``W``) of a microbatch, and the schedule's waits for sends and receives (``wait``). Nothing is
recorded, and nothing costs, when no recorder is active.

Times are wall-clock (``time.time``), so ranks on one machine share a clock; across machines they are as
close as the machines' clocks. On CUDA a box spans the kernels, not their launch: each action is bracketed by
CUDA events on the current stream, turned into wall-clock times once the recording ends (one synchronization
then, none per action, so the recorded step runs as an unrecorded one would); a ``wait`` box is then how long the
compute stream stood waiting for a transfer.
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

# forward, full backward, input-gradient backward, weight-gradient backward, the last stage's loss (its forward)
COMPUTE = ("F", "B", "I", "W", "L")
COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#8FBC8F", "W": "#C44E52", "L": "#8172B2", "wait": "#DDDDDD"}


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
    cpu: float = 0.0  # this thread's CPU seconds inside the box (time.thread_time): wall minus preemption and sleep
    cpu_start: float = 0.0  # this thread's CPU clock (time.thread_time) at the start: CPU spent between boxes


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
        self.on_cuda = torch.device(device).type == "cuda"
        self.events: list[TimelineEvent] = []
        self._wait = None
        self._pending: list[tuple[str, int, int, Any, Any, float, float]] = []  # CUDA: times not yet resolved
        self._origin: tuple[Any, float] | None = None  # CUDA: an event and the wall-clock time it stands for

    def __enter__(self) -> TimelineRecorder:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("A TimelineRecorder is already active in this process: record one at a time.")
        _ACTIVE = self
        if self.on_cuda:  # the device's clock, tied to the host's once: events are timed against this one
            torch.cuda.synchronize()
            origin = torch.cuda.Event(enable_timing=True)
            origin.record()
            self._origin = (origin, time.time())
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
        self.resolve()

    def mark(self) -> Any:
        """Now, on this recorder's clock: a recorded CUDA event on CUDA, the wall-clock time elsewhere."""
        if not self.on_cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(
        self, kind: str, stage: int, microbatch: int, start: Any, end: Any, cpu: float = 0.0, cpu_start: float = 0.0
    ) -> None:
        """Record one event between two :meth:`mark` results (CUDA: resolved when the recording ends)."""
        if self.on_cuda:
            self._pending.append((kind, stage, microbatch, start, end, cpu, cpu_start))
        else:
            self.events.append(TimelineEvent(kind, stage, microbatch, start, end, cpu, cpu_start))

    def resolve(self) -> None:
        """Turn the CUDA events recorded so far into wall-clock times (synchronizes the device once)."""
        if not self._pending or self._origin is None:
            return
        torch.cuda.synchronize()
        origin, wall = self._origin
        for kind, stage, microbatch, start, end, cpu, cpu_start in self._pending:
            begin = wall + origin.elapsed_time(start) / 1e3
            finish = wall + origin.elapsed_time(end) / 1e3
            self.events.append(TimelineEvent(kind, stage, microbatch, begin, finish, cpu, cpu_start))
        self._pending.clear()

    @contextmanager
    def action(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        """Times the enclosed block as one event."""
        start, cpu = self.mark(), time.thread_time()
        try:
            yield
        finally:
            end, cpu_end = self.mark(), time.thread_time()
            self.add(kind, stage, microbatch, start, end, cpu_end - cpu, cpu)


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
                    "args": {
                        "stage": e["stage"],
                        "microbatch": e["microbatch"],
                        "cpu_ms": e.get("cpu", 0.0) * 1e3,
                        "cpu_start": e.get("cpu_start", 0.0),
                    },
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _compute_span(timelines: Sequence[dict]) -> tuple[float, float] | None:
    """From the first forward of any rank to the last backward of any rank: the step the formula describes.

    Waits before the first box (a rank that entered the schedule while its neighbour was still finishing the
    previous step) and after the last (a send's completion) are not the schedule's bubble.
    """
    boxes = [e for t in timelines for e in t["events"] if e["kind"] in COMPUTE]
    if not boxes:
        return None
    return min(e["start"] for e in boxes), max(e["end"] for e in boxes)


def bubble_fractions(timelines: Sequence[dict]) -> dict[int, float]:
    """Idle fraction of each pp rank: 1 - (its busy compute time) / (the step's span over all ranks).

    The span runs from the first compute box of any rank to the last; busy is the time inside F, B, I, W and
    L (the last stage's loss: part of its forward) boxes; waits and the gaps between boxes are idle. The
    literature's GPipe/1F1B bubble with equal stage times is ``(p - 1) / (m + p - 1)``.
    """
    window = _compute_span(timelines)
    if window is None:
        return {}
    span = window[1] - window[0]
    out = {}
    for t in _rows(timelines):
        busy = sum(e["end"] - e["start"] for e in t["events"] if e["kind"] in COMPUTE)
        out[t["pp_rank"]] = 1.0 - busy / span if span > 0 else 0.0
    return out


def bubble_breakdown(timelines: Sequence[dict]) -> dict[int, dict]:
    """Where each pp rank's step goes, in seconds: what :func:`bubble_fractions` calls idle, taken apart.

    Per pp rank: ``span`` (the step, as in bubble_fractions); ``compute`` (wall time inside compute boxes)
    and ``compute_cpu`` (this thread's CPU time inside them: their wall time less preemption by other
    processes); ``by_kind`` (compute wall time per kind); ``fill`` (before this rank's first box) and
    ``drain`` (after its last); between its first and last box: ``wait`` (inside the schedule's send/recv
    waits; ``waits``: how many) and ``between`` (the rest: the schedule's own Python, issuing sends and
    receives), ``between_cpu`` (the CPU time of this thread between boxes, waits included).
    """
    window = _compute_span(timelines)
    if window is None:
        return {}
    t0, t1 = window
    out = {}
    for t in _rows(timelines):
        boxes = sorted((e for e in t["events"] if e["kind"] in COMPUTE), key=lambda e: e["start"])
        if not boxes:
            continue
        first, last = boxes[0]["start"], boxes[-1]["end"]
        waits = [e for e in t["events"] if e["kind"] == "wait" and first <= e["start"] and e["end"] <= last]
        row: dict = {
            "span": t1 - t0,
            "compute": sum(e["end"] - e["start"] for e in boxes),
            "compute_cpu": sum(e.get("cpu", 0.0) for e in boxes),
            "by_kind": {k: sum(e["end"] - e["start"] for e in boxes if e["kind"] == k) for k in COMPUTE},
            "fill": first - t0,
            "drain": t1 - last,
            "wait": sum(e["end"] - e["start"] for e in waits),
            "waits": len(waits),
            "between_cpu": sum(b["cpu_start"] - a["cpu_start"] - a["cpu"] for a, b in zip(boxes, boxes[1:])),
        }
        row["between"] = last - first - row["compute"] - row["wait"]
        out[t["pp_rank"]] = row
    return out


def replayed_bubble(timelines: Sequence[dict], overhead: bool = True) -> dict[int, float]:
    """The bubble of the recorded schedule re-timed on an idle machine: each rank runs its compute boxes in the
    recorded order, each lasting its CPU time (so preemption by other processes drops out), as soon as its
    inputs exist (forward after the previous stage's forward, backward after the next stage's backward or
    the loss, weight gradient after input gradient), with no transfer time.

    Args:
        overhead: also charge the CPU time each rank spent between two boxes (the schedule's Python, issuing
            sends and receives) before the later box. False: the schedule's shape and stage balance alone.

    Returns:
        Per pp rank, 1 - CPU-busy / replayed span; {} when the boxes do not form a complete schedule.
    """
    queues = {
        t["pp_rank"]: sorted((e for e in t["events"] if e["kind"] in COMPUTE), key=lambda e: e["start"])
        for t in _rows(timelines)
    }
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(queues, 0.0)
    last_stage = max((e["stage"] for q in queues.values() for e in q), default=-1)
    position = dict.fromkeys(queues, 0)
    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while position[rank] < len(queue):
                i, e = position[rank], queue[position[rank]]
                ready = _ready_at(e, done, last_stage)
                if ready is None:
                    break
                gap = queue[i]["cpu_start"] - queue[i - 1]["cpu_start"] - queue[i - 1]["cpu"] if i and overhead else 0.0
                start = max(clock[rank] + max(gap, 0.0), ready)
                clock[rank] = start + e["cpu"]
                done.setdefault((e["kind"], e["stage"], e["microbatch"]), clock[rank])
                position[rank], progress = i + 1, True
    if any(position[r] < len(q) for r, q in queues.items()) or not done:
        return {}
    span = max(clock.values())
    return {r: 1.0 - sum(e["cpu"] for e in q) / span for r, q in queues.items()}


def _ready_at(e: dict, done: dict[tuple[str, int, int], float], last_stage: int) -> float | None:
    """When the inputs of box ``e`` exist in a replay (None: not yet)."""
    kind, stage, mb = e["kind"], e["stage"], e["microbatch"]
    if kind == "F":
        needs = [("F", stage - 1, mb)] if stage > 0 else []
    elif kind == "L":
        needs = [("F", stage, mb)]
    elif kind == "W":
        needs = [("I", stage, mb)]
    elif stage == last_stage:
        needs = [("L", stage, mb)] if ("L", stage, mb) in done else [("F", stage, mb)]
    else:
        needs = [(k, stage + 1, mb) for k in ("B", "I") if (k, stage + 1, mb) in done] or [("B", stage + 1, mb)]
    times = [done.get(n) for n in needs]
    return None if any(t is None for t in times) else max(times, default=0.0)


def timelines_from_trace(trace: dict) -> list[dict]:
    """The per-rank timelines back from a :func:`chrome_trace` (what ``timeline.json`` holds)."""
    rows: dict[int, dict] = {}
    for e in trace["traceEvents"]:
        if e["ph"] != "X":
            continue
        row = rows.setdefault(e["tid"], {"rank": e["tid"], "pp_rank": e["pid"], "events": []})
        start, args = e["ts"] / 1e6, e.get("args", {})
        stage, microbatch, cpu = args.get("stage", -1), args.get("microbatch", -1), args.get("cpu_ms", 0.0) / 1e3
        event = TimelineEvent(
            e["cat"], stage, microbatch, start, start + e["dur"] / 1e6, cpu, args.get("cpu_start", 0.0)
        )
        row["events"].append(asdict(event))
    return [rows[k] for k in sorted(rows)]


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
