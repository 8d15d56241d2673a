"""ssmgrad's default thread count follows OMP_NUM_THREADS when it is set, as torch's does (torchrun sets
it to 1 per rank), and is independent of torch.set_num_threads. Each case runs in a fresh interpreter,
since the default is read at import. The oracle: torch's own reading of the same environment."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _child(code, omp):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split(), r.stderr


# A value that is not a list of positive integers is ignored with a warning: LLVM's libomp 14 aborts
# the process at its first parallel region when it reads one (the clang build in .ci/compilers.sh),
# so the call below runs a parallel region (two threads) and checks the environment is restored.
@pytest.mark.parametrize("omp,want", [(None, "cores"), ("3", 3), ("3,1", 3), (" 2 , 1 ", 2), ("1", 1),
                                      ("0", "cores"), ("many", "cores"), ("4,x", "cores"), ("", "cores"),
                                      ("-2", "cores")])
def test_default_follows_omp_num_threads(omp, want):
    code = ("import os, numpy as np, ssmgrad\n"
            "n = ssmgrad.get_num_threads()\n"
            "ssmgrad.set_num_threads(2)\n"
            "sx = np.ones((2, 64, 515), np.float32); c = np.ones((64, 4), np.float32)\n"
            "assert float(ssmgrad.ssm_conv(sx, c)[0, 0, 0]) == 4.0\n"
            "print(n, len(os.sched_getaffinity(0)), repr(os.environ.get('OMP_NUM_THREADS')), sep='|')\n")
    out, err = _child(code, omp)
    got, cores, seen = " ".join(out).split("|")
    assert int(got) == (int(cores) if want == "cores" else want), (omp, got, cores)
    assert seen == repr(omp)                      # the environment is as the user set it
    warned = "is not a list of positive integers" in err
    assert warned == (omp is not None and want == "cores"), err


def test_same_default_as_torch_and_independent_counts():
    # torch reads OMP_NUM_THREADS too: under torchrun (OMP_NUM_THREADS=1) both use one thread per rank
    code = ("import torch, ssmgrad\n"
            "a = (torch.get_num_threads(), ssmgrad.get_num_threads())\n"
            "torch.set_num_threads(2)\n"
            "b = ssmgrad.get_num_threads()\n"
            "ssmgrad.set_num_threads(3)\n"
            "print(*a, b, torch.get_num_threads(), ssmgrad.get_num_threads())\n")
    torch_n, ssm_n, after_torch_set, torch_after, ssm_after = map(int, _child(code, "1")[0])
    assert torch_n == ssm_n == 1
    assert after_torch_set == 1                    # torch.set_num_threads leaves ssmgrad's count alone
    assert torch_after == 2 and ssm_after == 3     # and ssmgrad.set_num_threads leaves torch's alone
    torch_n, ssm_n = map(int, _child("import torch, ssmgrad; print(torch.get_num_threads(), ssmgrad.get_num_threads())",
                                     "2,1")[0])
    assert torch_n == ssm_n == 2
