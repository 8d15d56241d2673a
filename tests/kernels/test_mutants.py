"""The oracle tests catch an error of about their tolerance inside every kernel form and gradient region.

csrc/ssm_mutant.h marks one term per (kernel form, output or gradient region) with
SSM_MUTANT(id, expr): the bare expression in every ordinary build (the same code: the hash goldens
do not move), and in a build compiled with -DSSMGRAD_MUTANTS the term scaled by (1 + rel) when the
environment variable SSMGRAD_MUTANT=<name>:<rel> selects that mutant when the library loads.

This test builds that extension once in a private copy of the tree (as .ci/sanitize.sh does: a
temporary directory, `setup.py build_ext --inplace` with CFLAGS=-DSSMGRAD_MUTANTS), then for each
mutant runs a few of the ordinary tests whose oracle shares no code with the kernels (the torch
reference and torch.autograd, or whole-array NumPy in float64; never the hash goldens) in a
subprocess with the mutant selected, and asserts that the run fails on an assertion (a failed
test, not a collection error or a crash); and once with no mutant selected, asserting that the same
tests pass on that build. rel is a few times (5x) the relative tolerance of the tests run, so an
error just above what a test allows must be seen, not one a thousand times over it.

Cost, measured (GCC 12, on an idle 2-core Zen 4): the build (for this CPU only) 19 s of CPU, the 53
runs 75 s of CPU, two at a time: under a minute of wall time (build 10 s, runs 41 s). The runs are
forked from one process that has imported torch and pytest (tests/kernels/mutant_runner.py): as 53 new
interpreters they took 257 s of CPU and 133 s of wall time on the same machine. The first
failing check of each mutant is printed (pytest -s); all but two name the region the mutant sits in
(back_ck_dC scales e^(l_t) dy_t, which feeds d_C's head term and the carried state gradient: d_s
fails first; gdn_vec_dstate scales the carried d_state, which feeds the earlier tokens' d_k: d_k
fails first).

The mutant build is for this CPU only (SSMGRAD_NATIVE=1: the pass its dispatch would pick; AVX-512
here: the blocked float32 conv kernels, the 64-byte vector code of the scan, the delta-rule op's
vector recurrence); the float64 tests run the conv's and the scan's loops (the conv_blk_* and
gdn_vec_* mutants sit in AVX-512 code only, but gdn_vec_fwd and gdn_vec_decode, which an AVX2 build runs too:
on a CPU without it, an AVX2-only host or under SSMGRAD_NO_AVX512=1, no test runs them, and their checks
skip, saying so: AVX512_ONLY, AVX2_TOO). The kernels'
other passes hold the same marks (each id marks its term in every version of the form).
"""

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.integration   # a second build of the extension; .ci's sanitizer and compiler passes skip it
CI = os.environ.get("CI", "").lower() == "true"

# tolerances of the tests run (rtol; the float32 ones are atol = tol * (1 + max |ref|), rtol 0)
SCAN_FWD = 1e-11      # tests/kernels/test_scan.py FWD_TOL, test_scan_fwd_chunked.py, test_decode.py
SCAN_GRAD = 1e-10     # tests/kernels/test_scan.py GRAD_TOL, test_scan_back_chunked.py
CONV_FWD = 1e-12      # tests/kernels/test_conv.py FWD_TOL
CONV_GRAD = 1e-11     # tests/kernels/test_conv.py GRAD_TOL
CONV_F32 = 2e-6       # tests/kernels/test_conv.py F32_TOL
GDN = 1e-10           # tests/kernels/test_gdn.py FWD_TOL, GRAD_TOL; tests/kernels/test_gdn_chunked.py TOL
K = 5                 # rel = K x the tolerance

CONV_F64 = ["tests/kernels/test_conv.py::test_forward", "tests/kernels/test_conv.py::test_backward_vs_autograd"]
# the blocked kernels' shapes but the three large ones (BLOCKED_SHAPES[7:]: the NumPy oracle takes seconds there)
CONV_BLOCKED = [f"tests/kernels/test_conv.py::test_float32_blocked_shapes[shape{i}]" for i in range(7)]
SCAN_FWD_REC = ["tests/kernels/test_scan.py::test_forward_vs_reference", "-k", "recurrence-recurrence"]
SCAN_BACK_REC = ["tests/kernels/test_scan.py::test_backward_vs_autograd", "-k", "recurrence-"]
SCAN_BACK_CK = ["tests/kernels/test_scan_back_chunked.py::test_chunked_vs_autograd"]
GDN_TESTS = ["tests/kernels/test_gdn.py::test_against_autograd"]
# float64, S 8 to 32 with form="recurrence": the 64-byte vector recurrence on an AVX-512 CPU
GDN_VEC = ["tests/kernels/test_gdn.py::test_vector_recurrence"]
# float64, one token, S 8 to 32: the vector recurrence's decode path on an AVX-512 CPU
GDN_VEC_DECODE = ["tests/kernels/test_gdn.py::test_vector_decode"]
GDN_CK = ["tests/kernels/test_gdn_chunked.py::test_against_autograd"]   # form="chunked"
GDN_KCK = ["tests/kernels/test_gdn_kda_chunked.py::test_against_autograd"]   # per-channel gate, form="chunked"

# name (csrc/ssm_mutant.c): (rel, [one test selection per run; every run must fail])
MUTANTS = {
    "conv_fwd": (K * CONV_FWD, [CONV_F64]),
    "conv_back": (K * CONV_GRAD, [CONV_F64]),
    "conv_back_weight": (K * CONV_GRAD, [CONV_F64]),
    "conv_blk_fwd": (K * CONV_F32, [CONV_BLOCKED]),
    "conv_blk_back": (K * CONV_F32, [CONV_BLOCKED]),
    "conv_blk_back_weight": (K * CONV_F32, [CONV_BLOCKED]),
    "scan_rec_y": (K * SCAN_FWD, [SCAN_FWD_REC]),
    "scan_ck_y": (K * SCAN_FWD, [["tests/kernels/test_scan_fwd_chunked.py::test_chunked_vs_reference"]]),
    "scan_ck_state": (K * SCAN_FWD, [["tests/kernels/test_scan_fwd_chunked.py::test_chunked_vs_reference"]]),
    "scan_decode": (K * SCAN_FWD, [["tests/kernels/test_decode.py::test_decode_vs_reference"],
                                   ["tests/kernels/test_scan_update.py::test_update_equals_reference", "-k", "float64"]]),
    **{f"back_rec_{r}": (K * SCAN_GRAD, [SCAN_BACK_REC]) for r in ("ds", "dx", "ddt", "dA", "dB", "dC")},
    **{f"back_ck_{r}": (K * SCAN_GRAD, [SCAN_BACK_CK]) for r in ("ds", "dx", "ddt", "dA", "dB", "dC")},
    **{f"gdn_{r}": (K * GDN, [GDN_TESTS]) for r in ("fwd", "dq", "dk", "dv", "dg", "dbeta", "dstate")},
    **{f"gdn_vec_{r}": (K * GDN, [GDN_VEC]) for r in ("fwd", "dq", "dk", "dv", "dg", "dbeta", "dstate")},
    "gdn_vec_decode": (K * GDN, [GDN_VEC_DECODE]),
    **{f"gdn_ck_{r}": (K * GDN, [GDN_CK]) for r in ("fwd", "dq", "dk", "dv", "dg", "dbeta", "dstate")},
    **{f"gdn_kck_{r}": (K * GDN, [GDN_KCK]) for r in ("fwd", "dq", "dk", "dv", "dg", "dbeta", "dstate")},
}
# the mutants that sit in AVX-512 code only (level 4 with its 64-byte kernels): on a CPU without it (an
# AVX2-only host, or SSMGRAD_NO_AVX512=1) their tests pass without running that code, and their checks skip
AVX512_ONLY = {**{n: "the float32 conv's cache-blocked kernels" for n in MUTANTS if n.startswith("conv_blk_")},
               **{n: "the delta-rule op's vector recurrence" for n in MUTANTS if n.startswith("gdn_vec_")}}
# ... except the delta-rule op's vector forward and decode, which an AVX2 build (level 3) runs too
AVX2_TOO = {"gdn_vec_fwd", "gdn_vec_decode"}


def _runs_vector_code(name):
    import ssmgrad
    info = ssmgrad._ext.build_info()
    return info["avx512_kernels"] or (name in AVX2_TOO and info["simd_selected"].split()[0] in ("AVX2", "x86-64-v3"))

# d_A of the scan: test_scan.py's check_against_autograd compares it (ssm_scan_back(..., return_dA=True))


def _c_names():
    """The mutant names csrc/ssm_mutant.c knows, and the SSM_MUT_* ids the kernels mark."""
    with open(os.path.join(ROOT, "csrc", "ssm_mutant.c"), encoding="utf-8") as f:
        names = dict(re.findall(r"\[(SSM_MUT_\w+)\] = \"(\w+)\"", f.read()))
    used = set()
    for d in ("csrc", os.path.join("csrc", "inst")):
        for fn in os.listdir(os.path.join(ROOT, d)):
            if fn.endswith((".c", ".h")) and not fn.startswith("ssm_mutant"):
                with open(os.path.join(ROOT, d, fn), encoding="utf-8") as f:
                    # SSM_MUTANT(id, ...) in a kernel, or the id handed to gdn_grads.h's row writers, which
                    # apply SSM_MUTANT(mut, ...) to it
                    used |= set(re.findall(r"(?:SSM_MUTANT\(|gdn_(?:add|put)_row\([^;]*?,\s*)(SSM_MUT_\w+)",
                                           f.read()))
    return names, used


def test_every_mutant_is_marked_and_checked():
    names, used = _c_names()
    assert len(names) >= 29, names
    assert set(names.values()) == set(MUTANTS), "csrc/ssm_mutant.c and MUTANTS differ"
    assert set(names) == used, f"ids with no SSM_MUTANT mark in a kernel: {set(names) - used}"


def _have(tool):
    if shutil.which(tool):
        return True
    if CI:
        pytest.fail(f"{tool} not found (CI=true: a failure, not a skip)")
    pytest.skip(f"{tool} not found: the mutant build cannot be made")


def _cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@pytest.fixture(scope="module")
def mutant_tree(tmp_path_factory):
    """A private copy of the tree with _ssmgrad built with -DSSMGRAD_MUTANTS."""
    cc = (os.environ.get("CC") or "cc").split()[0]
    _have(cc)
    src = tmp_path_factory.mktemp("mutants") / "src"
    junk = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".pytest_cache",
                                  ".hypothesis", "ggml")
    shutil.copytree(ROOT, src, ignore=junk)
    # -O2, not the release -O3: the copy compiles in about half the CPU time, and what is checked (each
    # mutant's term changes a result the tests catch) does not depend on the optimisation level.
    # SSMGRAD_NATIVE=1: the kernels compiled once, for this CPU, instead of for each of the three SIMD
    # levels the dispatch could pick: the runs below exercise the pass this CPU picks, and a native
    # build compiles the same bodies for it (about a third of the compile)
    # -g0: no debug information (Python's flags hold -g): less compile time, the same code
    env = dict(os.environ, CFLAGS=(os.environ.get("CFLAGS", "") + " -g0 -DSSMGRAD_MUTANTS").strip(), SSMGRAD_OPT="-O2",
               SSMGRAD_NATIVE="1")
    t, c = time.time(), _cpu()
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-j", "2"], cwd=src, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, f"the mutant build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    print(f"\nmutant build: {time.time() - t:.0f} s, {_cpu() - c:.0f} s of CPU")
    return str(src)


def _pytest_args(selection, stop_at_first=True):
    # --capture=sys: what the library prints at load (the mutant it selected) reaches the run's stderr
    return ["-q", "-p", "no:cacheprovider", "--capture=sys", "-m", "", "--no-header", "-rN",
            *(["-x"] if stop_at_first else []), *selection]


@pytest.fixture(scope="module")
def mutant_runs(mutant_tree, tmp_path_factory):
    """{(name, i): (CompletedProcess, seconds)} for every mutant's every run, and under the key
    (None, 0) the run with no mutant of every test function any selection takes from (all their
    cases). Each run is pytest in a process of its own, forked by tests/kernels/mutant_runner.py from
    one that has imported torch, NumPy and pytest (about 2.5 CPU s a run less than a new interpreter),
    two at a time."""
    jobs = [{"key": [name, i], "args": _pytest_args(sel), "mutant": f"{name}:{rel:g}"}
            for name, (rel, sels) in MUTANTS.items() for i, sel in enumerate(sels)]
    funcs = sorted({arg.split("[")[0] for _, sels in MUTANTS.values() for sel in sels for arg in sel
                    if arg.startswith("tests/")})
    jobs.append({"key": [None, 0], "args": _pytest_args(funcs, stop_at_first=False), "mutant": None})
    d = tmp_path_factory.mktemp("mutant-runs")
    (d / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k not in ("SSMGRAD_MUTANT", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = mutant_tree
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, os.path.join(mutant_tree, "tests", "kernels", "mutant_runner.py"), str(d / "jobs.json"),
           str(d / "results.json")]
    t, c = time.time(), _cpu()
    r = subprocess.run(cmd, cwd=mutant_tree, env=env, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, f"mutant_runner.py failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    results = {}
    for res in json.loads((d / "results.json").read_text()):
        key = tuple(res["key"])
        results[key] = (subprocess.CompletedProcess(key, res["returncode"], res["stdout"], res["stderr"]),
                        res["seconds"])
    assert len(results) == len(jobs), "mutant_runner.py lost runs"
    print(f"\n{len(jobs)} runs: {time.time() - t:.0f} s, {_cpu() - c:.0f} s of CPU")
    return results


def test_no_mutant_passes(mutant_runs):
    r, secs = mutant_runs[(None, 0)]
    assert r.returncode == 0, f"the selected tests fail on the mutant build with no mutant:\n{r.stdout[-4000:]}"
    assert "mutant" not in r.stderr, r.stderr
    print(f"no mutant: {r.stdout.strip().splitlines()[-1]} ({secs:.0f} s)")


def _first_failure(out):
    m = re.search(r"^E +(AssertionError: .*|.*Not equal to tolerance.*|.*Mismatch.*)$", out, re.M)
    return m.group(1)[:160] if m else "?"


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(mutant_runs, name):
    rel, sels = MUTANTS[name]
    if name in AVX512_ONLY and not _runs_vector_code(name):
        pytest.skip(f"{name} sits in AVX-512 code ({AVX512_ONLY[name]}{' or AVX2' if name in AVX2_TOO else ''}): "
                    "this CPU or build never runs it")
    for i, sel in enumerate(sels):
        r, secs = mutant_runs[(name, i)]
        assert f"ssmgrad: mutant {name}," in r.stderr, f"the build did not select {name}:\n{r.stderr[-2000:]}"
        assert r.returncode == 1, (f"mutant {name} (x{1 + rel:.12g}) not caught by {' '.join(sel)} "
                                   f"(exit {r.returncode}, {secs:.0f} s):\n{r.stdout[-3000:]}")
        assert "AssertionError" in r.stdout or "Mismatch" in r.stdout, r.stdout[-3000:]
        print(f"{name} x(1 + {rel:g}): caught by {' '.join(sel)} in {secs:.1f} s: {_first_failure(r.stdout)}")
