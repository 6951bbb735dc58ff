"""docs/reference/strategy-keys.md is rendered from the schema (lightning_parallel/recipes/reference.py): every
``strategy.*`` key has a description beside its field, no description names a key that is gone, and the page is
what the schema renders now."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.recipes import reference
from lightning_parallel.recipes.config import StrategyConf

ROOT = Path(__file__).resolve().parents[1]


def test_every_strategy_key_has_a_description():
    assert reference.undocumented() == [], "describe these keys in their class's Attributes: docstring section"
    assert reference.stray_entries() == [], "these Attributes: entries name no field: rename or remove them"
    rows = reference.key_rows()
    assert [key for key, *_ in rows] == [f"strategy.{f.name}" for f in dataclasses.fields(StrategyConf)]
    assert {f.name for f in dataclasses.fields(ParallelConfig)} <= {key.split(".", 1)[1] for key, *_ in rows}


def test_a_key_added_without_a_description_is_caught():
    @dataclasses.dataclass
    class Grown(StrategyConf):
        """A schema with one key more.

        Attributes:
            described: a key with its meaning.
            gone: a key since removed.
        """

        described: int = 1
        new_key: int = 0

    assert reference.undocumented(Grown) == ["new_key"]
    assert reference.stray_entries(Grown) == ["gone"]
    assert "| `strategy.described` | `int` | `1` | a key with its meaning. |" in reference.render(Grown)


def test_the_page_is_what_the_schema_renders():
    page = ROOT / "docs" / "reference" / "strategy-keys.md"
    assert page.read_text() == reference.render(), "stale: run python -m lightning_parallel.recipes.reference"
    assert reference.main(["--check"]) == 0


def test_the_page_is_in_the_site_nav_and_lists_every_preset():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))["nav"]
    assert "reference/strategy-keys.md" in str(nav)
    page = reference.render()
    for file in (ROOT / "conf" / "strategy").glob("*.yaml"):
        assert f"| `strategy={file.stem}` |" in page
    assert "`strategy.zero_stage` | `int` | `0` |" in page and "`strategy.dp` | `Any` | `auto` |" in page
