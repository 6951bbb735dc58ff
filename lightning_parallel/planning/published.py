"""Published large training runs (``../shared/published_runs.md``) as planner inputs, and the comparison table of
``docs/planner.md`` (``python -m lightning_parallel.plan --published``).

Each :class:`Run` holds what the paper states about the model, the cluster, the layout and the system (kernel,
checkpointing, schedule); its published throughput is used only to compute the error after the prediction.
What a paper does not state (microbatch size, virtual stages) the planner chooses, as a user would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_parallel.planning.cluster import Cluster, get_device
from lightning_parallel.planning.hf_config import ModelShape, gpt_shape
from lightning_parallel.planning.layout import Layout, Workload
from lightning_parallel.planning.search import complete, search

MEGATRON = "Megatron-LM (Narayanan et al. 2021), Table 1"
LLAMA3 = "Llama 3 (Dubey et al. 2024), Table 4"
ZERO3 = "Megatron-LM (Narayanan et al. 2021), Table 2"


@dataclass(frozen=True)
class Run:
    """One published run: the inputs the planner gets, and the published TFLOP/s per GPU (not given to it).

    Attributes:
        source, label: where the row comes from and a short name.
        shape, cluster, workload: the model, the devices, the batch and system.
        layout: the published layout; ``free``: the layout fields the paper leaves open (the planner picks them).
        tflops: published TFLOP/s per GPU, counted as the paper counts it.
    """

    source: str
    label: str
    shape: ModelShape
    cluster: Cluster
    workload: Workload
    layout: Layout
    free: tuple[str, ...]
    tflops: float


def _megatron(params_b: float, heads: int, hidden: int, layers: int, t: int, p: int, d: int, batch: int, tf: float):
    shape = gpt_shape(f"GPT {params_b}B", layers, hidden, heads, 51200, 2048)
    # interleaved 1F1B, full recomputation, no sequence parallelism, no distributed optimizer (2021)
    layout = Layout(
        tp=t, pp=p, dp=d, activation_checkpointing="full", pp_schedule="interleaved_1f1b" if p > 1 else "1f1b"
    )
    work = Workload(2048, batch, precision="16-mixed", attention="materialized", flops_count="megatron")
    return Run(
        MEGATRON,
        shape.name,
        shape,
        Cluster(t * p * d, 8, get_device("a100-80gb")),
        work,
        layout,
        ("microbatches", "pp_virtual_stages"),
        tf,
    )


def _table2(scheme: str, gpus: int, micro: int, tf: float) -> Run:
    """Table 2 of the same paper: GPT-3 175B (96 layers, hidden 12,288, 96 heads), global batch 1536, ZeRO-3
    without model parallelism (DeepSpeed) against PTD-P (t=8, p=12), the same A100 cluster; both with activation
    recomputation. Transcribed into this module only (not in ``../shared/published_runs.md``)."""
    shape = gpt_shape("GPT 174.6B", 96, 12288, 96, 51200, 2048)
    work = Workload(2048, 1536, precision="16-mixed", attention="materialized", flops_count="megatron")
    if scheme == "zero3":  # microbatch size 4, 2, 1 at 384, 768, 1536 GPUs: one microbatch per step
        layout = Layout(dp=gpus, zero_stage=3, activation_checkpointing="full", microbatches=1536 // gpus // micro)
        free: tuple[str, ...] = ()
    else:
        layout = Layout(tp=8, pp=12, dp=gpus // 96, activation_checkpointing="full", pp_schedule="interleaved_1f1b")
        layout = replace(layout, microbatches=1536 // layout.dp // micro)
        free = ("pp_virtual_stages",)
    label = f"175B {'ZeRO-3' if scheme == 'zero3' else 'PTD-P'} {gpus} GPUs"
    return Run(ZERO3, label, shape, Cluster(gpus, 8, get_device("a100-80gb")), work, layout, free, tf)


LLAMA3_405B = ModelShape("Llama 3 405B", 128256, 16384, 126, 128, 8, 128, 128, 53248, seq_len=8192)


def _llama3(gpus: int, tp: int, cp: int, pp: int, dp: int, seq: int, batch_per_dp: int, tf: float) -> Run:
    # FSDP (parameters kept between forward and backward), interleaved schedule, no checkpointing
    layout = Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        zero_stage=3,
        reshard_after_forward=False,
        sequence_parallel=True,
        pp_schedule="interleaved_1f1b",
        overlap_grad_reduce=True,
    )
    work = Workload(seq, batch_per_dp * dp, precision="bf16-mixed", attention="flash")
    label = f"405B {gpus} GPUs, seq {seq}"
    return Run(
        LLAMA3,
        label,
        LLAMA3_405B,
        Cluster(gpus, 8, get_device("h100")),
        work,
        layout,
        ("microbatches", "pp_virtual_stages"),
        tf,
    )


RUNS = [
    _megatron(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron(3.6, 32, 3072, 30, 2, 1, 32, 512, 138),
    _megatron(7.5, 32, 4096, 36, 4, 1, 32, 512, 142),
    _megatron(18.4, 48, 6144, 40, 8, 1, 32, 1024, 135),
    _megatron(39.1, 64, 8192, 48, 8, 2, 32, 1536, 138),
    _megatron(76.1, 80, 10240, 60, 8, 4, 32, 1792, 140),
    _megatron(145.6, 96, 12288, 80, 8, 8, 24, 2304, 148),
    _megatron(310.1, 128, 16384, 96, 8, 16, 15, 2160, 155),
    _megatron(529.6, 128, 20480, 105, 8, 35, 9, 2520, 163),
    _megatron(1008.0, 160, 25600, 128, 8, 64, 6, 3072, 163),
    _llama3(8192, 8, 1, 16, 64, 8192, 32, 430),
    _llama3(16384, 8, 1, 16, 128, 8192, 16, 400),
    _llama3(16384, 8, 16, 16, 8, 131072, 16, 380),
]
# the published comparison of ZeRO-3 and 3D parallelism at scale (apart from RUNS: the calibration's rows)
ZERO3_RUNS = [
    _table2("zero3", 384, 4, 144),
    _table2("zero3", 768, 2, 88),
    _table2("zero3", 1536, 1, 44),
    _table2("ptdp", 384, 1, 153),
    _table2("ptdp", 768, 1, 149),
    _table2("ptdp", 1536, 1, 141),
]


def counted_flops_per_token(run: Run, checkpointing: str) -> float:
    """FLOPs per token as the run's source counts them (to turn its TFLOP/s into tokens/s)."""
    from lightning_parallel.planning.analytic import AnalyticEstimate, count_throughput

    est = AnalyticEstimate(replace(run.layout, activation_checkpointing=checkpointing), step_time=1.0)
    count_throughput(est, run.shape, Cluster(1, 1, run.cluster.device), run.workload)
    return est.tflops_per_gpu * 1e12 / (run.workload.global_batch * run.workload.seq_len)


def compare(run: Run) -> dict[str, Any]:
    """The planner's prediction for the published layout (the fields the paper leaves open chosen by it) and its
    own recommendation, beside the published figure (read only here, after predicting)."""
    predicted = complete(run.shape, run.cluster, run.layout, run.workload, run.free)
    best = search(run.shape, run.cluster, run.workload, top=1)
    assert predicted is not None, run.label
    per_token = counted_flops_per_token(run, run.layout.activation_checkpointing)
    published_tps = run.tflops * 1e12 * run.cluster.gpus / per_token
    return {
        "source": run.source,
        "run": run.label,
        "gpus": run.cluster.gpus,
        "published_layout": run.layout.describe(),
        "published_tflops": run.tflops,
        "published_tokens_per_s": published_tps,
        "predicted": predicted,
        "error": predicted.tflops_per_gpu / run.tflops - 1,
        "recommended": best[0] if best else None,
    }


def published_table() -> str:
    """The Markdown table of docs/planner.md: every published run against the planner."""
    lines = [
        "| run | GPUs | published layout | published TFLOP/s per GPU (tokens/s) | predicted (error) | predicted "
        "memory per GPU | recommended layout | its predicted tokens/s (vs published) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in RUNS:
        c = compare(run)
        p, r = c["predicted"], c["recommended"]
        fits = "" if p.feasible else " (over the memory limit)"
        rec = (
            f"`{r.layout.describe()}` | {r.tokens_per_s:,.0f} ({r.tokens_per_s / c['published_tokens_per_s'] - 1:+.0%})"
        )
        lines.append(
            f"| {c['run']} | {c['gpus']:,} | `{p.layout.describe()}` | {c['published_tflops']:.0f} "
            f"({c['published_tokens_per_s']:,.0f}) | {p.tflops_per_gpu:.0f} ({c['error']:+.1%}) | "
            f"{p.memory / 1e9:.1f} GB{fits} | {rec} |"
        )
    return "\n".join(lines)
