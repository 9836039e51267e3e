"""docs/benchmarks.md is generated from docs/results/index.json
(bench/benchmarks_md.py): the committed page is what the index gives, and
the current figure of a target is the newest result that is main's own."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("benchmarks_md", ROOT / "bench" / "benchmarks_md.py")
assert _spec is not None and _spec.loader is not None
benchmarks_md = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(benchmarks_md)


def test_the_committed_page_is_what_the_index_gives() -> None:
    assert benchmarks_md.main(["--check"]) == 0, "run: python bench/benchmarks_md.py"


def _target(name: str, value: float) -> dict:
    return {"target": name, "value": value, "op": "<=", "bound": 6.0, "met": value <= 6.0, "note": ""}


def test_the_newest_result_of_main_is_the_current_figure() -> None:
    entries = [
        {"file": "a.json", "machine": "2-core CPU VM", "date": "2026-12-04", "commit": "a", "command": "x"},
        {"file": "b.json", "machine": "2-core CPU box (24 GiB)", "date": "2026-12-05", "commit": "b", "command": "x"},
        {"file": "c.json", "machine": "2-core CPU VM", "date": "2026-12-05", "commit": "c", "command": "x",
         "current": False},
        {"file": "d.json", "machine": "2-core CPU VM", "date": "2026-12-03", "commit": "d", "command": "x"},
    ]
    data = {
        "a.json": {"targets": [_target("p50", 7.0), _target("hops", 6)]},
        "b.json": {"targets": [_target("p50", 5.5)]},
        "c.json": {"targets": [_target("p50", 9.0), _target("hops", 8)]},  # the other arm: never current
        "d.json": {"prompts": 3},  # no targets
    }
    figures = benchmarks_md.current(entries, data)
    assert list(figures) == ["2-core CPU box"]  # both names of the machine
    box = figures["2-core CPU box"]
    assert box["p50"][0]["value"] == 5.5 and box["p50"][1]["commit"] == "b"  # newer date wins
    assert box["hops"][0]["value"] == 6 and box["hops"][1]["commit"] == "a"
    page = benchmarks_md.render(entries, data)
    assert "2 targets: 2 met, 0 not met." in page
    assert "[c.json](results/c.json) (other arm)" in page  # listed, marked
    every = page[page.index("## Every result"):]
    assert every.index("| 2026-12-05 |") < every.index("| 2026-12-04 |") < every.index("| 2026-12-03 |")


def test_a_result_file_the_index_does_not_list_stops_the_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "index.json").write_text(json.dumps({"about": "", "results": []}))
    (tmp_path / "stray.json").write_text("{}")
    monkeypatch.setattr(benchmarks_md, "RESULTS", tmp_path)
    with pytest.raises(SystemExit, match="does not list stray.json"):
        benchmarks_md.load()
