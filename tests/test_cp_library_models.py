"""Context parallelism (cp) for Hugging Face and LitGPT models: the same 10 AdamW steps (fp32) as the plain model
trained in one process (tests/test_hf_parity.py's and tests/test_litgpt_parity.py's references), with the attention
switched through the model protocol's ``context_parallel`` (HF: an attention function registered in transformers'
``AttentionInterface``; LitGPT: its ``scaled_dot_product_attention``) and the rotary positions of each rank's chunks.

`make test`: the tiny HF Llama (grouped-query attention) at cp=2, ring (accumulating 2 micro-batches) and Ulysses
(clipped), one world-2 launch. `make test-full`: cp=2 x tp=2 (ring and Ulysses), cp=2 x pp=2, LitGPT's Llama-style
and GPT-NeoX-style (a quarter of each head rotary) models at cp=2 ring and Ulysses,
LitGPT's Llama at cp=2 x tp=2 and cp=2 x pp=2, the recipe at cp=2.
Single-process checks: the switched HF and LitGPT models give the plain model's logits at the positions given, and
the bad inputs are refused by name.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from causal_lm_parity import assert_clipping_active, check, launch
from test_hf_parity import CONFIGS, plain_hf_training

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.parallel.context import check_context_layout
from lightning_parallel.parallel.mesh import ParallelDims

# label -> (world, strategy spec, model, tp); "clip" clips the gradient norm, "accum" accumulates 2 micro-batches
FAST = {
    "llama cp2 ring accum": (2, "hybrid3d:cp=2", "llama", 1),
    "llama cp2 ulysses clip": (2, "hybrid3d:cp=2,cp_mode=ulysses", "llama", 1),
}
SLOW = {
    "llama cp2 x tp2": (4, "hybrid3d:cp=2,tp=2", "llama", 2),
    "llama cp2 x tp2 ulysses clip": (4, "hybrid3d:cp=2,tp=2,cp_mode=ulysses", "llama", 2),
    "llama cp2 x pp2": (4, "hybrid3d:cp=2,pp=2", "llama", 1),
}
LITGPT = {
    "llama cp2 ring": (2, "hybrid3d:cp=2", "llama", 1),
    "llama cp2 ulysses clip": (2, "hybrid3d:cp=2,cp_mode=ulysses", "llama", 1),
    "neox cp2 ring accum": (2, "hybrid3d:cp=2", "neox", 1),
    # world 4 (a second launch of the same Batch)
    "llama cp2 x tp2": (4, "hybrid3d:cp=2,tp=2", "llama", 2),
    "llama cp2 x pp2 clip": (4, "hybrid3d:cp=2,pp=2", "llama", 1),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    folder = tmp_path_factory.mktemp("hf_cp_llama")
    model.save_pretrained(folder)
    return {"llama": str(folder)}


@pytest.fixture(scope="module")
def references(folders) -> dict:
    return {("llama", clip): plain_hf_training(folders["llama"], clip) for clip in (None, 0.05)}


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders):
    return launch(tmp_path_factory, folders, FAST, "hf_cp", "hf")


@pytest.mark.parametrize("label", list(FAST))
def test_hf_context_parallel_matches_one_process(label, fast_runs, references):
    check(fast_runs, label, FAST[label], references)


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders):
    return launch(tmp_path_factory, folders, SLOW, "hf_cp_slow", "hf")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_hf_context_parallel_composes(label, slow_runs, references):
    check(slow_runs, label, SLOW[label], references)


def test_clipping_is_active_in_the_reference(references):
    assert_clipping_active(references, "llama")


# ----- LitGPT (make test-full) -----


@pytest.fixture(scope="module")
def litgpt_folders(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("litgpt")
    from test_litgpt_parity import CONFIGS as LITGPT_CONFIGS
    from test_litgpt_parity import GPT, save_config

    out = {}
    for name, config in LITGPT_CONFIGS.items():
        torch.manual_seed(0)
        model = GPT(config())
        model.apply(model._init_weights)
        folder = tmp_path_factory.mktemp(f"litgpt_cp_{name}")
        save_config(model.config, folder)
        torch.save(model.state_dict(), folder / "lit_model.pth")
        out[name] = str(folder)
    return out


@pytest.fixture(scope="module")
def litgpt_runs(tmp_path_factory, litgpt_folders):
    return launch(tmp_path_factory, litgpt_folders, LITGPT, "litgpt_cp", "litgpt")


@pytest.mark.slow
@pytest.mark.parametrize("label", list(LITGPT))
def test_litgpt_context_parallel_matches_one_process(label, litgpt_runs, litgpt_folders):
    from test_litgpt_parity import plain_litgpt_training

    model = LITGPT[label][2]
    clip = 0.05 if "clip" in label else None
    check(litgpt_runs, label, LITGPT[label], {(model, clip): plain_litgpt_training(litgpt_folders[model], clip)})


# ----- one process: the switch itself, and the refusals -----


def _shifted_positions(length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(length, device=device) + 3  # positions that are not 0..T-1: the model must use them


def test_hf_switch_runs_the_given_attention_and_positions():
    """The registered attention function and the position hook give the plain model's logits at those positions."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    module = HFCausalLM(model)
    ids = torch.randint(0, 128, (2, 8))
    want = model(input_ids=ids, position_ids=_shifted_positions(8, ids.device).expand(2, -1)).logits
    calls = []

    def attention(q, k, v, dropout_p=0.0, scale=None):
        calls.append(q.shape)
        assert k.shape == q.shape, "key/value heads are repeated to the query heads"
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    switched = module.context_parallel(attention, _shifted_positions)
    assert switched == ["model.model.layers.0.self_attn", "model.model.layers.1.self_attn"]
    torch.testing.assert_close(module(ids), want, rtol=0, atol=1e-6)
    assert len(calls) == 2 and module.attention_heads() == 4


def test_litgpt_switch_runs_the_given_attention_and_positions():
    pytest.importorskip("litgpt")
    from test_litgpt_parity import CONFIGS as LITGPT_CONFIGS

    from lightning_parallel.litgpt import LitGPTCausalLM

    torch.manual_seed(0)
    module = LitGPTCausalLM(LITGPT_CONFIGS["neox"]())
    module.materialize()  # built on meta from the config: its weights made here
    ids = torch.randint(0, 128, (2, 8))
    pos = _shifted_positions(8, ids.device)
    with torch.no_grad():
        gpt = module.model  # GPT.forward's blocks, given the rotary rows of these positions
        x = gpt.transformer.wte(ids)
        for block in gpt.transformer.h:
            x = block(x, gpt.cos[pos].unsqueeze(0), gpt.sin[pos].unsqueeze(0), None, None, None)
        want = gpt.lm_head(gpt.transformer.ln_f(x))
    calls = []

    def attention(q, k, v, dropout_p=0.0, scale=None):
        calls.append(scale)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    assert module.context_parallel(attention, _shifted_positions) == [
        "model.transformer.h.0.attn", "model.transformer.h.1.attn"
    ]  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(module(ids), want, rtol=0, atol=1e-6)
    assert len(calls) == 2 and calls[0] == pytest.approx(1 / 8**0.5)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (lambda: transformers.MistralConfig(**_SMALL, sliding_window=4), r"cp=2 runs causal attention .*sliding"),
        (lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4), r"config.attn_pdrop=0.1"),
        (lambda: transformers.LlamaConfig(**_SMALL, attention_dropout=0.1), r"config.attention_dropout=0.1: set it"),
    ],
    ids=["sliding-window", "gpt2-dropout", "llama-dropout"],
)
def test_hf_attention_cp_cannot_run_is_refused(config, message):
    with torch.device("meta"):
        module = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config()))
    with pytest.raises(ValueError, match=message):
        module.check_parallel_degrees(ParallelDims.of(cp=2))


_SMALL = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip


def test_ulysses_heads_and_padding_are_refused_by_name():
    with torch.device("meta"):
        module = HFCausalLM(transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()))
    check_context_layout(module, 2, "ulysses", 2)  # 4 heads / tp 2 / cp 2
    with pytest.raises(ValueError, match=r"n_head / tp = 4 / 2 = 2 does not divide by cp=4"):
        check_context_layout(module, 4, "ulysses", 2)


def test_litgpt_sliding_window_is_refused():
    pytest.importorskip("litgpt")
    from litgpt.config import Config

    from lightning_parallel.litgpt import check_litgpt_degrees

    config = Config(name="x", block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=2, n_embd=32, n_head=4,
                    sliding_window_size=4, sliding_window_indices=[1, 1])  # fmt: skip
    with torch.device("meta"):
        from litgpt.model import GPT

        model = GPT(config)
    with pytest.raises(ValueError, match=r"cp=2 cannot run a LitGPT model with config.sliding_window_size=4"):
        check_litgpt_degrees(model, ParallelDims.of(cp=2))


@pytest.mark.slow
def test_recipe_trains_an_hf_model_at_cp2(tmp_path):
    """recipes/train_gpt.py model=hf_llama_tiny at cp=2: the byte data split over the cp ranks, the loss falls, and
    the sample (whole prompts on every cp rank: whole_sequence) is written."""
    import math

    from recipe_runs import GPT, run_recipe

    got = run_recipe(
        GPT, tmp_path, "trainer=debug", "trainer.max_steps=6", "sample_tokens=8", "model=hf_llama_tiny",
        "strategy=hybrid3d", "strategy.cp=2", "trainer.devices=2",
    )  # fmt: skip
    assert got["layout"]["cp"] == 2 and got["steps"] == 6
    assert math.isfinite(got["final_train_loss"]) and got["final_train_loss"] < math.log(256) - 0.5, got
    assert len(got["sample"]) > 0
