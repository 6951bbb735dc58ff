"""A frozen bf16 base with fp32 LoRA adapters (``HFCausalLM(..., base_dtype=torch.bfloat16)``) under ZeRO-1/2/3, tp=2,
pp=2 and HSDP 2x2, against the same peft model (bf16 base, fp32 adapters, same initialization) trained in one process by
a plain loop; and what each rank holds, read from its tensors: model-state bytes equal to
:func:`~lightning_parallel.planning.adapters.adapter_model_state_bytes`, no gradient for a frozen weight and no gradient
buffer beyond the adapters' share, on any rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from causal_lm_parity import CLIP, launch, layout_of, options, train_reference
from conftest import Batch
from parity import PARAM_ATOL, assert_same_losses, assert_same_params
from test_hf_lora import LORA, folders, lora_config, small  # noqa: F401  (folders: the fixture)
from workers.cases.lora_memory import gradient_leaves

from lightning_parallel.hf import HFCausalLM
from lightning_parallel.hf.lora import apply_peft, cast_frozen_base
from lightning_parallel.parallel.data.stages import ZERO_STAGES
from lightning_parallel.planning.adapters import adapter_model_state_bytes

BF16 = torch.bfloat16
# label -> (world, strategy spec, model, tp), as tests/test_hf_lora.py; "mem": 2 steps, what the ranks hold only
FAST = {
    "llama bf16 zero3 clip": (2, "zero3", "llama", 1),
    "llama bf16 zero1 mem": (2, "zero1", "llama", 1),
    "llama bf16 zero2 mem": (2, "zero2", "llama", 1),
}
SLOW = {
    "llama bf16 zero2": (2, "zero2", "llama", 1),
    "llama bf16 tp2 clip": (2, "hybrid3d:tp=2", "llama", 2),
    "llama bf16 tp2 sp": (2, "hybrid3d:tp=2,sequence_parallel=1", "llama", 2),
    "gpt2 bf16 zero3": (2, "zero3", "gpt2", 1),
    "gpt2 bf16 zero0 mem": (2, "hybrid3d:zero_stage=0", "gpt2", 1),
    "llama bf16 pp2 1f1b clip": (2, "hybrid3d:pp=2", "llama", 1),
    "llama bf16 hsdp 2x2 zero3": (4, "hybrid3d:dp_shard=2,zero_stage=3", "llama", 1),
}
# runs checked for parity only: the memory checks count the whole model on every rank sharded over the whole world,
# not a pipeline stage's share nor HSDP's shard groups (tests/test_hf_lora_layouts.py checks what those ranks hold)
PARITY_ONLY = ("pp2", "hsdp")
MEMORY_STEPS = 2
# Precision bars (loss relative, adapter absolute). Reference and run hold the same dtypes (bf16 base; fp32 adapters,
# gradients, optimizer states and loss), and a CPU bf16 matmul gives each row the same bits whatever the batch
# around it, so a data-parallel split changes only the order of fp32 sums. In fp32 that stays at 1e-7; here it
# does not: each LoRA layer adds its fp32 output to the base's bf16 one and rounds the sum to bf16, so an fp32
# difference in the last bit flips a bf16 rounding now and then (2^-8 relative), and AdamW, whose updates do not
# shrink with the gradient, carries that into the adapters. One process training the same global batch as two
# accumulated halves (nothing else changed) already moves the adapters by 1e-5 to 2.4e-5 and the losses by up to
# 8.5e-6 (test_bars_cover_the_rounding_noise_of_one_process measures it; seen under zero3: 2.4e-5, zero2: 2e-8): ZeRO
# gets 4x that. Under tp each rank also rounds its partial products of a row-parallel layer (o_proj, down_proj) to
# bf16 before they are summed, where one process rounds the whole product once: bf16's unit roundoff on every such
# output, every step. One process doing only that moves losses 1.8e-5 and adapters 1.1e-3 (the same test, slow;
# tp2 runs seen: 2.1e-5 and 1.5e-3 to 1.8e-3, against AdamW's 1e-2 of movement over 10 steps at lr 1e-3): tp gets
# about 4x that. That bar checks the dtypes under tp; the fp32 tp parity of tests/test_hf_lora.py (1e-5) checks
# the split itself.
BARS = {"dp": (3e-5, 1e-4), "tp": (1e-4, 4e-3)}


def bars(spec: tuple) -> tuple[float, float]:
    return BARS["tp" if spec[3] > 1 else "dp"]


# cases/hf.py's case keys per model: the adapters, the bf16 base, what each rank holds
EXTRA = {m: {"lora": c, "base_dtype": "bf16", "memory": True} for m, c in LORA.items()}


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory, folders) -> Batch:  # noqa: F811
    return short(launch(tmp_path_factory, folders, FAST, "lora_bf16", "hf", extra=EXTRA))


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, folders) -> Batch:  # noqa: F811
    return short(launch(tmp_path_factory, folders, SLOW, "lora_bf16_slow", "hf", extra=EXTRA))


def short(batch: Batch) -> Batch:
    """The "mem" runs take MEMORY_STEPS steps (optimizer states exist from the first); the PARITY_ONLY runs report
    no memory."""
    for label, (_, _, runs) in batch.runs.items():
        if label.endswith(" mem"):
            runs[0]["steps"] = MEMORY_STEPS
        runs[0]["memory"] = label in MEMORY_CHECKED
    return batch


MEMORY_CHECKED = [k for k in [*FAST, *SLOW] if not any(word in k for word in PARITY_ONLY)]


def bf16_peft_model(name: str, folder: str) -> transformers.PreTrainedModel:
    """The same peft model the workers build (adapters from the same seed), its frozen base converted to bf16."""
    model = apply_peft(transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True),
                       lora_config(name))  # fmt: skip
    cast_frozen_base(model, BF16)
    return model


def half_batches(m, ids):
    """The loss of the global batch as the mean of its two halves' (one graph): the gradient is summed in the
    order data parallelism sums it, nothing else changes."""
    return sum(m(input_ids=part, labels=part).loss for part in ids.chunk(2)) / 2


def row_partials(model: torch.nn.Module) -> None:
    """Every row-parallel base layer (Llama's o_proj and down_proj) computes its output as tp=2 does: two partial
    products over halves of the input features, each rounded to bf16, then summed in bf16."""

    def split(module, args, output):
        x, half = args[0], args[0].shape[-1] // 2
        w = module.weight
        return F.linear(x[..., :half], w[:, :half]) + F.linear(x[..., half:], w[:, half:])

    for name, module in model.named_modules():
        if name.endswith(("o_proj.base_layer", "down_proj.base_layer")):
            module.register_forward_hook(split)


class References:
    """The one-process trainings, each run once when first asked for: (model, clip[, variant]) -> (losses,
    params); variant "halves": the loss as :func:`half_batches`, "row partials": :func:`row_partials`."""

    def __init__(self, folders: dict) -> None:  # noqa: F811
        self.folders, self.done = folders, {}

    def __getitem__(self, key: tuple) -> tuple:
        name, clip, *variant = key
        if key not in self.done:
            model = bf16_peft_model(name, self.folders[name])
            if variant == ["row partials"]:
                row_partials(model)
            loss_of = half_batches if variant == ["halves"] else (lambda m, ids: m(input_ids=ids, labels=ids).loss)
            self.done[key] = train_reference(model, model.config.vocab_size, loss_of,
                                             HFCausalLM.__init__.__defaults__, clip)  # fmt: skip
        return self.done[key]


@pytest.fixture(scope="module")
def references(folders) -> References:  # noqa: F811
    return References(folders)


def distance(references: References, key: tuple) -> tuple[float, float]:
    """(largest loss relative, largest adapter absolute) difference of the variant ``key`` from its reference."""
    (want_losses, want), (got_losses, got) = references[key[:2]], references[key]
    loss_rel = max(abs(g - w) / abs(w) for g, w in zip(got_losses, want_losses))
    return loss_rel, max((got[k] - want[k]).abs().max().item() for k in want if "lora_" in k)


@pytest.mark.parametrize(
    ("variant", "layout"),  # both slow (test budget): one-process reference runs
    [pytest.param("halves", "dp", marks=pytest.mark.slow), pytest.param("row partials", "tp", marks=pytest.mark.slow)],
)
def test_bars_cover_the_rounding_noise_of_one_process(variant, layout, references):
    """The bars against what one process does with only the rounding changed: the global batch as two
    accumulated halves (dp's sum order), the row-parallel products as two bf16 partial sums (tp's). Above fp32's
    bars (which a correct bf16 run would fail), within the layout's bars, and the adapter bar at most 10x above."""
    loss_rel, param_abs = distance(references, ("llama", CLIP, variant))
    print(f"one process, {variant}: losses {loss_rel:.1e} relative, adapters {param_abs:.1e} apart")
    loss_bar, param_bar = BARS[layout]
    assert PARAM_ATOL < param_abs <= param_bar and 10 * param_abs >= param_bar, param_abs
    assert loss_rel <= loss_bar, loss_rel


def check_bf16_run(runs: Batch, label: str, spec: tuple, references: dict, folders: dict) -> None:  # noqa: F811
    """Losses and adapters within the bars; the frozen base bitwise the bf16 base the run started from."""
    world, strategy, model, tp = spec
    run = runs[label]
    want_losses, want = references[model, options(label)["clip"]]
    loss_rtol, param_atol = bars(spec)
    leaders = [d * tp for d in range(world // tp // layout_of(strategy, world, tp)[0])]
    loss_rel = assert_same_losses(run.losses("train", leaders), want_losses, label, rtol=loss_rtol)
    got = run.params("train")
    adapters = {k: v for k, v in want.items() if "lora_" in k}
    param_abs = assert_same_params({k: got[k] for k in adapters}, adapters, label, atol=param_atol)
    base = {k: v for k, v in want.items() if "lora_" not in k}
    assert got.keys() == want.keys(), label
    assert all(v.dtype == BF16 for v in base.values()) and all(got[k].dtype == BF16 for k in base), label
    assert all(got[k].dtype == torch.float32 for k in adapters), label
    changed = [k for k, v in base.items() if not torch.equal(got[k], v)]
    assert not changed, f"{label}: frozen base parameters changed: {changed[:5]}"
    print(f"{label}: max loss rel diff {loss_rel:.1e}, max adapter abs diff {param_abs:.1e}")


@pytest.mark.parametrize("label", [k for k in FAST if not k.endswith(" mem")])
def test_bf16_base_parity(label, fast_runs, references, folders):  # noqa: F811
    check_bf16_run(fast_runs, label, FAST[label], references, folders)


@pytest.mark.slow
@pytest.mark.parametrize("label", [k for k in SLOW if not k.endswith(" mem")])
def test_bf16_base_parity_wider(label, slow_runs, references, folders):  # noqa: F811
    check_bf16_run(slow_runs, label, SLOW[label], references, folders)


# ----- what each rank holds -----


def counts(model: str) -> tuple[int, int]:
    """(frozen base, adapter) elements of the whole peft model, in one process."""
    peft_model = apply_peft(small(model), lora_config(model))
    frozen = sum(p.numel() for p in peft_model.parameters() if not p.requires_grad)
    return frozen, sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def layout(runs: Batch, label: str, spec: tuple) -> tuple[int, int, list[tuple[str, dict]]]:
    """(ZeRO stage, dp, [(rank label, that rank's result: its ``memory`` report, cases/hf.py's frozen_report)])."""
    world, strategy, _, tp = spec
    stage = int(strategy[4]) if strategy.startswith("zero") else int(strategy.partition("zero_stage=")[2][:1] or 0)
    reports = [(f"{label} rank {rank}", runs[label].case("train", rank)) for rank in range(world)]
    return stage, world // tp, reports


def check_model_state_bytes(runs: Batch, label: str, spec: tuple) -> None:
    """Every rank's parameter, gradient and optimizer-state bytes (its storages, each once) equal the formula: the
    bf16 base's 2 bytes per element, sharded only by ZeRO-3 (and split by tp), plus the adapters' 16 sharded by
    the stage. Without tp the counts are the one-process model's; under tp each rank's own (its replicated tensors
    are whole on every tp rank), and the even split the planner assumes must not be above them."""
    model, tp = spec[2:]
    base, adapters = counts(model)
    stage, dp, reports = layout(runs, label, spec)
    for where, result in reports:
        mem = result["memory"]
        assert mem["frozen_dtypes"] == ["torch.bfloat16"], where
        if tp == 1:
            rank_base, rank_adapters = base, adapters
        else:
            rank_base, rank_adapters = mem["frozen_local_numel"], mem["adapter_local_numel"]
            even = adapter_model_state_bytes(base, adapters, zero_stage=stage, dp=dp, tp=tp, base_bytes_per_param=2)
            assert base // tp < rank_base < base and adapters // tp < rank_adapters < adapters, where
            assert even < mem["states"]["total"], where
        want = adapter_model_state_bytes(rank_base, rank_adapters, zero_stage=stage, dp=dp, base_bytes_per_param=2)
        got = mem["states"]
        sharded = ZERO_STAGES[stage].sharded
        assert got["grads"] == 4 * rank_adapters // (dp if "grads" in sharded else 1), f"{where}: {got}"
        assert got["optimizer"] == 8 * rank_adapters // (dp if "optimizer" in sharded else 1), f"{where}: {got}"
        assert got["total"] == want, f"{where}: {got} bytes held, the formula says {want}"
        if where.endswith(" 0"):
            print(f"{label}: rank 0 holds {got} (formula {want}; step counters apart: {mem['step_scalars']})")


def check_no_full_size_gradient(runs: Batch, label: str, spec: tuple) -> None:
    """On every rank: every backward gives gradients to the adapters' elements and no other (the autograd graph's
    leaves: a frozen weight there would get a full-size gradient, even for a moment), all fp32; no frozen
    parameter ever holds a gradient; no gradient buffer is larger than the adapters (after every backward), and
    after the step the gradient storages held add up to no more than the stage's share of the adapters (ZeRO-2/3:
    1/dp; ZeRO 0-1 keep them whole)."""
    model, tp = spec[2:]
    _, adapters = counts(model)
    stage, dp, reports = layout(runs, label, spec)
    for where, result in reports:
        mem = result["memory"]
        local = adapters if tp == 1 else mem["adapter_local_numel"]
        share = local // dp if "grads" in ZERO_STAGES[stage].sharded else local
        assert mem["leaf_numels"] and set(mem["leaf_numels"]) == {adapters}, f"{where}: {mem['leaf_numels']}"
        assert mem["leaf_dtypes"] == ["torch.float32"], where
        for i, held in enumerate([*mem["after_backward"], mem["after_step"]]):
            assert held and not [w for w, _, _ in held if w.startswith("frozen:")], f"{where} backward {i}: {held}"
            assert max(size for _, _, size in held) <= 4 * local, f"{where} backward {i}: {held}"
        assert result["flat_frozen"] == 0, f"{where}: {result['flat_frozen']} frozen parameters in a flat buffer"
        storages = {address: size for _, address, size in mem["after_step"]}
        assert sum(storages.values()) == 4 * share, f"{where}: {mem['after_step']} (share {share} elements)"


@pytest.mark.parametrize("label", list(FAST))
def test_model_state_bytes_equal_the_formula(label, fast_runs):
    check_model_state_bytes(fast_runs, label, FAST[label])


@pytest.mark.parametrize("label", list(FAST))
def test_no_full_size_gradient_buffer(label, fast_runs):
    check_no_full_size_gradient(fast_runs, label, FAST[label])


@pytest.mark.slow
@pytest.mark.parametrize("label", [k for k in SLOW if k in MEMORY_CHECKED])
def test_model_state_bytes_equal_the_formula_wider(label, slow_runs):
    check_model_state_bytes(slow_runs, label, SLOW[label])


@pytest.mark.slow
@pytest.mark.parametrize("label", [k for k in SLOW if k in MEMORY_CHECKED])
def test_no_full_size_gradient_buffer_wider(label, slow_runs):
    check_no_full_size_gradient(slow_runs, label, SLOW[label])


# ----- no process group -----


@pytest.mark.parametrize(("value", "dtype"), [("bf16", BF16), ("BFloat16", BF16), (BF16, BF16), ("fp32", None),
                                              ("float32", None), (torch.float32, None), (None, None)])  # fmt: skip
def test_base_dtype_converts_the_frozen_base_only(value, dtype):
    module = HFCausalLM(small("llama"), peft_config=lora_config("llama"), base_dtype=value)
    frozen = {p.dtype for p in module.parameters() if not p.requires_grad}
    assert frozen == {dtype or torch.float32}
    assert {p.dtype for p in module.parameters() if p.requires_grad} == {torch.float32}
    assert {b.dtype for b in module.buffers()} == {torch.float32}  # rotary frequencies stay as HF keeps them


def test_bf16_base_computes_the_adapters_in_fp32():
    """peft casts each LoRA layer's input to the adapter's dtype: the base layer sees bf16, lora_A fp32; one AdamW
    step gives gradients and optimizer states to the fp32 adapters only, the base unchanged."""
    module = HFCausalLM(small("llama"), peft_config=lora_config("llama"), base_dtype="bf16")
    q_proj = module.model.base_model.model.model.layers[0].self_attn.q_proj
    seen = {}

    def note(name):
        return lambda module, args: seen.update({name: args[0].dtype})  # returns None: the input is unchanged

    q_proj.base_layer.register_forward_pre_hook(note("base"))
    q_proj.lora_A["default"].register_forward_pre_hook(note("lora_A"))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    base = {n: p.clone() for n, p in module.named_parameters() if not p.requires_grad}
    optimizer = module.configure_optimizers()
    loss = module.loss(module(ids), ids)
    assert loss.dtype == torch.float32 and seen == {"base": BF16, "lora_A": torch.float32}
    assert sum(t.numel() for t in gradient_leaves(loss)) == counts("llama")[1]
    loss.backward()
    optimizer.step()
    assert all(p.grad is None for p in module.parameters() if not p.requires_grad)
    states = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert states and {v.dtype for v in states} == {torch.float32}
    assert all(torch.equal(p, base[n]) for n, p in module.named_parameters() if not p.requires_grad)


def test_gradient_leaves_show_a_weight_left_trainable():
    """The check behind test_no_full_size_gradient_buffer can fail: a base weight left trainable is a leaf of the
    graph (its full-size gradient would be allocated), and counts."""
    module = HFCausalLM(small("llama"), peft_config=lora_config("llama"), base_dtype="bf16")
    embed = module.hf_model.model.embed_tokens.weight
    embed.requires_grad_(True)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    leaves = gradient_leaves(module.loss(module(ids), ids))
    assert sum(t.numel() for t in leaves) == counts("llama")[1] + embed.numel()
    assert any(t is embed for t in leaves) and BF16 in {t.dtype for t in leaves}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"base_dtype": "fp16"}, ValueError, r"base_dtype='fp16'\) is not supported: use one of \['bf16'"),
        ({"base_dtype": torch.float16}, ValueError, r"base_dtype=torch.float16\) is not supported"),
        ({"base_dtype": 16}, TypeError, r"base_dtype=...\) takes a torch.dtype or a string, not int"),
        ({"base_dtype": "bf16", "peft_config": None}, ValueError, r"base_dtype='bf16'\) needs peft_config"),
    ],
)
def test_bad_base_dtype_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        HFCausalLM(small("llama"), **{"peft_config": lora_config("llama"), **kwargs})


def test_adapter_formula_by_hand():
    """1000 base elements in bf16 and 100 adapter elements at dp=4: ZeRO 0-2 keep the base whole (2000 bytes); the
    adapters' 400 bytes of parameters, 400 of gradients and 800 of AdamW states are sharded as each stage says."""
    by_stage = {0: 2000 + 1600, 1: 2000 + 800 + 800 // 4, 2: 2000 + 400 + 1200 // 4, 3: (2000 + 1600) // 4}
    for stage, want in by_stage.items():
        assert adapter_model_state_bytes(1000, 100, zero_stage=stage, dp=4, base_bytes_per_param=2) == want
    # tp x pp = 10 split both evenly (100 base elements at 4 bytes, 10 adapter elements), then ZeRO-3 over dp=4
    assert adapter_model_state_bytes(1000, 100, zero_stage=3, dp=4, tp=2, pp=5, base_bytes_per_param=4) == 100 + 40
    # the sharded part rounded up, as the padded buffers are: 3 adapter elements, 36 sharded bytes over dp=8
    assert adapter_model_state_bytes(0, 3, zero_stage=2, dp=8, base_bytes_per_param=2) == 12 + 5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_adapters_alone_are_the_zero_formula(stage):
    """No frozen base: the ZeRO formulas of the sharding table, fp32 AdamW (what the planner uses without
    adapters)."""
    for params, dp in ((1000, 1), (1000, 4), (1001, 4)):
        want = ZERO_STAGES[stage].state_bytes_exact(params, dp)
        assert adapter_model_state_bytes(0, params, zero_stage=stage, dp=dp, base_bytes_per_param=2) == want


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"dp": 0}, r"dp=0\): must be at least 1"), ({"zero_stage": 4}, r"zero_stage=4\): use 0, 1, 2 or 3"),
     ({"tp": 0}, r"tp=0\)")],
)  # fmt: skip
def test_adapter_formula_refuses_bad_degrees(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adapter_model_state_bytes(10, 1, **{"zero_stage": 1, "dp": 2, "base_bytes_per_param": 2, **kwargs})
