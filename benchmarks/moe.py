"""``make bench``'s Mixture-of-Experts section: the GPT recipe's ``gpt_moe_tiny`` (3 MoE blocks, 8 experts, top-2)
under expert parallelism, measured against the formulas in the same run.

- All-to-all bytes: each MoE layer exchanges the per-expert counts (E int64) and then, per training step, sends
  its kept (token, choice) rows to the experts' ranks and back in forward (dispatch, combine) and the gradients of
  both in backward. Every such pass over an ep group moves ``tokens x k x d x bytes x (ep-1)/ep`` in all (tokens:
  the batch's tokens on that group): the dispatch inputs of its ranks hold every token's k rows, the combine
  inputs the same rows come back from, and all_to_all counts ``input bytes x (w-1)/w`` as sent
  (parallel/measure/comm_volume.py). Measured: each rank's all-to-alls of the counted step, summed over ranks.
- Expert-parameter bytes per rank: E/ep experts' worth. Measured twice: the model-state bytes (params, grads, Adam
  states) at ep=1 minus those at ep>1 on the same world, against the experts removed, and the local bytes of the
  expert weights themselves.
- Throughput: ep=2 against ep=1 (experts replicated) at world 2 (dp=2), interleaved as the other pairs are.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median
from typing import Any

from lightning_parallel.parallel.measure.comm_volume import sent_bytes

MOE = ["model=gpt_moe_tiny", "data.global_batch_size=16"]
THROUGHPUT_WORLD, THROUGHPUT_EP = 2, 2  # ep=2 against ep=1, world 2 (dp=2)
EXTRA = [(4, 4)]  # (world, ep) measured in one launch each beside its ep=1 baseline (bytes, not time)
PASSES = ("dispatch fwd", "combine fwd", "combine bwd", "dispatch bwd")
STATES = 4  # copies of each parameter in the model states: itself, its gradient, AdamW's two moments


def _spec(ep: int) -> str:
    return f"hybrid3d:ep={ep}" if ep > 1 else "hybrid3d"


def run_moe(out: Any, repeats: int, steps: int, launch: Callable[..., list], step_time: Callable) -> dict[str, Any]:
    """The throughput pair (whose launches also give world 2's bytes) and one launch per extra layout."""
    world, ep = THROUGHPUT_WORLD, THROUGHPUT_EP
    times: dict[int, list[float]] = {1: [], ep: []}
    layouts: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for _ in range(repeats):
        for e in (ep, 1):
            ranks = launch("gpt", MOE, world, _spec(e), out, steps)
            layouts.setdefault((world, e), ranks)  # bytes do not depend on the repeat: the first launch's
            times[e].append(step_time(ranks))
            print(f"  gpt_moe_tiny ep={e} w{world}: {times[e][-1] * 1e3:.0f} ms/step", flush=True)
    for w, e in EXTRA:
        for layout in ((w, e), (w, 1)):
            layouts[layout] = launch("gpt", MOE, layout[0], _spec(layout[1]), out, steps=5)
    base, ours = median(times[1]), median(times[ep])
    return {
        "throughput": {
            "world": world,
            "ep": ep,
            "ep_step_s": ours,
            "replicated_step_s": base,
            "ratio": base / ours,  # > 1: expert parallelism is faster
            "samples": {str(k): v for k, v in times.items()},
        },
        "layouts": [{"world": w, "ep": e, "ranks": ranks} for (w, e), ranks in layouts.items()],
    }


# ----- analysis -----


def _sizes(ranks: list[dict[str, Any]]) -> tuple[int, int, int, int, int]:
    """(E, k, d, f, tokens on one ep group) of a launch."""
    first = ranks[0]
    m, ep = first["model"], first["degrees"]["ep"]
    return m["moe_experts"], m["moe_top_k"], m["d_model"], m["moe_hidden"], first["micro_batch"] * m["seq_len"] * ep


def pass_formula(ranks: list[dict[str, Any]]) -> float:
    """Bytes one pass of one MoE layer sends, summed over all ranks: per ep group tokens x k x d x 4 x (ep-1)/ep."""
    _, k, d, _, tokens = _sizes(ranks)
    first = ranks[0]
    ep, groups = first["degrees"]["ep"], first["degrees"]["dp"] // first["degrees"]["ep"]
    return groups * tokens * k * d * 4 * (ep - 1) / ep


def per_layer(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per MoE layer: each pass's payload per rank and its sent bytes summed over ranks, and the counts exchange.

    Each rank issues, per layer in forward, counts (int64), dispatch, combine; in backward, layers in reverse,
    the combine's gradient then the dispatch's."""
    names = ranks[0]["moe_layers"]
    n = len(names)
    rows = [
        {"layer": name, "payload": {p: [] for p in PASSES}, "sent": dict.fromkeys(PASSES, 0.0), "counts": 0.0}
        for name in names
    ]
    for rank in ranks:
        events = rank["all_to_all_events"]
        assert len(events) == 5 * n, f"{len(events)} all-to-alls for {n} MoE layers: expected {5 * n}"
        backward = events[3 * n :]
        for i, row in enumerate(rows):
            counts, dispatch, combine = events[3 * i : 3 * i + 3]
            j = n - 1 - i  # backward visits the layers in reverse
            assert counts["dtype"] == "int64" and "int" not in dispatch["dtype"] + combine["dtype"]
            row["counts"] += sent_bytes("all_to_all", counts["payload_bytes"], counts["group_size"])
            chosen = (dispatch, combine, backward[2 * j], backward[2 * j + 1])
            for name, event in zip(PASSES, chosen):
                row["payload"][name].append(event["payload_bytes"])
                row["sent"][name] += sent_bytes("all_to_all", event["payload_bytes"], event["group_size"])
    return rows


def comm_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for layout in results["layouts"]:
        if layout["ep"] == 1:
            continue
        ranks = layout["ranks"]
        layers, formula = per_layer(ranks), pass_formula(ranks)
        measured = sum((r["comm_bytes_per_step"] or {}).get("all_to_all", {}).get("sent_bytes", 0) for r in ranks)
        counts = sum(row["counts"] for row in layers)
        total_formula = len(PASSES) * len(layers) * formula
        out.append(
            {
                "world": layout["world"],
                "ep": layout["ep"],
                "layers": layers,
                "step": len(ranks[0]["step_times"]) - 2,  # the counted step (0-based; worker.py's measure_step)
                "pass_formula": formula,
                "measured": measured,
                "formula": total_formula,
                "counts": counts,
                "ratio": measured / total_formula,
                "ratio_without_counts": (measured - counts) / total_formula,
            }
        )
    return out


def memory_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per ep > 1 layout: model-state bytes at ep=1 minus at ep (largest rank each) against the experts removed."""
    by = {(x["world"], x["ep"]): x["ranks"] for x in results["layouts"]}
    out = []
    for (world, ep), ranks in by.items():
        if ep == 1 or (world, 1) not in by:
            continue
        experts, _, d, f, _ = _sizes(ranks)
        layers = len(ranks[0]["moe_layers"])
        expert = 2 * d * f * 4  # one expert's fp32 weights (w1: d x f, w2: f x d)
        states = {e: max(r["model_state_bytes"]["total"] for r in by[(world, e)]) for e in (1, ep)}
        removed = layers * (experts - experts // ep) * expert * STATES
        local = [r["expert_param_bytes"] for r in ranks]
        out.append(
            {
                "world": world,
                "ep": ep,
                "states": states,
                "difference": states[1] - states[ep],
                "formula": removed,
                "expert_param_bytes": local,
                "expert_formula": layers * (experts // ep) * expert,
            }
        )
    return out


# ----- report -----


def _kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def _span(ratios: list[float]) -> str:
    low, high = f"{min(ratios):.3f}", f"{max(ratios):.3f}"
    return low if low == high else f"{low} to {high}"


def moe_lines(results: dict[str, Any]) -> list[str]:
    first = results["layouts"][0]["ranks"][0]
    m = first["model"]
    t = results["throughput"]
    lines = [
        "## Mixture-of-Experts: expert parallelism (`ep`)",
        "",
        f"`model=gpt_moe_tiny` ({len(first['moe_layers'])} MoE blocks, E = {m['moe_experts']} experts, "
        f"top-{m['moe_top_k']}, d = {m['d_model']}, f = {m['moe_hidden']}, dropless), global batch "
        f"{first['micro_batch'] * first['degrees']['dp']} x {m['seq_len']} tokens, fp32, `hybrid3d` with dp = world.",
        "",
        "**All-to-all bytes per step**, each rank's all-to-alls of the counted step (benchmarks/worker.py) summed over "
        "ranks. Per MoE layer and direction the formula is tokens x k x d x 4 bytes x (ep-1)/ep, tokens = the "
        "batch's tokens on the ep group: the dispatch inputs of the group's ranks hold every token's k rows, the "
        "combine inputs the rows coming back, and all_to_all counts input bytes x (w-1)/w as sent. Four passes per "
        "layer (dispatch and combine forward, their gradients backward). Step: the training step counted (0-based). "
        "Rows per ep rank: the expert rows each rank computed in that forward (its combine input): the router's "
        "balance at that step, which moves each rank's share but not the sum.",
        "",
        "| ep | world | step | MoE layer | measured KiB (dispatch fwd, combine fwd, combine bwd, dispatch bwd) | "
        "formula KiB each | ratio | rows per ep rank |",
        "|---:|---:|---:|---|---|---:|---:|---|",
    ]
    comm = comm_rows(results)
    for c in comm:
        for row in c["layers"]:
            sent = [row["sent"][p] for p in PASSES]
            rows = [b // (m["d_model"] * 4) for b in row["payload"]["combine fwd"]]
            lines.append(
                f"| {c['ep']} | {c['world']} | {c['step']} | `{row['layer']}` | {', '.join(_kib(s) for s in sent)} | "
                f"{_kib(c['pass_formula'])} | {_span([x / c['pass_formula'] for x in sent])} | "
                f"{', '.join(str(r) for r in rows)} |"
            )
    lines += [
        "",
        "| ep | world | all_to_all sent KiB/step, all ranks (the monitor's total) | formula KiB (4 passes x layers) | "
        "ratio | of which the counts exchange | ratio without it |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in comm:
        lines.append(
            f"| {c['ep']} | {c['world']} | {_kib(c['measured'])} | {_kib(c['formula'])} | **{c['ratio']:.4f}** | "
            f"{c['counts']:.0f} B | {c['ratio_without_counts']:.4f} |"
        )
    lines += [
        "",
        "**Expert parameters per rank**: model-state bytes (params + grads + 2 AdamW states, largest rank) at ep=1 "
        "minus at ep, against the experts a rank no longer holds: layers x (E - E/ep) x 2df x 4 bytes x 4; and the "
        "local bytes of the expert weights against layers x E/ep x 2df x 4 bytes.",
        "",
        "| world | ep | states MiB at ep=1 | states MiB at ep | difference MiB | formula MiB | ratio | "
        "expert weights KiB per rank | formula KiB | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in memory_rows(results):
        s, local = r["states"], r["expert_param_bytes"]
        lines.append(
            f"| {r['world']} | {r['ep']} | {s[1] / 2**20:.2f} | {s[r['ep']] / 2**20:.2f} | "
            f"{r['difference'] / 2**20:.2f} | {r['formula'] / 2**20:.2f} | **{r['difference'] / r['formula']:.3f}** | "
            f"{', '.join(_kib(x) for x in local)} | {_kib(r['expert_formula'])} | "
            f"**{max(local) / r['expert_formula']:.3f}** |"
        )
    lines += [
        "",
        f"**Throughput** at world {t['world']} (dp={t['world']}): ep={t['ep']} against ep=1 (every rank holds all "
        "experts), interleaved, medians of the per-launch median step times. Speed ratio = ep=1's step time / "
        f"ep={t['ep']}'s (above 1: expert parallelism is faster).",
        "",
        f"| world | ep=1 ms/step | ep={t['ep']} ms/step | speed ratio |",
        "|---:|---:|---:|---:|",
        f"| {t['world']} | {t['replicated_step_s'] * 1e3:.0f} | {t['ep_step_s'] * 1e3:.0f} | **{t['ratio']:.2f}x** |",
        "",
    ]
    return lines
