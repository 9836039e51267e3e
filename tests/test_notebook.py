"""examples/notebook.ipynb, executed top to bottom the way Jupyter runs it (a
real ipykernel through nbclient) on the CPU default: a local Ray cluster of
its own, three rank actors with NIXL agents, a workload with cancels, the
plots, the stats table. Any failing cell fails the test. Also checks what is
committed: the notebook's saved outputs, at least one plot among them."""

from __future__ import annotations

import base64
import copy
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
PNG = b"\x89PNG\r\n\x1a\n"


def _pngs(nb) -> list[bytes]:
    return [
        base64.b64decode(o["data"]["image/png"])
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]


def _text(nb, name: str) -> str:
    return "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == name
    )


def _check(nb) -> None:
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "a cell did not run"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    images = _pngs(nb)
    assert images, "no plot in the outputs"
    assert all(img.startswith(PNG) and len(img) > 10_000 for img in images), [len(i) for i in images]
    out, err = _text(nb, "stdout"), _text(nb, "stderr")
    assert "leaked blocks: 0" in out, out[-2000:]
    assert "'completed'" in out and "'cancelled'" in out, out[-2000:]
    assert "cancel after" in out, out[-2000:]
    # The newcomer's findings: no widget warning, no auth warning, no traceback.
    for noise in ("ipywidgets", "IProgress", "Token authentication", "Traceback"):
        assert noise not in err, err[-2000:]


def test_committed_notebook_holds_its_outputs_and_a_plot() -> None:
    _check(nbformat.read(NOTEBOOK, as_version=4))


def test_notebook_runs_top_to_bottom() -> None:
    nb = copy.deepcopy(nbformat.read(NOTEBOOK, as_version=4))
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    _check(nb)
