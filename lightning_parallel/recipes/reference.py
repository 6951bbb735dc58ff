"""The reference page of every ``strategy.*`` key of the recipes (docs/reference/strategy-keys.md), rendered from the
schemas: each key's type and default from the schemas of :mod:`~lightning_parallel.recipes.strategy_conf` (one per
strategy, with sections), the strategies that take it, its meaning from the ``Attributes:`` section of the docstring
of the class that declares it (a parallel setting's from :class:`~lightning_parallel.parallel.config.ParallelConfig`,
a section's key by its flat name there), and the presets from ``conf/strategy/*.yaml``. One source: a key is
described beside its field, and tests/test_strategy_reference.py fails when a key has no description or the page is
not what this module renders.

    python -m lightning_parallel.recipes.reference            # rewrite docs/reference/strategy-keys.md
    python -m lightning_parallel.recipes.reference --check    # exit 1 if the page is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from lightning_parallel.parallel.config import ParallelConfig
from lightning_parallel.parallel.sections import SECTIONS, recipe_key
from lightning_parallel.recipes.strategy_conf import STRATEGY_SCHEMAS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "strategy-keys.md"
PRESETS = ROOT / "conf" / "strategy"
_ENTRY = re.compile(r"^(\w+(?:, \w+)*): (.*)$")
FLAT = {".".join(path): name for name, path in SECTIONS.items()}  # pipeline.balance -> pp_balance


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of ``cls``'s own docstring (Google style), as ``{field: description}``; an entry
    naming several fields (``a, b: ...``) describes each. Continuation lines are joined with spaces."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    lines = doc.splitlines()
    if "Attributes:" not in lines:
        return {}
    out: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[lines.index("Attributes:") + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:  # the next section
            break
        match = _ENTRY.match(line.strip()) if depth == indent else None
        if match:
            names = match.group(1).split(", ")
            for name in names:
                out[name] = match.group(2)
        else:
            for name in names:
                out[name] += " " + line.strip()
    return out


def key_docs(cls: type) -> dict[str, str]:
    """Every field of the dataclass ``cls`` with its description from the class that declares it, or from
    ParallelConfig's where the field is one of its settings (an empty string where there is none)."""
    described = attribute_docs(ParallelConfig)
    for klass in reversed(cls.__mro__):
        described.update(attribute_docs(klass))
    return {f.name: described.get(f.name, "") for f in dataclasses.fields(cls)}


def schema_keys(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(key below ``strategy.``, field) of every key of the schema ``cls``, its sections' keys as
    ``section.key``, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        kind = _default(f)
        if dataclasses.is_dataclass(kind):
            out += schema_keys(type(kind), f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f))
    return out


def descriptions(schemas: dict[str, type] = STRATEGY_SCHEMAS) -> dict[str, str]:
    """The description of every key of ``schemas``: from the ``Attributes:`` of any schema that describes it (a key
    shared by several strategies is described once), else ParallelConfig's (``pipeline.balance``: ``pp_balance``)."""
    pool = attribute_docs(ParallelConfig)
    for cls in [*STRATEGY_SCHEMAS.values(), *schemas.values()]:
        for klass in reversed(cls.__mro__):
            pool.update(attribute_docs(klass))
    keys = dict.fromkeys(key for cls in schemas.values() for key, _ in schema_keys(cls))
    return {key: pool.get(key) or pool.get(FLAT.get(key, ""), "") for key in keys}


def undocumented(schemas: dict[str, type] = STRATEGY_SCHEMAS) -> list[str]:
    """The keys of ``schemas`` without a description."""
    return [key for key, text in descriptions(schemas).items() if not text.strip()]


def stray_entries(schemas: dict[str, type] = STRATEGY_SCHEMAS) -> list[str]:
    """``Attributes:`` entries of the schemas (and their bases) that name no field (a renamed or removed key)."""
    out = []
    for cls in schemas.values():
        names = {f.name for f in dataclasses.fields(cls)}
        out += [name for klass in cls.__mro__ for name in attribute_docs(klass) if name not in names]
    return sorted(set(out))


def _yaml_value(value: Any) -> str:
    """A default as it is typed on the command line (``strategy.key=VALUE``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict) and not value:
        return "{}"
    return str(value)


def _markdown(text: str) -> str:
    """A docstring's reST as Markdown in a table cell."""
    text = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"`\1`", text)  # :class:`~a.b.C` -> `C`
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _recipe_names(text: str) -> str:
    """ParallelConfig's flat names in a description as the recipes' keys (```pp_balance=`` -> ``pipeline.balance=``)."""
    return re.sub(r"``(\w+)(?=[`=])", lambda m: f"``{recipe_key(m.group(1))}", text)


def key_rows(schemas: dict[str, type] = STRATEGY_SCHEMAS) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, strategies, meaning) of every key of ``schemas``, in the order they first appear."""
    docs = descriptions(schemas)
    rows: dict[str, tuple[str, str, str, list[str], str]] = {}
    for name, cls in schemas.items():
        for key, f in schema_keys(cls):
            meaning = _markdown(_recipe_names(docs[key]))
            rows.setdefault(key, (f"strategy.{key}", str(f.type), _yaml_value(_default(f)), [], meaning))[3].append(
                name
            )
    return [
        (key, kind, default, ", ".join(_strategy(n) for n in names), meaning)
        for key, kind, default, names, meaning in rows.values()
    ]


def _strategy(name: str) -> str:
    return "`zero*`" if name == "zero" else f"`{name}`"


def presets(folder: Path = PRESETS) -> list[tuple[str, dict[str, Any]]]:
    """Each ``conf/strategy/<preset>.yaml`` and the keys it sets (its ``defaults:`` list left out)."""
    out = []
    for file in sorted(folder.glob("*.yaml")):
        data = yaml.safe_load(file.read_text()) or {}
        out.append((file.stem, {k: v for k, v in data.items() if k != "defaults"}))
    return out


def render(schemas: dict[str, type] = STRATEGY_SCHEMAS, folder: Path = PRESETS) -> str:
    """The reference page, as Markdown."""
    lines = [
        "# Strategy keys",
        "",
        "<!-- generated by `python -m lightning_parallel.recipes.reference` from the schemas' docstrings "
        "(lightning_parallel/parallel/config.py, lightning_parallel/recipes/strategy_conf.py): edit those, then "
        "rerun -->",
        "",
        "Every `strategy.*` key the recipes take (`recipes/train_gpt.py`, `recipes/train_vgg.py`, "
        "`recipes/finetune.py`, `recipes/dpo.py`), with its default, the strategies that take it and its meaning. "
        "Set one on the command line as `strategy.KEY=VALUE` after picking a preset with `strategy=NAME`: each "
        "strategy has a schema of its own, so a misspelled key, a key the chosen strategy does not take (`strategy.pp` "
        "under `strategy=zero2`) or a value of the wrong type is refused when Hydra composes the config. The degrees "
        "and the stable keys are top-level; the other settings sit in sections (`strategy.pipeline.balance`). The "
        "parallel settings are those of `ParallelConfig`, which `Hybrid3DStrategy(...)` and "
        "`Hybrid3DFabricStrategy(...)` take as keyword arguments by their flat names (`pp_balance=` for "
        "`strategy.pipeline.balance`).",
        "",
        "## Presets",
        "",
        "`strategy=NAME` picks `conf/strategy/NAME.yaml`: its strategy's schema, the keys it sets, every other key "
        "at its default.",
        "",
        "| Preset | Sets |",
        "| --- | --- |",
    ]
    for name, values in presets(folder):
        sets = ", ".join(f"`{k}={_yaml_value(v)}`" for k, v in _flat(values).items()) or "nothing"
        lines.append(f"| `strategy={name}` | {sets} |")
    lines += ["", "## Keys", "", "| Key | Type | Default | Strategies | Meaning |", "| --- | --- | --- | --- | --- |"]
    for key, kind, default, strategies, meaning in key_rows(schemas):
        lines.append(f"| `{key}` | `{_markdown(kind)}` | `{default}` | {strategies} | {meaning} |")
    return "\n".join(lines) + "\n"


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A preset's keys, its sections' as ``section.key``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        out |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {f"{prefix}{key}": value}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or check) docs/reference/strategy-keys.md.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the schema's")
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    missing = undocumented()
    if missing:
        print(f"strategy keys without a description: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render()
    if args.check:
        stale = not args.out.is_file() or args.out.read_text() != text
        if stale:
            print(f"{args.out} is stale: run python -m lightning_parallel.recipes.reference", file=sys.stderr)
        return int(stale)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
