"""ZeRO-3 unit choice: blocks, leftover top-level children, tied weights kept in one unit."""

from __future__ import annotations

from torch import nn

from lightning_parallel.models import LitGPT
from lightning_parallel.parallel.data.fsdp import fsdp_units


def test_gpt_units_are_blocks_then_the_model():
    assert fsdp_units(LitGPT()) == [f"model.blocks.{i}" for i in range(4)] + ["model"]


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
    model = LitGPT()
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
