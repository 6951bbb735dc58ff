"""The analytic planner prints recipe overrides the recipe accepts, and proposes nothing the model's family refuses:
a 70B-shaped Llama config at 256 GPUs, its top proposal's overrides through the recipe's composition and
pre-launch checks as printed (world 256, the 70B config on the meta device) and at world 2 on a tiny Llama of the
same family (the slow variant trains 2 steps with them). ``strategy=auto`` plans the same models in the recipe
(``model=hf``, ``model=litgpt``) within what their family and ``peft=lora`` take."""

from __future__ import annotations

import functools
import json
import math

import pytest
import transformers
from recipe_runs import GPT, run_recipe
from test_recipe_configs import compose_gpt

from lightning_parallel.hf.plan import SP_WITH_PP
from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.plan import main
from lightning_parallel.planning.layout import Layout, Workload, recipe_overrides
from lightning_parallel.planning.scale_cli import format_scale_table
from lightning_parallel.recipes.auto import resolve_auto
from lightning_parallel.recipes.family import family_refusal, recipe_model_refusal
from lightning_parallel.recipes.gpt import check_config

LLAMA_70B = {  # Llama-3.1-70B's config.json shape
    "vocab_size": 128256,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
TINY = {  # the same family: Llama, grouped-query attention
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,  # 8 pipeline stages: pp=2 with the 4 interleaved stages per rank proposed
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
PLAN = ["--gpus", "256", "--device", "h100", "--seq-len", "8192", "--global-batch-tokens", "4M"]


def llama_folder(path, fields: dict) -> str:
    transformers.LlamaConfig(**fields).save_pretrained(path)  # config.json only: fresh weights
    return str(path)


@pytest.fixture(scope="module")
def plan_70b(tmp_path_factory) -> dict:
    """``plan`` on the 70B config, as JSON (the table prints the same rows: :func:`format_scale_table`)."""
    folder = llama_folder(tmp_path_factory.mktemp("llama70b") / "llama70b", LLAMA_70B)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([folder, *PLAN, "--precision", "bf16-mixed", "--top", "12", "--json"]) == 0
    return {"folder": folder, **json.loads(out.getvalue())}


def test_no_proposal_is_refused_by_the_family(plan_70b):
    layouts = [Layout(**r["layout"]) for r in plan_70b["layouts"]]
    assert len(layouts) == 12
    assert not [x for x in layouts if x.pp > 1 and x.tp > 1 and x.sequence_parallel]
    assert [x for x in layouts if x.pp > 1 and x.tp > 1]  # tp x pp is still proposed: without it
    refuses = family_refusal(plan_70b["folder"])
    assert refuses(Layout(tp=2, pp=2, dp=64, sequence_parallel=True)) == SP_WITH_PP
    assert "ep=2 splits the experts of MoE models" in refuses(Layout(tp=2, pp=2, dp=64, ep=2))
    assert refuses(Layout(tp=3, dp=1)).startswith("tp=3")  # tp must divide the heads (the planner's own rule too)
    assert not any(refuses(x) for x in layouts)


def test_a_given_layout_is_completed_within_what_the_family_takes(plan_70b, capsys):
    """A layout given with pp x tp is completed and printed; one asking for sequence parallelism too is refused
    with the family's reason (unfiltered, the search ranked two such layouts 5th and 6th for this config)."""
    folder = plan_70b["folder"]
    assert main([folder, *PLAN, "--layout", "tp=2,pp=2,dp=32,cp=2,zero_stage=3", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["layouts"]
    assert row["layout"]["sequence_parallel"] is False and "strategy.pp=2" in row["overrides"]
    assert main([folder, *PLAN, "--layout", "tp=2,pp=2,dp=32,cp=2,sequence_parallel=true"]) == 2
    assert SP_WITH_PP in capsys.readouterr().err


def test_litgpt_names_are_searched_within_what_their_family_takes(capsys):
    refuses = family_refusal("pythia-160m")
    assert "not supported for LitGPT models" in refuses(Layout(tp=2, pp=2, dp=4, sequence_parallel=True))
    assert refuses(Layout(tp=2, pp=2, dp=4)) == "" and "has none" in refuses(Layout(dp=16, ep=2))
    args = ["--gpus", "16", "--seq-len", "2048", "--global-batch-size", "64", "--top", "40", "--json"]
    assert main(["pythia-160m", *args]) == 0
    layouts = [Layout(**r["layout"]) for r in json.loads(capsys.readouterr().out)["layouts"]]
    assert [x for x in layouts if x.pp > 1 and x.tp > 1] and [x for x in layouts if x.sequence_parallel]
    assert not [x for x in layouts if x.pp > 1 and x.tp > 1 and x.sequence_parallel]


def test_litgpt_lora_proposals_leave_out_what_its_adapters_refuse(capsys):
    """LitGPT's LoRA refuses cp and ep: with --lora-rank the long-sequence search proposes no cp (without it, most of
    its top 40 split the sequence)."""
    args = ["pythia-160m", "--gpus", "64", "--seq-len", "16384", "--global-batch-size", "64", "--top", "40", "--json"]
    counts = []
    for lora in ([], ["--lora-rank", "8"]):
        assert main([*args, *lora]) == 0
        layouts = [Layout(**r["layout"]) for r in json.loads(capsys.readouterr().out)["layouts"]]
        counts.append(sum(x.cp > 1 for x in layouts))
        assert layouts and not any(x.ep > 1 for x in layouts)
    assert counts[0] > 0 and counts[1] == 0, counts
    assert "cp=2 with LitGPTCausalLM(lora=...)" in family_refusal("pythia-160m", lora=True)(Layout(cp=2, dp=32))


def test_overrides_print_and_keep_the_plan(plan_70b):
    table = format_scale_table(plan_70b)
    for row in plan_70b["layouts"]:
        assert f"recipe: {' '.join(row['overrides'])}" in table
        settings = dict(item.split("=", 1) for item in row["overrides"])
        assert settings["strategy"] == "hybrid3d" and settings["trainer.devices"] == "8"
        assert int(settings["trainer.num_nodes"]) * 8 == 256 and settings["precision"] == "bf16-mixed"
        x = Layout(**row["layout"])
        assert int(settings["strategy.dp"]) == x.dp and int(settings.get("strategy.tp", 1)) == x.tp
        assert int(settings.get("strategy.pp", 1)) == x.pp and int(settings.get("strategy.cp", 1)) == x.cp
        strategy: dict = {}  # the printed strategy.* keys, sections (pipeline.virtual_stages) as nested mappings
        for k, v in settings.items():
            *sections, key = k.split(".")
            if sections and sections[0] == "strategy":
                functools.reduce(lambda node, name: node.setdefault(name, {}), sections[1:], strategy)[key] = _typed(v)
        config = ParallelConfig.from_mapping(strategy)
        warnings: list[str] = []
        config.validate(warn=warnings.append)  # nothing printed that the strategy would ignore
        assert not warnings, (row["overrides"], warnings)
        assert config.dims(256).world_size == 256


def test_microbatches_and_defaults():
    work = Workload(seq_len=4096, global_batch=64, precision="32-true")
    pipelined = Layout(tp=2, pp=2, dp=2, pp_schedule="interleaved_1f1b", microbatches=8, overlap_grad_reduce=True)
    got = recipe_overrides(pipelined, work, gpus_per_node=4)
    assert got == [
        "strategy=hybrid3d",
        "strategy.dp=2",
        "strategy.pp=2",
        "strategy.tp=2",
        "strategy.pp_schedule=interleaved_1f1b",
        "strategy.microbatches=8",
        "strategy.grad_reduce.overlap=true",
        "precision=32-true",
        "model.seq_len=4096",
        "data.global_batch_size=64",
        "trainer.devices=4",
        "trainer.num_nodes=2",
    ]
    # the planner's None is one sample per microbatch (32 per dp rank), the recipe's is 2 x pp: printed
    assert "strategy.microbatches=16" in recipe_overrides(Layout(pp=2, dp=4), work, 8)
    assert "strategy.microbatches=4" not in recipe_overrides(Layout(pp=2, dp=4, microbatches=4), work, 8)
    # at pp=1 the microbatches are gradient accumulation; the pipeline's settings are left out
    flat = recipe_overrides(Layout(dp=8, microbatches=4, zero_stage=3, overlap_grad_reduce=True), work, 8)
    assert "trainer.accumulate_grad_batches=4" in flat and not any("microbatches" in o for o in flat)
    assert not any("overlap" in o for o in flat)  # ZeRO-3's FSDP2 overlaps by itself


def test_the_recipe_accepts_the_printed_overrides_as_printed(plan_70b):
    """world 256 (8 x 32 nodes), the 70B config built on the meta device by the recipe's own checks."""
    overrides = plan_70b["layouts"][0]["overrides"]
    check_config(compose_gpt(*overrides, "model=hf", f"model.path={plan_70b['folder']}"))


def at_world_2(overrides: list[str]) -> list[str]:
    """The printed overrides fitted to 2 processes and the tiny model, every other key as printed: the
    model-parallel degree of the layout that is above 1 (pp, else tp, else cp: the first) becomes 2 and the others
    1, dp what is left of 2 (the degrees' product must be 2); trainer.devices=2, trainer.num_nodes=1; model.seq_len
    the tiny model's 64 positions; data.global_batch_size the fewest samples its dp x accumulation x microbatches
    split takes (512 samples of 64 tokens would only be slow). The rest as printed: ZeRO stage, schedule, virtual
    stages, microbatches, accumulation, precision (the tiny Llama has 8 layers for pp=2 x 4 virtual stages)."""
    s = dict(item.split("=", 1) for item in overrides)
    degrees = {axis: int(s.get(f"strategy.{axis}", 1)) for axis in ("pp", "tp", "cp")}
    kept = next((axis for axis, d in degrees.items() if d > 1), None)
    for axis in degrees:
        s[f"strategy.{axis}"] = "2" if axis == kept else "1"
    s["strategy.dp"] = "1" if kept else "2"
    if "strategy.ep" in s:
        s["strategy.ep"] = "1"
    if s.get("strategy.dp_shard"):
        s["strategy.dp_shard"] = s["strategy.dp"]
    if int(s.get("strategy.pipeline.virtual_stages", 1)) > 4:  # the tiny model's 11 pipeline layers: 2 x 4 stages
        s["strategy.pipeline.virtual_stages"] = "4"
    dp, accumulate = int(s["strategy.dp"]), int(s.get("trainer.accumulate_grad_batches", 1))
    per_step = int(s.get("strategy.microbatches", 2 * int(s["strategy.pp"]))) if s["strategy.pp"] != "1" else 1
    s.update({"model.seq_len": "64", "data.global_batch_size": str(dp * accumulate * per_step)})
    s.update({"trainer.devices": "2", "trainer.num_nodes": "1"})
    return [f"{k}={v}" for k, v in s.items()]


def test_the_recipe_accepts_them_at_world_2_on_a_tiny_llama(plan_70b, tmp_path):
    overrides = at_world_2(plan_70b["layouts"][0]["overrides"])
    printed = dict(item.split("=", 1) for item in plan_70b["layouts"][0]["overrides"])
    scaled = dict(item.split("=", 1) for item in overrides)
    replaced = {"strategy.dp", "strategy.pp", "strategy.tp", "strategy.cp", "model.seq_len", "strategy.dp_shard"}
    replaced |= {"strategy.pipeline.virtual_stages"}
    replaced |= {"data.global_batch_size", "trainer.devices", "trainer.num_nodes"}  # dp_shard: at_world_2's dp
    assert {k: v for k, v in scaled.items() if k not in replaced} == {
        k: v for k, v in printed.items() if k not in replaced
    }
    tiny = llama_folder(tmp_path / "tiny", TINY)
    cfg = compose_gpt(*overrides, "model=hf", f"model.path={tiny}")
    check_config(cfg)
    assert cfg.strategy.name == "hybrid3d" and cfg.precision.value == printed["precision"]
    for row in plan_70b["layouts"][1:]:  # every other proposal too (pp x tp, HSDP, interleaved stages)
        check_config(compose_gpt(*at_world_2(row["overrides"]), "model=hf", f"model.path={tiny}"))


@pytest.mark.slow
def test_the_printed_overrides_train_at_world_2(plan_70b, tmp_path):
    overrides = at_world_2(plan_70b["layouts"][0]["overrides"])
    tiny = llama_folder(tmp_path / "tiny", TINY)
    short = ["trainer=debug", "trainer.max_steps=2", "trainer.val_check_interval=2", "sample_tokens=4"]
    got = run_recipe(GPT, tmp_path, *overrides, "model=hf", f"model.path={tiny}", *short, timeout=900)
    assert got["steps"] == 2 and got["layout"]["world_size"] == 2
    assert math.isfinite(got["final_train_loss"])


# ----- strategy=auto in the recipe, on the same models -----

AUTO_70B = ["strategy=auto", "trainer.devices=8", "trainer.num_nodes=32", "strategy.auto_device_memory=80GB"]
AUTO_70B += ["precision=bf16-mixed", "model.seq_len=8192", "data.global_batch_size=512", "trainer.accelerator=cpu"]


def _auto_layout(cfg) -> Layout:
    names = {f for f in Layout.__dataclass_fields__} & set(ParallelConfig.names())
    config = ParallelConfig.from_mapping(cfg.strategy)  # the recipe's keys, sections included
    return Layout(**{name: getattr(config, name) for name in names})


def test_auto_plans_the_70b_hf_config_within_what_its_family_takes(plan_70b):
    cfg = compose_gpt(*AUTO_70B, "model=hf", f"model.path={plan_70b['folder']}")
    resolve_auto(cfg)
    warnings: list[str] = []
    ParallelConfig.from_mapping(cfg.strategy).validate(warn=warnings.append)
    assert cfg.strategy.name == "hybrid3d" and not warnings, warnings
    assert cfg.strategy.planned["planner"] == "analytic"
    layout = _auto_layout(cfg)
    assert layout.dp * layout.pp * layout.tp * layout.cp == 256 and 1 < layout.tp <= 8
    assert family_refusal(plan_70b["folder"])(layout) == ""
    check_config(cfg)  # the recipe's own pre-launch checks at world 256, the 70B model on the meta device


def test_auto_under_lora_leaves_out_what_the_adapters_refuse(plan_70b):
    """peft.dropout > 0 is refused under tp (the adapters' dropout masks are not split): the plan goes without tp
    (without LoRA it takes tp=2: the test above)."""
    lora = ["model=hf", f"model.path={plan_70b['folder']}", "peft=lora", "peft.dropout=0.1"]
    refuses = recipe_model_refusal(compose_gpt(*AUTO_70B, *lora))
    assert "peft.dropout" in refuses(Layout(tp=2, dp=128)) and refuses(Layout(tp=1, dp=256)) == ""
    cfg = compose_gpt(*AUTO_70B, *lora)
    resolve_auto(cfg)
    assert cfg.strategy.tp == 1 and refuses(_auto_layout(cfg)) == ""
    check_config(cfg)


def test_auto_trains_a_tiny_llama_at_world_2(tmp_path):
    run = ["trainer=debug", "trainer.max_steps=2", "trainer.val_check_interval=2", "sample_tokens=0"]
    tiny = llama_folder(tmp_path / "tiny", TINY)
    got = run_recipe(GPT, tmp_path, "strategy=auto", "model=hf", f"model.path={tiny}", "trainer.devices=2", *run)
    planned = got["planned"]
    assert planned["planner"] == "analytic" and got["layout"]["world_size"] == 2
    assert {k: got["layout"][k] for k in ("dp", "pp", "tp", "zero_stage")} == {
        k: planned["layout"][k] for k in ("dp", "pp", "tp", "zero_stage")
    }
    assert got["steps"] == 2 and math.isfinite(got["final_train_loss"])


def test_auto_plans_litgpt_in_the_recipe():
    cfg = compose_gpt("strategy=auto", "model=litgpt", "trainer.devices=4", "trainer.accelerator=cpu")
    resolve_auto(cfg)
    assert cfg.strategy.name == "hybrid3d" and cfg.strategy.planned["planner"] == "analytic"
    assert family_refusal(cfg.model.name)(_auto_layout(cfg)) == ""
    check_config(cfg)


def _typed(text: str) -> object:
    if text in ("true", "false"):
        return text == "true"
    return int(text) if text.isdigit() else text
