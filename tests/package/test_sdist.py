"""The sdist: built from a copy of this tree (python -m build --sdist --no-isolation; `build` and
setuptools>=77 come with the test extra), it carries the LICENSE and SPDX license metadata, every
source file, and everything the test suite and the README's commands need: tests/ with conftest.py,
reference.py and the C driver, benchmarks/, examples/ (test_train.py runs examples/train.py), docs/ (the
spec), .ci/ (sanitize.sh, constraints.txt) and ggml/ (the patch and the scripts tests/ggml/test_ggml*.py
run); no build products. The test suite collected from
the unpacked sdist must collect every test without an error, and its C-driver test must pass
there (it compiles csrc/ and tests/c_api/ from the sdist).
"""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it
SHIPPED_DIRS = ["csrc", "ssmgrad", "tests", "benchmarks", "examples", "docs", ".ci", "ggml"]
JUNK = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", "*.so", ".pytest_cache",
                              ".hypothesis", ".mypy_cache", "*.orig", "*.rej", "*~")


def source_files():
    """Files of the tree that the sdist must carry (relative paths)."""
    want = {"LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in"}
    for d in SHIPPED_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, d)):
            dirnames[:] = [n for n in dirnames if not JUNK(dirpath, [n])]
            for n in filenames:
                if not JUNK(dirpath, [n]):
                    want.add(os.path.relpath(os.path.join(dirpath, n), ROOT))
    return want


def test_sdist_contents(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=JUNK)                  # never writes egg-info into the tree
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(tmp_path / "dist"),
                        str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("ssmgrad-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
        top = names[0].split("/")[0]
        files = {n[len(top) + 1:] for n, m in zip(names, tf.getmembers()) if m.isfile()}
        pkg_info = tf.extractfile(f"{top}/PKG-INFO").read().decode()
        license_text = tf.extractfile(f"{top}/LICENSE").read().decode()
        tf.extractall(tmp_path / "unpacked", filter="data") if sys.version_info >= (3, 12) else \
            tf.extractall(tmp_path / "unpacked")
    missing = source_files() - files
    assert not missing, f"the sdist lacks {sorted(missing)}"
    for needed in ("tests/conftest.py", "tests/reference.py", "tests/c_api/test_c_api.c", "examples/train.py",
                   "docs/ssm-ops.md", ".ci/constraints.txt", ".ci/sanitize.sh", "LICENSE",
                   "ggml/build.sh", "ggml/patches/0001-ggml-ssm-conv-scan-backward.patch", "ggml/grad_sweep.py"):
        assert needed in files, needed
    junk = [f for f in files if f.endswith((".so", ".pyc", ".o")) or "__pycache__" in f or f.startswith("build/")]
    assert not junk, junk
    assert "License-Expression: MIT" in pkg_info and "License-File: LICENSE" in pkg_info, pkg_info[:1500]
    assert "Copyright (c) 2026 the ssmgrad authors" in license_text and "MIT License" in license_text

    # the unpacked sdist's suite: collects completely, and the C driver builds and passes from it
    unpacked = tmp_path / "unpacked" / top
    env = dict(os.environ)
    col = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=unpacked, capture_output=True, text=True, timeout=600, env=env)
    assert col.returncode == 0 and not re.search(r"\d+ errors?\b", col.stdout), col.stdout[-3000:] + col.stderr[-3000:]
    here = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    count = lambda out: [ln for ln in out.splitlines() if "::" in ln]
    assert len(count(col.stdout)) == len(count(here.stdout)) > 100, (len(count(col.stdout)), len(count(here.stdout)))
    # the driver built from the sdist's files and run once (its other runs, the SIMD caps and aarch64
    # under qemu, are the same sources: the main suite runs them from the tree)
    c_api = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/kernels/test_c_api.py::test_c_program"],
                           cwd=unpacked, capture_output=True, text=True, timeout=600, env=env)
    assert c_api.returncode == 0 and "1 passed" in c_api.stdout, c_api.stdout[-3000:] + c_api.stderr[-3000:]


def test_testpaths_name_every_test_folder():
    """pyproject.toml's testpaths (the README's `python -m pytest -q` runs what it names) lists the
    folders of tests/ one by one, for their order: every folder of tests/ that holds a test file is
    named, and nothing else."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        testpaths = tomllib.load(f)["tool"]["pytest"]["ini_options"]["testpaths"]
    folders = {os.path.relpath(dirpath, ROOT) for dirpath, _, files in os.walk(os.path.join(ROOT, "tests"))
               if any(re.fullmatch(r"test_.*\.py", n) for n in files)}
    tops = {os.path.join(*p.split(os.sep)[:2]) for p in folders}
    assert len(testpaths) == len(set(testpaths)) and set(testpaths) == tops, (testpaths, sorted(tops))
