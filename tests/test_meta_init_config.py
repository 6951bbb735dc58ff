"""Models from a config alone (HFCausalLM of a transformers config or a config-only folder, LitGPTCausalLM of a litgpt
config) are built on the meta device and initialized shard by shard once split, through the same
``fill_meta_tensors`` the recipe GPT's meta build goes through (:class:`SeededInit` as its ``init``):

- memory (slow): a config-only Llama of 454 MiB and a LitGPT config of 258 MiB set up under zero3 and under tp=2 at
  world 2; on each rank the most tensor bytes alive at once (counted op by op, tests/workers/cases/meta_init.py's
  ``PeakTensorBytes``: exact, sees every storage torch allocates, where tracemalloc sees none) and the process's
  resident-memory high-water growth (the kernel's ``VmHWM``, reset at the case's start: what the dispatcher could
  miss) stay within the rank's own parameter bytes plus its largest pipeline layer plus a stated fixed overhead,
  which is below the whole model;
- values: the parameters after setup (gathered) equal one process's build with the same seed, bit for bit, under
  zero3 and tp=2 (fast, small models) and at the big size (slow);
- without a process group: the values are Hugging Face's own ``_init_weights`` of each module (LitGPT's own
  ``reset_parameters()``) under that module's seed, ties kept; a folder holding only config.json builds the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import run_worker
from torch import nn

from lightning_parallel.parallel.materialize import unit_seed

HF_SMALL = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
# 119M parameters, 454 MiB in fp32: embedding and head 125 MiB each, a decoder layer 34 MiB
HF_BIG = {
    **HF_SMALL,
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
LIT_SMALL = {"name": "pythia-14m", "n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 32, "padded_vocab_size": 256}
# 68M parameters, 258 MiB: embedding and head 75 MiB each, a block 27 MiB
LIT_BIG = {**LIT_SMALL, "n_layer": 4, "n_embd": 768, "n_head": 12, "padded_vocab_size": 25600}
LAYOUTS = {"zero3": "zero3", "tp2": "hybrid3d:tp=2"}
# beyond the rank's own parameters and one layer: buffers (rotary tables), the pieces of a stand-in checked for
# NaN (1 MiB), the tensors Lightning and the process groups make; for resident memory also allocator arenas and the
# setup's Python objects (seen: 1.1 MiB and less over the bound, both measures)
TENSOR_OVERHEAD = 4 * 2**20
RSS_OVERHEAD = 32 * 2**20


def one_process(model: str, config: dict) -> dict[str, torch.Tensor]:
    """The module built in one process after the worker's seed, its weights made there (``materialize()``)."""
    from workers.cases.meta_init import config_only

    torch.manual_seed(0)  # the worker's seed_everything(0)
    module = config_only({"model": model, model: config})
    module.materialize()
    return module.state_dict()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{label}: {name} differs from one process's build"


SMALL_RUNS = [("hf", "zero3"), ("lit", "tp2")]  # one launch in make test; the other pairs at the big size (slow)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("config_only_small")
    cases = [
        {"name": f"{model}_{layout}", "strategy": LAYOUTS[layout], "model": kind, kind: config, "save": True}
        for model, layout in SMALL_RUNS
        for kind, config in [("hf", HF_SMALL) if model == "hf" else ("litgpt", LIT_SMALL)]
    ]
    run_worker("meta_init", 2, ["--cases", json.dumps(cases)], out)
    return out


@pytest.mark.parametrize(("model", "layout"), SMALL_RUNS)
def test_initial_values_equal_one_process(small, model, layout):
    got = torch.load(small / f"{model}_{layout}_params.pt", weights_only=True)
    want = one_process("hf", HF_SMALL) if model == "hf" else one_process("litgpt", LIT_SMALL)
    _assert_same(got, want, f"{model} under {layout}")


GPT2_TIED = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32}
PP_CASES = {"hf_gpt2_tied": ("hf", GPT2_TIED), "hf_llama": ("hf", HF_SMALL), "lit": ("litgpt", LIT_SMALL)}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    out = tmp_path_factory.mktemp("config_only_pp")
    cases = [
        {"name": name, "strategy": "hybrid3d:pp=2", "model": model, model: config, "save": True}
        for name, (model, config) in PP_CASES.items()
    ]
    run_worker("meta_init", 2, ["--cases", json.dumps(cases)], out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PP_CASES))
def test_pipeline_stages_start_from_one_process(pipelined, name):
    """Under pp each stage initializes only its layers; a weight tied across stages (GPT-2's head) gets the
    embedding's values on the head's stage."""
    model, config = PP_CASES[name]
    got = torch.load(pipelined / f"{name}_params.pt", weights_only=True)
    _assert_same(got, one_process(model, config), f"{name} under pp=2")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """``get(model, layout)``: (each rank's result, the folder) of one launch per model and layout, made when first
    asked for, a small warm-up case first (imports and groups made on first use are not counted in the big model's
    resident memory)."""
    results = {}

    def get(model: str, layout: str) -> tuple[list[dict], Path]:
        if (model, layout) not in results:
            small_config, config = (HF_SMALL, HF_BIG) if model == "hf" else (LIT_SMALL, LIT_BIG)
            out = tmp_path_factory.mktemp(f"big_{model}_{layout}")
            strategy = LAYOUTS[layout]
            cases = [
                {"name": "warm", "strategy": strategy, "model": model, model: small_config},
                {"name": f"{model}_{layout}", "strategy": strategy, "model": model, model: config, "save": True},
            ]
            ranks = run_worker("meta_init", 2, ["--cases", json.dumps(cases)], out, timeout=900)
            results[model, layout] = ([rank[1] for rank in ranks], out)
        return results[model, layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf", "litgpt"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_peak_memory_is_a_shard_and_one_layer(big, model, layout):
    ranks, _ = big(model, layout)
    for rank, r in enumerate(ranks):
        whole, layer, shard = r["model_bytes"], r["layer_bytes"], r["local_param_bytes"]
        bound = shard + layer
        row = (
            f"{model} {layout} rank {rank}: model {whole / 2**20:.1f} MiB, shard {shard / 2**20:.1f} MiB, layer "
            f"{layer / 2**20:.1f} MiB, peak tensors {r['peak_tensor_bytes'] / 2**20:.1f} MiB, RSS growth "
            f"{r['rss_growth'] / 2**20:.1f} MiB"
        )
        print(row)
        assert shard <= 0.51 * whole, row  # each rank holds half the parameters
        assert bound + RSS_OVERHEAD < whole, row  # the bound is below a whole copy: the check can fail
        assert r["peak_tensor_bytes"] <= bound + TENSOR_OVERHEAD, row
        assert r["rss_growth"] <= bound + RSS_OVERHEAD, row


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf", "litgpt"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_big_initial_values_equal_one_process(big, model, layout):
    _, out = big(model, layout)
    got = torch.load(out / f"{model}_{layout}_params.pt", weights_only=True)
    _assert_same(got, one_process(model, HF_BIG if model == "hf" else LIT_BIG), f"{model} under {layout}")


# ----- without a process group -----


def _hf_reference(fields: dict) -> dict[str, torch.Tensor]:
    """Hugging Face's own path, written out: the model built on meta, given storage, each module's ``_init_weights``
    under its seed (seed 0), then tied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for path, module in model.named_modules():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(unit_seed(0, path))
                model._init_weights(module)
    model.tie_weights()
    return {f"model.{k}": v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_hf_values_are_hf_init_weights_per_module(tied):
    config = {**HF_SMALL, "tie_word_embeddings": tied}
    got = one_process("hf", config)
    _assert_same(got, _hf_reference(config), f"tie_word_embeddings={tied}")
    assert torch.equal(got["model.lm_head.weight"], got["model.model.embed_tokens.weight"]) == tied


def test_litgpt_values_are_reset_parameters_per_module():
    from litgpt.config import Config
    from litgpt.model import GPT

    fields = dict(LIT_SMALL)
    with torch.device("meta"):
        model = GPT(Config.from_name(fields.pop("name"), **fields))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for path, module in model.named_modules():
            if callable(getattr(module, "reset_parameters", None)):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(unit_seed(0, path))
                    module.reset_parameters()
    want = {f"model.{k}": v for k, v in model.state_dict().items()}
    _assert_same(one_process("litgpt", LIT_SMALL), want, "litgpt")


def test_a_config_only_folder_builds_on_meta_and_the_same_values(tmp_path):
    from transformers import AutoConfig

    from lightning_parallel.hf import HFCausalLM

    fields = dict(HF_SMALL)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(tmp_path)
    torch.manual_seed(0)
    module = HFCausalLM(str(tmp_path))
    assert all(p.is_meta for p in module.parameters()) and module.awaits_materialize
    with pytest.raises(RuntimeError, match=r"not there yet .* call .materialize\(\) first"):
        module(torch.zeros(1, 4, dtype=torch.long))
    module.materialize()
    _assert_same(module.state_dict(), one_process("hf", HF_SMALL), "config-only folder")
    eager = HFCausalLM(str(tmp_path), lazy_load=False)  # the old way: whole on the host now, transformers' draws
    assert not any(p.is_meta for p in eager.parameters()) and not eager.awaits_materialize


def test_a_tied_weight_in_another_stage_gets_its_first_owners_values():
    """Under pp the head may sit in another stage than the embedding it is tied to: its own unit gives it the
    embedding's values (SeededInit's ties), not its own draw."""
    from lightning_parallel.parallel.materialize import SeededInit, fill_meta_tensors

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight
    init = SeededInit(model, lambda module: module.reset_parameters(), seed=0)
    embedding = model[0]
    model[0] = nn.Identity()  # the embedding's stage is elsewhere; the head's weight is its own tensor now
    model[1].weight = nn.Parameter(torch.empty(16, 8, device="meta"))
    fill_meta_tensors(model, model, torch.device("cpu"), init=init)
    torch.manual_seed(unit_seed(0, "0"))
    want = nn.Embedding(16, 8).weight
    assert embedding is not None and torch.equal(model[1].weight, want)


def test_a_unit_holding_other_units_stands_in_for_its_own_tensors_only(monkeypatch):
    """LitGPT's GPT owns its rotary tables and has a reset_parameters(): built on meta (LitGPT's own scripts under
    Fabric) it is a unit holding every other one. It stands in for its two tables, not the whole model, and the
    values are still ``GPT(config)``'s, the global generator replayed."""
    from litgpt.config import Config
    from litgpt.model import GPT

    import lightning_parallel.parallel.materialize as materialize

    fields = dict(LIT_SMALL)
    config = Config.from_name(fields.pop("name"), **fields)
    torch.manual_seed(0)
    want = GPT(config).state_dict()
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    with torch.device("meta"):
        model = GPT(config)
    stood_in: dict[str, int] = {}
    reset = materialize._reset_unit

    def counted(path, unit, own, *args, **kwargs):
        stood_in[path] = len(own)
        return reset(path, unit, own, *args, **kwargs)

    monkeypatch.setattr(materialize, "_reset_unit", counted)
    materialize.fill_meta_tensors(model, model, torch.device("cpu"), rng_state=state)
    assert stood_in[""] == 2 and max(stood_in.values()) == 2  # cos and sin; a Linear's weight and bias
    _assert_same(model.state_dict(), want, "GPT built on meta")
