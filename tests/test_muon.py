"""MuonAdamW (lightning_parallel/parallel/optim/muon.py): its Muon part against torch.optim.Muon, the split rule,
bad input, and the owner exchange of sharded matrices at world 2 (tests/workers/cases/muon_exchange.py)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from harness import run_worker
from torch import nn

from lightning_parallel.models.gpt import GPTConfig, RecipeGPT
from lightning_parallel.parallel.optim.muon import MuonAdamW, check_muon_precision, split_params
from lightning_parallel.parallel.optim.muon_exchange import chunk_sizes, ns_cost, owners


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24, bias=False), nn.Tanh(), nn.Linear(24, 8, bias=False))


def _train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 10, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)  # each step's batch by its index: a resumed run sees the same
        x, y = torch.randn(16, 12, generator=g), torch.randn(16, 8, generator=g)
        loss = (net(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_muon_part_is_torch_muon(nesterov, adjust_lr_fn):
    """ns_dtype=bfloat16 is torch.optim.Muon's update op for op: within bf16's noise (here: equal)."""
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ours, theirs = _net(), _net()
    got = _train(ours, MuonAdamW([{"params": list(ours.parameters()), "use_muon": True}], **settings))
    want = _train(theirs, torch.optim.Muon(theirs.parameters(), **settings))
    assert got == pytest.approx(want, rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_float32_newton_schulz_moves_little_from_bfloat16():
    """ns_dtype=float32 runs the same iteration in fp32: parameters within bf16's rounding of torch's after 10 steps,
    and not identical (the dtype is really used)."""
    ours, theirs = _net(), _net()
    _train(ours, MuonAdamW([{"params": list(ours.parameters()), "use_muon": True}], ns_dtype="float32"))
    _train(theirs, torch.optim.Muon(theirs.parameters(), lr=0.02))
    diffs = [(a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters())]
    assert 0 < max(diffs) < 0.02 * 10 * 2**-7  # 10 steps of lr-sized updates, each off by bf16's rounding at most


def test_split_rule_on_the_recipe_gpt():
    model = RecipeGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, tie_weights=False))
    muon, decay, no_decay = split_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in muon} == {
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")
    }
    assert {names[id(p)] for p in decay} == {"embed.wte.weight", "embed.wpe.weight", "head.lm_head.weight"}
    assert all(p.ndim == 1 for p in no_decay) and len(no_decay) == len(list(model.parameters())) - 15
    optimizer = MuonAdamW.from_module(model)
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False, False]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0, 0.0]
    assert [g["lr"] for g in optimizer.param_groups] == [0.02, 3e-3, 3e-3]


@pytest.mark.parametrize("tie", [True, False])
def test_split_rule_when_widths_equal_the_vocabulary_or_the_positions(tie):
    """gpt_tiny's shapes: d_model == seq_len (64) and mlp.fc's 4 * d_model == the vocabulary (256). Only the head is
    AdamW's; every block matrix is Muon's (a rule by out_features alone gave Muon nothing here)."""
    model = RecipeGPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64, tie_weights=tie))
    muon, decay, _ = split_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(muon) == 12 and all(names[id(p)].startswith("blocks.") for p in muon)
    assert {names[id(p)] for p in decay} == {"embed.wte.weight", "embed.wpe.weight"} | (
        set() if tie else {"head.lm_head.weight"}
    )


def test_split_rule_head_by_name_or_last_and_stage_stand_in():
    """A head registered first (LitGPT's order) is told by its name; an unnamed last Linear onto the vocabulary is the
    head; a stage without the embedding tells it by the size its stand-in keeps; a middle Linear as wide as the
    vocabulary is a matrix."""
    from lightning_parallel.parallel.pipeline.split import ElsewhereLayer

    class HeadFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(16, 64, bias=False)
            self.wte = nn.Embedding(64, 16)
            self.fc = nn.Linear(16, 64, bias=False)
            self.proj = nn.Linear(64, 16, bias=False)

    first = HeadFirst()
    assert [p for p in split_params(first)[0]] == [first.fc.weight, first.proj.weight]
    stage = nn.Sequential(ElsewhereLayer("embed", 0, (64, 8)), nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 64))
    assert [p for p in split_params(stage)[0]] == [stage[1].weight, stage[2].weight]


def test_adamw_part_is_torch_adamw():
    ours, theirs = _net(), _net()
    got = _train(ours, MuonAdamW(ours.parameters(), adamw_lr=1e-2, adamw_weight_decay=0.05))
    want = _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05))
    assert got == want


def test_state_dict_resumes_exactly():
    """Momentum buffers and AdamW's moments saved and loaded (torch.save of the state dict): the next losses equal."""
    whole = _net()
    torch.manual_seed(0)
    whole.insert(0, nn.LayerNorm(12))  # a 1-D parameter: AdamW's state too
    reference = copy.deepcopy(whole)
    make = lambda net: MuonAdamW.from_module(net, ns_dtype="float32")  # noqa: E731
    want = _train(reference, make(reference), steps=8)
    first = make(whole)
    _train(whole, first, steps=4)
    buffer = io.BytesIO()
    torch.save({"model": whole.state_dict(), "optimizer": first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = copy.deepcopy(whole)
    resumed.load_state_dict(saved["model"])
    second = make(resumed)
    second.load_state_dict(saved["optimizer"])
    assert {k for s in second.state.values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    assert _train(resumed, second, steps=4, start=4) == want[4:]


def test_bad_input_names_the_setting():
    with pytest.raises(ValueError, match=r"shape \(3,\).*use_muon=False.*from_module"):
        MuonAdamW([{"params": [nn.Parameter(torch.ones(3))], "use_muon": True}])
    with pytest.raises(ValueError, match=r"ns_dtype='float16'.*bfloat16, float32"):
        MuonAdamW([nn.Parameter(torch.ones(3))], ns_dtype="float16")
    with pytest.raises(ValueError, match=r"ns_dtype=torch.float16.*bfloat16, float32"):
        MuonAdamW([nn.Parameter(torch.ones(3))], ns_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"adjust_lr_fn='rms'"):
        MuonAdamW([nn.Parameter(torch.ones(3))], adjust_lr_fn="rms")


def test_fp16_loss_scaling_refused_by_name():
    """The strategies (Trainer and Fabric) call check_muon_precision on each optimizer they set up."""
    muon = MuonAdamW.from_module(_net())
    with pytest.raises(ValueError, match=r"MuonAdamW with precision='16-mixed'.*bf16-mixed"):
        check_muon_precision(muon, "16-mixed")
    check_muon_precision(muon, "bf16-mixed")
    check_muon_precision(torch.optim.AdamW(_net().parameters()), "16-mixed")


def test_owners_balance_and_torch_chunk_sizes():
    assert owners([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40 -> 0, 30 -> 1, 20 -> 1 (30 < 40), 10 -> 0 (40 < 50)
    assert owners([ns_cost((128, 32)), ns_cost((32, 32)), ns_cost((32, 128)), ns_cost((64, 64))], 2) == [1, 0, 1, 0]
    assert ns_cost((8, 32, 128)) == 8 * ns_cost((32, 128)) == 8 * 32 * 128 * 32  # a stack: E matrices
    assert chunk_sizes(7, 2) == [4, 3] and chunk_sizes(3, 4) == [1, 1, 1, 0] and chunk_sizes(5, 4) == [2, 2, 1, 0]


@pytest.mark.parametrize("ns_dtype", ["float32"])
def test_sharded_matrices_orthogonalized_whole_at_world_2(tmp_path, ns_dtype):
    ranks = run_worker("muon_exchange", 2, ["--opts", f'{{"ns_dtype": "{ns_dtype}"}}'], tmp_path, timeout=300)
    for rank in ranks:
        assert rank["worst"] <= 1e-6, rank
        assert rank["sent_bytes"] == rank["formula_bytes"] > 0
    assert sum(r["orthogonalized"] for r in ranks) == 6  # each matrix once, not on every rank
    assert [r["orthogonalized"] for r in ranks] == [ranks[0]["owners"].count(q) for q in range(2)]
    flat = [r["flat"] for r in ranks]  # ZeRO-1/2: 90 elements in 2 slices of 45, the (6, 4) matrix across the cut
    assert flat[0]["crossing"] == 1 and sum(f["covered"] for f in flat) == 90
    assert max(f["worst"] for f in flat) <= 1e-6 and sum(f["orthogonalized"] for f in flat) == 5
    assert_balanced([r["ns_cost"] for r in ranks], ranks[0]["costs"] if "costs" in ranks[0] else None)
    replicated = [r["replicated"] for r in ranks]  # ZeRO-0: whole matrices everywhere, each done by one owner
    assert max(r["worst"] for r in replicated) <= 1e-6
    assert sum(r["orthogonalized"] for r in replicated) == 6 and min(r["orthogonalized"] for r in replicated) > 0
    assert all(r["sent_bytes"] == r["formula_bytes"] > 0 for r in replicated), replicated
    assert_balanced([r["ns_cost"] for r in replicated], replicated[0]["costs"])


def assert_balanced(loads: list[int], costs: list[int] | None) -> None:
    """Greedy owners, costliest first: no rank's Newton-Schulz cost exceeds another's by more than one matrix's."""
    assert sum(loads) > 0 and (costs is None or sum(loads) == sum(costs)), (loads, costs)
    assert max(loads) - min(loads) <= max(costs or loads), loads
