"""Every ```python block of README.md runs as written, in a fresh interpreter, and prints something.

The blocks that load a real model carry the `model` marker, like the other real-model tests. Nothing here
looks at the generated words (they depend on the BLAS library's rounding): a block passes when it exits
cleanly and prints."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks():
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def _params():
    params = []
    for i, code in enumerate(python_blocks()):
        marks = [pytest.mark.model] if "load_model" in code else []
        params.append(pytest.param(code, id=f"block{i}", marks=marks))
    return params


def test_readme_has_python_blocks_and_fits_its_budget():
    assert python_blocks(), "README.md lost its Python examples"
    assert len(README.read_text(encoding="utf-8")) <= 25_000


@pytest.mark.parametrize("code", _params())
def test_readme_block_runs_and_prints(code, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip(), "the block printed nothing"
