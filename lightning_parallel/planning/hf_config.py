"""A transformer's shape for the analytic planner (:mod:`.analytic`): from a Hugging Face ``config.json``, a LitGPT
name, a recipe GPT config or plain GPT dimensions. Pure Python: nothing is instantiated.

Hugging Face families read: llama, mistral, qwen2, qwen3, gemma (1-3), gpt2, mixtral, qwen2_moe, qwen3_moe,
deepseek_v3 (multi-head latent attention and shared experts). MoE layers are described by their routed experts,
top-k, the experts' FFN width, shared experts and which layers are dense.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe"}
GATED |= {"deepseek_v3", "deepseek_v2", "phi3", "olmo2", "granite"}


@dataclass(frozen=True)
class ModelShape:
    """What the analytic model needs of a decoder-only transformer.

    Attributes:
        name: for tables.
        vocab, hidden, layers, heads, kv_heads: the usual dimensions (kv_heads < heads: grouped-query attention).
        qk_head_dim, v_head_dim: per-head widths of queries/keys and of values (equal but for MLA).
        ffn: a dense MLP's intermediate width; gated: SwiGLU/GeGLU (three matrices) or a plain two-matrix MLP.
        attn_params: parameters of one attention block (None: q, k, v, o projections from the dimensions).
        tied: the output head shares the embedding.
        experts, top_k, moe_ffn: routed experts per MoE layer, experts per token and each expert's width.
        shared_ffn: the summed width of a MoE layer's shared (always-on) experts.
        dense_layers: how many layers have a dense MLP (the rest are MoE; 0 for a dense model with experts=0).
        dropout: the blocks keep dropout masks (Megatron's GPT does; current LLMs train without).
        seq_len: the model's context length (the default sequence).
        biases: every linear and norm has a bias (GPT-2, Megatron's GPT); learned_positions: rows of a learned
            position embedding (0: rotary).
    """

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    ffn: int
    gated: bool = True
    attn_params: int | None = None
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    dropout: bool = False
    seq_len: int = 2048
    biases: bool = False
    learned_positions: int = 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def attention_params(self) -> int:
        if self.attn_params is not None:
            return self.attn_params
        q, kv = self.heads * self.qk_head_dim, self.kv_heads * (self.qk_head_dim + self.v_head_dim)
        return self.hidden * (q + kv) + self.heads * self.v_head_dim * self.hidden

    def mlp_params(self, width: int) -> int:
        return (3 if self.gated else 2) * self.hidden * width

    def _mlp_biases(self, width: int) -> int:
        return ((2 if self.gated else 1) * width + self.hidden) if self.biases else 0

    def expert_params_per_layer(self) -> int:
        """The routed experts' parameters of one MoE layer (split over ep)."""
        return self.experts * self.mlp_params(self.moe_ffn)

    def layer_params(self, moe: bool) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of one layer: attention, norms, a dense MLP or a router, the
        shared experts and the routed ones."""
        base = self.attention_params() + 2 * self.hidden
        if self.biases:  # q, k, v and output projections, two norms
            base += self.heads * self.qk_head_dim + self.kv_heads * (self.qk_head_dim + self.v_head_dim)
            base += 3 * self.hidden
        if not moe:
            return base + self.mlp_params(self.ffn) + self._mlp_biases(self.ffn), 0
        return base + self.hidden * self.experts + self.mlp_params(self.shared_ffn), self.expert_params_per_layer()

    def lora_params(self, rank: int, moe: bool) -> int:
        """LoRA adapter elements of one layer at ``rank``: the q, k, v and output projections and the dense (or
        shared-expert) MLP linears, r (in + out) each; routers and routed experts keep none."""
        h, q, kv = self.hidden, self.heads * self.qk_head_dim, self.kv_heads * self.qk_head_dim
        attn = (h + q) + (h + kv) + (h + self.kv_heads * self.v_head_dim) + (self.heads * self.v_head_dim + h)
        width = self.shared_ffn if moe else self.ffn
        return rank * (attn + ((3 if self.gated else 2) * (h + width) if width else 0))

    def embedding_params(self) -> int:
        extra = self.learned_positions * self.hidden + (self.hidden if self.biases else 0)
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden + extra

    def num_params(self) -> int:
        dense, _ = self.layer_params(False)
        base, experts = self.layer_params(True)
        return self.embedding_params() + self.dense_layers_count() * dense + self.moe_layers * (base + experts)

    def dense_layers_count(self) -> int:
        return self.layers - self.moe_layers

    def active_params(self) -> int:
        """Parameters one token goes through (top-k of the routed experts), the embedding lookup excluded and the
        output head included: what the 6 N FLOPs-per-token count multiplies."""
        dense, _ = self.layer_params(False)
        base, _ = self.layer_params(True)
        moe = base + self.top_k * self.mlp_params(self.moe_ffn)
        return self.vocab * self.hidden + self.dense_layers_count() * dense + self.moe_layers * moe

    def experts_per_rank(self, ep: int) -> int:
        """Routed experts of each MoE layer on one ep rank."""
        if not self.experts:
            raise ValueError(f"ep={ep} needs a MoE model, and {self.name} has no routed experts: use ep=1.")
        if ep < 1 or self.experts % ep:
            raise ValueError(f"ep={ep} must divide the {self.experts} experts of {self.name}: pick a divisor.")
        return self.experts // ep

    def all_to_all_bytes(self, tokens: int, ep: int, act_bytes: int = 2) -> float:
        """Bytes one rank sends to other ep ranks per step for ``tokens`` tokens through every MoE layer: each
        token's hidden vector to each of its top-k experts, dispatched and combined, forward and backward (4
        all-to-alls), (ep-1)/ep of them off the rank (uniform routing)."""
        self.experts_per_rank(ep)
        return 4 * self.moe_layers * tokens * self.top_k * self.hidden * act_bytes * (ep - 1) / ep


def gpt_shape(name: str, layers: int, hidden: int, heads: int, vocab: int, seq_len: int) -> ModelShape:
    """Megatron's GPT: fused MHA, a 4h GeLU MLP, biases, learned positions, tied embeddings, dropout."""
    head = hidden // heads
    return ModelShape(
        name,
        vocab,
        hidden,
        layers,
        heads,
        heads,
        head,
        head,
        4 * hidden,
        gated=False,
        tied=True,
        dropout=True,
        seq_len=seq_len,
        biases=True,
        learned_positions=seq_len,
    )


def _get(c: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if c.get(key) is not None:
            return c[key]
    return default


def from_hf_config(c: dict[str, Any], name: str = "") -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dictionary (``text_config`` for multimodal ones).

    Args:
        c: the parsed config.
        name: for tables (default: ``model_type``).
    """
    c = c.get("text_config") or c
    kind = c.get("model_type", "")
    hidden = _get(c, "hidden_size", "n_embd", "d_model")
    layers = _get(c, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(c, "num_attention_heads", "n_head")
    if not (hidden and layers and heads and c.get("vocab_size")):
        raise ValueError(
            f"config {name or kind!r} lacks hidden_size, num_hidden_layers, num_attention_heads or vocab_size: "
            "give a decoder-only transformer's config.json."
        )
    head_dim = _get(c, "head_dim", default=hidden // heads)
    kv = _get(c, "num_key_value_heads", default=heads)
    ffn = _get(c, "intermediate_size", "n_inner", default=4 * hidden)
    shape = dict(
        name=name or kind,
        vocab=c["vocab_size"],
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv,
        qk_head_dim=head_dim,
        v_head_dim=head_dim,
        ffn=ffn,
        gated=kind in GATED,
        biases=kind == "gpt2",
        learned_positions=c.get("n_positions", 0) if kind == "gpt2" else 0,
        tied=bool(c.get("tie_word_embeddings", kind == "gpt2")),
        seq_len=_get(c, "max_position_embeddings", "n_positions", default=2048),
    )
    shape.update(_moe_fields(c, kind, layers))
    if kind in ("deepseek_v3", "deepseek_v2"):
        shape.update(_mla_fields(c, hidden, heads))
    return ModelShape(**shape)


def _moe_fields(c: dict[str, Any], kind: str, layers: int) -> dict[str, Any]:
    experts = _get(c, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    if not experts:
        return {}
    moe_ffn = _get(c, "moe_intermediate_size", default=c.get("intermediate_size"))
    shared = c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * moe_ffn
    if kind in ("deepseek_v3", "deepseek_v2"):
        dense = c.get("first_k_dense_replace", 0)
    else:  # qwen-MoE: every decoder_sparse_step-th layer is MoE, but mlp_only_layers
        step = c.get("decoder_sparse_step", 1) or 1
        only = set(c.get("mlp_only_layers") or [])
        dense = sum(1 for i in range(layers) if i in only or (i + 1) % step)
    return {
        "experts": experts,
        "top_k": c.get("num_experts_per_tok", 2),
        "moe_ffn": moe_ffn,
        "shared_ffn": shared,
        "dense_layers": dense,
    }


def _mla_fields(c: dict[str, Any], hidden: int, heads: int) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections."""
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_rank, kv_rank = c.get("q_lora_rank"), c["kv_lora_rank"]
    q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
    kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v)
    return {"qk_head_dim": nope + rope, "v_head_dim": v, "kv_heads": heads, "attn_params": q + kv + heads * v * hidden}


def load_hf_config(path: str | Path) -> ModelShape:
    """Read ``config.json`` (or the one in a folder) into a :class:`ModelShape`."""
    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    if not file.is_file():
        raise ValueError(f"{path} is neither a config.json nor a folder holding one.")
    return from_hf_config(json.loads(file.read_text()), name=file.parent.name if file.name == "config.json" else "")


def from_litgpt(name: str) -> ModelShape:
    """A LitGPT model by name (``litgpt.Config.from_name``)."""
    from litgpt import Config  # lazily: litgpt is optional for the planner

    try:
        c = Config.from_name(name)
    except ValueError as err:
        raise ValueError(f"{name!r} is not a LitGPT model name ({err}).") from None
    return litgpt_shape(c, name)


def litgpt_shape(c: Any, name: str = "") -> ModelShape:
    """A :class:`ModelShape` from a ``litgpt.Config`` (``model=litgpt`` in the recipes: a name or a checkpoint
    folder's config, with the recipe's changes applied)."""
    gated = c.mlp_class_name in ("LLaMAMLP", "GemmaMLP", "LLaMAMoE")
    moe = {}
    if c.mlp_class_name == "LLaMAMoE":
        moe = {
            "experts": c.n_expert,
            "top_k": c.n_expert_per_token,
            "moe_ffn": c.moe_intermediate_size or c.intermediate_size,
        }
    return ModelShape(
        name or c.name,
        c.padded_vocab_size,
        c.n_embd,
        c.n_layer,
        c.n_head,
        c.n_query_groups,
        c.head_size,
        c.head_size,
        c.intermediate_size,
        gated=gated,
        tied=False,
        seq_len=c.block_size,
        **moe,
    )


def from_recipe(m: Any, name: str = "") -> ModelShape:
    """This package's recipe GPT (a ``GPTModelConf``): a plain GeLU MLP of ``mlp_ratio`` x d_model, tied head."""
    shape = gpt_shape(name, m.n_layer, m.d_model, m.n_head, m.vocab_size, m.seq_len)
    ffn = int(m.mlp_ratio * m.d_model)
    moe = {}
    if getattr(m, "moe_experts", 0):
        moe_layers = m.n_layer // (getattr(m, "moe_every", 1) or 1)  # blocks every-1, 2 every-1, ...
        moe = {
            "experts": m.moe_experts,
            "top_k": m.moe_top_k,
            "moe_ffn": getattr(m, "moe_hidden", None) or ffn,
            "shared_ffn": getattr(m, "moe_shared_hidden", 0),
            "dense_layers": m.n_layer - moe_layers,
        }
    return ModelShape(**{**shape.__dict__, "ffn": ffn, "dropout": bool(m.dropout), **moe})
