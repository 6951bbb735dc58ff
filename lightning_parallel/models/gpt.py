"""A GPT-style decoder you can read top to bottom (after nanoGPT): token and position embeddings,
pre-norm blocks, a head tied to the token embedding."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_parallel.parallel.expert.moe import GroupedExperts, MoE, check_moe_settings


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes; divisible by tp 1, 2, 4, 8 for vocabulary-parallel embeddings
    seq_len: int = 64  # longest context the position embedding covers
    n_layer: int = 4  # blocks: the units pipeline stages and ZeRO-3 split the model into
    n_head: int = 4  # attention heads; tensor parallelism splits them, so tp must divide it
    d_model: int = 64  # width; a multiple of n_head
    mlp_ratio: int = 4  # hidden width of the MLP relative to d_model
    dropout: float = 0.0  # 0 keeps runs comparable across layouts
    tie_weights: bool = True  # the head reuses the token embedding (GPT-2 does)
    # Mixture-of-Experts: 0 keeps every FFN dense; E > 0 makes every moe_every-th block's FFN a MoE of E experts
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 2  # blocks moe_every-1, 2*moe_every-1, ... (every other block by default)
    moe_hidden: int | None = None  # each expert's hidden width (None: mlp_ratio * d_model)
    moe_capacity_factor: float | None = None  # None: dropless
    moe_shared_hidden: int = 0  # a shared expert's hidden width (0: none)
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model({self.d_model}) must be a multiple of n_head({self.n_head}): change one of them."
            )
        if self.moe_experts:
            check_moe_settings(self.moe_experts, self.moe_top_k, self.moe_capacity_factor, "gelu")
            if isinstance(self.moe_every, bool) or not isinstance(self.moe_every, int) or self.moe_every < 1:
                raise ValueError(f"moe_every={self.moe_every!r}: set it to a positive integer (2: every other block).")

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` (0-based) has a MoE FFN."""
        return bool(self.moe_experts) and i % self.moe_every == self.moe_every - 1

    @property
    def moe_blocks(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_moe_block(i)]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Causal attention of (B, H, T, D) queries, keys and values: the default ``attention_core``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)


def arange_positions(seq_len: int, device: torch.device) -> Tensor:
    """Positions 0..T-1: the default ``position_ids``."""
    return torch.arange(seq_len, device=device)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        # q, k and v are separate so tensor parallelism can split each by heads column-wise
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        # no key bias: it adds the same score to every key of a query, which softmax cancels, so its
        # true gradient is 0 and Adam would only amplify rounding noise into it
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        # context parallelism points this at attention across the cp ranks (GPT.context_parallel)
        self.attention_core = causal_attention

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape  # (B, T, C)
        # -1 for the head count: under tensor parallelism each rank holds n_head / tp heads
        q, k, v = (lin(x).view(B, T, -1, self.head_dim(x)).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = self.attention_core(q, k, v, dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)

    def head_dim(self, x: Tensor) -> int:
        return x.shape[-1] // self.n_head


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


def _layer_generator(index: int) -> torch.Generator:
    """Random numbers for one layer's initial weights: from the global seed and the layer's position only,
    so a layer gets the same weights whichever rank or pipeline stage materializes it."""
    return torch.Generator().manual_seed((torch.initial_seed() * 1_000_003 + index) % 2**63)


@torch.no_grad()
def _normal_(tensor: Tensor, std: float, generator: torch.Generator) -> None:
    # drawn on the host then copied, so every device type gets the same numbers
    tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)


def _reset_linears_and_norms(module: nn.Module, generator: torch.Generator, residual_std: float) -> None:
    """GPT-2's init: weights N(0, 0.02) (residual projections scaled down), biases 0, norms 1 and 0."""
    for name, sub in module.named_modules():
        if isinstance(sub, GroupedExperts):
            sub.reset_parameters(generator, std=0.02, out_std=residual_std)
        elif isinstance(sub, nn.Linear):
            _normal_(sub.weight, residual_std if name.endswith("proj") else 0.02, generator)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.LayerNorm):
            sub.reset_parameters()


def moe_ffn(cfg: GPTConfig) -> MoE:
    return MoE(
        cfg.d_model,
        cfg.moe_hidden or cfg.mlp_ratio * cfg.d_model,
        cfg.moe_experts,
        cfg.moe_top_k,
        capacity_factor=cfg.moe_capacity_factor,
        shared_hidden=cfg.moe_shared_hidden,
        aux_loss_coeff=cfg.moe_aux_loss_coeff,
        z_loss_coeff=cfg.moe_z_loss_coeff,
    )


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, index: int) -> None:
        super().__init__()
        self.index = index  # position among the pipeline layers: seeds its initial weights
        self.residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp: nn.Module = moe_ffn(cfg) if cfg.is_moe_block(index - 1) else MLP(cfg)

    def reset_parameters(self) -> None:
        _reset_linears_and_norms(self, _layer_generator(self.index), self.residual_std)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token plus position embeddings: the first pipeline layer."""

    index = 0  # first pipeline layer

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        # context parallelism points this at the positions of this rank's pieces of the sequence (GPT.context_parallel)
        self.position_ids = arange_positions

    def reset_parameters(self) -> None:
        generator = _layer_generator(self.index)
        _normal_(self.wte.weight, 0.02, generator)  # first draw: Head repeats it for a tied lm_head
        _normal_(self.wpe.weight, 0.02, generator)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]  # (B, T) token ids
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.seq_len={self.seq_len}")
        return self.wte(idx) + self.wpe(self.position_ids(T, idx.device))  # (B, T, C)


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits: the last pipeline layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.index = cfg.n_layer + 1
        self.tied = cfg.tie_weights
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def reset_parameters(self) -> None:
        self.ln_f.reset_parameters()
        # a tied head gets the embedding's values, also when a pipeline stage holds its own copy
        generator = _layer_generator(Embedding.index if self.tied else self.index)
        _normal_(self.lm_head.weight, 0.02, generator)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)


class RecipeGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg, index=1 + i) for i in range(cfg.n_layer))
        self.head = Head(cfg)
        if cfg.tie_weights:
            self.head.lm_head.weight = self.embed.wte.weight
        if not self.embed.wte.weight.is_meta:  # on the meta device the strategy initializes each stage
            self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in self.layers():
            layer.reset_parameters()

    def layers(self) -> list[nn.Module]:
        """The model as a sequence: embedding, blocks, head. Pipeline stages cut it between layers."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: Tensor) -> Tensor:
        x = idx
        for layer in self.layers():
            x = layer(x)
        return x  # (B, T, V) logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def context_parallel(self, attention: Callable[..., Tensor], positions: Callable[..., Tensor]) -> list[str]:
        """Context parallelism (the model protocol's ``context_parallel``): every block's ``attn.attention_core``
        pointed at ``attention``, the embedding's ``position_ids`` at ``positions``; the attention modules' paths."""
        if isinstance(self.embed, Embedding):  # under pp another stage's layers are placeholders here
            self.embed.position_ids = positions
        blocks = [(i, block) for i, block in enumerate(self.blocks) if isinstance(block, Block)]
        for _, block in blocks:
            block.attn.attention_core = attention
        return [f"blocks.{i}.attn" for i, _ in blocks]

    def check_tensor_parallel(self, tp: int) -> None:
        """Tensor parallelism splits heads, the MLP and the vocabulary: each must divide by tp."""
        self.check_tensor_parallel_config(self.cfg, tp)

    @staticmethod
    def check_tensor_parallel_config(cfg: GPTConfig, tp: int) -> None:
        for name, size in [("n_head", cfg.n_head), ("d_model", cfg.d_model), ("vocab_size", cfg.vocab_size)]:
            if size % tp:
                raise ValueError(f"tp={tp} does not divide GPTConfig.{name}={size}: choose tp among its divisors.")


def gpt_tp_plan(
    prefix: str = "", sequence_parallel: bool = False, moe_blocks: list[int] | None = None, n_layer: int = 0
) -> dict[str, ParallelStyle]:
    """Megatron's plan for :class:`GPT`: heads and MLP split column-then-row, the vocabulary split in the
    embedding (row-wise) and the head (column-wise, logits left sharded for a vocabulary-parallel loss).

    With ``sequence_parallel`` the layer norms and the residual stream between blocks are split along the
    sequence (dim 1) as well, and the tp all-reduces become reduce-scatter / all-gather pairs.

    MoE blocks (``moe_blocks`` of ``n_layer``) keep their experts replicated over tp: each tp rank routes the same
    tokens (under sequence parallelism the sequence is gathered before the MoE and split again after it).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    block = f"{prefix}blocks.*"
    plan: dict[str, ParallelStyle] = {
        # the sum of the embeddings is replicated: the position embedding is added before any sharding
        f"{prefix}embed.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        f"{block}.attn.q": ColwiseParallel(),
        f"{block}.attn.k": ColwiseParallel(),
        f"{block}.attn.v": ColwiseParallel(),
        f"{block}.attn.proj": RowwiseParallel(output_layouts=seq),
        f"{prefix}head.lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        # q, k and v read one replicated DTensor: their input gradients add up as partial sums and are
        # all-reduced once in backward (Megatron's f), not once per projection
        f"{block}.attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
    }
    if sequence_parallel:
        plan.update(
            {
                # the first block takes the replicated embeddings and keeps only its slice of the sequence
                f"{prefix}blocks.0": PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
                f"{block}.ln_1": SequenceParallel(),
                f"{block}.ln_2": SequenceParallel(),
                f"{block}.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                f"{prefix}head.ln_f": SequenceParallel(),
            }
        )
    moe = set(moe_blocks or ())
    dense = [f"{prefix}blocks.{i}" for i in range(n_layer) if i not in moe] if moe else [block]
    for b in dense:
        plan[f"{b}.mlp.fc"] = ColwiseParallel()
        plan[f"{b}.mlp.proj"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan[f"{b}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for i in sorted(moe):
        if sequence_parallel:
            plan[f"{prefix}blocks.{i}.mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
            )
    return plan
