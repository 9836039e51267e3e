"""The mutation check's catalogue stays current: every mutant's snippet is
found exactly once in its file (tests/mutation/run.py would report it
"stale" or "ambiguous" and run nothing for it, so a refactor that moves the
code must update the snippet in the same change)."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_mutant_names_its_code_exactly_once() -> None:
    mutants = tomllib.loads((ROOT / "tests" / "mutation" / "mutants.toml").read_text())["mutant"]
    assert len(mutants) > 100
    off = {
        m["id"]: (ROOT / m["file"]).read_text().count(m["original"])
        for m in mutants
        if (ROOT / m["file"]).read_text().count(m["original"]) != 1
    }
    assert off == {}, f"stale (0) or ambiguous (>1) mutant snippets: {off}"
    assert len({m["id"] for m in mutants}) == len(mutants), "mutant ids repeat"
