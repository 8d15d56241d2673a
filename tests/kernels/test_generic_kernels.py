"""The scan kernels' loops for CPUs without AVX-512, checked on any machine.

With AVX-512 the scan kernels take versions written in 64-byte vector types; every other CPU
runs auto-vectorized loops over arrays (see ssm_vec64 in csrc/ssm_target_begin.h). On an AVX-512 machine
the rest of the suite only reaches the first kind, so this test runs the scan tests again in a
child process with SSMGRAD_NO_AVX512=1, which switches the kernels to the loops of other CPUs.
Elsewhere both runs take the same loops. The conv tests run there too: with AVX-512 the
float32 conv takes the cache-blocked kernels of csrc/ssm_conv_blk_body.h, with the switch off the
portable ones of csrc/ssm_conv_body.h, which every other CPU runs. The conv and scan tests run once more with
SSMGRAD_SIMD capping the runtime dispatch at x86-64-v3 and at the x86-64 baseline. Each rerun
covers every form of the scan: the decode path, the recurrence, the chunked forward and backward.
"""

import json
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# every form of the scan (decode, recurrence, chunked forward and backward) and the conv (there:
# ssm_conv_body.h's kernels instead of ssm_conv_blk_body.h's)
FORM_TESTS = ["tests/kernels/test_scan.py", "tests/kernels/test_decode.py", "tests/kernels/test_scan_back_chunked.py",
              "tests/kernels/test_scan_fwd_chunked.py", "tests/kernels/test_conv.py"]
SCAN_TESTS = FORM_TESTS + ["tests/kernels/test_concurrency.py", "tests/kernels/test_numerics_edges.py"]
# the Gated DeltaNet's recurrence tests too (decode included): its vector forward runs at x86-64-v3 as well
PASS_TESTS = FORM_TESTS + ["tests/kernels/test_gdn.py"]


def _deselected(config):
    """The --deselect options of this run, for the child pytest: what the parent run leaves out (the
    sanitizer pass's 8192-token numerics cases, .ci/sanitize.sh) stays out of the child's rerun too."""
    return [a for nodeid in (config.getoption("deselect") or []) for a in ("--deselect", nodeid)]


def _child_env():
    env = dict(os.environ, SSMGRAD_NO_AVX512="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def test_switch_reaches_the_kernels():
    out = subprocess.run([sys.executable, "-c", "import json, ssmgrad; print(json.dumps(ssmgrad._ext.build_info()))"],
                         cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["avx512_kernels"] is False


def test_scan_tests_pass_with_the_loops_of_other_cpus(pytestconfig):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_deselected(pytestconfig),
                        *SCAN_TESTS],
                       cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    assert " passed" in r.stdout and "failed" not in r.stdout.splitlines()[-1]


# The other passes of the runtime SIMD dispatch (csrc/inst/, docs/simd.md): SSMGRAD_SIMD caps the
# level the kernels pick, so the x86-64-v3 (AVX2) and baseline builds of every kernel, which an
# AVX-512 machine never picks by itself, run the conv and scan tests here too, and the Gated DeltaNet's
# recurrence tests (tests/kernels/test_gdn.py).
@pytest.mark.parametrize("cap", ["x86-64-v3", "x86-64"])
def test_conv_and_scan_tests_pass_in_each_simd_pass(cap, pytestconfig):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"runtime SIMD dispatch is x86-64 only (this is {platform.machine()})")
    env = dict(os.environ, SSMGRAD_SIMD=cap)
    env.pop("PYTEST_ADDOPTS", None)
    info = subprocess.run([sys.executable, "-c", "import json, ssmgrad; print(json.dumps(ssmgrad._ext.build_info()))"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    selected = json.loads(info.stdout.strip().splitlines()[-1])["simd_selected"]
    if "no runtime dispatch" in selected:
        # every build CI makes (gcc, gcc-11, clang, clang without OpenMP, the sanitized one) has the
        # dispatch: there a build without it is a regression, not a reason to skip
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: this build has one SIMD pass only ({selected}), so the x86-64-v3 and baseline passes go untested")
        pytest.skip(f"this build has one SIMD pass only: {selected}")
    # the cap never raises the level: a CPU without AVX2 stays at the baseline
    assert selected.split()[0] in (["x86-64-v3", "x86-64"] if cap == "x86-64-v3" else ["x86-64"]), selected
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_deselected(pytestconfig),
                        *PASS_TESTS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
    assert " passed" in r.stdout and "failed" not in r.stdout.splitlines()[-1]
