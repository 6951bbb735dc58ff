"""BENCHMARKS.md from benchmarks/bench.py's results: one table per question, then the findings
(benchmarks/findings.md, written by hand from what the tables show)."""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

from async_ps import async_lines
from auto_sweep import auto_lines
from context import context_lines
from host_syncs import host_sync_lines
from hsdp import hsdp_lines
from lora import lora_lines
from moe import moe_lines
from muon import muon_lines
from overhead import overhead_lines
from spatial import spatial_lines
from speed import speed_lines

from lightning_parallel.parallel.data.stages import stage_sharding

FINDINGS = Path(__file__).resolve().parent / "findings.md"
# the ZeRO stage whose formula a strategy's model states follow (Lightning's FSDP2 path shards like stage 3)
STAGE = {"ddp": 0, "hybrid3d": 0, "zero1": 1, "zero2": 2, "zero3": 3, "model_parallel": 3}


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def pair_ratios(ours: list[float], theirs: list[float]) -> str:
    """Each interleaved pair's ratio (their step time / ours): ``median (min-max), n pairs``; a single ratio from one
    pair of launches says little on a loaded host."""
    ratios = sorted(t / o for o, t in zip(ours, theirs))
    if not ratios:
        return "-"
    return f"{median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}), {len(ratios)} pairs"


def throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| comparison | recipe | world | ours | Lightning's | ours ms/step | Lightning ms/step | speed ratio | "
        "per pair: median (min-max) | launches, ours / Lightning's (ms) |",
        "|---|---|---:|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        samples = r.get("samples") or {}
        spread = " / ".join(
            ", ".join(f"{x * 1e3:.0f}" for x in samples.get(r[side], [])) or "-" for side in ("ours", "lightning")
        )
        pairs = pair_ratios(samples.get(r["ours"], []), samples.get(r["lightning"], []))
        lines.append(
            f"| {r['comparison']} | {r['recipe']} | {r['world']} | `{r['ours']}` | `{r['lightning']}` | "
            f"{r['ours_step_s'] * 1e3:.0f} | {r['lightning_step_s'] * 1e3:.0f} | **{r['ratio']:.2f}x** | {pairs} | "
            f"{spread} |"
        )
    return lines


def phase_table(rows: list[dict[str, Any]], below: float = 1.05) -> list[str]:
    """The step by phase (rank 0, ms) for each pairing under ``below``x: where ours and Lightning's differ."""
    lines = [
        "| comparison | recipe | side | forward | backward | reduce | step | sum ms |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["ratio"] >= below or len(r.get("phases_s", {})) < 2:
            continue
        for side in ("ours", "lightning"):
            p = r["phases_s"][side]
            cells = " | ".join(f"{p[k] * 1e3:.1f}" for k in ("forward", "backward", "reduce", "step"))
            lines.append(f"| {r['comparison']} | {r['recipe']} | `{r[side]}` | {cells} | {sum(p.values()) * 1e3:.1f} |")
    return lines if len(lines) > 2 else []


def _phase_section(rows: list[dict[str, Any]]) -> list[str]:
    table = phase_table(rows)
    if not table:
        return []
    return [
        "Where the pairings under 1.05x spend their step (rank 0, median ms by Lightning's hooks, "
        "benchmarks/worker.py `StepPhases`): forward = batch start to `on_before_backward` (zero_grad, the "
        "training step, ZeRO-3's gathers); backward = to `on_after_backward` (DDP's overlapped all-reduce "
        "included); reduce = to `on_before_optimizer_step` (our reduction after backward, clipping); step = "
        "to batch end (the optimizer, ZeRO-1/2's parameter gather). benchmarks/findings.md reads it.",
        "",
        *table,
        "",
    ]


def memory_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per data-parallel strategy: the largest rank's model-state bytes against the ZeRO formula (fp32 Adam)."""
    out = []
    for r in rows:
        if ":" in r["strategy"]:
            continue  # tp and pp layouts split the model itself: the communication table's rows
        stage = STAGE[r["strategy"].split(":")[0]]
        ranks = r["ranks"]
        worst = max(ranks, key=lambda x: x["model_state_bytes"]["total"])
        formula = stage_sharding(stage).state_bytes_exact(worst["num_params"], r["world"])
        out.append({**r, "stage": stage, "measured": worst["model_state_bytes"], "formula": formula})
    return out


def memory_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| strategy | world | ZeRO stage | params MiB | grads MiB | optimizer MiB | total MiB | formula MiB | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in memory_rows(rows):
        m = r["measured"]
        lines.append(
            f"| `{r['strategy']}` | {r['world']} | {r['stage']} | {_mb(m['params'])} | {_mb(m['grads'])} | "
            f"{_mb(m['optimizer'])} | {_mb(m['total'])} | {_mb(r['formula'])} | {m['total'] / r['formula']:.3f} |"
        )
    return lines


def comm_theory(row: dict[str, Any]) -> tuple[float, str]:
    """Bytes a rank sends per step by the textbook algorithms (ring collectives), and the formula."""
    first = row["ranks"][0]
    w, psi = row["world"], 4 * first["num_params"]  # fp32 gradient or parameter bytes
    ring = (w - 1) / w
    spec = row["strategy"]
    if spec.startswith("hybrid3d:tp="):
        m = first["model"]
        act = first["micro_batch"] * m["seq_len"] * m["d_model"] * 4
        return (4 * m["n_layer"] + 2) * act * 2 * ring, "(4L + 2) all-reduces of the activation: 2(4L+2)A(t-1)/t"
    if spec.startswith("hybrid3d:pp="):
        m = first["model"]
        act = first["micro_batch"] * m["seq_len"] * m["d_model"] * 4
        tied = m["vocab_size"] * m["d_model"] * 4  # the embedding tied to the head, on the first and last stage
        return act + tied * 2 * ring, "A (activations forward or their gradients back) + tied weight all-reduce"
    name = spec.split(":")[0]
    if name in ("zero3", "model_parallel"):
        return 3 * psi * ring, "all-gather x2 + reduce-scatter: 3Ψ(w-1)/w (1.5x DP; the root unit is gathered once)"
    if name == "zero1":
        return 2 * psi * ring, "ZeRO paper: reduce-scatter + all-gather, 2Ψ(w-1)/w"
    return 2 * psi * ring, "all-reduce: 2Ψ(w-1)/w"


def comm_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| strategy | world | measured KiB/step (max rank) | theory KiB | ratio | by op (KiB sent) | theory |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        worst = max(r["ranks"], key=lambda x: x["comm_sent_bytes_per_step"] or 0)
        measured = worst["comm_sent_bytes_per_step"] or 0.0
        theory, formula = comm_theory(r)
        ops = ", ".join(f"{k} {v['sent_bytes'] / 1024:.0f}" for k, v in sorted(worst["comm_bytes_per_step"].items()))
        lines.append(
            f"| `{r['strategy']}` | {r['world']} | {measured / 1024:.1f} | {theory / 1024:.1f} | "
            f"{measured / theory:.3f} | {ops} | {formula} |"
        )
    return lines


def expected_bubble(pp: int, microbatches: int, virtual: int) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1), the warm-up and drain shrunk v-fold by interleaving."""
    fill = (pp - 1) / virtual
    return fill / (microbatches + fill)


def bubble_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| pp | schedule | microbatches | samples per microbatch | stages/rank | split | measured idle per pp rank | "
        "mean | replayed on CPU times (schedule alone) | compute wall / CPU | compute ms per pp rank | formula | "
        "step ms |",
        "|---:|---|---:|---:|---:|---|---|---:|---|---:|---|---:|---:|",
    ]

    def mean(values: dict) -> float:
        return sum(values.values()) / len(values) if values else float("nan")

    for r in rows:
        measured = [r["measured"][k] for k in sorted(r["measured"])]
        formula = expected_bubble(r["pp"], r["microbatches"], r["virtual"])
        shown = "≈0 (ZB-V)" if r["schedule"] == "zero_bubble" else f"{formula:.3f}"
        replayed = f"{mean(r['replayed']):.3f} ({mean(r['replayed_shape']):.3f})" if r.get("replayed") else "-"
        stretch = f"{mean(r['wall_over_cpu']):.2f}" if r.get("wall_over_cpu") else "-"
        compute_ms = r.get("compute_ms") or {}
        compute = ", ".join(f"{compute_ms[k]:.0f}" for k in sorted(compute_ms)) or "-"
        lines.append(
            f"| {r['pp']} | {r['schedule']} | {r['microbatches']} | {r.get('global_batch', 16) // r['microbatches']} | "
            f"{r['virtual']} | {r.get('balance', 'uniform')} | "
            f"{', '.join(f'{x:.3f}' for x in measured)} | {sum(measured) / len(measured):.3f} | {replayed} | "
            f"{stretch} | {compute} | {shown} | {r['step_s'] * 1e3:.0f} |"
        )
    return lines


def split_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        "| split | stages (layers) | re-timed stage ms | slowest / mean |",
        "|---|---|---|---:|",
    ]
    for name in ("profile", "uniform"):
        stages = ", ".join(f"{a}-{b}" for a, b in result["stages"][name])
        ms = ", ".join(f"{t * 1e3:.1f}" for t in result["stage_seconds"][name])
        lines.append(f"| {name} | {stages} | {ms} | {result['slowest_over_mean'][name]:.3f} |")
    profile, uniform = (max(result["stage_seconds"][k]) for k in ("profile", "uniform"))
    lines += ["", f"The profiled split's slowest stage is {uniform / profile:.2f}x faster than the uniform split's."]
    return lines


def _rerun_note(results: dict[str, Any]) -> list[str]:
    """Sections run again apart (``bench.py --only``) since the full run."""
    if "rerun" not in results:
        return []
    sections = ", ".join(results["rerun"]["sections"])
    machines = results["rerun"].get("machines", [])
    other = [m for m in machines if m != results["machine"]]
    where = f" Some ran on another machine ({'; '.join(other)}): compare rows within a section." if other else ""
    return [
        f"Sections rerun since then with `--only` (the last rerun: {results['rerun']['seconds']:.0f} s): "
        f"{sections}.{where}",
        "",
    ]


def write_report(results: dict[str, Any], path: Path) -> None:
    num_params = results["memory"][0]["ranks"][0]["num_params"]
    lines = [
        "# Benchmarks",
        "",
        f"Written by `make bench` (benchmarks/bench.py) in one run of {results['wall_seconds'] / 60:.1f} minutes on "
        f"{results['machine']}. Raw figures: benchmarks/results.json.",
        "",
        *_rerun_note(results),
        "## Throughput against Lightning's own strategies",
        "",
        "Same model, same global batch, same data; pairs interleaved, medians of the per-launch median step "
        "times. Speed ratio = Lightning's step time / ours (above 1: ours is faster). Lightning's FSDP2 path is "
        "`ModelParallelStrategy` with the model's TP plan and `fully_shard` in `configure_model` "
        "(benchmarks/baselines.py); Lightning's `FSDPStrategy` refuses CPU devices.",
        "",
        *throughput_table(results["throughput"]),
        "",
        *_phase_section(results["throughput"]),
        "## Model-state memory per rank against the ZeRO formulas",
        "",
        f"GPT bench model, P = {num_params:,} parameters, fp32 AdamW (K = 8 bytes of state per parameter), "
        "counted from the tensors after an optimizer step (largest rank). Formulas (Rajbhandari et al., 2020): "
        "stage 0: 16P; 1: 8P + 8P/N; 2: 4P + 12P/N; 3: 16P/N.",
        "",
        *memory_table(results["memory"]),
        "",
    ]
    lines += [
        "## Bytes communicated per step per rank against the theoretical volume",
        "",
        "Counted at torch's dispatcher (lightning_parallel/parallel/comm_volume.py) during one step, as the bytes "
        "a ring algorithm sends (all-reduce of n bytes: 2n(w-1)/w; all-gather, reduce-scatter: n(w-1)/w; send: "
        "n), so backends compare. Ψ = 4P bytes; A = micro-batch x sequence x width x 4 bytes.",
        "",
        *comm_table(results["memory"]),
        "",
        "## Pipeline bubble",
        "",
        "Idle fraction of each pp rank over one recorded step, median of the launches (1 - busy/span; span: "
        "from the first forward of any rank to the last backward; busy: forward, the last stage's loss, backward "
        "and weight-gradient computation) against (p-1)/(m+p-1), with the fill and drain divided by v for v "
        "virtual stages per rank (interleaved 1F1B). Replayed: the same step re-timed with each box lasting its "
        "thread CPU time (other processes' preemption drops out) and no transfer time, with the schedule's own "
        "CPU work between boxes charged, and in brackets without it (the schedule's shape and the stage balance "
        "alone). Compute wall / CPU above 1: the ranks were preempted inside their boxes. Mean: the pipeline's "
        "bubble (idle device time over all device time), which the formula gives for equal stages. Compute ms "
        "per pp rank: each rank's boxes in the step, which shows the stage balance: a rank faster than the slowest "
        "by a fraction x idles about x m/(m+p-1) more than the formula at 1F1B's pace. GPT bench model with "
        "6 blocks (8 pipeline layers); split `params`: `pp_balance='params'`, which under ZB-V balances the "
        "ranks. The timelines (Chrome trace + PNG) lie under runs/bench/*/timeline/.",
        "",
        *bubble_table(results["bubble"]),
        "",
        "## Profile-guided pipeline split",
        "",
        f'`pp_balance="profile"` on VGG16 (14 pipeline layers) for pp={results["pipeline_split"]["pp"]}, '
        f"microbatch {results['pipeline_split']['microbatch']}: each stage of the profiled and of the uniform split "
        "re-timed apart from the profiler (forward + backward, this process's CPU seconds, least of 7 rounds).",
        "",
        *split_lines(results["pipeline_split"]),
        "",
    ]
    if "overhead" in results:
        lines += [*overhead_lines(results["overhead"]), ""]
    if "moe" in results:
        lines += moe_lines(results["moe"])
    if "speed" in results:
        lines += speed_lines(results["speed"])
    if "hsdp" in results:
        lines += hsdp_lines(results["hsdp"])
    if "async" in results:
        lines += async_lines(results["async"])
    if "context" in results:
        lines += context_lines(results["context"])
    if "spatial" in results:
        lines += spatial_lines(results["spatial"])
    if "lora" in results:
        lines += lora_lines(results["lora"])
    if "muon" in results:
        lines += muon_lines(results["muon"])
    if "auto" in results:
        lines += auto_lines(results["auto"])
    if "host_syncs" in results:
        lines += host_sync_lines(results["host_syncs"])
    if FINDINGS.exists():
        lines += ["## Findings", "", FINDINGS.read_text().strip(), ""]
    path.write_text("\n".join(lines))
