"""VGG with BatchNorm for small images (CIFAR's 32x32), read top to bottom: groups of conv-bn-relu (some
ending in a 2x2 max-pool), then a two-layer classifier head. No torchvision.

Configurations A (VGG11) and D (VGG16) of Simonyan and Zisserman, 2014, with every channel count scaled by
``VGGConfig.width / 64`` so tests can run a tiny one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_parallel.models.gpt import _layer_generator, _normal_
from lightning_parallel.parallel.spatial.layout import check_spatial_layout
from lightning_parallel.parallel.tensor.conv import (
    ChannelInParallel,
    ChannelNormParallel,
    ChannelOutParallel,
    check_conv_tp_plan,
)
from lightning_parallel.parallel.tensor.plan import check_tp_plan

# output channels of each conv at full width (64); "M" closes the group before it with a 2x2 max-pool
VGG_LAYOUTS: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}
_POOLS = 5  # every layout halves the image five times


@dataclass
class VGGConfig:
    name: str = "vgg11"  # "vgg11" (8 convs) or "vgg16" (13 convs): pipeline layers are the convs plus the head
    num_classes: int = 10  # CIFAR-10
    width: int = 64  # channels of the first convs (the paper's 64); later ones have 2x, 4x, 8x: tp must divide them
    in_channels: int = 3  # RGB
    image_size: int = 32  # height = width of the input; five max-pools need a multiple of 32
    batch_norm: bool = True  # BatchNorm after every conv (then the conv has no bias: the norm would cancel it)

    def __post_init__(self) -> None:
        if self.name not in VGG_LAYOUTS:
            raise ValueError(f"VGGConfig.name={self.name!r} is not one of {sorted(VGG_LAYOUTS)}: pick one of them.")
        if self.width < 1:
            raise ValueError(f"VGGConfig.width={self.width} must be at least 1 (64 is the paper's VGG).")
        if self.image_size % 2**_POOLS:
            raise ValueError(
                f"VGGConfig.image_size={self.image_size} must be a multiple of {2**_POOLS}: the {_POOLS} max-pools "
                "halve it five times."
            )

    def conv_channels(self) -> list[tuple[int, bool]]:
        """(output channels, ends with a max-pool) of each conv, in order."""
        groups: list[tuple[int, bool]] = []
        for item in VGG_LAYOUTS[self.name]:
            if item == "M":
                groups[-1] = (groups[-1][0], True)
            else:
                groups.append((max(1, int(item) * self.width // 64), False))
        return groups


class ConvGroup(nn.Module):
    """conv 3x3 -> BatchNorm -> ReLU (-> 2x2 max-pool): one pipeline layer."""

    def __init__(self, in_channels: int, out_channels: int, pool: bool, batch_norm: bool, index: int) -> None:
        super().__init__()
        self.index = index  # position among the pipeline layers: seeds its initial weights
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=not batch_norm)
        if batch_norm:
            self.bn = nn.BatchNorm2d(out_channels)
        else:
            self.bn = None
        self.pool = pool

    def reset_parameters(self) -> None:
        # He et al.'s fan-out normal for a conv followed by ReLU (torchvision's VGG init)
        fan_out = self.conv.out_channels * math.prod(self.conv.kernel_size)
        _normal_(self.conv.weight, math.sqrt(2.0 / fan_out), _layer_generator(self.index))
        if self.conv.bias is not None:
            nn.init.zeros_(self.conv.bias)
        if self.bn is not None:
            self.bn.reset_parameters()  # weight 1, bias 0, running statistics 0 and 1

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)  # (B, C_out, H, W)
        if self.bn is not None:
            x = self.bn(x)
        x = F.relu(x)
        return F.max_pool2d(x, 2) if self.pool else x  # (B, C_out, H/2, W/2) after a pool


class Head(nn.Module):
    """flatten -> Linear -> ReLU -> Linear to class logits: the last pipeline layer."""

    def __init__(self, in_features: int, hidden: int, num_classes: int, index: int) -> None:
        super().__init__()
        self.index = index
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def reset_parameters(self) -> None:
        generator = _layer_generator(self.index)
        _normal_(self.fc1.weight, math.sqrt(2.0 / self.fc1.in_features), generator)
        _normal_(self.fc2.weight, 0.01, generator)  # small logits: the first loss is about log(num_classes)
        nn.init.zeros_(self.fc1.bias)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.relu(self.fc1(x.flatten(1))))  # (B, C, h, w) -> (B, num_classes)


class VGG(nn.Module):
    def __init__(self, cfg: VGGConfig) -> None:
        super().__init__()
        self.cfg = cfg
        groups, channels = [], cfg.in_channels
        for i, (out_channels, pool) in enumerate(cfg.conv_channels()):
            groups.append(ConvGroup(channels, out_channels, pool, cfg.batch_norm, index=i))
            channels = out_channels
        self.features = nn.ModuleList(groups)
        side = cfg.image_size // 2**_POOLS  # 1 for 32x32 images
        self.head = Head(channels * side * side, channels, cfg.num_classes, index=len(groups))
        if not self.head.fc1.weight.is_meta:  # on the meta device the strategy initializes each stage
            self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in self.layers():
            layer.reset_parameters()

    def layers(self) -> list[nn.Module]:
        """The model as a sequence: the conv groups, then the head. Pipeline stages cut it between layers."""
        return [*self.features, self.head]

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers():  # (B, 3, 32, 32) -> ... -> (B, 8 * width, 1, 1)
            x = layer(x)
        return x  # (B, num_classes) logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def check_tensor_parallel(self, tp: int, prefix: str = "") -> None:
        """Every channel and feature count the plan splits must divide by tp."""
        plan = vgg_tp_plan(prefix, self.cfg)
        check_conv_tp_plan(self, plan, tp, fix="or change VGGConfig.width (every channel count is a multiple of it)")
        check_tp_plan(self, plan, tp)

    @staticmethod
    def check_spatial_parallel_config(cfg: VGGConfig, spatial: int) -> None:
        """Refuse an image size the ``spatial`` strips cannot split through the five pools (traced on meta)."""
        with torch.device("meta"):
            model = VGG(cfg)
            example = torch.empty(1, cfg.in_channels, cfg.image_size, cfg.image_size)
        check_spatial_layout(model, spatial, ["head"], example)

    @staticmethod
    def check_tensor_parallel_config(cfg: VGGConfig, tp: int) -> None:
        """:meth:`check_tensor_parallel` from the config alone (builds the model on the meta device)."""
        with torch.device("meta"):
            model = VGG(cfg)
        model.check_tensor_parallel(tp)


def vgg_tp_plan(prefix: str = "", cfg: VGGConfig | None = None) -> dict[str, ParallelStyle]:
    """Megatron's pairing for :class:`VGG`, on channels: conv ``i`` split by output channels (its BatchNorm
    on the same channel shard), conv ``i + 1`` by input channels with its partial outputs summed; the head's
    two Linears column-then-row. Every pair ends replicated, so the head sees whole features.

    With an odd number of convs (VGG16) the first conv stays replicated: at 3 input channels it is the
    cheapest to repeat on every rank.

    Args:
        prefix: the path of the :class:`VGG` inside the module the plan is applied to (``"model."``).
        cfg: the model's configuration (its conv count and whether it has BatchNorm).
    """
    cfg = cfg or VGGConfig()
    convs = len(cfg.conv_channels())
    plan: dict[str, ParallelStyle] = {}
    for i in range(convs % 2, convs, 2):
        plan[f"{prefix}features.{i}.conv"] = ChannelOutParallel()
        if cfg.batch_norm:
            plan[f"{prefix}features.{i}.bn"] = ChannelNormParallel()
        plan[f"{prefix}features.{i + 1}.conv"] = ChannelInParallel()
    plan[f"{prefix}head.fc1"] = ColwiseParallel()
    plan[f"{prefix}head.fc2"] = RowwiseParallel()
    return plan
