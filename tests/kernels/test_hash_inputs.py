"""The golden hash files' inputs have the same bits on every host, whatever SIMD code numpy picks.

benchmarks/scan_hashes.py and gdn_hashes.py draw their inputs with numpy; numpy's np.exp and np.log
(float64) take X86_V4 (AVX-512), X86_V3 (AVX2) or baseline code by the CPU, with other last bits, so
inputs made with them differed on an AVX2-only host and its kernels' outputs missed the golden file
recorded on an AVX-512 one (192 of gdn_hashes.txt's 672 cases, 55 of scan_hashes.txt's 248). The scripts
now compute their transcendental parts from exactly rounded operations (tests/reference.py, exact_exp).
Oracle: the same digest computed in a child process where NPY_DISABLE_CPU_FEATURES turns off each
level of numpy's dispatch this CPU has, so that it runs the code an AVX2-only or a baseline x86-64 CPU
runs; numpy's own switch, no code of the scripts'. (The kernels' side: the golden tests' x86-64-v3 and
x86-64 passes reproduced under `qemu-x86_64 -cpu EPYC-v1`, an emulated AVX2-only EPYC; docs/simd.md.)
"""
import os
import subprocess
import sys

import pytest

import gdn_hashes
import scan_hashes

BENCH = os.path.dirname(os.path.abspath(gdn_hashes.__file__))


def _dispatch_levels():
    """numpy's dispatched feature groups this CPU has, highest first: each one disabled in turn (with
    all above it) gives the code a CPU without it runs"""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    return [f for f in reversed(__cpu_dispatch__) if __cpu_features__.get(f)]


def _disable_sets():
    levels = _dispatch_levels()
    return [" ".join(levels[:i + 1]) for i in range(len(levels))]


@pytest.mark.parametrize("script", [gdn_hashes, scan_hashes], ids=["gdn", "scan"])
@pytest.mark.parametrize("disable", _disable_sets() or [None])
def test_inputs_do_not_depend_on_numpy_dispatch(script, disable):
    if disable is None:
        pytest.skip("numpy dispatches no SIMD level beyond its baseline on this CPU")
    here = script.input_digest()
    code = (f"import sys; sys.path[:0] = {[BENCH, os.path.join(os.path.dirname(BENCH), 'tests')]!r}; "
            f"import {script.__name__} as m; print(m.input_digest())")
    env = dict(os.environ, NPY_DISABLE_CPU_FEATURES=disable)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == here, (f"{script.__name__}'s inputs differ with numpy's {disable} code off: "
                                      f"{r.stdout.strip()} != {here}")
