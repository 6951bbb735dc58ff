"""Observability: communication bytes against the textbook volumes, FLOPs, model-state bytes, the pipeline
timeline (order, bubble, files), and the recipe's metrics.json fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import run_worker
from recipe_runs import GPT, run_recipe
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from workers.cases.common import TINY

from lightning_parallel.callbacks.monitor import LocalFlopCounter, peak_flops
from lightning_parallel.models.gpt import RecipeGPT as GPTModel
from lightning_parallel.parallel.measure.comm_volume import sent_bytes
from lightning_parallel.parallel.measure.timeline import (
    bubble_fractions,
    chrome_trace,
    compute_order,
    plot_timeline,
)

MICROBATCHES = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CASES = [
    {"name": "ddp", "strategy": "ddp"},
    {"name": "zero1", "strategy": "zero1"},
    {"name": "zero2", "strategy": "zero2"},
    {"name": "zero3", "strategy": "zero3"},
    {"name": "tp", "strategy": "hybrid3d:tp=2"},
    {"name": "gpipe", "strategy": f"hybrid3d:pp=2,microbatches={MICROBATCHES},pp_schedule=gpipe", "timeline": True},
    {"name": "1f1b", "strategy": f"hybrid3d:pp=2,microbatches={MICROBATCHES},pp_schedule=1f1b", "timeline": True},
]


# ----- unit: no process group -----
def test_sent_bytes_follow_the_ring_convention():
    n = 1000
    assert sent_bytes("all_reduce", n, 4) == 2 * n * 3 / 4
    assert sent_bytes("all_gather", n, 4) == sent_bytes("reduce_scatter", n, 4) == n * 3 / 4
    assert sent_bytes("send", n, 2) == n and sent_bytes("recv", n, 2) == 0
    assert sent_bytes("all_reduce", n, 1) == 0  # a group of one moves nothing


def test_peak_flops_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops(None, "bf16") is None and peak_flops("Some CPU", "fp32") is None
    with pytest.raises(ValueError, match="dtype='fp8' is unknown"):
        peak_flops("NVIDIA H100", "fp8")


def test_local_flop_counter_matches_torch_on_plain_tensors():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    with FlopCounterMode(display=False) as reference:
        model(x).sum().backward()
    with LocalFlopCounter() as local:
        model(x).sum().backward()
    assert local.flops == reference.get_total_flops() > 0


def _ideal_timeline(schedule: str, pp: int, m: int) -> list[dict]:
    """Unit-time F and B (B twice as long) placed as the literature draws GPipe / 1F1B, by dependency."""
    orders = {r: _expected_order(schedule, r, pp, m) for r in range(pp)}
    done: dict[tuple[int, str], float] = {}
    clock = dict.fromkeys(range(pp), 0.0)
    events: dict[int, list[dict]] = {r: [] for r in range(pp)}
    pending = {r: list(orders[r]) for r in range(pp)}
    while any(pending.values()):
        for r in range(pp):
            while pending[r]:
                action = pending[r][0]
                dep = (r - 1, action) if action[0] == "F" else (r + 1, action)
                if action[0] == "B" and r == pp - 1:
                    dep = (r, "F" + action[1:])
                if 0 <= dep[0] < pp and dep not in done:
                    break
                start = max(clock[r], done.get(dep, 0.0))
                end = start + (1.0 if action[0] == "F" else 2.0)
                events[r].append(
                    {"kind": action[0], "stage": r, "microbatch": int(action[1:]), "start": start, "end": end}
                )
                done[(r, action)], clock[r] = end, end
                pending[r].pop(0)
    return [{"rank": r, "pp_rank": r, "events": events[r]} for r in range(pp)]


def _expected_order(schedule: str, rank: int, pp: int, m: int) -> list[str]:
    """GPipe: all forwards, then all backwards. 1F1B (PipeDream-flush): pp - rank - 1 warm-up forwards, then
    one forward and one backward in turn, then the remaining backwards."""
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    warmup = min(pp - rank - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - warmup, m)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_of_an_ideal_schedule_is_the_textbook_one(schedule, tmp_path):
    pp, m = 4, 8
    timelines = _ideal_timeline(schedule, pp, m)
    fractions = bubble_fractions(timelines)
    for r in range(pp):
        assert compute_order(timelines[r]) == _expected_order(schedule, r, pp, m)
        assert fractions[r] == pytest.approx((pp - 1) / (m + pp - 1)), (schedule, r, fractions)
    trace = chrome_trace(timelines)
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == pp * 2 * m and {e["pid"] for e in boxes} == set(range(pp))
    plot_timeline(timelines, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC


# ----- distributed: one launch at world 2 runs every configuration -----
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("observability")
    ranks = run_worker("obs", 2, ["--cases", json.dumps(CASES)], out, timeout=400)
    return {c["name"]: [ranks[r][i] for r in range(2)] for i, c in enumerate(CASES)}, out


def _events(result: dict, kind: str, payload: int | None = None) -> list[dict]:
    return [e for e in result["events"] if e["kind"] == kind and (payload is None or e["payload_bytes"] == payload)]


def _sent_without_scalars(result: dict) -> float:
    """Bytes sent in the step, less the scalar all-reduces (the logged loss) that every strategy adds and DDP's
    broadcast of its bucket order (once, when it rebuilds its buckets)."""
    kept = [e for e in result["events"] if e["payload_bytes"] > 4 and e["kind"] != "broadcast"]
    return sum(sent_bytes(e["kind"], e["payload_bytes"], e["group_size"]) for e in kept)


def test_ddp_all_reduces_exactly_the_gradient_bytes(runs):
    for rank, result in enumerate(runs[0]["ddp"]):
        grads = 4 * result["num_params"]  # fp32
        buckets = sum(e["payload_bytes"] for e in _events(result, "all_reduce") if e["payload_bytes"] > 4)
        assert buckets == grads, f"rank {rank}: DDP all-reduced {buckets} bytes, the gradients are {grads}"
        assert _sent_without_scalars(result) == pytest.approx(2 * grads * (2 - 1) / 2)  # 2P(w-1)/w


def test_zero_volumes_against_data_parallel(runs):
    ddp = _sent_without_scalars(runs[0]["ddp"][0])
    ratios = {name: _sent_without_scalars(runs[0][name][0]) / ddp for name in ("zero1", "zero2", "zero3")}
    print(f"\nbytes sent per step relative to DDP (world 2): {ratios}")
    assert ratios["zero2"] == pytest.approx(1.0, rel=0.01)  # reduce-scatter + all-gather: DP's volume
    # + a second all-gather of each block for backward; the root unit (embeddings, final norm, tied head) stays
    # gathered from forward to backward, as torch's default keeps the FSDP root
    with torch.device("meta"):
        model = GPTModel(TINY)
    outside_blocks = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    num_params = sum(p.numel() for p in model.parameters())
    assert ratios["zero3"] == pytest.approx(1.5 - 0.5 * outside_blocks / num_params, rel=0.01)
    assert ratios["zero1"] == pytest.approx(1.5, rel=0.01)  # stage 1 all-reduces, then all-gathers the update


def test_tensor_parallel_all_reduces_per_layer(runs):
    result = runs[0]["tp"][0]
    activation = result["micro_batch"] * TINY.seq_len * TINY.d_model * 4
    all_reduces = _events(result, "all_reduce")
    first_loss = next(i for i, e in enumerate(all_reduces) if e["payload_bytes"] != activation)
    forward = [e for e in all_reduces[:first_loss] if e["payload_bytes"] == activation]
    backward = [e for e in all_reduces[first_loss:] if e["payload_bytes"] == activation]
    # forward: Megatron's 2 per layer (attention and MLP outputs) + the vocabulary-parallel embedding;
    # backward: Megatron's 2 per layer too (the summed input gradients of q, k and v, and the MLP's), + the head's
    assert len(forward) == 2 * TINY.n_layer + 1
    assert len(backward) == 2 * TINY.n_layer + 1
    assert all(e["group_size"] == 2 for e in forward + backward)


def test_pipeline_sends_and_receives_the_activations(runs):
    for name in ("gpipe", "1f1b"):
        for rank, result in enumerate(runs[0][name]):
            micro = result["micro_batch"] // MICROBATCHES
            activation = micro * TINY.seq_len * TINY.d_model * 4
            # forward: stage 0 sends activations; backward: stage 1 sends their gradients (the same size)
            assert len(_events(result, "send", activation)) == MICROBATCHES, (name, rank, result["events"])
            assert len(_events(result, "recv", activation)) == MICROBATCHES, (name, rank, result["events"])


def test_flops_per_step_are_the_same_in_every_layout(runs):
    flops = {name: runs[0][name][0]["summary"]["flops_per_step"] for name in ("ddp", "zero3", "tp", "gpipe")}
    assert len(set(flops.values())) == 1, flops  # each layout's ranks together compute the same model


def test_model_state_bytes_of_fp32_adamw(runs):
    for name in ("ddp", "zero3", "tp", "gpipe"):
        for rank, result in enumerate(runs[0][name]):
            states = result["summary"]["model_state_bytes"]
            params = result["local_param_bytes"]  # the shard or stage this rank holds
            assert states["params"] == states["grads"] == params, (name, rank, states)
            assert states["optimizer"] == 2 * params and states["total"] == 4 * params, (name, rank, states)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_timeline(runs, schedule):
    results, out = runs
    trace = json.loads((out / schedule / "timeline.json").read_text())
    assert (out / schedule / "timeline.png").read_bytes()[:8] == PNG_MAGIC
    rows = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] in ("F", "B"):
            rows.setdefault(e["pid"], []).append(e)
    assert sorted(rows) == [0, 1]
    for pp_rank, boxes in rows.items():
        order = [e["name"] for e in sorted(boxes, key=lambda e: e["ts"])]
        assert order == _expected_order(schedule, pp_rank, 2, MICROBATCHES), (schedule, pp_rank, order)
    bubble = {int(k): v for k, v in results[schedule][0]["summary"]["pipeline_bubble"].items()}
    print(f"\n{schedule}: measured idle fraction per pp rank {bubble} (textbook {1 / (MICROBATCHES + 1):.2f})")
    assert set(bubble) == {0, 1} and all(0 < v < 1 for v in bubble.values())


# ----- recipe -----
def _recipe_forward_flops(overrides: list[str]) -> int:
    """FLOPs of one forward of the recipe's GPT on its global batch, in one process (torch's counter)."""
    from hydra import compose, initialize_config_dir

    from lightning_parallel.recipes.config import register_configs
    from lightning_parallel.recipes.gpt import gpt_config

    register_configs()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("train_gpt", overrides=[o for o in overrides if not o.startswith(("strategy", "observ"))])
    model = GPTModel(gpt_config(cfg.model))
    tokens = torch.zeros(cfg.data.global_batch_size, cfg.model.seq_len, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    return counter.get_total_flops()


def test_recipe_counts_the_backward_flops_of_its_measured_step(tmp_path):
    """The default measure_step (2) is also the batch the activation monitor measures, and both callbacks count
    under dispatch modes, which torch pops from the top of one stack: they must nest. Before, the activation
    monitor left first at the start of backward and popped the FLOP counter: the step counted its forward only."""
    overrides = ["trainer=debug", "trainer.max_steps=3", "sample_tokens=0", "trainer.devices=1"]
    metrics = run_recipe(GPT, tmp_path, *overrides, "strategy=hybrid3d")
    assert metrics["flops_per_step"] == pytest.approx(3 * _recipe_forward_flops(overrides), rel=1e-6)


def test_recipe_metrics_json_has_the_observability_fields(tmp_path):
    overrides = ["trainer=debug", "trainer.max_steps=4", "sample_tokens=0", "trainer.devices=2"]
    overrides += ["strategy=hybrid3d", "strategy.pp=2", "observability.timeline=true"]
    metrics = run_recipe(GPT, tmp_path, *overrides)
    assert metrics["mfu"] is None  # CPU: no known peak
    # counted over both pp ranks: forward and backward of the whole model on the global batch, 3x the forward
    assert metrics["flops_per_step"] == pytest.approx(3 * _recipe_forward_flops(overrides), rel=1e-6)
    assert metrics["samples_per_second"] > 0
    seq_len = 64  # conf/model/gpt_tiny.yaml
    assert metrics["tokens_per_second"] == pytest.approx(metrics["samples_per_second"] * seq_len)
    assert len(metrics["model_state_bytes"]) == 2 and len(metrics["comm_bytes_per_step"]) == 2
    for states, comm in zip(metrics["model_state_bytes"], metrics["comm_bytes_per_step"]):
        assert states["total"] == states["params"] + states["grads"] + states["optimizer"] > 0
        assert comm["send"]["payload_bytes"] > 0 and comm["recv"]["payload_bytes"] > 0
    assert set(metrics["pipeline_bubble"]) == {"0", "1"}
    assert (tmp_path / "run" / "timeline.json").exists() and (tmp_path / "run" / "timeline.png").exists()
