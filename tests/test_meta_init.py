"""Layouts that shard parameters (ZeRO-3, tp and their compositions with pp) build and split the model on the meta
device: no rank ever holds a whole copy, and each rank gets exactly the values a single process has.

- memory: a GPT larger than one rank's budget is set up under zero3 and under tp=2 at world 2; the most tensor bytes
  alive on a rank at once (counted op by op) and the process's resident-memory growth stay near half the model, where
  a layout holding it whole (zero1, the control) goes past the whole model;
- values: built in configure_model, under Trainer.init_module() or on the host, the parameters after setup equal a
  single process's init bit for bit (the GPT seeds its own layers; a plain MLP draws from the global generator);
- training: 10 steps from a meta build match the single-process reference under zero3, zero3_offload, tp, dp x tp
  with ZeRO-3, pp x tp and pp x ZeRO-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import PARITY_CASES, Batch
from harness import run_worker
from parity import assert_same_losses, assert_same_params
from torch import nn

from lightning_parallel.models.gpt import GPTConfig, RecipeGPT
from lightning_parallel.parallel.materialize import fill_meta_tensors
from lightning_parallel.protocol import reset_units

BUDGET = 0.75  # of the whole model: what one rank may hold; the model does not fit one rank
BIG = {"vocab_size": 256, "seq_len": 64, "n_layer": 24, "n_head": 8, "d_model": 256}  # 19M parameters, 73 MiB
SMALL = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 8, "d_model": 32}  # the workers' TINY


def _setup(tmp_path_factory, tag: str, cases: list[dict], world: int = 2) -> tuple[list[list[dict]], Path]:
    out = tmp_path_factory.mktemp(tag)
    return run_worker("meta_init", world, ["--cases", json.dumps(cases)], out), out


@pytest.fixture(scope="module")
def memory(tmp_path_factory) -> dict[str, list[dict]]:
    """One fresh launch per layout; a small warm-up case first, so imports and process groups made on first use are
    not counted in the big model's resident memory."""
    results = {}
    for label, strategy, build in [
        ("zero3", "zero3", "configure"),
        ("tp", "hybrid3d:tp=2", "init_module"),
        ("zero1", "zero1", "configure"),  # the control: every rank holds all parameters by design
    ]:
        sizes = (("warm", SMALL), ("big", BIG))
        cases = [{"name": n, "strategy": strategy, "build": build, "gpt": g} for n, g in sizes]
        ranks, _ = _setup(tmp_path_factory, f"mem_{label}", cases)
        results[label] = [rank[1] for rank in ranks]
    return results


def test_no_rank_holds_a_whole_copy(memory):
    rows = []
    for label, ranks in memory.items():
        for rank, r in enumerate(ranks):
            model = r["model_bytes"]
            peak, rss = r["peak_tensor_bytes"] / model, r["rss_growth"] / model
            rows.append(
                f"{label:>5} rank {rank}: model {model / 2**20:.1f} MiB, peak tensors {peak:.2f} "
                f"({r['peak_tensor_bytes'] / 2**20:.1f} MiB), RSS growth {rss:.2f} ({r['rss_growth'] / 2**20:.1f} MiB)"
            )
            if label == "zero1":  # the measurement sees a whole copy where there is one
                assert peak >= 1.0 and rss >= 0.9, rows[-1]
            else:
                assert 0.5 <= peak <= BUDGET and rss <= BUDGET, rows[-1]
    print("\n" + "\n".join(rows))


def _single_process_gpt() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # the worker's seed_everything(0)
    return {f"model.{k}": v for k, v in RecipeGPT(GPTConfig(**SMALL)).state_dict().items()}


def _single_process_mlp() -> dict[str, torch.Tensor]:
    from workers.cases.meta_init import PlainMLP

    torch.manual_seed(0)
    return {f"net.{k}": v for k, v in PlainMLP.build().state_dict().items()}


VALUE_CASES = [  # (strategy, model, build)
    ("zero3", "gpt", "init_module"),
    ("zero3", "plain", "init_module"),
    ("zero3", "plain", "configure"),
    ("hybrid3d:tp=2", "gpt", "configure"),
    ("hybrid3d:tp=2", "plain", "init_module"),
    ("hybrid3d:tp=2", "plain", "host"),
]


@pytest.fixture(scope="module")
def values(tmp_path_factory):
    cases = [
        {"name": f"v{i}", "strategy": s, "model": m, "build": b, "gpt": SMALL, "save": True}
        for i, (s, m, b) in enumerate(VALUE_CASES)
    ]
    _, out = _setup(tmp_path_factory, "values", cases)
    return out


@pytest.mark.parametrize("index", range(len(VALUE_CASES)), ids=["-".join(c) for c in VALUE_CASES])
def test_initial_values_equal_a_single_process(values, index):
    strategy, model, build = VALUE_CASES[index]
    got = torch.load(values / f"v{index}_params.pt", weights_only=True)
    want = _single_process_gpt() if model == "gpt" else _single_process_mlp()
    assert set(got) == set(want), set(got) ^ set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{strategy} {model} built by {build}: {name} differs"


META_LAYOUTS = {  # label -> (world, strategy)
    "zero3": (2, "zero3"),
    "zero3_offload": (2, "zero3_offload"),
    "tp2": (2, "hybrid3d:tp=2"),
    "dp2-tp2-zero3": (4, "hybrid3d:dp=2,tp=2,zero_stage=3"),
    "pp2-tp2": (4, "hybrid3d:pp=2,tp=2,microbatches=2"),
    "pp2-dp2-zero3": (4, "hybrid3d:pp=2,dp=2,zero_stage=3,pp_schedule=gpipe"),
}


@pytest.fixture(scope="module")
def meta_runs(tmp_path_factory) -> Batch:
    case = [{**PARITY_CASES[0], "meta": True}]
    return Batch(tmp_path_factory, {label: (w, s, case) for label, (w, s) in META_LAYOUTS.items()}, tag="meta")


@pytest.mark.parametrize(
    "label", [pytest.param(k, marks=pytest.mark.slow) if w > 2 else k for k, (w, _) in META_LAYOUTS.items()]
)
def test_training_from_a_meta_build_matches_one_process(label, meta_runs, reference):
    world, strategy = META_LAYOUTS[label]
    run = meta_runs[label]
    for rank in range(world):
        assert run.case("plain", rank)["built_on"] == "meta", f"{label} rank {rank} built real tensors"
    tp = 2 if "tp=2" in strategy else 1
    pp = 2 if "pp=2" in strategy else 1
    leaders = list(range(0, world // pp, tp))  # one rank per dp index, on the first stage
    assert_same_losses(run.losses("plain", leaders), reference.losses("plain"), label)
    assert_same_params(run.params("plain"), reference.params("plain"), label)


# ----- without a process group: plain tensors, the reset units and the errors -----


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_meta_build_reset_replays_the_global_generator():
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    want = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).state_dict()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    torch.manual_seed(99)  # whatever ran since
    units = fill_meta_tensors(model, model, torch.device("cpu"), rng_state=state)
    assert units == ["0", "2"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def test_gpt_units_are_its_layers():
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.model = RecipeGPT(GPTConfig(**SMALL))

        def pipeline_layers(self):
            return self.model.layers()

    module = Wrapper()
    names = {n for n, _ in module.named_parameters()}
    units = [path for path, _ in reset_units(module, module, names)]
    assert units == ["model.embed", "model.blocks.0", "model.blocks.1", "model.head"]


def test_a_tensor_nothing_initializes_is_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), _NoReset())
    with pytest.raises(TypeError, match=r"\['1.scale'\] are built on the meta device .* _NoReset has no reset_param"):
        fill_meta_tensors(model, model, torch.device("cpu"))


def test_a_reset_that_leaves_a_tensor_unwritten_is_named():
    class Partial(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Parameter(torch.empty(2)), nn.Parameter(torch.empty(2))

        def reset_parameters(self) -> None:
            nn.init.ones_(self.a)

    with torch.device("meta"):
        model = nn.Sequential(Partial())
    with pytest.raises(TypeError, match=r"\['0.b'\] .* left them unwritten"):
        fill_meta_tensors(model, model, torch.device("cpu"))


def test_set_aside_and_back_keeps_tied_weights_tied():
    """Host and meta tensors share no type: moving between them makes new Parameters, which would untie a weight."""
    from lightning_parallel.parallel.materialize import set_aside

    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    want = model[0].weight.detach().clone()
    values = set_aside(model)
    assert model[0].weight.is_meta and model[0].weight is model[1].weight
    fill_meta_tensors(model, model, torch.device("cpu"), values)
    assert model[0].weight is model[1].weight and torch.equal(model[0].weight, want)
    assert len(list(model.parameters())) == 1
