"""What the tests of tests/ggml/ share: building llama.cpp's ggml with `bash ggml/build.sh`, importing
ggml/'s Python check scripts, and reading the tensors the check binaries dump.

Without ggml/build.sh in the checkout or without a tool the build needs, a test skips, except under
CI=true, where that is an error; a build that fails is a failure.
"""

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
GGML = ROOT / "ggml"
CI = os.environ.get("CI", "").lower() == "true"
# cmake and ninja may come from pip (the test extra) into this Python's bin directory, which is
# not on PATH when the interpreter is run by its full path
ENV = dict(os.environ, PYTHON=sys.executable,
           PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
TOOLS = ("cmake", "ninja", "cc", "c++", "tar", "patch")


def unavailable(msg):
    """Skip for want of MSG; under CI=true fail instead."""
    if CI:
        pytest.fail(f"{msg} (CI=true: a missing ggml build is an error, not a skip)")
    pytest.skip(msg)


def build_ggml(*args, tools=()):
    """Runs `bash ggml/build.sh ARGS` (a no-op when up to date) and returns its output."""
    script = GGML / "build.sh"
    if not script.is_file():
        unavailable("ggml/build.sh not in this checkout")
    missing = [t for t in TOOLS + tuple(tools) if shutil.which(t, path=ENV["PATH"]) is None]
    if missing:
        unavailable(f"the ggml build needs {', '.join(missing)} (cmake, ninja: pip install '.[test]')")
    p = subprocess.run(["bash", str(script), *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=7200)
    out = p.stdout.decode(errors="replace")
    if p.returncode != 0:
        pytest.fail(f"bash ggml/build.sh {' '.join(args)} failed:\n{out[-6000:]}")
    return out


def built_script(name, binaries):
    """ggml/NAME.py as a module, after the patched build; BINARIES(module) lists the files the build must
    have made for it."""
    build_ggml()
    sys.path.insert(0, str(GGML))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(GGML))
    for path in binaries(module):
        if not Path(path).is_file():
            pytest.fail(f"bash ggml/build.sh succeeded but built no {path}")
    return module


def once_per_key(prepare, workdir):
    """key -> prepare(*key, workdir), each key's model converted once (a module fixture's cache)."""
    cache = {}

    def get(*key):
        if key not in cache:
            cache[key] = prepare(*key, workdir)
        return cache[key]
    return get


def load_dump(d):
    """The tensors a check binary dumped into D: (manifest, load(case, name)); manifest.txt has a line
    `case name type ne0 ne1 ...` a tensor, type f32, i32 or param (an integer, ne0)."""
    man = {}
    with open(os.path.join(d, "manifest.txt")) as f:
        for line in f:
            case, name, typ, *ne = line.split()
            man.setdefault(case, {})[name] = (typ, [int(v) for v in ne])

    def load(case, name):
        typ, ne = man[case][name]
        if typ == "param":
            return ne[0]
        a = np.fromfile(os.path.join(d, f"{case}.{name}.bin"), dtype=np.float32 if typ == "f32" else np.int32)
        return a.reshape(tuple(reversed(ne)))       # NumPy shape: ggml's ne reversed
    return man, load


def import_peft():
    """peft, for the LoRA tests' oracle; without it the module skips, except under CI=true (an error)."""
    try:
        import peft
    except ImportError:
        if CI:
            pytest.fail("peft is not installed (CI=true: a missing tool is an error, not a skip)")
        pytest.skip("peft is not installed")
    return peft


def sha256(path):
    """The hex sha256 of a file's bytes (the LoRA tests check that a base GGUF stays as it was)."""
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def import_lora_peft():
    """ggml/lora_peft.py as a module."""
    sys.path.insert(0, str(ROOT / "ggml"))
    try:
        import lora_peft
    finally:
        sys.path.remove(str(ROOT / "ggml"))
    return lora_peft
