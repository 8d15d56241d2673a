"""SSM_SCAN forward and backward against the float64 oracles.

Oracles: the torch reference + autograd (tests/reference.py) and, without torch, central finite
differences of ssmgrad's own float64 forward. Every gradient is compared on its own, with its own
tolerance, and the assertion message carries the max difference.
"""

import numpy as np
import pytest

import ssmgrad
from reference import (
    assert_close, fd_vjp, make_scan_inputs, np_ssm_scan, ref_scan_grads, ref_scan_np, ref_ssm_scan,
    scan_args, scan_out_size, to_torch,
)

# every test once with each form of the backward (the forward ones too: cheap, and simpler)
pytestmark = pytest.mark.usefixtures("scan_back_form")

NAMES = ("s", "x", "dt", "B", "C")          # regions of gin, in order

# float64 kernel vs float64 torch reference: only rounding differs.
# Measured: <= 2e-14 abs at these sizes; the tolerances leave ~50x room, no more.
FWD_TOL = dict(atol=1e-13, rtol=1e-11)
GRAD_TOL = dict(atol=1e-12, rtol=1e-10)
# vs central differences (eps=1e-6): truncation + cancellation error ~1e-9 at these sizes.
FD_TOL = dict(atol=1e-6, rtol=1e-6)


def split_out(out, inp, K=1):
    s, x = inp["s"], inp["x"]
    y, st = ssmgrad.split(out, x.shape, (K, x.shape[0]) + s.shape[1:])
    return y, st


def split_gin(gin, inp):
    return dict(zip(NAMES, ssmgrad.split(gin, *(inp[k].shape for k in NAMES))))


def scan_back(inp, grad, K=1):
    """(dict of the five gradients, d_A) from one ssm_scan_back call with return_dA=True."""
    gin, d_A = ssmgrad.ssm_scan_back(*scan_args(inp), grad, K=K, return_dA=True)
    return split_gin(gin, inp), d_A


def check_against_autograd(inp, grad, K=1, tol=GRAD_TOL):
    got, d_A = scan_back(inp, grad, K=K)
    ref = ref_scan_grads(*scan_args(inp), grad, K=K)
    for k in NAMES:
        assert_close(got[k], ref[k], name=f"d_{k} vs autograd", **_scaled(tol, ref[k]))
    assert_close(d_A, ref["A"], name="d_A vs autograd", **_scaled(tol, ref["A"]))
    return got, d_A, ref


def _scaled(tol, ref):
    """Absolute tolerance scaled by the array's magnitude (sums of O(1) terms)."""
    scale = max(1.0, float(np.max(np.abs(ref)))) if np.size(ref) else 1.0
    return dict(atol=tol["atol"] * scale, rtol=tol["rtol"])


# name: (n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs)
CASES = {
    # Mamba-1 branch: head_dim == 1, A (n_head, d_state)
    "m1":              (4, 1, 3, 1, 2, 5, [1, 0], 2),
    "m1_groups":       (4, 1, 3, 2, 2, 4, [0, 1], 2),
    "m1_dup_extra":    (3, 1, 2, 1, 3, 3, [3, 1, 3], 5),
    "m1_nt1":          (4, 1, 3, 1, 2, 1, [1, 0], 2),
    "m1_1seq":         (2, 1, 4, 1, 1, 4, [0], 1),
    # Mamba-2 branch: head_dim > 1, A (n_head, 1)
    "m2":              (4, 3, 4, 1, 3, 4, [2, 0, 1], 3),
    "m2_groups":       (4, 2, 3, 2, 2, 3, [1, 0], 2),
    "m2_group_per_head": (3, 2, 2, 3, 2, 3, [0, 1], 2),
    "m2_dup_extra":    (2, 2, 3, 1, 4, 3, [4, 0, 4, 4], 6),
    "m2_nt1":          (4, 2, 3, 2, 3, 1, [2, 1, 0], 3),
    "m2_1seq":         (2, 3, 2, 1, 1, 5, [0], 1),
    # d_state long enough for vector loops, with and without a remainder
    "m1_ds16":         (3, 1, 16, 1, 2, 3, [1, 0], 3),
    "m2_ds19":         (2, 4, 19, 1, 2, 3, [0, 1], 2),
    "m2_ds32_hd8":     (2, 8, 32, 2, 1, 2, [1], 2),
    # the branch follows A's shape, not head_dim
    "m1A_head_dim2":   (2, 2, 3, 2, 2, 3, [0, 1], 2, False),
    "m2A_head_dim1":   (4, 1, 3, 2, 2, 3, [1, 0], 2, True),
}


def case_inputs(rng, name, mamba2=None, dtype=np.float64):
    n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs = CASES[name][:8]
    if mamba2 is None and len(CASES[name]) > 8:
        mamba2 = CASES[name][8]
    return make_scan_inputs(rng, n_head=n_head, head_dim=head_dim, d_state=d_state, n_group=n_group,
                            n_seqs=n_seqs, n_t=n_t, ids=ids, n_rs=n_rs, mamba2=mamba2, dtype=dtype)


def random_grad(rng, inp, K=1):
    """A random gradient over the WHOLE packed output: y region and state region(s) nonzero."""
    return rng.standard_normal(scan_out_size(inp, K))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.usefixtures("scan_fwd_form")     # and with each form of the forward
def test_forward_vs_reference(rng, name):
    inp = case_inputs(rng, name)
    out = ssmgrad.ssm_scan(*scan_args(inp))
    assert out.dtype == np.float64 and out.ndim == 1 and out.size == scan_out_size(inp)
    assert_close(out, ref_scan_np(*scan_args(inp)), name="out vs torch reference", **FWD_TOL)
    y, st = split_out(out, inp)
    assert st.shape[0] == 1


@pytest.mark.parametrize("name", ["m1", "m2_groups", "m2_dup_extra"])
@pytest.mark.usefixtures("scan_fwd_form")     # and with each form of the forward
def test_forward_vs_numpy_loop(rng, name):
    # the scalar numpy loop is an oracle independent of torch
    inp = case_inputs(rng, name)
    out = ssmgrad.ssm_scan(*scan_args(inp))
    assert_close(out, np_ssm_scan(*scan_args(inp)), name="out vs numpy loop", **FWD_TOL)


@pytest.mark.parametrize("name", CASES)
def test_backward_vs_autograd(rng, name):
    inp = case_inputs(rng, name)
    check_against_autograd(inp, random_grad(rng, inp))


@pytest.mark.parametrize("name", CASES)
def test_backward_vs_finite_differences(rng, one_thread, name):
    """A plumbing check, not an oracle: the finite differences are those of ssmgrad's own forward
    (checked itself against the references), so they show that the backward is the derivative of
    the forward. The oracles are tests/reference.py's torch recurrence under torch.autograd
    (test_backward_vs_autograd) and its NumPy reverse recurrence."""
    inp = case_inputs(rng, name)
    grad = random_grad(rng, inp)
    got, d_A = scan_back(inp, grad)
    ids = inp["ids"]
    floats = [inp[k] for k in ("s", "x", "dt", "A", "B", "C")]
    f = lambda s, x, dt, A, B, C: ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
    for i, k in enumerate(("s", "x", "dt", "A", "B", "C")):
        fd = fd_vjp(f, floats, i, grad)
        assert_close(d_A if k == "A" else got[k], fd, name=f"d_{k} vs finite differences",
                     **_scaled(FD_TOL, fd))


@pytest.mark.parametrize("name", ["m1_dup_extra", "m2_dup_extra"])
def test_duplicate_ids_accumulate_and_unreferenced_rows_are_zero(rng, name):
    inp = case_inputs(rng, name)
    grad = random_grad(rng, inp)
    got, _, ref = check_against_autograd(inp, grad)
    ids = inp["ids"]
    unref = np.setdiff1d(np.arange(inp["s"].shape[0]), ids)
    assert unref.size > 0 and len(set(ids.tolist())) < len(ids)
    assert np.all(got["s"][unref] == 0.0), "d_s rows that no id names must be exactly 0"
    # a duplicated row is the sum of the per-sequence contributions: compare with one call per sequence
    n_seqs, x_shape = len(ids), inp["x"].shape
    g_y = grad[:inp["x"].size].reshape(x_shape)
    g_s = grad[inp["x"].size:].reshape((n_seqs,) + inp["s"].shape[1:])
    d_s_sum = np.zeros_like(got["s"])
    for q in range(n_seqs):
        one = {k: (v[q:q + 1] if k in ("x", "dt", "B", "C", "ids") else v) for k, v in inp.items()}
        gq = np.concatenate([g_y[q].ravel(), g_s[q].ravel()])
        d_s_sum += split_gin(ssmgrad.ssm_scan_back(*scan_args(one), gq), one)["s"]
    assert_close(got["s"], d_s_sum, name="d_s vs sum of single-sequence d_s", **_scaled(GRAD_TOL, d_s_sum))


@pytest.mark.parametrize("mamba2", [False, True])
def test_permuted_ids_select_rows(rng, mamba2):
    # sequence q reads row ids[q] and writes state slot q (not row ids[q])
    inp = make_scan_inputs(rng, n_head=2, head_dim=2 if mamba2 else 1, d_state=3, n_seqs=3, n_t=0,
                           ids=[2, 0, 1], n_rs=4)
    out = ssmgrad.ssm_scan(*scan_args(inp))
    _, st = split_out(out, inp)
    np.testing.assert_array_equal(st[0], inp["s"][[2, 0, 1]])


@pytest.mark.parametrize("mamba2", [False, True])
@pytest.mark.parametrize("region", ["y_only", "state_only"])
def test_gradient_regions_separately(rng, mamba2, region):
    # the final-state region seeds the reverse recurrence on its own; y alone must not need it
    inp = make_scan_inputs(rng, n_head=2, head_dim=2 if mamba2 else 1, d_state=3, n_seqs=2, n_t=4,
                           ids=[1, 0], n_rs=3, mamba2=mamba2)
    grad = random_grad(rng, inp)
    n_y = inp["x"].size
    if region == "y_only":
        grad[n_y:] = 0
    else:
        grad[:n_y] = 0
    check_against_autograd(inp, grad)


DT_EDGE = np.array([19.999, 20.0, 20.001, 30.0, -30.0])


@pytest.mark.parametrize("mamba2", [False, True])
def test_softplus_threshold(rng, one_thread, mamba2):
    n_head = 5
    inp = make_scan_inputs(rng, n_head=n_head, head_dim=2 if mamba2 else 1, d_state=2, n_seqs=2, n_t=3,
                           ids=[0, 1], mamba2=mamba2)
    # every edge value in every token and sequence, rotated over the heads; A small so that
    # exp(30 * A) does not flush the state
    dt = np.empty_like(inp["dt"])
    for q in range(2):
        for t in range(3):
            dt[q, t] = np.roll(DT_EDGE, q * 3 + t)
    inp["dt"] = dt
    inp["A"] = inp["A"] * 0.05
    out = ssmgrad.ssm_scan(*scan_args(inp))
    assert_close(out, ref_scan_np(*scan_args(inp)), name="out vs torch reference", **FWD_TOL)
    grad = random_grad(rng, inp)
    got, _, ref = check_against_autograd(inp, grad)
    # the oracle's d_dt at the edges: sigmoid(v) for v <= 20 and exactly 1 above, via dsp
    # finite differences of ssmgrad's own forward (plumbing; the oracle is check_against_autograd
    # above): eps=1e-4 so that the 2e-9 jump of softplus at exactly 20 costs < 1e-5
    # relative, while the truncation error (eps^2) stays below the tolerance
    f = lambda dt_: ssmgrad.ssm_scan(inp["s"], inp["x"], dt_, inp["A"], inp["B"], inp["C"], inp["ids"])
    fd = fd_vjp(f, [dt], 0, grad, eps=1e-4)
    assert_close(got["dt"], fd, name="d_dt vs finite differences", atol=1e-4 * max(1, np.abs(fd).max()), rtol=1e-4)


def test_softplus_derivative_values(rng):
    # one head, one token, one state, zero start state: y = C*B*x*sp(dt), so d_dt = C*B*x*sp'(dt)
    for v in DT_EDGE:
        s = np.zeros((1, 1, 1, 1)); x = np.ones((1, 1, 1, 1)); dt = np.full((1, 1, 1), v)
        A = -np.ones((1, 1)); B = np.ones((1, 1, 1, 1)); C = np.ones((1, 1, 1, 1))
        out = ssmgrad.ssm_scan(s, x, dt, A, B, C, [0])
        sp = np.log1p(np.exp(v)) if v <= 20 else v
        assert_close(out[0], sp, atol=0, rtol=1e-15, name=f"softplus({v})")
        gin = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, [0], np.array([1.0, 0.0]))
        d_dt = ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)[2]
        dsp = 1.0 / (1.0 + np.exp(-v)) if v <= 20 else 1.0
        assert_close(d_dt.ravel()[0], dsp, atol=0, rtol=1e-14, name=f"d_dt at dt={v}")


# --- rollback snapshots (K) ------------------------------------------------------------------

@pytest.mark.parametrize("n_t,K", [(5, 1), (5, 2), (5, 3), (5, 5), (5, 7), (1, 3), (2, 2), (3, 4)])
def test_snapshots_K(rng, one_thread, n_t, K):
    inp = make_scan_inputs(rng, n_head=4, head_dim=2, d_state=3, n_group=2, n_seqs=2, n_t=n_t,
                           ids=[1, 2], n_rs=3, mamba2=True)
    out = ssmgrad.ssm_scan(*scan_args(inp), K=K)
    assert out.size == scan_out_size(inp, K)
    ref = ref_scan_np(*scan_args(inp), K=K)
    assert_close(out, ref, name=f"out (K={K}) vs torch reference", **FWD_TOL)
    assert_close(out, np_ssm_scan(*scan_args(inp), K=K), name=f"out (K={K}) vs numpy loop", **FWD_TOL)
    _, st = split_out(out, inp, K)
    assert np.all(st[max(1, n_t):] == 0), "snapshot slots k >= n_t must be exactly 0"
    grad = random_grad(rng, inp, K)
    got, d_A, _ = check_against_autograd(inp, grad, K=K)
    floats = [inp[k] for k in ("s", "x", "dt", "A", "B", "C")]
    # finite differences of ssmgrad's own forward: plumbing (the oracle is check_against_autograd above)
    f = lambda *a: ssmgrad.ssm_scan(*a, inp["ids"], K=K)
    for i, k in enumerate(("s", "x", "dt", "A", "B", "C")):
        fd = fd_vjp(f, floats, i, grad)
        assert_close(d_A if k == "A" else got[k], fd, name=f"d_{k} (K={K}) vs finite differences",
                     **_scaled(FD_TOL, fd))


def test_K1_is_default(rng):
    inp = case_inputs(rng, "m2")
    grad = random_grad(rng, inp)
    a = ssmgrad.ssm_scan(*scan_args(inp))
    b = ssmgrad.ssm_scan(*scan_args(inp), K=1)
    assert a.tobytes() == b.tobytes()
    assert ssmgrad.ssm_scan_back(*scan_args(inp), grad).tobytes() == \
        ssmgrad.ssm_scan_back(*scan_args(inp), grad, K=1).tobytes()


# --- return_dA ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["m1", "m1_dup_extra", "m2", "m2_groups", "m2_dup_extra"])
def test_return_dA(rng, name):
    inp = case_inputs(rng, name)
    grad = random_grad(rng, inp)
    gin_plain = ssmgrad.ssm_scan_back(*scan_args(inp), grad)
    res = ssmgrad.ssm_scan_back(*scan_args(inp), grad, return_dA=True)
    assert isinstance(res, tuple) and len(res) == 2
    gin, d_A = res
    assert gin.tobytes() == gin_plain.tobytes(), "return_dA must not change gin"
    assert d_A.shape == inp["A"].shape and d_A.dtype == np.float64
    ref = ref_scan_grads(*scan_args(inp), grad)["A"]
    assert_close(d_A, ref, name="d_A vs autograd", **_scaled(GRAD_TOL, ref))


# --- empty sizes -------------------------------------------------------------------------------

@pytest.mark.parametrize("mamba2,K", [(False, 1), (True, 1), (True, 3)])
def test_n_t_zero(rng, mamba2, K):
    inp = make_scan_inputs(rng, n_head=2, head_dim=2 if mamba2 else 1, d_state=3, n_seqs=3, n_t=0,
                           ids=[2, 0, 2], n_rs=4, mamba2=mamba2)
    out = ssmgrad.ssm_scan(*scan_args(inp), K=K)
    y, st = split_out(out, inp, K)
    assert y.shape == inp["x"].shape and y.size == 0
    np.testing.assert_array_equal(st[0], inp["s"][inp["ids"]])   # final state is the start state
    assert np.all(st[1:] == 0)
    assert_close(out, ref_scan_np(*scan_args(inp), K=K), name="out vs torch reference", **FWD_TOL)
    grad = random_grad(rng, inp, K)
    got, d_A, ref = check_against_autograd(inp, grad, K=K)
    # d_s[r] = sum of GS[0, q] over q with ids[q] == r; rows 1, 3 unreferenced
    gs = grad[inp["x"].size:].reshape((K, 3) + inp["s"].shape[1:])[0]
    expect = np.zeros_like(inp["s"])
    np.add.at(expect, inp["ids"], gs)
    assert_close(got["s"], expect, atol=1e-15, rtol=1e-15, name="d_s for n_t=0")
    assert np.all(got["s"][[1, 3]] == 0)
    assert np.all(d_A == 0)


@pytest.mark.parametrize("mamba2", [False, True])
def test_d_state_zero(rng, mamba2):
    """No states: y is 0 and so are the gradients that run through the state (d_x, d_dt, d_A), whichever
    form and SIMD pass runs (the x86-64-v3 reverse step once left its per-row sums unwritten here)."""
    inp = make_scan_inputs(rng, n_head=3, head_dim=2 if mamba2 else 1, d_state=0, n_seqs=2, n_t=5,
                           ids=[1, 0], n_rs=2, mamba2=mamba2)
    out = ssmgrad.ssm_scan(*scan_args(inp))
    assert np.all(out == 0)
    got, d_A, _ = check_against_autograd(inp, random_grad(rng, inp, 1))
    assert np.all(got["x"] == 0) and np.all(got["dt"] == 0) and np.all(d_A == 0)


@pytest.mark.parametrize("mamba2", [False, True])
@pytest.mark.parametrize("n_t", [0, 3])
def test_n_seqs_zero(rng, mamba2, n_t):
    inp = make_scan_inputs(rng, n_head=2, head_dim=2 if mamba2 else 1, d_state=3, n_seqs=0, n_t=n_t,
                           ids=np.zeros(0, np.int32), n_rs=2, mamba2=mamba2)
    out = ssmgrad.ssm_scan(*scan_args(inp))
    assert out.shape == (0,) and out.dtype == np.float64
    gin, d_A = ssmgrad.ssm_scan_back(*scan_args(inp), np.zeros(0), return_dA=True)
    got = split_gin(gin, inp)
    assert gin.size == sum(inp[k].size for k in NAMES)
    assert got["s"].shape == inp["s"].shape and np.all(got["s"] == 0)
    assert d_A.shape == inp["A"].shape and np.all(d_A == 0)


# --- aliased layouts ---------------------------------------------------------------------------

def _xbc_views(xBC, n_head, head_dim, n_group, d_state):
    n_seqs, n_t, _ = xBC.shape
    d_inner, G = n_head * head_dim, n_group * d_state
    x = xBC[..., :d_inner].reshape(n_seqs, n_t, n_head, head_dim)
    B = xBC[..., d_inner:d_inner + G].reshape(n_seqs, n_t, n_group, d_state)
    C = xBC[..., d_inner + G:].reshape(n_seqs, n_t, n_group, d_state)
    return x, B, C


@pytest.mark.parametrize("n_group", [1, 2])
@pytest.mark.parametrize("n_t", [1, 4])
def test_llamacpp_xBC_views(rng, one_thread, n_group, n_t):
    n_head, head_dim, d_state, n_seqs = 4, 2, 3, 2
    d_inner, G = n_head * head_dim, n_group * d_state
    base = make_scan_inputs(rng, n_head=n_head, head_dim=head_dim, d_state=d_state, n_group=n_group,
                            n_seqs=n_seqs, n_t=n_t, ids=[1, 0], n_rs=3, mamba2=True)
    xBC = rng.standard_normal((n_seqs, n_t, d_inner + 2 * G))
    x, B, C = _xbc_views(xBC, n_head, head_dim, n_group, d_state)
    assert np.shares_memory(x, xBC) and np.shares_memory(B, xBC) and np.shares_memory(C, xBC)
    assert not x.flags.c_contiguous or n_t * n_seqs == 1
    s, dt, A, ids = base["s"], base["dt"], base["A"], base["ids"]

    out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
    expect = ref_scan_np(s, np.ascontiguousarray(x), dt, A, np.ascontiguousarray(B), np.ascontiguousarray(C), ids)
    assert_close(out, expect, name="out with xBC views", **FWD_TOL)

    grad = rng.standard_normal(out.size)
    gin = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad)
    d_s, d_x, d_dt, d_B, d_C = ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)
    d_xBC = np.concatenate([d_x.reshape(n_seqs, n_t, d_inner), d_B.reshape(n_seqs, n_t, G),
                            d_C.reshape(n_seqs, n_t, G)], axis=-1)

    # autograd w.r.t. xBC itself, the views taken inside the graph
    tx = to_torch(xBC, requires_grad=True)
    tvx, tvB, tvC = _xbc_views(tx, n_head, head_dim, n_group, d_state)
    ref_out = ref_ssm_scan(to_torch(s), tvx, to_torch(dt), to_torch(A), tvB, tvC, ids)
    (ref_out * to_torch(grad)).sum().backward()
    ref = tx.grad.numpy()
    assert_close(d_xBC, ref, name="d_xBC vs autograd w.r.t. xBC", **_scaled(GRAD_TOL, ref))

    # and without torch: finite differences of ssmgrad's whole scan as a function of xBC (plumbing:
    # the view bookkeeping; the oracle is the autograd comparison above)
    f = lambda a: _scan_from_xbc(a, s, dt, A, ids, n_head, head_dim, n_group, d_state)
    fd = fd_vjp(f, [xBC], 0, grad)
    assert_close(d_xBC, fd, name="d_xBC vs finite differences", **_scaled(FD_TOL, fd))


def _scan_from_xbc(a, s, dt, A, ids, n_head, head_dim, n_group, d_state):
    x, B, C = _xbc_views(a, n_head, head_dim, n_group, d_state)
    return ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)


def test_mamba1_x_db_views(rng):
    # Mamba-1: B and C are views into the x_db projection (n_seqs, n_t, dt_rank + 2*d_state)
    n_head, d_state, n_seqs, n_t, dt_rank = 4, 3, 2, 3, 2
    base = make_scan_inputs(rng, n_head=n_head, head_dim=1, d_state=d_state, n_seqs=n_seqs, n_t=n_t,
                            ids=[0, 1], mamba2=False)
    x_db = rng.standard_normal((n_seqs, n_t, dt_rank + 2 * d_state))
    B = x_db[..., dt_rank:dt_rank + d_state].reshape(n_seqs, n_t, 1, d_state)
    C = x_db[..., dt_rank + d_state:].reshape(n_seqs, n_t, 1, d_state)
    assert np.shares_memory(B, x_db)
    s, x, dt, A, ids = base["s"], base["x"], base["dt"], base["A"], base["ids"]
    out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
    assert_close(out, ref_scan_np(s, x, dt, A, B, C, ids), name="out with x_db views", **FWD_TOL)
    grad = rng.standard_normal(out.size)
    gin = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad)
    _, _, _, d_B, d_C = ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)
    ref = ref_scan_grads(s, x, dt, A, B, C, ids, grad)
    assert_close(d_B, ref["B"], name="d_B (x_db view)", **_scaled(GRAD_TOL, ref["B"]))
    assert_close(d_C, ref["C"], name="d_C (x_db view)", **_scaled(GRAD_TOL, ref["C"]))


def _overlap_views(xbc, n_seqs):
    return xbc[0:n_seqs], xbc[1:1 + n_seqs], xbc[2:2 + n_seqs]      # B, x, C


@pytest.mark.parametrize("mamba2", [False, True])
@pytest.mark.parametrize("n_seqs", [2, 3])
def test_ggml_xbc_overlap(rng, one_thread, mamba2, n_seqs):
    # ggml's test-backend-ops layout: head_dim = d_state, n_group = n_head, views that overlap
    n_head, d_state, n_t = 2, 3, 3
    xbc = rng.standard_normal((2 * n_seqs, n_t, n_head, d_state))
    base = make_scan_inputs(rng, n_head=n_head, head_dim=d_state, d_state=d_state, n_group=n_head,
                            n_seqs=n_seqs, n_t=n_t, n_rs=n_seqs + 1, ids=rng.permutation(n_seqs + 1)[:n_seqs],
                            mamba2=mamba2)
    s, dt, A, ids = base["s"], base["dt"], base["A"], base["ids"]
    B, x, C = _overlap_views(xbc, n_seqs)
    assert np.shares_memory(B, x) and np.shares_memory(x, C)

    def scan(a):
        B_, x_, C_ = _overlap_views(a, n_seqs)
        return ssmgrad.ssm_scan(s, x_, dt, A, B_, C_, ids)

    out = scan(xbc)
    assert_close(out, ref_scan_np(s, x.copy(), dt, A, B.copy(), C.copy(), ids), name="out (xbc_overlap)", **FWD_TOL)
    grad = rng.standard_normal(out.size)
    gin = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad)
    _, d_x, _, d_B, d_C = ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)
    d_xbc = np.zeros_like(xbc)
    d_xbc[0:n_seqs] += d_B
    d_xbc[1:1 + n_seqs] += d_x
    d_xbc[2:2 + n_seqs] += d_C

    tx = to_torch(xbc, requires_grad=True)
    tB, tx_, tC = _overlap_views(tx, n_seqs)
    ref_out = ref_ssm_scan(to_torch(s), tx_, to_torch(dt), to_torch(A), tB, tC, ids)
    (ref_out * to_torch(grad)).sum().backward()
    ref = tx.grad.numpy()
    assert_close(d_xbc, ref, name="d_xbc vs autograd", **_scaled(GRAD_TOL, ref))
    fd = fd_vjp(scan, [xbc], 0, grad)         # of ssmgrad's own forward: plumbing; the oracle is above
    assert_close(d_xbc, fd, name="d_xbc vs finite differences", **_scaled(FD_TOL, fd))


@pytest.mark.parametrize("mamba2", [False, True])
def test_B_is_C(rng, one_thread, mamba2):
    inp = make_scan_inputs(rng, n_head=4, head_dim=2 if mamba2 else 1, d_state=3, n_group=2, n_seqs=2, n_t=3,
                           ids=[1, 0], mamba2=mamba2)
    s, x, dt, A, BC, ids = inp["s"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["ids"]
    out = ssmgrad.ssm_scan(s, x, dt, A, BC, BC, ids)
    assert_close(out, ref_scan_np(s, x, dt, A, BC, BC, ids), name="out (B is C)", **FWD_TOL)
    grad = rng.standard_normal(out.size)
    gin = ssmgrad.ssm_scan_back(s, x, dt, A, BC, BC, ids, grad)
    _, _, _, d_B, d_C = ssmgrad.split(gin, s.shape, x.shape, dt.shape, BC.shape, BC.shape)
    ts = to_torch(BC, requires_grad=True)
    ref_out = ref_ssm_scan(to_torch(s), to_torch(x), to_torch(dt), to_torch(A), ts, ts, ids)
    (ref_out * to_torch(grad)).sum().backward()
    ref = ts.grad.numpy()
    assert_close(d_B + d_C, ref, name="d_B + d_C vs autograd w.r.t. the shared array", **_scaled(GRAD_TOL, ref))
    # of ssmgrad's own forward: plumbing; the oracle is the autograd comparison above
    fd = fd_vjp(lambda a: ssmgrad.ssm_scan(s, x, dt, A, a, a, ids), [BC], 0, grad)
    assert_close(d_B + d_C, fd, name="d_B + d_C vs finite differences", **_scaled(FD_TOL, fd))
    # each separately too: B is C must not confuse which gradient goes where
    sep = ref_scan_grads(s, x, dt, A, BC, BC.copy(), ids, grad)
    assert_close(d_B, sep["B"], name="d_B (B is C)", **_scaled(GRAD_TOL, sep["B"]))
    assert_close(d_C, sep["C"], name="d_C (B is C)", **_scaled(GRAD_TOL, sep["C"]))


# --- strides, dtypes of ids, python sequences --------------------------------------------------

def _strided(rng, a, kind):
    """The same values as ``a`` in a non-contiguous layout."""
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "negative":
        flipped = np.ascontiguousarray(a[::-1])
        return flipped[::-1]
    if kind == "step":
        big = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["fortran", "negative", "step"])
@pytest.mark.parametrize("name", ["m1_groups", "m2_dup_extra"])
@pytest.mark.usefixtures("scan_fwd_form")     # and with each form of the forward
def test_any_strides(rng, kind, name):
    inp = case_inputs(rng, name)
    grad = random_grad(rng, inp)
    want_out = ssmgrad.ssm_scan(*scan_args(inp))
    want_gin, want_dA = ssmgrad.ssm_scan_back(*scan_args(inp), grad, return_dA=True)
    strided = {k: _strided(rng, v, kind) for k, v in inp.items()}
    for k, v in strided.items():
        np.testing.assert_array_equal(v, inp[k])
        if kind != "fortran":       # a Fortran (n, 1) array is C-contiguous too
            assert v.size <= 1 or not v.flags.c_contiguous, k
    out = ssmgrad.ssm_scan(*scan_args(strided))
    gin, dA = ssmgrad.ssm_scan_back(*scan_args(strided), _strided(rng, grad, kind), return_dA=True)
    assert_close(out, want_out, atol=1e-14, rtol=1e-13, name=f"out ({kind})")
    assert_close(gin, want_gin, atol=1e-13, rtol=1e-12, name=f"gin ({kind})")
    assert_close(dA, want_dA, atol=1e-13, rtol=1e-12, name=f"d_A ({kind})")


@pytest.mark.parametrize("ids_dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64, np.intp])
def test_ids_any_integer_dtype(rng, ids_dtype):
    inp = case_inputs(rng, "m2_dup_extra")
    grad = random_grad(rng, inp)
    want = ssmgrad.ssm_scan(*scan_args(inp)), ssmgrad.ssm_scan_back(*scan_args(inp), grad)
    inp["ids"] = inp["ids"].astype(ids_dtype)
    got = ssmgrad.ssm_scan(*scan_args(inp)), ssmgrad.ssm_scan_back(*scan_args(inp), grad)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()


def test_python_sequences(rng):
    inp = case_inputs(rng, "m2_groups")
    grad = random_grad(rng, inp)
    want_out = ssmgrad.ssm_scan(*scan_args(inp))
    want_gin = ssmgrad.ssm_scan_back(*scan_args(inp), grad)
    lists = [a.tolist() for a in scan_args(inp)]
    out = ssmgrad.ssm_scan(*lists)
    gin = ssmgrad.ssm_scan_back(*lists, grad.tolist())
    assert out.dtype == np.float64
    assert out.tobytes() == want_out.tobytes() and gin.tobytes() == want_gin.tobytes()


# --- float32 -----------------------------------------------------------------------------------

# float32 vs the float64 oracle, stated tolerance: every element within
# F32_TOL * (1 + max |value| of that array) -- ~40 float32 ulps of the array's scale; measured
# errors are ~2e-7 of the scale at these sizes.
F32_TOL = 5e-6


@pytest.mark.parametrize("name,K", [("m1", 1), ("m1_dup_extra", 1), ("m2", 1), ("m2", 3), ("m2_groups", 1),
                                    ("m2_dup_extra", 1), ("m2_dup_extra", 5), ("m2_nt1", 1), ("m2_nt1", 2),
                                    ("m1_ds16", 1), ("m2_ds32_hd8", 1)])
def test_float32_close_to_float64(rng, name, K):
    inp64 = case_inputs(rng, name)
    inp32 = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in inp64.items()}
    inp64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inp32.items()}  # same values
    grad32 = random_grad(rng, inp64, K).astype(np.float32)
    out32 = ssmgrad.ssm_scan(*scan_args(inp32), K=K)
    gin32, dA32 = ssmgrad.ssm_scan_back(*scan_args(inp32), grad32, K=K, return_dA=True)
    assert out32.dtype == np.float32 and gin32.dtype == np.float32 and dA32.dtype == np.float32
    out64 = ref_scan_np(*scan_args(inp64), K=K)
    ref = ref_scan_grads(*scan_args(inp64), grad32.astype(np.float64), K=K)
    assert_close(out32, out64, atol=F32_TOL * (1 + np.abs(out64).max()), rtol=0, name="out float32")
    got = split_gin(gin32, inp32)
    for k in NAMES:
        assert_close(got[k], ref[k], atol=F32_TOL * (1 + np.abs(ref[k]).max()), rtol=0, name=f"d_{k} float32")
    assert_close(dA32, ref["A"], atol=F32_TOL * (1 + np.abs(ref["A"]).max()), rtol=0, name="d_A float32")


# --- split -------------------------------------------------------------------------------------

def test_split_views_and_values(rng):
    packed = rng.standard_normal(2 * 3 + 4 + 0 + 5)
    a, b, c, d = ssmgrad.split(packed, (2, 3), (4,), (0, 7), (5, 1))
    assert a.shape == (2, 3) and b.shape == (4,) and c.shape == (0, 7) and d.shape == (5, 1)
    for v in (a, b, d):
        assert v.flags.c_contiguous and np.shares_memory(v, packed)
    np.testing.assert_array_equal(a.ravel(), packed[:6])
    np.testing.assert_array_equal(b, packed[6:10])
    np.testing.assert_array_equal(d.ravel(), packed[10:])


def test_split_scan_out(rng):
    inp = case_inputs(rng, "m2")
    out = ssmgrad.ssm_scan(*scan_args(inp))
    y, st = ssmgrad.split(out, inp["x"].shape, (inp["x"].shape[0],) + inp["s"].shape[1:])
    n_y = inp["x"].size
    np.testing.assert_array_equal(y, out[:n_y].reshape(inp["x"].shape))
    np.testing.assert_array_equal(st, out[n_y:].reshape(st.shape))


@pytest.mark.parametrize("shapes", [[(2, 3)], [(2, 3), (4,), (5, 2)], [(20,)], [], [(2, 3), (4,), (5,), (1,)]])
def test_split_size_mismatch(rng, shapes):
    packed = np.zeros(15)
    with pytest.raises(ValueError):
        ssmgrad.split(packed, *shapes)
