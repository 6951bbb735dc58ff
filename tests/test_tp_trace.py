"""The walk of ``strategy.tp`` that ARCHITECTURE.md lists cannot grow unseen: before launch, the files the setting
visits are measured (tests/tp_trace.py) and must be the listed ones, with no returns; every listed file exists and
names the symbol the list gives it (after launch too)."""

from __future__ import annotations

import re

import pytest
from tp_trace import ROOT, trace_gpt_checks

DOC = ROOT / "ARCHITECTURE.md"
MAX_FILES = 11  # the goal is 10: lower this as the path gets shorter, never raise it
ENTRY = re.compile(r"^\d+\. `([^`]+)` `([^`]+)`", re.MULTILINE)


def listed(section: str) -> list[tuple[str, str]]:
    """The (file, symbol) entries of the doc's section titled ``section``."""
    text = DOC.read_text()
    start = text.index(f"### {section}")
    end = min(i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i > 0)
    return ENTRY.findall(text[start : end if end > 0 else None])


def test_tp_before_launch_visits_the_listed_files_only_with_no_returns():
    trace = trace_gpt_checks(["strategy=hybrid3d", "strategy.tp=2", "trainer.devices=2"])
    expected = [file for file, _ in listed("Before launch")]
    assert trace.returns == [], f"strategy.tp derived again instead of carried: {trace.returns}"
    assert trace.files() == expected, (
        "strategy.tp's path before launch changed: update ARCHITECTURE.md (its section on strategy.tp) to what "
        f"tests/tp_trace.py measures, {trace.files()}"
    )
    assert len(expected) <= MAX_FILES
    for file, symbol in listed("Before launch"):  # each listed step is where the trace went
        assert any(f == file and (fn == symbol or symbol in (ROOT / f).read_text()) for f, fn in trace.visits), (
            file,
            symbol,
        )


@pytest.mark.parametrize("section", ["Before launch", "After launch"])
def test_every_listed_file_names_its_symbol(section):
    entries = listed(section)
    assert entries, section
    for file, symbol in entries:
        path = ROOT / file
        assert path.is_file(), f"ARCHITECTURE.md lists {file}, which does not exist"
        assert re.search(rf"\b(def|class) {re.escape(symbol)}\b", path.read_text()), f"{file} has no {symbol}"


def test_the_tracer_counts_a_setting_derived_again():
    """The measure can fail: the degrees derived a second time from the same settings count as a return."""
    from tp_trace import Trace, following_tp

    from lightning_parallel.parallel.config import ParallelConfig

    trace = Trace()
    config = ParallelConfig(tp=2)
    with following_tp(trace):
        first = config.dims(2)
        second = config.dims(2)  # equal, not the same object: derived again
    assert first == second and first is not second
    assert trace.returns == [("lightning_parallel/parallel/config.py", "dims")], trace.returns
    assert "lightning_parallel/parallel/config.py" in trace.files(), trace.visits
