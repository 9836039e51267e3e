"""Every Python block of the README runs as written.

Each ```python block is a complete script: it runs in a subprocess (its own
local Ray cluster) and must exit 0; the blocks assert what they claim. Two
kinds are left to other places: the vLLM block needs the `vllm` extra
(tests/integrations/test_vllm.py runs it in CI's second venv), and the
cluster block needs a cluster of several nodes with GPUs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def run_block(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)


def _kind(code: str) -> str:
    if "kvhandoff.integrations.vllm_connector" in code:
        return "vllm"
    if 'address="auto"' in code:
        return "cluster"
    return "local"


def test_every_python_block_is_a_complete_script() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 5
    for code in blocks:
        assert "asyncio.run(main())" in code and "import asyncio" in code, code[:300]
        compile(code, "README block", "exec")


LOCAL = [b for b in python_blocks() if _kind(b) == "local"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("code", LOCAL, ids=[f"block{i}" for i in range(len(LOCAL))])
def test_readme_block_runs(code: str, tmp_path: Path) -> None:
    done = run_block(code, tmp_path)
    assert done.returncode == 0, f"{code[:400]}\n--- stdout\n{done.stdout[-2000:]}\n--- stderr\n{done.stderr[-4000:]}"
