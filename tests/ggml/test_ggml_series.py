"""The change in upstream shape: `bash ggml/build.sh --export DIR` writes it as git-format
patches against the pristine llama.cpp tree, one concern each, and they apply with `git am`, in order,
to a fresh extraction of the whole vendored llama.cpp of the sdist.

- the series has one patch per concern, in the documented order, and each applies on the previous;
- the tree they make equals, file for file, the one ggml/build.sh builds (build/ggml/_src, from which
  libllama, llama-finetune and llama-tokenize are built), so what is exported is what is tested;
- that tree builds on its own: ggml and test-backend-ops with a plain cmake of the patched tree (no
  variable pointing back into this checkout: ssmgrad's kernels are files of the tree), and its
  test-backend-ops checks SSM_CONV's gradients.

Only the final tree is built (a build per patch would cost eight builds of libllama); each patch is
applied by `git am`, which checks it against the tree of the patches before it.
"""

import filecmp
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ggml_build import ENV, build_ggml  # noqa: E402

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

BUILD = os.environ.get("SSMGRAD_GGML_BUILD", os.path.join(ROOT, "build", "ggml"))
CACHE = os.environ.get("SSMGRAD_GGML_CACHE",
                       os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "ssmgrad-ggml"))
SDIST = os.path.join(CACHE, "llama_cpp_python-0.3.36.tar.gz")
TOP = "llama_cpp_python-0.3.36/vendor/llama.cpp/"

CONCERNS = [
    "ggml-ssm-conv-scan-backward",
    "ggml-concat-backward",
    "ggml-view-backward-strided-gradient",
    "ggml-opt-reset-gradients-rebuilt-graphs",
    "llama-training-copies-recurrent-start-state",
    "llama-train-token-embd",
    "common-opt-dataset-short-text-error",
    "tests-backend-ops-grad-cases",
    "ggml-mul-mat-id-backward",
    "ggml-sigmoid-backward",
    "ggml-clamp-backward",
    "ggml-strided-gradient-into-binary-ops",
    "llama-hybrid-memory-training-inputs",
    "convert-hybrid-ssm-families-transformers5",
    "ggml-get-rows-batched-backward",
    "ggml-sub-div-broadcast-backward",
    "ggml-cpu-soft-max-back-in-place",
    "ggml-gated-delta-net-backward",
    "tests-backend-ops-gated-delta-net-grad-cases",
    "convert-delta-rule-families-transformers5",
    "llama-qwen3next-dense-layers",
    "llama-mla-training-reads-ubatch-k",
    "llama-kimi-linear-reference-norm-eps",
    "ggml-cpu-out-prod-f32-register-tiles",
    "llama-finetune-lora-adapter",
    "llama-nemotron-h-latent-lora",
    "llama-kimi-linear-lora-projections",
    "ggml-cpu-out-prod-quantized-tiles",
    "llama-finetune-no-weight-repacking",
    "ggml-mul-mat-id-back-quantized-experts",
    "llama-finetune-lora-experts",
    "llama-finetune-optimizer-argument-errors",
    "common-log-drained-at-exit",
]
GIT_ENV = dict(ENV, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")


def _run(args, cwd, timeout=3600, env=GIT_ENV):
    p = subprocess.run(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    assert p.returncode == 0, "%s failed:\n%s" % (" ".join(args), p.stdout.decode(errors="replace")[-6000:])
    return p.stdout.decode(errors="replace")


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    build_ggml(tools=("git",))                            # fetches the sdist too
    out = tmp_path_factory.mktemp("series")
    _run(["bash", os.path.join(ROOT, "ggml", "build.sh"), "--export", str(out)], ROOT)
    patches = sorted(os.listdir(out))
    # the tree is extracted to DIR/_src and built in DIR, the layout of ggml/build.sh's build directory,
    # so that with ccache (CCACHE_BASEDIR=DIR, as build.sh sets it) a file compiled there with the same
    # bytes and flags is not compiled again
    tree = tmp_path_factory.mktemp("llama.cpp") / "_src"
    tree.mkdir()
    with tarfile.open(SDIST) as tf:
        # the sdist's vendor/llama.cpp/.git is a submodule's gitlink file pointing outside the sdist
        members = [m for m in tf.getmembers() if m.name.startswith(TOP) and m.name[len(TOP):] != ".git"]
        for m in members:
            m.name = m.name[len(TOP):]
        if sys.version_info >= (3, 12):
            tf.extractall(tree, members=members, filter="tar")
        else:
            tf.extractall(tree, members=members)
    _run(["git", "init", "-q"], tree)
    _run(["git", "add", "-A"], tree)
    _run(["git", "commit", "-q", "-m", "pristine"], tree)
    return out, patches, tree


def test_one_patch_per_concern_in_order(series):
    out, patches, _ = series
    assert [p[5:-6] for p in patches] == CONCERNS, patches
    # numbered in order from 0001; numbers may be left free (a range kept for a concern of another branch)
    nums = [int(p[:4]) for p in patches]
    assert nums[0] == 1 and all(a < b for a, b in zip(nums, nums[1:])), patches
    for p in patches:
        text = open(os.path.join(out, p)).read()
        assert text.startswith("From ") and "\nSubject: [PATCH " in text, p


def test_series_applies_in_order_and_matches_the_built_tree(series):
    out, patches, tree = series
    for p in patches:
        _run(["git", "am", "-q", os.path.join(out, p)], tree)
    log = _run(["git", "log", "--format=%s"], tree).splitlines()
    assert len(log) == len(patches) + 1
    # every file of build.sh's tree is the exported tree's file (the exported tree is the whole
    # llama.cpp, build.sh's the part it builds)
    src = os.path.join(BUILD, "_src")
    differ = []
    for dirpath, _, files in os.walk(src):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            if rel == ".stamp":
                continue
            other = os.path.join(tree, rel)
            if not os.path.exists(other) or not filecmp.cmp(os.path.join(dirpath, f), other, shallow=False):
                differ.append(rel)
    assert not differ, differ[:20]
    assert os.path.exists(os.path.join(tree, "ggml", "src", "ggml-cpu", "ssmgrad", "ssmgrad.h"))
    # the CPython glue stays out of ggml: no file of the kernels' copy includes Python.h
    kernels = os.path.join(tree, "ggml", "src", "ggml-cpu", "ssmgrad")
    with_python = [os.path.relpath(os.path.join(d, f), kernels) for d, _, fs in os.walk(kernels) for f in fs
                   if "Python.h" in open(os.path.join(d, f), errors="replace").read()]
    assert not with_python, with_python


def test_patched_tree_builds_on_its_own(series):
    """ggml + test-backend-ops from the exported tree alone, through ggml/CMakeLists.txt (which only
    adds the programs: the sdist's ggml/ lacks ggml.pc.in, so it does not configure as a top-level
    project) with no variable pointing into this checkout, and its test-backend-ops checks
    SSM_CONV's and CONCAT's gradients."""
    out, patches, tree = series
    if len(_run(["git", "log", "--format=%s"], tree).splitlines()) == 1:      # run alone: apply first
        for p in patches:
            _run(["git", "am", "-q", os.path.join(out, p)], tree)
    b = tree.parent
    launcher, env = [], dict(GIT_ENV)
    if os.environ.get("SSMGRAD_GGML_CCACHE", "1") != "0" and shutil.which("ccache"):
        launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        env.update(CCACHE_BASEDIR=str(b), CCACHE_NOHASHDIR="1")
    _run(["cmake", "-S", os.path.join(ROOT, "ggml"), "-B", str(b), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_SOURCE_DIR=%s" % (tree / "ggml"), "-DTEST_BACKEND_OPS=%s" % (tree / "tests" / "test-backend-ops.cpp"),
          "-DSSMGRAD_PATCHED=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=OFF",
          "-DGGML_BLAS=OFF", "-DGGML_LLAMAFILE=OFF", *launcher], tree)
    _run(["cmake", "--build", str(b), "-j", os.environ.get("SSMGRAD_GGML_JOBS", "2"), "--target", "test-backend-ops"],
         tree, timeout=7200, env=env)
    exe = str(b / "bin" / "test-backend-ops")
    env = dict(ENV, TERM="dumb")
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    o = ansi.sub("", _run([exe, "grad", "-o", "SSM_CONV", "-t", "1", "-p", r"ne_a=\[[0-9],"], tree, env=env))
    assert o.count("SSM_CONV(") >= 4 and "FAIL" not in o and o.rstrip().endswith("OK"), o[-3000:]
    o = ansi.sub("", _run([exe, "grad", "-o", "CONCAT", "-t", "1", "-p", r"ne_a=\[3,4,2,2\]"], tree, env=env))
    assert o.count("CONCAT(") == 24 and "FAIL" not in o and o.rstrip().endswith("OK"), o[-3000:]
