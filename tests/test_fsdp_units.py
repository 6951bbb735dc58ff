"""ZeRO-3 unit choice: blocks, leftover top-level children, tied weights kept in one unit."""

from __future__ import annotations

import ast
import subprocess
import sys

from harness import REPO, free_port
from torch import nn

from lightning_parallel.models import GPTModule
from lightning_parallel.parallel.data.fsdp import fsdp_units

sys.path.insert(0, str(REPO / "examples"))
from byo_model import MLPClassifier  # noqa: E402


def test_gpt_units_are_blocks_then_the_model():
    assert fsdp_units(GPTModule()) == [f"model.blocks.{i}" for i in range(4)] + ["model"]


class TiedAtTop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def test_weights_tied_across_top_level_children_move_to_the_root():
    assert fsdp_units(TiedAtTop()) == ["layers.0", "layers.2", ""]


class Loose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(nn.init.ones_(nn.Parameter(nn.Linear(1, 1).weight.new_empty(3))))
        self.proj = nn.Linear(3, 3)


def test_parameters_directly_on_the_root_make_the_root_a_unit():
    assert fsdp_units(Loose()) == ["proj", ""]


def test_every_parameter_belongs_to_exactly_one_unit():
    model = GPTModule()
    units = fsdp_units(model)
    owners: dict[int, list[str]] = {}
    for unit in units:
        module = model.get_submodule(unit)
        nested = [u for u in units if u != unit and (unit == "" or u.startswith(unit + "."))]
        inner = {id(p) for u in nested for p in model.get_submodule(u).parameters()}
        for p in module.parameters():
            if id(p) not in inner:
                owners.setdefault(id(p), []).append(unit)
    assert all(len(v) == 1 for v in owners.values())
    assert len(owners) == len(list(model.parameters()))


def test_a_model_with_no_enclosing_unit_gets_the_root_as_one():
    # stem, blocks and head would each be an FSDP2 root of its own, kept gathered from forward to backward
    model = MLPClassifier(depth=2)
    assert fsdp_units(model) == ["blocks.0", "blocks.1", "head.0", "head.1", "stem", ""]


_RESHARD = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
sys.path.insert(0, {examples!r})
from byo_model import MLPClassifier
from lightning_parallel.parallel.data.fsdp import apply_fsdp, set_prefetch
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = MLPClassifier(depth=3)
units = apply_fsdp(model, init_device_mesh("cpu", (1,)))
model(torch.randn(4, 32)).sum().backward()
state = lambda u: model.get_submodule(u)._get_fsdp_state()
roots = [u for u in units if state(u)._is_root]
gathered = [u for u in units if u and state(u)._fsdp_param_group.is_unsharded]
print("RESULT", repr((roots, gathered, set_prefetch(model, units))))
dist.destroy_process_group()
"""


def test_every_unit_but_the_root_is_freed_after_forward_and_blocks_prefetch_the_next():
    script = _RESHARD.format(examples=str(REPO / "examples"), port=free_port())
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, out.stderr[-3000:]
    roots, gathered, pairs = ast.literal_eval(line.removeprefix("RESULT "))
    assert roots == [""] and gathered == []
    assert pairs == [("blocks.0", "blocks.1"), ("blocks.1", "blocks.2")]
