"""The map and the docs name files that exist: every ``lightning_parallel/...py`` and ``docs/...md`` path written in
ARCHITECTURE.md, README.md, docs/ or the package's own source (docstrings, comments); every package-relative path
in backticks on ARCHITECTURE.md (`` `parallel/mesh.py` ``); and, the other way round, every module and package of
``lightning_parallel/`` on ARCHITECTURE.md's map; the mesh's axis order as the docs write it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_parallel"
MAP = ROOT / "ARCHITECTURE.md"
# a path as the docs write it: not preceded by a path character (``../docs/x.md`` is a relative link, not this) nor
# by a branch name (``newcomer-axis:lightning_parallel/parallel/scan.py``, git's notation: a file on a kept branch)
REPO_PATH = re.compile(r"(?<![\w./:-])((?:lightning_parallel/[\w./-]*?\.py|docs/[\w./-]*?\.md))(?![\w/-])")
BACKTICKED = re.compile(r"`([\w./-]+(?:\.py|/))`")


def texts() -> dict[str, str]:
    pages = [MAP, ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    sources = [*sorted(PACKAGE.rglob("*.py")), *sorted((ROOT / "recipes").glob("*.py"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in [*pages, *sources]}


def test_repository_paths_in_docs_and_docstrings_exist():
    missing = [
        f"{name}: {path}"
        for name, text in texts().items()
        for path in REPO_PATH.findall(text)
        if not (ROOT / path).exists()
    ]
    assert not missing, f"paths that name no file (moved or renamed? fix the text): {missing}"


def map_paths() -> set[str]:
    """The package-relative paths ARCHITECTURE.md names in backticks (``parallel/mesh.py``, ``hf/families/``)."""
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    top = {p.name for p in PACKAGE.glob("*.py")}
    found = set(BACKTICKED.findall(MAP.read_text()))
    return {p for p in found if p.split("/")[0] in packages or p in top}


def test_package_paths_on_the_map_exist():
    # inside the package, or the repository's own (`recipes/train_gpt.py`: the scripts beside the package)
    missing = sorted(p for p in map_paths() if not (PACKAGE / p).exists() and not (ROOT / p).exists())
    assert not missing, f"ARCHITECTURE.md names package paths that do not exist: {missing}"


def test_every_module_and_package_is_on_the_map():
    named = map_paths()
    modules = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    packages = {f"{p.parent.relative_to(PACKAGE)}/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    absent = sorted((modules | packages) - named)
    assert not absent, (
        f"not on ARCHITECTURE.md's map: {absent}; add a row for each to its package's table "
        "(its path inside lightning_parallel/ in backticks and what it holds)"
    )


def test_the_checks_see_a_missing_path():
    """The patterns catch what they are for: a stale path in prose, a module missing from a map."""
    prose = "see lightning_parallel/parallel/gone.py and docs/gone.md, not ../docs/x.md or docs/"
    assert REPO_PATH.findall(prose) == ["lightning_parallel/parallel/gone.py", "docs/gone.md"]
    assert BACKTICKED.findall("`parallel/mesh.py` and `hf/families/` but not `x.yaml`") == [
        "parallel/mesh.py",
        "hf/families/",
    ]


def mesh_axes() -> list[str]:
    """``MESH_AXES`` read from parallel/mesh.py's source (its names and their constants), not imported: no torch."""
    tree = ast.parse((PACKAGE / "parallel" / "mesh.py").read_text())
    values = {
        target.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    names = values["MESH_AXES"]
    assert isinstance(names, ast.Tuple), "MESH_AXES is not a tuple of names: update this test"
    return [ast.literal_eval(values[name.id]) for name in names.elts]


def test_the_mesh_order_in_the_docs_is_the_codes():
    """docs/concepts.md and ARCHITECTURE.md write the mesh's axes outermost first, as ``MESH_AXES`` orders them."""
    order = " x ".join(mesh_axes())
    concepts = re.findall(r"world = ([\w x]+)", (ROOT / "docs" / "concepts.md").read_text())
    assert concepts == [order], f"docs/concepts.md: {concepts}, the mesh: {order}"
    assert f"\n{order}\n" in MAP.read_text(), f"ARCHITECTURE.md does not show the mesh's axes as {order}"
