"""LitGPTCausalLM(lora={...}): LitGPT's own LoRA (``litgpt.lora.GPT``, its settings by their names) on a frozen base
under ZeRO 0-3, tp=2 (with and without sequence parallelism) and pp=2 (1f1b, zero bubble, interleaved; x tp=2),
against the same LitGPT LoRA model (same adapter initialization, loaded as litgpt's finetune/lora.py loads it) trained
in one process by a plain loop; what each rank holds for the frozen base; the plan each LoRA layer gets; bad input
refused before any worker starts."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from causal_lm_parity import CLIP, check, check_frozen_base, launch, train_reference
from conftest import Batch
from parity import PARAM_ATOL
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel import Hybrid3DStrategy
from lightning_parallel.litgpt import LitGPTCausalLM, litgpt_tensor_parallel_plan
from lightning_parallel.litgpt.plan import GroupedQKVColwise, LitLoRAParallel
from lightning_parallel.strategies.checks import check_model

litgpt_lora = pytest.importorskip("litgpt.lora")  # make install installs the litgpt extra
from litgpt.config import Config  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402
from test_litgpt_parity import CONFIGS, folders  # noqa: E402, F401  (the tiny checkpoint folders, written once)

EVERY_BLOCK_LAYER = {"lora_query": True, "lora_key": True, "lora_value": True, "lora_projection": True,
                     "lora_mlp": True}  # fmt: skip
# model key -> (model folder, LitGPT LoRA settings): "qv head" adapts q and v of the fused projection only (the
# adapter output padded into the q and v columns) and the vocabulary head; neox has biases and no grouped queries
LORA = {
    "llama": ("llama", {"lora_r": 4, "lora_alpha": 8, **EVERY_BLOCK_LAYER}),
    "llama qv head": ("llama", {"lora_r": 4, "lora_alpha": 8, "lora_query": True, "lora_value": True,
                                "lora_head": True}),
    "neox": ("neox", {"lora_r": 2, "lora_alpha": 4, **EVERY_BLOCK_LAYER, "lora_head": True}),
}  # fmt: skip

# label -> (world, strategy spec, model key, tp), as tests/test_litgpt_parity.py; "clip" clips the gradient norm
FAST = {
    "llama lora zero2 clip": (2, "zero2", "llama", 1),
    "llama lora tp2 clip": (2, "hybrid3d:tp=2", "llama", 2),
}
SLOW = {
    "llama lora zero0": (2, "hybrid3d:zero_stage=0", "llama", 1),
    "llama lora zero1": (2, "zero1", "llama", 1),
    "llama lora zero3 clip": (2, "zero3", "llama", 1),
    "llama lora tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "llama", 2),
    "llama qv head lora tp2 clip": (2, "hybrid3d:tp=2", "llama qv head", 2),
    "llama qv head lora zero3": (2, "zero3", "llama qv head", 1),
    "neox lora tp2": (2, "hybrid3d:tp=2", "neox", 2),
    "neox lora tp2 sp clip": (2, "hybrid3d:tp=2,sequence_parallel=1", "neox", 2),
    "neox lora zero2": (2, "zero2", "neox", 1),
    "llama lora dp2 x tp2 zero3 accum": (4, "hybrid3d:tp=2,zero_stage=3", "llama", 2),
    "llama lora pp2 1f1b clip": (2, "hybrid3d:pp=2", "llama", 1),
    "neox lora pp2 zero_bubble": (2, "hybrid3d:pp=2,pp_schedule=zero_bubble", "neox", 1),
    "llama qv head lora pp2 interleaved_1f1b": (2, "hybrid3d:pp=2,pp_schedule=interleaved_1f1b", "llama qv head", 1),
    "llama lora pp2 x tp2": (4, "hybrid3d:pp=2,tp=2", "llama", 2),
}


def lora_runs(tmp_path_factory, folders: dict, runs: dict, tag: str) -> Batch:  # noqa: F811
    paths = {key: folders[folder] for key, (folder, _) in LORA.items()}
    extra = {key: {"lora": settings} for key, (_, settings) in LORA.items()}
    return launch(tmp_path_factory, paths, runs, tag, "litgpt", extra=extra)


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders) -> Batch:  # noqa: F811
    return lora_runs(tmp_path_factory, folders, FAST, "litgpt_lora")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders) -> Batch:  # noqa: F811
    return lora_runs(tmp_path_factory, folders, SLOW, "litgpt_lora_slow")


def litgpt_lora_model(key: str, folder: str) -> torch.nn.Module:
    """The model as litgpt's finetune/lora.py builds it, from LitGPT's pieces alone: ``litgpt.lora.GPT`` of the
    folder's config with the settings, drawn from seed 0 (the module's adapter_seed), the base checkpoint loaded
    with ``strict=False``, only the adapters trainable."""
    config = litgpt_lora.Config(**asdict(Config.from_file(f"{folder}/model_config.yaml")), **LORA[key][1])
    torch.manual_seed(0)
    model = litgpt_lora.GPT(config)
    model.load_state_dict(torch.load(f"{folder}/lit_model.pth", weights_only=True), strict=False)
    litgpt_lora.mark_only_lora_as_trainable(model)
    return model


class References(dict):
    """(model key, clip) -> LitGPT's GPT and loss (``chunked_cross_entropy`` on shifted targets) in a plain loop,
    trained when first asked for (the fast tier trains only the keys it checks)."""

    def __init__(self, folders: dict[str, str]) -> None:  # noqa: F811
        super().__init__()
        self.folders = folders

    def __missing__(self, key: tuple[str, float | None]):
        model = litgpt_lora_model(key[0], self.folders[LORA[key[0]][0]])
        self[key] = train_reference(
            model, model.config.vocab_size,
            lambda m, ids: chunked_cross_entropy(m(ids)[:, :-1], ids[:, 1:], chunk_size=0),
            LitGPTCausalLM.__init__.__defaults__, key[1],
        )  # fmt: skip
        return self[key]


@pytest.fixture(scope="module")
def references(folders) -> References:  # noqa: F811
    return References(folders)


def check_lora_run(runs: Batch, label: str, spec: tuple, references: dict, folders: dict) -> None:  # noqa: F811
    """Losses and adapters as the reference's; the frozen base bitwise as the checkpoint holds it."""
    check(runs, label, spec, references)
    got = runs[label].params("train")
    key = spec[2]
    initial = litgpt_lora_model(key, folders[LORA[key][0]]).state_dict()
    base = {f"model.{k}": v for k, v in initial.items() if "lora_" not in k}
    adapters = [k for k in got if "lora_" in k]
    assert adapters and len(base) + len(adapters) == len(got)
    changed = [k for k, v in base.items() if not torch.equal(got[k], v)]
    assert not changed, f"{label}: frozen base parameters changed: {changed[:5]}"


@pytest.mark.parametrize("label", list(FAST))
def test_litgpt_lora_parity(label, fast_runs, references, folders):  # noqa: F811
    check_lora_run(fast_runs, label, FAST[label], references, folders)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_litgpt_lora_parity_wider(label, slow_runs, references, folders):  # noqa: F811
    check_lora_run(slow_runs, label, SLOW[label], references, folders)


@pytest.mark.parametrize("key", [pytest.param(k, marks=[] if k == "llama" else pytest.mark.slow) for k in LORA])
def test_clipping_is_active_in_the_litgpt_lora_reference(key, references):
    """A "clip" run that did not clip would fail parity: clipping moves the reference's adapters far more than the
    tolerance."""
    plain, clipped = references[key, None][1], references[key, CLIP][1]
    assert max((plain[k] - clipped[k]).abs().max().item() for k in plain) > 20 * PARAM_ATOL


def check_frozen_base_holds_nothing(runs: Batch, label: str, spec: tuple) -> None:
    check_frozen_base(runs, label, spec, [p for p in small(spec[2]).parameters() if p.requires_grad])


@pytest.mark.parametrize("label", list(FAST))
def test_litgpt_frozen_base_has_no_gradient_or_optimizer_state(label, fast_runs):
    check_frozen_base_holds_nothing(fast_runs, label, FAST[label])


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_litgpt_frozen_base_has_no_gradient_or_optimizer_state_wider(label, slow_runs):
    check_frozen_base_holds_nothing(slow_runs, label, SLOW[label])


# ----- no process group -----


def small(key: str, **settings) -> LitGPTCausalLM:
    """The model key's LoRA module on a base config with its own initialization (no folder)."""
    torch.manual_seed(0)
    return LitGPTCausalLM(CONFIGS[LORA[key][0]](), lora={**LORA[key][1], **settings})


def test_module_builds_litgpts_lora_model_and_freezes_the_base(folders):  # noqa: F811
    module = LitGPTCausalLM(folders["llama"], lora=LORA["llama"][1])
    assert type(module.model) is litgpt_lora.GPT and module.has_lora
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert "model.transformer.h.0.attn.qkv.lora_A" in trainable and "model.lm_head.lora_A" not in trainable
    assert all(n.rpartition(".")[2] in ("lora_A", "lora_B") for n in trainable)
    optimized = {id(p) for g in module.configure_optimizers().param_groups for p in g["params"]}
    assert optimized == {id(p) for p in module.parameters() if p.requires_grad}
    # the base as the checkpoint holds it, the adapters as litgpt's own build draws them from seed 0
    want = litgpt_lora_model("llama", folders["llama"]).state_dict()
    assert all(torch.equal(v, want[k.removeprefix("model.")]) for k, v in module.state_dict().items())
    torch.manual_seed(1)  # the adapters come from adapter_seed, whatever the global generator holds
    state = torch.get_rng_state()
    again = LitGPTCausalLM(folders["llama"], lora=LORA["llama"][1])
    assert torch.equal(torch.get_rng_state(), state)
    name = "transformer.h.1.mlp.fc_1.lora_A"
    assert torch.equal(module.model.get_parameter(name), again.model.get_parameter(name))
    other = LitGPTCausalLM(folders["llama"], lora=LORA["llama"][1], adapter_seed=1)
    assert not torch.equal(module.model.get_parameter(name), other.model.get_parameter(name))


def test_litgpts_own_lora_config_and_model_are_taken_as_they_are():
    config = litgpt_lora.Config(**asdict(CONFIGS["neox"]()), lora_r=2, lora_query=True)
    module = LitGPTCausalLM(config)
    assert type(module.model) is litgpt_lora.GPT and module.model.config.lora_r == 2
    model = litgpt_lora.GPT(config)
    assert LitGPTCausalLM(model).model is model and not model.lm_head.linear.weight.requires_grad
    assert not LitGPTCausalLM(CONFIGS["neox"]()).has_lora


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_plan_gives_lora_layers_their_base_style(sequence_parallel):
    model = small("llama qv head").model
    plan = litgpt_tensor_parallel_plan(model, sequence_parallel)
    block = "transformer.h.*"
    assert set(plan) == set(litgpt_tensor_parallel_plan(small_base("llama"), sequence_parallel))
    for path in (f"{block}.mlp.fc_1", f"{block}.mlp.fc_2", "lm_head"):
        assert isinstance(plan[path], LitLoRAParallel) and plan[path].kind == "col", path
        assert isinstance(plan[path].base_style, ColwiseParallel)
    for path in (f"{block}.mlp.proj", f"{block}.attn.proj"):
        assert isinstance(plan[path], LitLoRAParallel) and plan[path].kind == "row", path
        assert isinstance(plan[path].base_style, RowwiseParallel)
    assert isinstance(plan[f"{block}.attn.qkv"], GroupedQKVColwise)
    assert type(plan["transformer.wte"]) is RowwiseParallel
    assert plan["lm_head"].local_output is False  # the logits stay split for the vocabulary-parallel loss


def small_base(folder: str):
    return LitGPTCausalLM(CONFIGS[folder]()).model


def test_lora_placements_follow_the_base_layer():
    """Row-parallel base: weight and lora_A split on the input features, lora_B whole; column-parallel base: weight,
    bias and lora_B split on the output features, lora_A whole."""
    model = small("neox").model
    plan = litgpt_tensor_parallel_plan(model)
    pairs = [("linear", "weight"), ("linear", "bias"), ("", "lora_A"), ("", "lora_B")]
    for path, want in (("mlp.proj", ["S(1)", "R", "S(1)", "R"]), ("mlp.fc", ["S(0)", "S(0)", "R", "S(0)"])):
        style, layer = plan[f"transformer.h.*.{path}"], model.transformer.h[0].get_submodule(path)
        assert [str(style._placement(name, p, layer)) for name, p in pairs] == want, path


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"lora_rank": 4}, r"\['lora_rank'\] are not LitGPT LoRA settings.*'lora_r', 'lora_alpha'"),
        ({"lora_r": 0, "lora_query": True}, r"lora_r=0; set the adapters' rank lora_r >= 1"),
        ({"lora_r": 4}, r"adapts no layer: set at least one of \['lora_query', 'lora_key'.*'lora_head'\]"),
    ],
)
def test_bad_lora_settings_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        LitGPTCausalLM(CONFIGS["llama"](), lora=settings)


def test_lora_on_a_model_with_adapters_already_is_refused():
    model = litgpt_lora.GPT(litgpt_lora.Config(**asdict(CONFIGS["neox"]()), lora_r=2, lora_query=True))
    with pytest.raises(ValueError, match=r"has adapters already: pass lora=None"):
        LitGPTCausalLM(model, lora={"lora_r": 4, "lora_value": True})


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        ({"cp": 2}, r"cp=2 with LitGPTCausalLM\(lora=...\) is not supported yet.*set cp=1"),
        ({"ep": 2}, r"ep=2 with LitGPTCausalLM\(lora=...\) is not supported yet.*set ep=1"),
        ({"tp": 2}, r"lora_dropout=0.05 with tp=2 is not supported yet: set lora_dropout=0.0"),
    ],
)
def test_layouts_not_supported_yet_are_refused_before_launch(layout, match):
    module = small("llama", lora_dropout=0.05)
    strategy = Hybrid3DStrategy(**layout)
    with pytest.raises(ValueError, match=match):
        check_model(module, strategy.config, strategy.config.dims(2))
