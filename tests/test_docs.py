"""The documentation's snippets: every Python and shell block of README.md and docs/ parses, and runs (`make
test-full`), unless the line before it says why it cannot run here (``<!-- docs: no-run REASON -->``, REASON one
of :data:`NO_RUN`). Shell lines that start a recipe run as written plus a few-step trainer (:data:`SMOKE`, keys
the line does not set itself), in a scratch folder that sees the repository's recipes, configs and examples.
``make docs`` (CI) builds the site with strict checks: links, anchors, includes and docstrings."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))  # run whole, in order: tests/test_tutorials.py
README_MAX_LINES = 200
NO_RUN = {  # why a snippet cannot run on this machine: it is then only parsed
    "gpu": "needs a CUDA device",
    "slurm": "needs a SLURM cluster",
    "nodes": "needs several machines",
    "install": "installs packages (the test environment is installed already)",
    "suite": "runs the test suite, the benchmarks or the GPU check themselves",
    "user-files": "names the reader's own files or folders",
    "long": "runs for many minutes on 2 cores (a 70B model simulated at hundreds of ranks); its output is shown",
}
MARK = re.compile(r"<!-- docs: no-run (\S+) -->")
SMOKE = {"trainer.max_steps": "4", "trainer.val_check_interval": "2", "trainer.limit_val_batches": "1"}
RECIPE = re.compile(r"\brecipes/(train_gpt|train_vgg|finetune|dpo)\.py\b")
LINKED = ("recipes", "conf", "examples", "benchmarks", "data")  # what the snippets' relative paths reach


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    lang: str
    code: str
    no_run: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def snippets() -> list[Snippet]:
    found = []
    for page in [*PAGES, *TUTORIALS]:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("```"):
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, f"{page.name}:{i + 1}: unclosed code fence"
            lang, mark = lines[i][3:].strip(), MARK.search(lines[i - 1]) if i else None
            if lang in ("python", "bash"):
                code = "\n".join(lines[i + 1 : end])
                found.append(Snippet(page.name, i + 1, lang, code, mark.group(1) if mark else None))
            i = end + 1
    return found


SNIPPETS = snippets()
RUNNABLE = [s for s in SNIPPETS if s.no_run is None and s.page not in {t.name for t in TUTORIALS}]


def test_the_readme_is_short_and_every_snippet_is_checked():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES
    assert len(SNIPPETS) >= 30 and len(RUNNABLE) >= 15, (len(SNIPPETS), len(RUNNABLE))
    print(f"{len(SNIPPETS)} snippets, {len(RUNNABLE)} run by `make test-full`, {len(SNIPPETS) - len(RUNNABLE)} parsed")


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_snippet_parses_and_a_no_run_mark_says_why(snippet: Snippet):
    assert snippet.no_run is None or snippet.no_run in NO_RUN, f"{snippet.id}: no-run reason not one of {list(NO_RUN)}"
    if snippet.lang == "python":
        ast.parse(snippet.code, filename=snippet.id)
    else:
        done = subprocess.run(["bash", "-n"], input=snippet.code, text=True, capture_output=True)
        assert done.returncode == 0, f"{snippet.id}: {done.stderr}"
        for command in shell_commands(snippet.code):
            shlex.split(command, comments=True)  # quoting a reader can paste


def shell_commands(code: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines left out."""
    joined = code.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def smoke(command: str) -> str:
    """A recipe command as written plus a few-step trainer, for the keys it does not set."""
    if not RECIPE.search(command):
        return command
    given = {w.split("=")[0].lstrip("+") for w in shlex.split(command, comments=True) if "=" in w}
    extra = [f"{k}={v}" for k, v in SMOKE.items() if k not in given]
    return re.sub(r"\s+#.*$", "", command) + " " + " ".join(extra)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    for name in LINKED:
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, scratch: Path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HYDRA_FULL_ERROR": "1"}
    if snippet.lang == "python":
        script = scratch / "snippet.py"
        script.write_text(snippet.code)
        runs = [[sys.executable, str(script)]]
    else:
        runs = [["bash", "-c", smoke(c)] for c in shell_commands(snippet.code)]
    for argv in runs:
        done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{snippet.id}: {argv[-1][:200]}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
