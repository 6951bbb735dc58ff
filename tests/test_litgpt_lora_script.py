"""LitGPT's own LoRA fine-tuning script (``litgpt.finetune.lora.main``, unchanged) under this package's Fabric
strategies, on the tiny LitGPT checkpoint folder made locally (slow tier, one launch each at world 1, 2 and 4): its
logged loss at each optimizer step under zero3 (dp=2), hybrid3d tp=2, zero2 (dp=2, with the script's in-loop
validation and rank-0 generation), zero1 (dp=2), tp=2 x dp=2 and tp=2 x ZeRO-3 dp=2 equals the same script in one
process, within 1e-5; the LoRA file it saves (``lit_model.pth.lora``) is the one-process file; the ``lit_model.pth``
its final ``merge_lora`` writes loads into LitGPT's plain ``GPT`` and equals the one-process one. Lightning's
``ModelParallelStrategy`` (the script's own choice) runs on CPU/gloo at dp=2 too: its losses equal until the first
update takes effect, then not, since its ``empty_init=True`` materialization draws other initial adapters than one
process (ours replays them); given one process's values before its ``parallelize_fn``, it equals throughout.

Fast tier: the meta-device build draws one process's values (the mechanism behind the equal adapters) and the
stand-in for the CLI-only ``save_hyperparameters`` feeds LitGPT's ``merge_lora``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import Batch
from litgpt import GPT as PlainGPT
from litgpt.lora import GPT, Config
from litgpt.scripts.merge_lora import load_lora_metadata
from parity import assert_same_losses, assert_same_params
from torch import nn

from lightning_parallel.litgpt.fabric import hyperparameters_writer, litgpt_protocol
from lightning_parallel.parallel.materialize import fill_meta_tensors
from lightning_parallel.recipes.finetune_assets import make_default_assets

LORA_FLAGS = dict(lora_r=2, lora_query=True, lora_key=False, lora_value=True, lora_projection=True)
LORA_FLAGS |= dict(lora_mlp=True, lora_head=True)


def _tiny(mlp: str) -> Config:
    sizes = dict(n_layer=2, n_head=4, n_query_groups=2, n_embd=32, block_size=16, intermediate_size=64)
    return Config(**sizes, padded_vocab_size=64, vocab_size=64, mlp_class_name=mlp, **LORA_FLAGS)


def _built_on_meta(build, seed: int = 1, prepare=None) -> tuple[dict, dict]:
    """(one process's state dict, the state dict of the same build on meta filled by its reset units)."""
    torch.manual_seed(seed)
    want = build().state_dict()
    torch.manual_seed(seed)
    state = torch.random.get_rng_state()
    with torch.device("meta"):
        model = build()
    if prepare is not None:
        prepare(model)
    torch.manual_seed(seed + 1)  # whatever ran since
    fill_meta_tensors(model, model, torch.device("cpu"), rng_state=state)
    return want, model.state_dict()


@pytest.mark.parametrize("mlp", ["GptNeoxMLP", "LLaMAMLP"])
def test_lora_gpt_built_on_meta_gets_one_process_values(mlp):
    want, got = _built_on_meta(lambda: GPT(_tiny(mlp)), prepare=litgpt_protocol)
    assert_same_params(got, want, f"litgpt.lora.GPT ({mlp}) on meta", atol=0.0)


def test_a_unit_draws_after_the_units_inside_it_and_its_writes_stand():
    class Adapted(nn.Module):  # LitGPT's LoRALinear pattern: the child first, the own tensor drawn last
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.extra = nn.Parameter(torch.empty(2, 4))
            self.reset_parameters()

        def reset_parameters(self) -> None:
            nn.init.normal_(self.extra)
            nn.init.zeros_(self.linear.bias)  # a write over the child's draw, as in one process

    want, got = _built_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), Adapted(), nn.Linear(4, 2)))
    assert torch.equal(want["1.linear.bias"], torch.zeros(4))
    assert_same_params(got, want, "nested reset units", atol=0.0)


def test_hyperparameters_writer_feeds_merge_lora(tmp_path):
    save = hyperparameters_writer(checkpoint_dir=tmp_path / "base", precision="32-true", **LORA_FLAGS)
    save(None, tmp_path)
    params, base, precision = load_lora_metadata(tmp_path)
    assert params == LORA_FLAGS and base == tmp_path / "base" and precision == "32-true"


# ----- the script itself (slow) -----


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> Batch:
    assets = str(make_default_assets(tmp_path_factory.mktemp("assets") / "finetune")[0].parent)
    case = {"name": "lora", "steps": 3, "global_batch": 4, "assets": assets}
    looped = {**case, "eval_interval": 2}  # validation, then generation on rank 0, after step 2
    runs = {
        "reference": (1, "ddp", [looped]),
        "zero3": (2, "zero3", [{**case, "dp": 2}]),
        "tp2": (2, "hybrid3d:tp=2", [case]),  # dp=1: the script's "devices" is 1
        "zero2": (2, "zero2", [{**looped, "dp": 2}]),
        "zero1": (2, "zero1", [{**case, "dp": 2}]),
        "lightning": (2, "modelparallel", [{**case, "dp": 2}]),
        "lightning_same_init": (2, "modelparallel:same_init", [{**case, "dp": 2}]),
        "tp2_dp2": (4, "hybrid3d:tp=2", [{**case, "dp": 2}]),
        "tp2_zero3": (4, "hybrid3d:tp=2,zero_stage=3", [{**case, "dp": 2}]),
    }
    return Batch(tmp_path_factory, runs, tag="litgpt_lora", worker="litgpt_lora")


def _saved(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["zero3", "tp2", "zero2", "zero1", "tp2_dp2", "tp2_zero3"])
def test_litgpt_lora_script_matches_one_process(scripts, label):
    run, ref = scripts[label], scripts["reference"]
    want = ref.case("lora")
    assert len(want["losses"]) == 3
    # the script logs each rank's running mean over its micro-batches of the step: their mean is the step's loss
    assert_same_losses(run.losses("lora"), want["losses"], f"litgpt finetune/lora.py under {label}")
    got = run.case("lora")
    assert all(math.isfinite(v) for v in got["val"]) and len(got["val"]) == len(want["val"]) - (label != "zero2")
    if label == "tp2":  # one data-parallel rank: the final validation sees the one-process samples
        assert_same_losses(got["val"][-1:], want["val"][-1:], f"{label} final validation")
    lora = _saved(got["lora_file"])["model"]
    assert lora and all("lora_" in k for k in lora)
    assert_same_params(lora, _saved(want["lora_file"])["model"], f"{label}: lit_model.pth.lora")
    merged = _saved(got["merged_file"])
    assert_same_params(merged, _saved(want["merged_file"]), f"{label}: merged lit_model.pth")
    PlainGPT(Config.from_file(Path(got["merged_file"]).parent / "model_config.yaml")).load_state_dict(merged)


@pytest.mark.slow
def test_lightning_model_parallel_runs_the_script_with_other_initial_adapters(scripts):
    run, ref = scripts["lightning"], scripts["reference"]
    got, want = run.losses("lora"), ref.case("lora")["losses"]
    # steps 1 and 2 see the initial model (lora_B is zero; the script's one warmup step has learning rate 0)
    assert_same_losses(got[:2], want[:2], "ModelParallelStrategy before its adapters act")
    # then its adapters act: empty_init=True gave it other lora_A values than one process draws
    assert abs(got[2] - want[2]) / want[2] > 1e-5
    lora, one = _saved(run.case("lora")["lora_file"])["model"], _saved(ref.case("lora")["lora_file"])["model"]
    assert (lora["lm_head.lora_A"] - one["lm_head.lora_A"]).abs().max() > 1e-2


@pytest.mark.slow
def test_lightning_model_parallel_from_one_process_values_matches(scripts):
    run, ours = scripts["lightning_same_init"], scripts["zero3"]
    # the model filled with one process's values before the script's parallelize_fn: nothing else differs
    assert_same_losses(run.losses("lora"), scripts["reference"].case("lora")["losses"], "ModelParallelStrategy")
    for rank in range(2):  # each dp rank's own micro-batches, as under zero3
        assert_same_losses(run.case("lora", rank)["losses"], ours.case("lora", rank)["losses"], f"rank {rank}")
    lora, want = _saved(run.case("lora")["lora_file"]), _saved(scripts["reference"].case("lora")["lora_file"])
    assert_same_params(lora["model"], want["model"], "ModelParallelStrategy: lit_model.pth.lora")
