"""HFCausalLM(peft_config=LoraConfig(...)) under pipeline parallelism (every schedule; a stage that holds no adapter;
a frozen embedding tied to the head across stages) and the composite layouts (pp x tp, dp x tp with ZeRO-3, HSDP),
against the same peft model trained in one process (tests/test_hf_lora.py's reference and checks)."""

from __future__ import annotations

import pytest
import torch
import transformers
from causal_lm_parity import launch
from test_device_hygiene import world  # noqa: F401  (the fixture: a one-rank gloo world)
from test_hf_lora import (
    LORA,
    MODELS,
    check_frozen_base_holds_nothing,
    check_lora_run,
    folders,  # noqa: F401  (the fixture: a folder per model of MODELS)
    lora_config,
    plain_lora_training,
    small,
)
from test_hf_parity import CONFIGS, WORLD8
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_parallel import Hybrid3DStrategy
from lightning_parallel._compat import StridedShard
from lightning_parallel.hf import HFCausalLM
from lightning_parallel.parallel.data.fsdp import shard_dim_of
from lightning_parallel.parallel.pipeline.schedules import SCHEDULES
from lightning_parallel.parallel.pipeline.split import StageModule
from lightning_parallel.parallel.pipeline.tied import TiedGradients
from lightning_parallel.strategies.checks import check_model

# More adapted models, put into test_hf_lora's LORA and MODELS while this module's tests run
VARIANTS = {
    # the adapters on the head only: pp's first stage (embedding and blocks) holds none
    "llama head": (CONFIGS["llama"], {**LORA["llama"], "target_modules": ["lm_head"]}),
    # an adapted embedding (peft's lora.Embedding in the first pipeline layer's place)
    "llama embed": (CONFIGS["llama"], {**LORA["llama"], "target_modules": ["embed_tokens", "q_proj"]}),
    # the frozen embedding tied to the frozen head, on two stages
    "llama tied": (lambda: transformers.LlamaConfig(**{**CONFIGS["llama"]().to_diff_dict(),
                                                        "tie_word_embeddings": True}), LORA["llama"]),
}  # fmt: skip

# label -> (world, strategy spec, model, tp). Llama's 5 pipeline layers split 3 + 2: the last stage (final norm and
# head) holds no adapter in every "llama" run
FAST = {
    "llama lora pp2 1f1b clip": (2, "hybrid3d:pp=2", "llama", 1),
}
SLOW = {
    "llama lora pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "llama", 2),
    "gpt2 lora dp2 x tp2 zero3 clip": (4, "hybrid3d:tp=2,zero_stage=3", "gpt2", 2),
    "llama lora hsdp 2x2 zero3": (4, "hybrid3d:dp_shard=2,zero_stage=3", "llama", 1),
    "llama lora pp2 gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "llama", 1),
    "llama lora pp2 interleaved_1f1b clip": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "llama", 1),
    "llama lora pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "llama", 1),
    "llama head lora pp2 1f1b": (2, "hybrid3d:pp=2", "llama head", 1),
    "llama head lora pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "llama head", 1),
    "llama tied lora pp2 1f1b clip": (2, "hybrid3d:pp=2", "llama tied", 1),
    "llama embed lora pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "llama embed", 1),
    "gpt2 lora pp2 1f1b": (2, "hybrid3d:pp=2", "gpt2", 1),
    "gpt2 lora pp2 gpipe clip": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "gpt2", 1),
    "gpt2 lora pp2 interleaved_1f1b": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "gpt2", 1),
    "gpt2 lora pp2 zero_bubble clip": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "gpt2", 1),
    "gpt2 lora pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "gpt2", 2),
    "llama lora dp2 x tp2 zero3": (4, "hybrid3d:tp=2,zero_stage=3", "llama", 2),
    "llama lora hsdp 2x2 zero2 clip": (4, "hybrid3d:dp_shard=2,zero_stage=2", "llama", 1),
}

# every (pp, dp, tp) split of world 8 the tiny Llama takes, ZeRO-3 (tests/test_hf_parity.py's), with adapters
WORLD8_LORA = {label.replace("llama", "llama lora"): spec for label, spec in WORLD8.items()}
# runs in which some pp rank holds no adapter at all (its stages' weights all frozen): checked to stay so
NO_ADAPTER_RANK = {
    "llama lora pp2 1f1b clip", "llama lora pp2 x tp2", "llama head lora pp2 1f1b", "llama head lora pp2 zero_bubble",
    "gpt2 lora pp2 zero_bubble clip",
}  # fmt: skip


def check_layout_run(runs, label: str, spec: tuple, references: dict, folders: dict) -> None:  # noqa: F811
    check_lora_run(runs, label, spec, references, folders)
    check_frozen_base_holds_nothing(runs, label, spec)
    if label in NO_ADAPTER_RANK:
        held = [runs[label].case("train", rank)["trainable_numel"] for rank in range(spec[0])]
        assert 0 in held, f"{label}: every rank holds adapters ({held}), the run no longer tests a rank without"


@pytest.fixture(scope="module", autouse=True)
def variants():
    with pytest.MonkeyPatch.context() as patch:
        for name, (config, lora) in VARIANTS.items():
            patch.setitem(MODELS, name, config)
            patch.setitem(LORA, name, lora)
        yield


@pytest.fixture(scope="module")
def references(folders) -> dict:  # noqa: F811
    """test_hf_lora's single-process references, each computed the first time a test asks for it."""

    class Lazy(dict):
        def __missing__(self, key: tuple) -> tuple:
            self[key] = plain_lora_training(key[0], folders[key[0]], key[1])
            return self[key]

    return Lazy()


def lora_launch(tmp_path_factory, folders: dict, runs: dict, tag: str):  # noqa: F811
    return launch(tmp_path_factory, folders, runs, tag, "hf", extra={m: {"lora": c} for m, c in LORA.items()})


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders):  # noqa: F811
    return lora_launch(tmp_path_factory, folders, FAST, "lora_layouts")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders):  # noqa: F811
    return lora_launch(tmp_path_factory, folders, SLOW, "lora_layouts_slow")


@pytest.mark.parametrize("label", list(FAST))
def test_lora_layout_parity(label, fast_runs, references, folders):  # noqa: F811
    check_layout_run(fast_runs, label, FAST[label], references, folders)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_lora_layout_parity_wider(label, slow_runs, references, folders):  # noqa: F811
    check_layout_run(slow_runs, label, SLOW[label], references, folders)


@pytest.fixture(scope="module")
def world8_runs(tmp_path_factory, folders):  # noqa: F811
    return lora_launch(tmp_path_factory, folders, WORLD8_LORA, "lora_layouts_w8")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(WORLD8_LORA))
def test_lora_parity_every_world8_split(label, world8_runs, references, folders):  # noqa: F811
    check_layout_run(world8_runs, label, WORLD8_LORA[label], references, folders)


# ----- no process group -----


def test_the_runs_named_to_hold_a_rank_without_adapters_exist():
    assert NO_ADAPTER_RANK <= FAST.keys() | SLOW.keys()


def test_pp_with_adapters_passes_the_checks_before_launch():
    module = HFCausalLM(small("llama"), peft_config=lora_config("llama"))
    for schedule in SCHEDULES:
        strategy = Hybrid3DStrategy(pp=2, pp_schedule=schedule)
        check_model(module, strategy.config, strategy.config.dims(2))


@pytest.mark.parametrize("asks", [False, True])
def test_a_stage_output_no_gradient_flows_into_asks_for_one_under_split_backward(asks):
    """Zero bubble's input-gradient pass finds the next stage's adapters only through an input that asks for a
    gradient; a frozen stage's output asks for one only when the schedule splits the backward."""
    frozen = nn.Linear(4, 4).requires_grad_(False)
    stage = StageModule([frozen])
    stage.output_asks_grad = asks
    out = stage(torch.randn(2, 4))
    assert out.requires_grad == asks and out.is_leaf
    with torch.no_grad():
        assert not stage(torch.randn(2, 4)).requires_grad  # forward-only passes stay without autograd
    trained = StageModule([nn.Linear(4, 4)])
    trained.output_asks_grad = True
    assert trained(torch.randn(2, 4)).grad_fn is not None  # a gradient flows in already: the graph is kept


def test_a_frozen_tied_weight_gets_no_gradient_from_the_pp_reduction(world):  # noqa: F811
    """A frozen embedding tied to the head (a LoRA base) has no gradient on any stage: the reduction leaves it None
    (a zero gradient would make it look trained) and still sums the trained tied weights."""
    root = nn.ModuleDict({"embed": nn.Linear(2, 3), "head": nn.Linear(2, 3)})
    for layer in root.values():
        layer.weight.requires_grad_(False)
        layer.bias.grad = torch.ones(3)
    tied = TiedGradients(root, [["embed.weight", "head.weight"], ["embed.bias", "head.bias"]], world)
    tied.reduce()
    assert all(layer.weight.grad is None for layer in root.values())
    assert all(torch.equal(layer.bias.grad, torch.full((3,), 2.0)) for layer in root.values())


def test_zero3_shards_a_matrix_tp_splits_part_by_part_on_its_other_dim(world):  # noqa: F811
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    fused_b = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [StridedShard(0, split_factor=3)]))
    assert shard_dim_of(fused_b) == Shard(1)  # LoRA's B of GPT-2's c_attn
    split_b = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    fused_bias = nn.Parameter(distribute_tensor(torch.randn(6), mesh, [StridedShard(0, split_factor=3)]))
    plain = nn.Parameter(torch.ones(2, 2))
    assert shard_dim_of(split_b) is None and shard_dim_of(fused_bias) is None and shard_dim_of(plain) is None
