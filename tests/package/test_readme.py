"""The docs' code runs as written: every code block of README.md and docs/*.md, so they cannot rot.

Every code block there is fenced and says what it is:
  ```python                 runs, on its own, in a fresh interpreter from the checkout (each block is
                            self-contained: a reader copies one block, not the page);
  ```sh                     runs in bash from the checkout;
  ```sh needs-build         a shell command that installs or builds (pip install, the ggml build, CI):
                            not run here (the main suite, .ci/run and tests/ggml/test_ggml*.py run them);
                            every file it names must exist, and the README's test command must be
                            the one .ci/run runs verbatim;
  ```text                   math, pseudo-code or printed output: not code.
A fence without one of these words, or an indented code block, fails the test (no silent skip).
ggml/README.md is written for a ggml build: its ```python blocks run, and the scripts its other
blocks run must exist.
"""
import glob
import os
import re
import subprocess
import sys

import pytest

import ssmgrad
import ssmgrad.torch as st

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it
README = os.path.join(ROOT, "README.md")
DOCS = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
GGML_README = os.path.join(ROOT, "ggml", "README.md")
KINDS = {"python", "sh", "sh needs-build", "text"}
STATE_SHAPE = "(K, n_seqs) + s.shape[1:]"


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def blocks(path):
    """[(info string, code, line number)] of the fenced blocks of a Markdown file."""
    out, info, start, code = [], None, 0, []
    for n, line in enumerate(read(path).splitlines(), 1):
        m = re.match(r"^```(.*)$", line)
        if info is None and m:
            info, start, code = m.group(1).strip(), n, []
        elif info is not None and line.rstrip() == "```":
            out.append((info, "\n".join(code) + "\n", start))
            info = None
        elif info is not None:
            code.append(line)
    assert info is None, f"{path}:{start}: unclosed fence"
    return out


def indented_blocks(path):
    """Line numbers of indented (4-space) code blocks outside fences and list items."""
    found, in_fence, prev = [], False, ""
    for n, line in enumerate(read(path).splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("    ") and line.strip() and not prev.strip():
            found.append(n)
        if not in_fence and line.strip() and not line.startswith(" "):
            list_item = re.match(r"^(\s*[-*+]|\s*\d+\.)\s", line)
            prev = "x" if list_item else ""         # a list item's continuation may be indented
        elif not line.strip():
            prev = prev if prev == "x" else ""
        else:
            prev = "y"
    return found


def cases():
    for path in DOCS:
        for info, code, line in blocks(path):
            yield pytest.param(path, info, code, id=f"{os.path.relpath(path, ROOT)}:{line}:{info or 'none'}")


def named_paths(code):
    """Repository paths a shell block names (tokens with a '/' or ending in .py/.sh)."""
    paths = []
    for tok in re.findall(r"[\w./-]+", code):
        tok = tok.rstrip(".")
        if tok.startswith(("-", "/", "http")) or "=" in tok:
            continue
        if ("/" in tok or tok.endswith((".py", ".sh"))) and not tok.startswith("build/"):
            paths.append(tok)
    return paths


def run_block(info, code, path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-c", code] if info == "python" else ["bash", "-euo", "pipefail", "-c", code]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, f"{os.path.relpath(path, ROOT)}: block failed:\n{code}\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("path,info,code", list(cases()))
def test_doc_code_block(path, info, code):
    assert info in KINDS, f"a fence must say what it holds, one of {sorted(KINDS)}; got {info!r}"
    if info in ("python", "sh"):
        run_block(info, code, path)
    elif info == "sh needs-build":
        for p in named_paths(code):
            assert os.path.exists(os.path.join(ROOT, p)), f"{p}: named by a needs-build block, not in the checkout"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_indented_code_blocks(path):
    assert indented_blocks(path) == [], f"indented code blocks (fence them, with a kind) at lines {indented_blocks(path)}"


def test_readme_has_the_quick_starts_and_the_ci_command():
    kinds = [(info, code) for info, code, _ in blocks(README)]
    py = [code for info, code in kinds if info == "python"]
    for needle in ("import ssmgrad\n", "ssmgrad.torch", "ssmgrad.transformers"):
        assert any(needle in b for b in py), f"README: no quick start with {needle!r}"
    assert any("ggml/build.sh" in code for _, code in kinds), "README: no ggml quick start"
    assert len(read(README).splitlines()) <= 150, "README.md is longer than 150 lines"
    test_cmd = [code.strip() for info, code in kinds if info == "sh needs-build" and "pytest" in code
                and ".ci/constraints.txt" in code]
    assert len(test_cmd) == 1, test_cmd
    assert test_cmd[0] in read(os.path.join(ROOT, ".ci", "run")), ".ci/run must run the README's test command verbatim"


def test_readme_says_what_the_install_and_the_self_check_do_not_show():
    """`pip install .` compiles for minutes with no output (pip shows a build's output only with -v), and the
    self-check's timings depend on the machine's load: the README says both where it gives the command."""
    text = read(README)
    at = text.index("pip install . && python -m ssmgrad")
    before = text[max(0, at - 600):at]
    assert "silently" in before and "`pip install -v .` shows it" in before, before
    assert "load-dependent" in before, before


def test_ggml_readme_runnable_blocks():
    """ggml/README.md: its python blocks run; the script every `bash X` / `python X` line of its
    other blocks (fenced or indented) runs exists."""
    for info, code, _ in blocks(GGML_README):
        if info == "python":
            run_block(info, code, GGML_README)
    scripts = re.findall(r"^\s*(?:\$ )?(?:bash|python) ((?:ggml|tests|benchmarks|examples)/\S+)", read(GGML_README), re.M)
    assert scripts, "ggml/README.md names no script"
    for s in scripts:
        assert os.path.exists(os.path.join(ROOT, s)), f"ggml/README.md runs {s}, which does not exist"


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
    docs = {"README": read(README), "ssmgrad.ssm_scan": ssmgrad.ssm_scan.__doc__,
            "ssmgrad.torch": st.__doc__, "ssmgrad.torch.split": st.split.__doc__}
    for where, text in docs.items():
        found = state_shapes(text)
        assert found, f"{where}: no split(out, x.shape, ...) example"
        assert set(found) == {STATE_SHAPE}, f"{where}: state shape written as {found}, expected {STATE_SHAPE}"


def test_ggml_doc_softplus_threshold_as_measured():
    """docs/ggml.md's measured value: ggml's float32 softplus logf(1 + expf(v)) is exactly 0 up to
    the float32 it names and not above it; ssmgrad's softplus is accurate there (float64 oracle)."""
    import numpy as np
    import _ssmgrad

    text = read(os.path.join(ROOT, "docs", "ggml.md"))
    m = re.search(r"exactly 0 for `dt <= (-[0-9.]+)`", text)
    assert m, "docs/ggml.md no longer states the measured threshold"
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
    # the relative-error marks: the largest dt (float32, 1e-4 grid) where ggml's form is off by
    # more than 0.1% / 10%
    grid = np.unique(np.arange(-16.6, 0, 1e-4).astype(np.float32))
    exact_g = np.log1p(np.exp(grid.astype(np.float64)))
    rel = np.abs(ggml(grid).astype(np.float64) - exact_g) / exact_g
    flat = " ".join(text.split())
    for mark, bound in (("-9.73", 1e-3), ("-14.43", 1e-1)):
        assert f"{100 * bound:g}% below `dt` = {mark}" in flat or f"{100 * bound:g}% below {mark}" in flat, mark
        assert abs(float(grid[rel > bound].max()) - float(mark)) < 0.01, (mark, grid[rel > bound].max())
