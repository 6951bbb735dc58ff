"""docs/reference/strategy-keys.md is rendered from the schemas (lightning_parallel/recipes/reference.py): every
``strategy.*`` key of every strategy's schema has a description, no description names a key that is gone, the page
is what the schemas render now, and each schema key that is a ParallelConfig setting has that setting's type and
default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.sections import SECTIONS, recipe_key
from lightning_parallel.recipes import reference
from lightning_parallel.recipes.strategy_conf import STRATEGY_SCHEMAS, Hybrid3DConf

ROOT = Path(__file__).resolve().parents[1]


def test_every_strategy_key_has_a_description():
    assert reference.undocumented() == [], "describe these keys in their class's Attributes: docstring section"
    assert reference.stray_entries() == [], "these Attributes: entries name no field: rename or remove them"
    rows = reference.key_rows()
    keys = {f"strategy.{key}" for cls in STRATEGY_SCHEMAS.values() for key, _ in reference.schema_keys(cls)}
    assert [key for key, *_ in rows] == list(dict.fromkeys(k for k, *_ in rows)) and set(k for k, *_ in rows) == keys
    # every ParallelConfig setting is a key of hybrid3d's schema, top-level or in its section
    assert {f"strategy.{recipe_key(name)}" for name in ParallelConfig.names()} <= {
        f"strategy.{key}" for key, _ in reference.schema_keys(Hybrid3DConf)
    }


def test_the_schemas_keys_have_parallel_configs_types_and_defaults():
    parallel = {f.name: f for f in dataclasses.fields(ParallelConfig)}
    flat = {".".join(path): name for name, path in SECTIONS.items()}
    checked = 0
    for cls in STRATEGY_SCHEMAS.values():
        for key, f in reference.schema_keys(cls):
            name = flat.get(key, key)
            if name in parallel and (key in flat or "." not in key):
                assert (f.type, f.default) == (parallel[name].type, parallel[name].default), (cls.__qualname__, key)
                checked += 1
    assert checked >= len(parallel)


def test_a_key_added_without_a_description_is_caught():
    @dataclasses.dataclass
    class Grown(Hybrid3DConf):
        """A schema with one key more.

        Attributes:
            described: a key with its meaning.
            gone: a key since removed.
        """

        described: int = 1
        new_key: int = 0

    schemas = {"grown": Grown}
    assert reference.undocumented(schemas) == ["new_key"]
    assert reference.stray_entries(schemas) == ["gone"]
    assert "| `strategy.described` | `int` | `1` | `grown` | a key with its meaning. |" in reference.render(schemas)


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
    assert "`strategy.pipeline.balance` | `str` | `uniform` | `hybrid3d`, `auto` |" in page
