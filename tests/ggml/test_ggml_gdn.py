"""GATED_DELTA_NET_BACK inside the patched ggml (ggml/patches/0020, 0021): the pieces that ggml's own
finite-difference harness does not see. (tests/ggml/test_ggml.py checks the grad-mode cases of
`test-backend-ops grad -o GATED_DELTA_NET`.)

- ggml/gdn_check.c (`gdn-check`):
  * ssmgrad's forward (gdn_fwd_f32) against ggml's own CPU forward of GGML_OP_GATED_DELTA_NET on the
    same inputs, Qwen3-Next's head size 128 included: at most a few ulps apart;
  * GATED_DELTA_NET_BACK through ggml's graph, plan and work buffer with 1, 2, 3 and 4 threads gives
    the same bytes, and those of ssmgrad's kernel called directly (run RACE_RUNS times);
  * its dump of the back op's inputs and result: the same bytes as ssmgrad.gated_delta_net_back, and
    close to torch.autograd through the float64 torch recurrence of tests/reference.py.

Policy as tests/ggml/test_ggml.py: with CI=true a missing tool is an error; a failing build always is.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ggml_build import build_ggml, load_dump  # noqa: E402
from test_ggml import BIN  # noqa: E402

pytestmark = pytest.mark.integration

RACE_RUNS = int(os.environ.get("SSMGRAD_GGML_RACE_RUNS", "20"))

# ssmgrad's forward vs ggml's: ssmgrad sums its dot products in ggml_vec_dot_f32's order (the AVX2
# build's 32 running sums and reduction tree), so with S a multiple of 32 every float must have
# ggml's bits. For S 16 (no full 32-float block: the tail, summed in an order that depends on ggml's
# compiler) within rounding: at most 4 ulps of the largest |value| of the region (o, or the state
# slots). Measured (Dec 2 2026, the six cases; decode_kda since, the same): every element bitwise equal, S 16 included. Before
# ssmgrad followed ggml's order (16 lanes), 2 ulps of the region's largest value at most, and 66-96%
# of the elements equal; one element's own ulp distance is no measure then (an o value close to 0 by
# cancellation differed by 46341 ulps of itself, 7e-10, an ulp of the summed terms).
FWD_S = {"qwen3next": 128, "decode": 128, "decode_kda": 64, "kda": 64, "snapshots": 32, "snapshots_kda": 16,
         "seq_bcast": 16}
FWD_CASES = set(FWD_S)
BACK_CASES = {"back_scalar", "back_kda", "back_bcast"}
MAX_ULP_AT_MAX = 4.0    # |difference| in ulps of the region's largest |value|


@pytest.fixture(scope="module")
def gdn_check():
    build_ggml()
    exe = os.path.join(BIN, "gdn-check")
    assert os.access(exe, os.X_OK), exe
    return exe


def _run(exe, *args):
    p = subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    return p.returncode, p.stdout.decode(errors="replace")


FWD = re.compile(r"^fwd (\S+) (\d+) max_ulp_o (\d+) max_ulp_state (\d+) max_abs (\S+) max_ulp_at_max (\S+)"
                 r" max_ulp_row (\S+) equal (\S+)$")


def test_forward_matches_ggml_within_ulps(gdn_check):
    rc, out = _run(gdn_check)
    assert rc == 0 and out.rstrip().endswith("OK"), out
    seen = {}
    for line in out.splitlines():
        m = FWD.match(line)
        if m:
            seen[m.group(1)] = (int(m.group(3)), int(m.group(4)), float(m.group(5)), float(m.group(6)),
                                float(m.group(8)))
    assert set(seen) == FWD_CASES, out
    for case, (u_o, u_s, a, u_max, equal) in seen.items():
        if FWD_S[case] % 32 == 0:
            assert u_o == u_s == 0 and equal == 1.0, "%s: %s" % (case, out)
        assert u_max <= MAX_ULP_AT_MAX, "%s: %s" % (case, out)


def test_back_op_bitwise_across_threads_repeated(gdn_check):
    for i in range(RACE_RUNS):
        rc, out = _run(gdn_check)
        assert rc == 0 and out.rstrip().endswith("OK"), "run %d of %d:\n%s" % (i + 1, RACE_RUNS, out)
        assert out.count("bitwise identical for n_threads 1, 2, 3, 4 and a direct call") == len(BACK_CASES), out


def test_back_op_against_float64_autograd(gdn_check, tmp_path):
    import ssmgrad
    import reference as R

    rc, out = _run(gdn_check, str(tmp_path))
    assert rc == 0 and out.rstrip().endswith("OK"), out
    man, load = load_dump(str(tmp_path))
    assert set(man) == BACK_CASES
    for case in sorted(BACK_CASES):
        ins = {n: load(case, n) for n in R.GDN_NAMES}
        grad, gin, K = load(case, "grad").ravel(), load(case, "gin").ravel(), load(case, "K")
        # ggml's op runs ssmgrad's kernel: the Python API gives the same bytes
        np.testing.assert_array_equal(gin, ssmgrad.gated_delta_net_back(*R.gdn_args(ins), grad, K=K))
        ref = R.ref_gdn_grads(*R.gdn_args(ins), grad, K=K)
        off = 0
        for name in R.GDN_NAMES:
            n = ins[name].size
            got = gin[off:off + n].reshape(ins[name].shape)
            off += n
            scale = float(np.abs(ref[name]).max())
            err = float(np.abs(got - ref[name]).max()) / scale
            assert scale > 0 and err < MAX_REL_ERR, "%s d_%s: max |diff| / max |ref| = %.3g" % (case, name, err)
        assert off == gin.size


MAX_REL_ERR = 1e-6    # measured (Dec 2 2026): 1.8e-7 at most over the three cases and six regions
