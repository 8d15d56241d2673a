"""The README's code runs as written: every ```python block, in order, in one namespace, in a
fresh interpreter (so that the README cannot rot). The blocks check themselves (asserts against
the NumPy results); this test also checks that the torch block really ran and that the state
shape given to `split` is written one way in the README and in both modules' docstrings.

torch is part of the test extra; without it the suite fails at collection (conftest.py).
"""
import os
import re
import subprocess
import sys

import ssmgrad
import ssmgrad.torch as st
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it
README = os.path.join(ROOT, "README.md")
STATE_SHAPE = "(K, n_seqs) + s.shape[1:]"


def python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_python_blocks_run_in_order():
    with open(README) as f:
        blocks = python_blocks(f.read())
    assert len(blocks) >= 2, "expected the NumPy and the PyTorch examples"
    assert any("ssmgrad.torch" in b for b in blocks), "the PyTorch example is missing"
    code = "\n".join(f"# --- README block {i}\n{b}" for i, b in enumerate(blocks))
    code += "\nimport torch\nassert isinstance(x, torch.Tensor) and x.grad is not None\nprint('README ok')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and "README ok" in r.stdout, f"README code failed:\n{r.stderr[-4000:]}"


def state_shapes(text):
    """The third argument of every `split(out, x.shape, ...)` in text (parentheses balanced)."""
    found = []
    for m in re.finditer(r"split\(out, x\.shape, ", text):
        depth, i = 0, m.end()
        while i < len(text) and not (depth == 0 and text[i] == ")"):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        found.append(text[m.end():i])
    return found


def test_state_shape_for_split_written_one_way():
    with open(README) as f:
        readme = f.read()
    docs = {"README": readme, "ssmgrad.ssm_scan": ssmgrad.ssm_scan.__doc__,
            "ssmgrad.torch": st.__doc__, "ssmgrad.torch.split": st.split.__doc__}
    for where, text in docs.items():
        found = state_shapes(text)
        assert found, f"{where}: no split(out, x.shape, ...) example"
        assert set(found) == {STATE_SHAPE}, f"{where}: state shape written as {found}, expected {STATE_SHAPE}"


def test_readme_softplus_threshold_as_measured():
    """The README's measured value: ggml's float32 softplus logf(1 + expf(v)) is exactly 0 up to
    the float32 it names and not above it; ssmgrad's softplus is accurate there (float64 oracle)."""
    import numpy as np
    import _ssmgrad

    with open(README) as f:
        text = f.read()
    m = re.search(r"exactly 0 for `dt <= (-[0-9.]+)`", text)
    assert m, "the README no longer states the measured threshold"
    v = np.float32(m.group(1))
    up = np.nextafter(v, np.float32(0))

    def ggml(a):
        a = np.float32(a)
        return np.log(np.float32(1) + np.exp(a))          # float32 throughout, as ggml's C

    assert ggml(v) == 0 and ggml(up) > 0, (v, ggml(v), up, ggml(up))
    pts = np.array([v, up, -16.7, -20.0, -9.73, -14.43], np.float32)
    ours = _ssmgrad._vmath("softplus", pts).astype(np.float64)
    exact = np.log1p(np.exp(pts.astype(np.float64)))
    assert np.all(np.abs(ours - exact) <= 4 * np.spacing(exact.astype(np.float32)).astype(np.float64)), (ours, exact)
    # the README's relative-error marks: the largest dt (float32, 1e-4 grid) where ggml's form is
    # off by more than 0.1% / 10%
    grid = np.unique(np.arange(-16.6, 0, 1e-4).astype(np.float32))
    exact_g = np.log1p(np.exp(grid.astype(np.float64)))
    rel = np.abs(ggml(grid).astype(np.float64) - exact_g) / exact_g
    for mark, bound in (("-9.73", 1e-3), ("-14.43", 1e-1)):
        assert f"{100 * bound:g}% below `dt` = {mark}" in text or f"{100 * bound:g}% below {mark}" in text, mark
        assert abs(float(grid[rel > bound].max()) - float(mark)) < 0.01, (mark, grid[rel > bound].max())
