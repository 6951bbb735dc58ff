"""The bubble measure (parallel/measure/timeline.py) on made-up timelines: which time counts, the breakdown of
the idle time, the replay on CPU times, and the Chrome trace round trip. No process group."""

from __future__ import annotations

import pytest

from lightning_parallel.parallel.measure.timeline import (
    bubble_breakdown,
    bubble_fractions,
    chrome_trace,
    replayed_bubble,
    timelines_from_trace,
)


def _one_f_one_b(pp: int, m: int, stretch: float = 1.0, overhead: float = 0.0) -> list[dict]:
    """1F1B (PipeDream-flush) with F = 1 and B = 2 CPU seconds, placed by dependency. Every box's wall time is
    ``stretch`` times its CPU time (preemption by other processes); ``overhead`` CPU seconds of the schedule's own
    work run before every box but a rank's first."""
    orders = {}
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i), ("B", i)]
        orders[r] = order + [("B", i) for i in range(m - warmup, m)]
    done: dict[tuple[str, int, int], float] = {}
    clock, cpu_clock = dict.fromkeys(range(pp), 0.0), dict.fromkeys(range(pp), 0.0)
    events: dict[int, list[dict]] = {r: [] for r in range(pp)}
    while any(orders.values()):
        for r in range(pp):
            while orders[r]:
                kind, mb = orders[r][0]
                dep = ("F", r - 1, mb) if kind == "F" else ("B", r + 1, mb) if r < pp - 1 else ("F", r, mb)
                if dep[1] >= 0 and dep not in done:
                    break
                gap = overhead if events[r] else 0.0
                start = max(clock[r] + gap * stretch, done.get(dep, 0.0))
                cpu = 1.0 if kind == "F" else 2.0
                cpu_clock[r] += gap
                end = start + cpu * stretch
                events[r].append({"kind": kind, "stage": r, "microbatch": mb, "start": start, "end": end,
                                  "cpu": cpu, "cpu_start": cpu_clock[r]})  # fmt: skip
                cpu_clock[r] += cpu
                done[(kind, r, mb)], clock[r] = end, end
                orders[r].pop(0)
    return [{"rank": r, "pp_rank": r, "events": events[r]} for r in range(pp)]


def test_span_runs_from_the_first_compute_box_to_the_last():
    """A rank that enters the schedule early and waits for its neighbour, or waits for a send after its last
    box, is outside the schedule's bubble; the last stage's loss (L) is forward work, so busy."""
    pp, m = 2, 8
    timelines = _one_f_one_b(pp, m)
    before = bubble_fractions(timelines)
    timelines[1]["events"].insert(0, {"kind": "wait", "stage": -1, "microbatch": -1, "start": -5.0, "end": 1.0})
    timelines[0]["events"].append({"kind": "wait", "stage": -1, "microbatch": -1, "start": 27.0, "end": 30.0})
    assert bubble_fractions(timelines) == before == pytest.approx(dict.fromkeys(range(pp), (pp - 1) / (m + pp - 1)))
    loss = {"kind": "L", "stage": 1, "microbatch": 0, "start": 2.0, "end": 2.0, "cpu": 0.0, "cpu_start": 0.0}
    timelines[1]["events"].append(loss)
    assert bubble_fractions(timelines) == before  # a box of no length changes nothing; a longer one is busy


def test_breakdown_adds_up_to_the_span():
    timelines = _one_f_one_b(2, 4, overhead=0.25)
    for rank, part in bubble_breakdown(timelines).items():
        total = part["compute"] + part["wait"] + part["between"] + part["fill"] + part["drain"]
        assert total == pytest.approx(part["span"]), (rank, part)
        assert part["compute_cpu"] == pytest.approx(4 * 3.0) and part["by_kind"]["B"] == pytest.approx(8.0)
        assert part["between_cpu"] == pytest.approx(0.25 * 7)  # 8 boxes: 7 gaps of the schedule's own work


@pytest.mark.parametrize("pp, m", [(2, 8), (4, 8)])
def test_replay_on_cpu_times_is_the_textbook_bubble(pp, m):
    """Stretched wall times (a loaded machine) change the span, not the replay: each box lasts its CPU time."""
    formula = (pp - 1) / (m + pp - 1)
    stretched = _one_f_one_b(pp, m, stretch=1.7)
    assert replayed_bubble(stretched) == pytest.approx(dict.fromkeys(range(pp), formula))
    with_overhead = _one_f_one_b(pp, m, overhead=0.1)
    assert replayed_bubble(with_overhead, overhead=False) == pytest.approx(dict.fromkeys(range(pp), formula))
    assert all(v > formula for v in replayed_bubble(with_overhead).values())
    assert replayed_bubble(with_overhead) == pytest.approx(bubble_fractions(with_overhead))


def test_chrome_trace_round_trip_keeps_the_cpu_times():
    timelines = _one_f_one_b(2, 4, overhead=0.1)
    back = timelines_from_trace(chrome_trace(timelines))
    assert bubble_fractions(back) == pytest.approx(bubble_fractions(timelines))
    assert replayed_bubble(back) == pytest.approx(replayed_bubble(timelines))
    assert [e["cpu"] for e in back[1]["events"]] == pytest.approx([e["cpu"] for e in timelines[1]["events"]])
