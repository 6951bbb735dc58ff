"""Hugging Face Mixture-of-Experts folders (Mixtral, Qwen3-MoE, DeepSeek-V3 tiny configs) written by
``save_pretrained``, whose experts transformers stores one matrix per expert and fuses at load: HFCausalLM reads
them through transformers' own conversions to the weights ``from_pretrained`` gives, in one process and under
ZeRO and pp (10 AdamW steps against the plain HF model); a rank holding half the experts reads half the experts'
bytes; a checkpoint of the module exports back to a folder ``from_pretrained`` loads to the same logits."""

from __future__ import annotations

import re

import pytest
import safetensors
import torch
import transformers  # a test dependency: make install installs the hf extra
from causal_lm_parity import check, launch, train_reference
from conftest import Batch
from torch import nn

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.hf.export import export_hf
from lightning_parallel.hf.loading import load_local_weights, module_expert_ranges
from lightning_parallel.hf.module import lazy_causal_lm

COMMON = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": None, "eos_token_id": None,
    "pad_token_id": None,
}  # fmt: skip
MOE = {  # 4 experts, top 2; DeepSeek-V3: a dense first layer, a shared expert, group-limited routing
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("qwen3_moe", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8,
    }),
    "deepseek_v3": ("deepseek_v3", {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    }),
}  # fmt: skip
EXPERTS = 4
EXPERT_PARAM = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")  # the fused (E, ...) parameters
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")  # the folder's per-expert tensors

# label -> (world, strategy spec, model, tp), as tests/test_hf_parity.py: one launch per world size
FAST = {
    "mixtral zero3": (2, "zero3", "mixtral", 1),
    "qwen3_moe pp2": (2, "hybrid3d:pp=2", "qwen3_moe", 1),
    "mixtral ep2": (2, "hybrid3d:ep=2", "mixtral", 1),  # the experts split over ep (hf/experts.py): 2 of 4 a rank
}
SLOW = {
    "deepseek_v3 zero3": (2, "zero3", "deepseek_v3", 1),
    "deepseek_v3 pp2": (2, "hybrid3d:pp=2", "deepseek_v3", 1),
    "mixtral pp2 gpipe": (2, "hybrid3d:pp=2,pp_schedule=gpipe", "mixtral", 1),
    "qwen3_moe zero1 clip": (2, "zero1", "qwen3_moe", 1),
    "mixtral ddp accum": (2, "ddp", "mixtral", 1),
    "qwen3_moe dp2 x pp2 zero3": (4, "hybrid3d:pp=2,zero_stage=3", "qwen3_moe", 1),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, (model_type, extra) in MOE.items():
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(model_type, **COMMON, **extra)
        folder = tmp_path_factory.mktemp(f"moe_{name}")
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        out[name] = str(folder)
    return out


def from_pretrained(folder: str) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)


@pytest.mark.parametrize("name", list(MOE))
def test_folder_stores_experts_one_by_one_and_loads_as_from_pretrained(name, folders):
    with safetensors.safe_open(f"{folders[name]}/model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert any(EXPERT_KEY.search(k) for k in keys) and not any(EXPERT_PARAM.search(k) for k in keys)
    module = HFCausalLM(folders[name])
    module.materialize()
    want, got = from_pretrained(folders[name]).state_dict(), module.model.state_dict()
    assert sorted(got) == sorted(want) and any(EXPERT_PARAM.search(k) for k in got)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert module.weight_bytes_read == folder_bytes(folders[name])  # every tensor read once


def folder_bytes(folder: str, keep=lambda key: True) -> int:
    from safetensors.torch import load_file

    tensors = load_file(f"{folder}/model.safetensors")
    return sum(t.numel() * t.element_size() for key, t in tensors.items() if keep(key))


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """Every tensor name the loader reads from a safetensors file (whole or a slice of it)."""
    names: list[str] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            names.append(name)
            return self.file.get_tensor(name)

        def get_slice(self, name):
            names.append(name)
            return self.file.get_slice(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    return names


@pytest.mark.parametrize("name", list(MOE))
@pytest.mark.parametrize("half", [0, 1])
def test_a_rank_holding_half_the_experts_reads_half_their_bytes(name, half, folders, opened):
    """The expert-parallel split's view: each fused expert parameter holds experts first..last-1 (a plain tensor;
    the first half said by ``expert_ranges``, the second by the experts module's ``expert_range`` hook); the loader
    opens only those experts' tensors of the folder."""
    first, last = half * EXPERTS // 2, (half + 1) * EXPERTS // 2
    model = lazy_causal_lm(folders[name])
    ranges = {}
    for path, module in model.named_modules():
        for attr in ("gate_up_proj", "down_proj"):
            param = getattr(module, attr, None)
            if path.endswith("mlp.experts") and isinstance(param, nn.Parameter):
                setattr(module, attr, nn.Parameter(param[first:last]))  # still on the meta device
                ranges[f"{path}.{attr}"] = (first, last)
                module.expert_range = (first, last) if half else None
    assert ranges and module_expert_ranges(model) == (ranges if half else {})
    given = {} if half else {"expert_ranges": ranges}
    read = load_local_weights(model, folders[name], torch.device("cpu"), {}, **given)
    want = from_pretrained(folders[name]).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key][first:last] if key in ranges else want[key]), key
    experts = {int(EXPERT_KEY.search(k).group(1)) for k in opened if EXPERT_KEY.search(k)}
    assert experts == set(range(first, last))
    expert_bytes = folder_bytes(folders[name], lambda key: bool(EXPERT_KEY.search(key)))
    assert read == folder_bytes(folders[name]) - expert_bytes // 2
    print(f"{name} experts {first}..{last - 1}: {read} bytes read of {folder_bytes(folders[name])}")


@pytest.mark.parametrize("name", list(MOE))
def test_export_hf_round_trip_gives_the_same_logits(name, folders, tmp_path):
    """A checkpoint of the module (its state dict under the fused names, trained-looking weights) written back by
    ``export-hf`` in transformers' on-disk format: ``from_pretrained`` loads it to the module's logits."""
    module = HFCausalLM(folders[name])
    module.materialize()
    with torch.no_grad():
        for param in module.parameters():  # no longer the folder's weights
            param.add_(0.01 * torch.randn_like(param))
    checkpoint = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "last.ckpt")
    out = export_hf(tmp_path / "last.ckpt", tmp_path / "hf")
    with safetensors.safe_open(f"{out}/model.safetensors", "pt") as f:
        assert any(EXPERT_KEY.search(k) for k in f.keys())  # transformers' per-expert format, as it saves
    ids = torch.randint(0, COMMON["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = module.model.eval()(input_ids=ids).logits
        got = from_pretrained(str(out)).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def references(folders) -> dict:
    return {
        (name, clip): train_reference(
            from_pretrained(folder), COMMON["vocab_size"], lambda m, ids: m(input_ids=ids, labels=ids).loss,
            HFCausalLM.__init__.__defaults__, clip,
        )
        for name, folder in folders.items()
        for clip in (None, 0.05)
    }  # fmt: skip


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, FAST, "hf_moe", "hf")


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders) -> Batch:
    return launch(tmp_path_factory, folders, SLOW, "hf_moe_slow", "hf")


@pytest.mark.parametrize("label", list(FAST))
def test_moe_folder_trains_as_plain_hf_under_layouts(label, fast_runs, references):
    check(fast_runs, label, FAST[label], references)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW))
def test_moe_folder_trains_as_plain_hf_under_more_layouts(label, slow_runs, references):
    check(slow_runs, label, SLOW[label], references)


def test_zero3_ranks_read_only_their_experts(fast_runs, folders):
    """ZeRO-3 shards each fused expert parameter on dim 0: each of the 2 ranks reads 2 of the 4 experts' tensors
    (and its dp shard of the others)."""
    read = [fast_runs["mixtral zero3"].case("train", r)["bytes_read"] for r in range(2)]
    full = folder_bytes(folders["mixtral"])
    experts = folder_bytes(folders["mixtral"], lambda key: bool(EXPERT_KEY.search(key)))
    print(f"mixtral zero3: bytes read per rank {read} of {full} (experts {experts})")
    assert all(r <= full - experts // 2 for r in read), (read, full, experts)
    assert sum(read) < full + experts // 4  # about one copy over the two ranks


def test_ep2_ranks_read_only_their_experts(fast_runs, folders):
    """Under ep=2 each rank holds 2 of the 4 experts (a DTensor sharded on dim 0 over ep) and everything else whole:
    it reads the whole folder but for the other rank's experts."""
    read = [fast_runs["mixtral ep2"].case("train", r)["bytes_read"] for r in range(2)]
    full = folder_bytes(folders["mixtral"])
    experts = folder_bytes(folders["mixtral"], lambda key: bool(EXPERT_KEY.search(key)))
    print(f"mixtral ep2: bytes read per rank {read} of {full} (experts {experts}: {experts // 2} per rank expected)")
    assert read == [full - experts // 2] * 2, (read, full, experts)


def test_expert_ranges_for_a_dtensor_is_refused(folders, monkeypatch):
    """A DTensor says which experts it holds: naming one in ``expert_ranges`` is refused, naming the fix, before
    anything is allocated (the loader's DTensor check pointed at ``nn.Parameter`` here: no process group)."""
    from lightning_parallel.hf import loading

    model = lazy_causal_lm(folders["mixtral"])
    name = "model.layers.0.mlp.experts.gate_up_proj"
    monkeypatch.setattr(loading, "DTensor", nn.Parameter)
    with pytest.raises(ValueError, match="expert_ranges names .*gate_up_proj.*, a DTensor.*plain tensors only"):
        load_local_weights(model, folders["mixtral"], torch.device("cpu"), {}, expert_ranges={name: (0, 2)})
    assert model.get_parameter(name).is_meta
