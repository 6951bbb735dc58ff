"""A GPT-style decoder you can read top to bottom (after nanoGPT): token and position embeddings,
pre-norm blocks, a head tied to the token embedding."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


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

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model({self.d_model}) must be a multiple of n_head({self.n_head}): change one of them."
            )


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

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape  # (B, T, C)
        # -1 for the head count: under tensor parallelism each rank holds n_head / tp heads
        q, k, v = (lin(x).view(B, T, -1, self.head_dim(x)).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
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


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token plus position embeddings: the first pipeline layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]  # (B, T) token ids
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.seq_len={self.seq_len}")
        return self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits: the last pipeline layer."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        if cfg.tie_weights:
            self.head.lm_head.weight = self.embed.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

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

    def check_tensor_parallel(self, tp: int) -> None:
        """Tensor parallelism splits heads, the MLP and the vocabulary: each must divide by tp."""
        cfg = self.cfg
        for name, size in [("n_head", cfg.n_head), ("d_model", cfg.d_model), ("vocab_size", cfg.vocab_size)]:
            if size % tp:
                raise ValueError(f"tp={tp} does not divide GPTConfig.{name}={size}: choose tp among its divisors.")


def gpt_tp_plan(prefix: str = "", sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Megatron's plan for :class:`GPT`: heads and MLP split column-then-row, the vocabulary split in the
    embedding (row-wise) and the head (column-wise, logits left sharded for a vocabulary-parallel loss).

    With ``sequence_parallel`` the layer norms and the residual stream between blocks are split along the
    sequence (dim 1) as well, and the tp all-reduces become reduce-scatter / all-gather pairs.
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
        f"{block}.mlp.fc": ColwiseParallel(),
        f"{block}.mlp.proj": RowwiseParallel(output_layouts=seq),
        f"{prefix}head.lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
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
                f"{block}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                f"{prefix}head.ln_f": SequenceParallel(),
            }
        )
    return plan
