"""The repository stands alone: no file points a reader outside it."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Documents of the team's workspace that are not in the repository (spelled
#: in pieces so that this file does not name them itself).
OUTSIDE = ("../" + "shared", "STYLE" + ".md", "DESIGN" + ".md")
TEXT = (".py", ".md", ".toml", ".sh", ".cfg", ".ipynb", ".txt", ".yaml", ".yml")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in out.splitlines() if name.endswith(TEXT) or "/" not in name and "." not in name]


def test_no_file_points_outside_the_repository() -> None:
    found = []
    for path in _tracked():
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {needle}" for needle in OUTSIDE if needle in text]
    assert found == []
