"""The analytic planner's FP8 (issue 46 item 5) and Muon (issue 47 item 3) counts, each against numbers worked out by
hand in the comments, the Newton-Schulz FLOPs against torch's flop counter on the optimizer's own iteration, and the
exchange bytes against what the optimizer's exchange counts (single process, no launches)."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel import plan as plan_cli
from lightning_parallel.parallel.optim import muon_owners
from lightning_parallel.parallel.optim.muon import NS_COEFFICIENTS, newton_schulz
from lightning_parallel.plan import main
from lightning_parallel.planning.analytic import _Rank, evaluate
from lightning_parallel.planning.auto import Machine, choose_layout
from lightning_parallel.planning.cluster import DEVICES, Cluster, get_device
from lightning_parallel.planning.fp8 import check_fp8_device, converted_kinds, converted_params, fp8_flop_share
from lightning_parallel.planning.hf_config import from_hf_config
from lightning_parallel.planning.layout import Layout, Workload, layout_error
from lightning_parallel.planning.matrices import layer_matrices
from lightning_parallel.planning.muon import (
    exchange_bytes,
    exchange_sent,
    muon_params,
    newton_schulz_flops,
    ns_flops,
    states_per_param,
)

# head_dim 16; per layer: q 64x64, k 32x64, v 32x64, o 64x64 (12,288), gate/up 128x64, down 64x128 (24,576)
TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128}  # fmt: skip
H100 = Cluster(8, 8, get_device("h100"))


def test_device_table_fp8_peaks_and_a100_refused():
    assert DEVICES["h100"].fp8_flops == DEVICES["h200"].fp8_flops == 1979e12  # dense, twice bf16's 989
    assert DEVICES["mi300x"].fp8_flops == 2615e12
    for name in ("a100-40gb", "a100-80gb"):
        with pytest.raises(ValueError, match=f"precision=fp8 needs fp8 .* {name} has none"):
            check_fp8_device(DEVICES[name], "fp8")
        check_fp8_device(DEVICES[name], "bf16-mixed")  # nothing to refuse
    a100, work = Cluster(8, 8, get_device("a100-80gb")), Workload(128, 8, precision="fp8")
    with pytest.raises(ValueError, match="a100-80gb has none"):
        evaluate(from_hf_config(TINY), a100, Layout(dp=8), work)
    machine = Machine(8, 8, 80e9, 0.0, 0.0, 0.0, "cuda", device="a100-80gb")
    with pytest.raises(ValueError, match="a100-80gb has none"):
        choose_layout(TINY, machine, global_batch=8, precision="fp8")


def test_fp8_flop_share_by_hand():
    shape = from_hf_config(TINY)
    assert converted_kinds(shape) == {"attention", "mlp"}
    # fp8 FLOPs per token: 2 x (12,288 + 24,576) x 2 layers = 147,456
    # MFU's count: 2 x active (head 512 x 64 = 32,768 + 2 x (36,864 + 2 norms of 64) = 106,752) = 213,504,
    # plus causal attention seq x heads x (16 + 16) x layers = 128 x 4 x 32 x 2 = 32,768: 246,272
    assert fp8_flop_share(shape, 128) == pytest.approx(147_456 / 246_272)
    # an MLP width that is no multiple of 16 keeps the MLP in bf16: only attention's 2 x 12,288 x 2 = 49,152
    odd = from_hf_config({**TINY, "intermediate_size": 120})
    assert converted_kinds(odd) == {"attention"}
    active = 32_768 + 2 * (12_288 + 128 + 3 * 64 * 120)
    assert fp8_flop_share(odd, 128) == pytest.approx(49_152 / (2 * active + 32_768))


def test_matrices_are_the_layer_parameters_without_norms():
    llama = from_hf_config(TINY)
    assert sum(m.numel for m in layer_matrices(llama, False)) == llama.layer_params(False)[0] - 2 * 64
    mixtral = from_hf_config({**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2})
    base, experts = mixtral.layer_params(True)
    assert sum(m.numel for m in layer_matrices(mixtral, True)) == base + experts - 2 * 64


def test_fp8_matmuls_at_fp8_peak_and_the_float8_all_gather_bytes():
    shape, x = from_hf_config(TINY), Layout(dp=2, zero_stage=3, microbatches=1)
    cluster = Cluster(2, 8, get_device("h100"))
    rank = _Rank(shape, cluster, x, Workload(128, 8, precision="fp8"))
    assert rank.gemm(4096, 4096, 4096, kind="attention") == pytest.approx(rank.gemm(4096, 4096, 4096) * 989 / 1979)
    assert rank.gemm(4096, 4096, 4096, kind="router") == rank.gemm(4096, 4096, 4096)  # kept in bf16
    # the rank holds every parameter before ZeRO-3: embedding and head 2 x 32,768 + final norm 64 + 2 x 36,992
    held, (fp8, tensors) = 139_584, converted_params(shape, 2, 0)
    assert (fp8, tensors) == (73_728, 14)  # 2 layers x 36,864 elements in 7 linears
    counts = {}
    for precision, gather in (("bf16-mixed", False), ("fp8", False), ("fp8", True)):
        est = evaluate(shape, cluster, x, Workload(128, 8, precision=precision, fsdp_float8_all_gather=gather))
        counts[precision, gather] = est.counts["zero3_gather_bytes"]
    # two gathers (forward, backward) of half the payload each; bf16: 2 bytes an element
    assert counts["bf16-mixed", False] == counts["fp8", False] == 2 * 2 * held / 2
    # float8: converted weights in 1 byte, the rest in 2, and an fp32 amax all-reduce per converted weight
    payload = 1 * 73_728 + 2 * (held - 73_728)
    assert counts["fp8", True] == pytest.approx(2 * (payload / 2 + 2 * 4 * 14 / 2))
    bf16 = evaluate(shape, cluster, x, Workload(128, 8))
    fp8 = evaluate(shape, cluster, x, Workload(128, 8, precision="fp8"))
    assert fp8.states == bf16.states and fp8.activations == bf16.activations  # fp32 masters, bf16 inputs kept
    # at d_model 64 the casts to fp8 cost more HBM time than the small matmuls save (the 8B one below: faster)
    assert fp8.times["compute"] > bf16.times["compute"]


def test_fp8_speedup_against_torchtitan():
    """torchtitan's Llama 3.1 8B on 8 H100s (96 GB, 2.4 TB/s), FSDP, local batch 2, seq 8192, selective checkpointing:
    6,667 tokens/s per GPU compiled in bf16, 8,532 with float8 (tensorwise, fp8 all-gather): 1.28x. Not fitted."""
    llama = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}  # fmt: skip
    cluster = Cluster(8, 8, get_device("h100", memory=96e9, hbm_bandwidth=2.4e12))
    x, rate = Layout(dp=8, zero_stage=3, microbatches=1, activation_checkpointing="selective"), {}
    for precision, gather in (("bf16-mixed", False), ("fp8", True)):
        work = Workload(8192, 16, precision=precision, fsdp_float8_all_gather=gather)
        rate[precision] = evaluate(from_hf_config(llama), cluster, x, work).tokens_per_s
    assert rate["fp8"] / rate["bf16-mixed"] == pytest.approx(8532 / 6667, rel=0.1)


def test_newton_schulz_flops_count_the_optimizers_iteration():
    for rows, cols in ((64, 128), (128, 64), (48, 48)):
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(rows, cols), NS_COEFFICIENTS, 5, 1e-7, torch.float32)
        assert counter.get_total_flops() == newton_schulz_flops(rows, cols)
    # by hand: m = 64, n = 128: 5 x (4 x 64^2 x 128 + 2 x 64^3) = 5 x (2,097,152 + 524,288)
    assert newton_schulz_flops(64, 128) == 13_107_200
    # the tiny llama's layer: q, o 5 x 6 x 64^3 = 7,864,320 each; k, v (32 x 64) 1,638,400 each; gate, up, down
    # 13,107,200 each: 58,327,040 a layer
    shape = from_hf_config(TINY)
    assert ns_flops(shape, 2, 0) == 2 * 58_327_040
    assert ns_flops(shape, 2, 0, world=4) == 2 * 58_327_040 / 4
    assert ns_flops(shape, 1, 0, world=64) == 13_107_200  # never below the largest matrix


def _exchange_stats(monkeypatch, shapes, world, rank, dtype):
    """What ``owner_exchange`` counts on ``rank`` of ``world`` for matrices split by rows (its collectives faked:
    only the counts are read)."""
    fake = types.SimpleNamespace(get_world_size=lambda group: world, get_rank=lambda group: rank)
    monkeypatch.setattr(muon_owners, "dist", fake)
    monkeypatch.setattr(muon_owners, "all_to_all", lambda flat, ins, outs, group: flat.new_zeros(sum(outs)))
    numels = [[n * cols for n in muon_owners.chunk_sizes(rows, world)] for rows, cols in shapes]
    costs = [muon_owners.ns_cost((rows, cols)) for rows, cols in shapes]
    mine = [torch.zeros(per_rank[rank]) for per_rank in numels]
    stats: dict[str, int] = {}
    muon_owners.owner_exchange(
        None,
        numels,
        costs,
        mine,
        lambda m, p: torch.cat(p).view(shapes[m]),
        lambda m, w: list(w.reshape(-1).split(numels[m])),
        lambda u: u,
        dtype,
        stats,
    )
    return stats["sent_bytes"]


def test_exchange_bytes_as_the_optimizer_counts_them(monkeypatch):
    # docs/muon.md's count: the test GPT (d_model 32, 2 blocks: q, k, v, proj 32x32, fc 128x32, fc2 32x128; P =
    # 24,576), W = 2, fp32: 49,152 bytes a rank, = 2 b (W-1) P / W^2
    gpt = [(32, 32)] * 4 * 2 + [(128, 32), (32, 128)] * 2
    assert exchange_sent(gpt, 2, elem=4) == [49_152, 49_152] == [exchange_bytes(24_576, 2, elem=4)] * 2
    # uneven slices and owners over 3 ranks, bf16 on the wire: what owner_exchange itself counts on each rank
    odd = [(7, 5), (64, 16), (10, 3), (33, 8)]
    counted = [_exchange_stats(monkeypatch, odd, 3, rank, torch.bfloat16) for rank in range(3)]
    assert exchange_sent(odd, 3, elem=2) == counted


def test_muon_state_exchange_and_time_by_hand():
    shape, cluster, P = from_hf_config(TINY), Cluster(4, 8, get_device("h100")), 73_728  # 2 layers x 36,864
    assert muon_params(shape, 2, 0) == P

    def both(x):
        return [evaluate(shape, cluster, x, Workload(128, 8, optimizer=o)) for o in ("adamw", "muon")]

    adamw, muon = both(Layout(dp=4, zero_stage=0, microbatches=1))
    assert adamw.states - muon.states == 4 * P  # one fp32 buffer a matrix element fewer, on every rank
    # whole on each of the 4 dp ranks: each owner's results to the 3 others, b (W-1) P / W
    assert muon.counts["muon_exchange_bytes"] == 2 * 3 * P / 4 and muon.counts["muon_ns_flops"] == 2 * 58_327_040 / 4
    assert muon.times["muon"] > 0 and muon.step_time > adamw.step_time
    adamw, muon = both(Layout(dp=4, zero_stage=1, microbatches=1))
    assert adamw.states - muon.states == 4 * P / 4  # ZeRO-1 shards the optimizer states over 4
    # owners over the 4 dp ranks: 2 b (W-1) P / W^2 in bf16
    assert muon.counts["muon_exchange_bytes"] == 2 * 2 * 3 * P / 16
    assert muon.counts["muon_ns_flops"] == 2 * 58_327_040 / 4
    _, muon = both(Layout(tp=2, dp=2, zero_stage=0, microbatches=1))  # owners over tp
    assert muon.counts["muon_exchange_bytes"] == 2 * 2 * 1 * P / 4
    _, muon = both(Layout(tp=2, dp=2, zero_stage=3, microbatches=1))  # over dp, tp, dp: 2 b P (1/2 + 1/2) / 4
    assert muon.counts["muon_exchange_bytes"] == 2 * 2 * P * (1 / 2 + 1 / 2) / 4
    assert muon.counts["muon_ns_flops"] == 2 * 58_327_040 / 4
    refusal = layout_error(shape, Layout(tp=2, dp=2, zero_stage=1), Workload(128, 8, optimizer="muon"), 4, 8)
    assert "optimizer=muon is refused under zero_stage=1 with tp=2" in refusal


def test_profiled_muon_states_per_parameter(monkeypatch):
    # docs/muon.md's example: Muon takes the Linear(32, 32)'s 1,024; AdamW the embedding 2,048, the bias 32, the norm
    # 64 and the head (64 outputs: the embedding's rows) 2,048 + 64
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 64))
    assert states_per_param(model) == pytest.approx((1_024 + 2 * 4_256) / 5_280)
    seen = []
    monkeypatch.setattr(plan_cli, "plan_layouts", lambda spec, world, settings: seen.append(settings) or [])
    plan = plan_cli.make_plan(plan_cli.parse_args(["gpt_small", "--world-size", "2", "--device-memory", "1GB",
                                                   "--optimizer", "muon"]))  # fmt: skip
    muon = 8 * 12 * 320**2  # q, k, v, proj 320 x 320 and fc, proj 1,280 x 320 in each of 8 blocks
    total = plan["num_params"]
    assert seen[0].optimizer_states == pytest.approx((muon + 2 * (total - muon)) / total)
    with pytest.raises(ValueError, match="--optimizer muon with --lora-rank"):
        plan_cli.make_plan(plan_cli.parse_args(["gpt_small", "--world-size", "2", "--device-memory", "1GB",
                                                "--optimizer", "muon", "--lora-rank", "4"]))  # fmt: skip


def test_cli_and_choose_layout(capsys):
    assert main(["gpt_tiny", "--world-size", "2", "--device-memory", "1GB", "--fsdp-float8-all-gather"]) == 2
    assert "--fsdp-float8-all-gather: the profiling planner" in capsys.readouterr().err
    assert main(["pythia-14m", "--gpus", "8", "--device", "a100-80gb", "--precision", "fp8"]) == 2
    assert "a100-80gb has none" in capsys.readouterr().err
    fp8_given = ["pythia-14m", "--gpus", "8", "--device", "a100-80gb", "--fp8-peak-flops", "624e12", "--json"]
    assert main([*fp8_given, "--precision", "fp8", "--top", "1"]) == 0  # a figure of one's own is taken
    assert json.loads(capsys.readouterr().out)["cluster"]["device"]["fp8_flops"] == 624e12
    args = ["pythia-14m", "--gpus", "8", "--device", "h100", "--precision", "fp8", "--optimizer", "muon", "--top", "1"]
    assert main([*args, "--fsdp-float8-all-gather"]) == 0
    out = capsys.readouterr().out
    assert "of the FLOPs in fp8 linears), optimizer muon" in out and "precision=fp8" in out and "optimizer=muon" in out
    machine = Machine(8, 8, 80e9, 0.0, 0.0, 0.0, "cuda", device="h100")
    choice = choose_layout(TINY, machine, global_batch=8, precision="fp8", optimizer="muon", seq_len=128)
    planned = choice.planned()
    assert planned["counts"]["fp8_flop_share"] == pytest.approx(147_456 / 246_272)
    assert "muon_ns_flops" in planned["counts"] and "muon" in planned["times_s"]
