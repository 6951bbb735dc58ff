"""The weight matrices (linear layers) of one transformer layer of a :class:`~.hf_config.ModelShape`, for what
treats matrices apart from other parameters: FP8 training (:mod:`.fp8`: which linears torchao converts) and Muon
(:mod:`.muon`: which parameters are orthogonalized, and their shapes). Pure Python.

- Attention: separate q, k and v projections (Hugging Face's, LitGPT's and the recipe GPT's layout; GPT-2's fused
  ``Conv1D`` is no ``nn.Linear`` and neither torchao nor Muon's split rule takes it), then the output projection.
  Multi-head latent
  attention (``attn_params`` given) is taken as one input matrix ``hidden x (attn_params / hidden - heads * v)``
  and the output projection: its low-rank factors are not listed one by one.
- MLP: gate, up and down (gated) or fc and proj, of the dense width; a MoE layer's shared experts the same at
  their summed width.
- MoE: the router (``experts x hidden``) and the routed experts (``count`` = experts, stacked in one 3-D tensor
  per matrix by Hugging Face, the recipe's ``MoE`` and LitGPT alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.planning.hf_config import ModelShape

ROW_PARALLEL = ("o", "down", "proj")  # tp splits these by their input features (the others by their outputs)


@dataclass(frozen=True)
class Matrix:
    """One linear layer's weight: ``rows`` (output features) x ``cols`` (input features), ``count`` of them (the
    routed experts); ``kind``: ``attention``, ``mlp`` (dense or shared-expert), ``router`` or ``expert``."""

    name: str
    rows: int
    cols: int
    kind: str
    count: int = 1

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


def layer_matrices(shape: ModelShape, moe: bool) -> list[Matrix]:
    """The weight matrices of one dense (``moe=False``) or MoE layer of ``shape`` (module docstring)."""
    s, h = shape, shape.hidden
    q, k, v = s.heads * s.qk_head_dim, s.kv_heads * s.qk_head_dim, s.kv_heads * s.v_head_dim
    out = Matrix("o", h, s.heads * s.v_head_dim, "attention")
    if s.attn_params is not None:  # multi-head latent attention, its input side as one matrix
        attn = [Matrix("qkv", s.attn_params // h - s.heads * s.v_head_dim, h, "attention"), out]
    else:
        attn = [Matrix("q", q, h, "attention"), Matrix("k", k, h, "attention"), Matrix("v", v, h, "attention"), out]
    if not moe:
        return attn + _mlp(s, s.ffn, "mlp")
    shared = _mlp(s, s.shared_ffn, "mlp") if s.shared_ffn else []
    experts = [Matrix(m.name, m.rows, m.cols, "expert", s.experts) for m in _mlp(s, s.moe_ffn, "expert")]
    return [*attn, Matrix("router", s.experts, h, "router"), *shared, *experts]


def _mlp(s: ModelShape, width: int, kind: str) -> list[Matrix]:
    h = s.hidden
    if s.gated:
        return [Matrix("gate", width, h, kind), Matrix("up", width, h, kind), Matrix("down", h, width, kind)]
    return [Matrix("fc", width, h, kind), Matrix("proj", h, width, kind)]


def stage_matrices(shape: ModelShape, dense: int, moe: int) -> list[tuple[Matrix, int]]:
    """Each matrix of ``dense`` dense and ``moe`` MoE layers (one pipeline stage's) with how many layers hold it."""
    return [(m, dense) for m in layer_matrices(shape, False)] + [(m, moe) for m in layer_matrices(shape, True)]
