"""The chunked (matrix-product) form of the Mamba-2 scan backward, at lengths that cut into
chunks (csrc/ssm_scan_back_chunked.c, SSM_CHUNK_T = 64 tokens), against the float64 oracles.

tests/kernels/test_scan.py and tests/kernels/test_threads.py run every case with each form forced (fixture
scan_back_form); their shapes are short (n_t < 64: one partial chunk). Here: n_t around and
across chunk boundaries, groups, duplicate ids and extra state rows, a nonzero gradient on the
final-state region, softplus above and below its threshold, strided inputs, float32 against
the float64 oracle, 1 / 2 / 3 threads bitwise identical, and the automatic choice.
"""

import numpy as np
import pytest

import _ssmgrad
import ssmgrad
from reference import (CHUNKED_CASES, assert_close, make_mamba2_case, make_scan_inputs, ref_scan_grads, scaled_tol,
                       scan_args, scan_out_size)

NAMES = ("s", "x", "dt", "B", "C")
GRAD_TOL = dict(atol=1e-12, rtol=1e-10)


@pytest.fixture
def chunked():
    old = _ssmgrad._set_scan_back("chunked")
    try:
        yield
    finally:
        _ssmgrad._set_scan_back(old)


def _back(inp, grad, form):
    old = _ssmgrad._set_scan_back(form)
    try:
        return ssmgrad.ssm_scan_back(*scan_args(inp), grad, return_dA=True)
    finally:
        _ssmgrad._set_scan_back(old)


def _split(gin, inp):
    return dict(zip(NAMES, ssmgrad.split(gin, *(inp[k].shape for k in NAMES))))


def _check_vs_autograd(inp, grad):
    """ssm_scan_back (the form set by the caller) against torch.autograd: every gradient and d_A;
    returns the split gradients."""
    gin, d_A = ssmgrad.ssm_scan_back(*scan_args(inp), grad, return_dA=True)
    got = _split(gin, inp)
    ref = ref_scan_grads(*scan_args(inp), grad)
    for k in NAMES:
        assert_close(got[k], ref[k], name=f"d_{k} vs autograd", **scaled_tol(GRAD_TOL, ref[k]))
    assert_close(d_A, ref["A"], name="d_A vs autograd", **scaled_tol(GRAD_TOL, ref["A"]))
    return got


# (n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs)
CASES = {
    "nt1": (2, 3, 4, 1, 2, 1, [1, 0], 2),
    **CHUNKED_CASES,
    "nt70_ds32_groups": (4, 2, 32, 2, 2, 70, [0, 1], 2),
}


def _inputs(rng, name, dtype=np.float64):
    return make_mamba2_case(rng, CASES[name], dtype)


@pytest.mark.parametrize("name", CASES)
def test_chunked_vs_autograd(rng, chunked, name):
    inp = _inputs(rng, name)
    grad = rng.standard_normal(scan_out_size(inp))      # y and the final-state region nonzero
    got = _check_vs_autograd(inp, grad)
    if name == "nt130_dup_extra":      # rows no id names: exactly zero; duplicates accumulate
        d_s = got["s"]
        assert np.all(d_s[[0, 2, 4]] == 0)
        assert np.any(d_s[3] != 0)


# float32 against the float64 oracle on the same (float32) values, per region, bound * (1 + max |ref|).
# Measured over the 4 cases x 20 seeds of the test's rng: d_s 4.6e-7, d_x 4.4e-7, d_dt 5.8e-7,
# d_B 5.2e-7, d_C 2.4e-7 (seed 0, the test's own: at most 5.0e-7); d_A 1.6e-5 (a sum over every
# token and state, with cancellation; seed 0: 1.8e-6). Bounds about 3x the worst of those.
F32_TOL = dict(s=2e-6, x=2e-6, dt=2e-6, B=2e-6, C=2e-6, A=5e-5)


@pytest.mark.parametrize("name", ["nt65", "nt150_groups", "nt130_dup_extra", "nt100_ds16_dup"])
def test_chunked_float32_close_to_float64(rng, chunked, name):
    inp32 = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in _inputs(rng, name).items()}
    grad32 = rng.standard_normal(scan_out_size(inp32)).astype(np.float32)
    g32, a32 = ssmgrad.ssm_scan_back(*scan_args(inp32), grad32, return_dA=True)
    assert g32.dtype == np.float32 and a32.dtype == np.float32
    up = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in inp32.items()}
    ref = ref_scan_grads(*scan_args(up), grad32.astype(np.float64))
    got = _split(g32.astype(np.float64), inp32)
    got["A"] = a32.astype(np.float64)
    for k, tol in F32_TOL.items():
        assert_close(got[k], ref[k], atol=tol * (1 + np.abs(ref[k]).max()), rtol=0, name=f"d_{k} f32 vs float64 autograd")


def test_chunked_softplus_threshold(rng, chunked):
    """dt on both sides of ggml's threshold 20 (softplus(dt) = dt above it, derivative 1)."""
    inp = _inputs(rng, "nt150_groups")
    dt = inp["dt"]
    dt[..., ::3] = 20.0 + rng.uniform(0.01, 2.0, size=dt[..., ::3].shape)
    dt[..., 1::3] = 20.0 - rng.uniform(0.01, 2.0, size=dt[..., 1::3].shape)
    inp["A"] = inp["A"] * 0.01          # keep the decays of sp ~ 20 away from exact 0
    _check_vs_autograd(inp, rng.standard_normal(scan_out_size(inp)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunked_strided_inputs(rng, chunked, dtype):
    """Non-contiguous x, B, C, dt, s: the same bits as their contiguous copies."""
    inp = _inputs(rng, "nt150_groups", dtype)
    grad = rng.standard_normal(scan_out_size(inp)).astype(dtype)
    want = ssmgrad.ssm_scan_back(*scan_args(inp), grad, return_dA=True)
    strided = {}
    for k, v in inp.items():
        if k in ("x", "B", "C", "dt", "s"):
            big = np.zeros(v.shape[:-1] + (2 * v.shape[-1],), dtype=v.dtype)
            big[..., ::2] = v
            strided[k] = big[..., ::2]                      # last axis stride 2
            assert not strided[k].flags.c_contiguous
        else:
            strided[k] = v
    got = ssmgrad.ssm_scan_back(*scan_args(strided), grad, return_dA=True)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunked_bitwise_across_threads(rng, restore_threads, force_threads, chunked, dtype):
    inp = make_scan_inputs(rng, n_head=8, head_dim=4, d_state=5, n_group=2, n_seqs=3, n_t=140, ids=[3, 0, 3],
                           n_rs=5, mamba2=True, dtype=dtype)
    grad = rng.standard_normal(scan_out_size(inp)).astype(dtype)
    res = {}
    for n in (1, 2, 3):
        ssmgrad.set_num_threads(n)
        gin, d_A = ssmgrad.ssm_scan_back(*scan_args(inp), grad, return_dA=True)
        res[n] = (gin.tobytes(), d_A.tobytes())
    ref = ref_scan_grads(*scan_args(inp), grad)
    got = _split(np.frombuffer(res[1][0], dtype=dtype).astype(np.float64), inp)
    tol = 1e-4 if dtype == np.float32 else 1e-11
    for k in NAMES:
        assert_close(got[k], ref[k], atol=tol * (1 + np.abs(ref[k]).max()), rtol=0, name=f"d_{k}, 1 thread")
    assert res[2] == res[1] and res[3] == res[1]


def test_forms_differ_in_rounding_only(rng):
    """The switch reaches the kernel: in float32 the two forms round differently (so the chunked
    tests above did not silently run the recurrence), and agree to float32 rounding."""
    inp = _inputs(rng, "nt150_groups", np.float32)
    grad = rng.standard_normal(scan_out_size(inp)).astype(np.float32)
    rec, rec_A = _back(inp, grad, "recurrence")
    chk, chk_A = _back(inp, grad, "chunked")
    assert rec.tobytes() != chk.tobytes()
    assert_close(chk.astype(np.float64), rec.astype(np.float64), atol=1e-4 * (1 + np.abs(rec).max()), rtol=0,
                 name="chunked vs recurrence")
    assert_close(chk_A.astype(np.float64), rec_A.astype(np.float64), atol=1e-4 * (1 + np.abs(rec_A).max()), rtol=0,
                 name="d_A chunked vs recurrence")


def test_K_above_1_and_mamba1_take_the_recurrence(rng):
    """The chunked form covers Mamba-2 with K == 1; forcing it leaves other calls bitwise unchanged."""
    inp = make_scan_inputs(rng, n_head=2, head_dim=3, d_state=4, n_seqs=2, n_t=70, mamba2=True)
    grad = rng.standard_normal(scan_out_size(inp, 3))
    args = scan_args(inp)
    old = _ssmgrad._set_scan_back("recurrence")
    try:
        want = ssmgrad.ssm_scan_back(*args, grad, K=3, return_dA=True)
        _ssmgrad._set_scan_back("chunked")
        got = ssmgrad.ssm_scan_back(*args, grad, K=3, return_dA=True)
    finally:
        _ssmgrad._set_scan_back(old)
    assert got[0].tobytes() == want[0].tobytes()
    inp1 = make_scan_inputs(rng, n_head=3, head_dim=1, d_state=4, n_seqs=2, n_t=70, mamba2=False)
    grad1 = rng.standard_normal(scan_out_size(inp1))
    assert _back(inp1, grad1, "chunked")[0].tobytes() == _back(inp1, grad1, "recurrence")[0].tobytes()


@pytest.mark.parametrize("kernel", ["back", "fwd"])
def test_set_scan_modes(kernel):
    """_set_scan_back / _set_scan_fwd (the backward's form here, the forward's in
    tests/kernels/test_scan_fwd_chunked.py) switch what build_info reports and return the previous mode."""
    setter, key = getattr(_ssmgrad, f"_set_scan_{kernel}"), f"scan_{kernel}"
    old = setter("chunked")
    try:
        assert _ssmgrad.build_info()[key] == "chunked"
        assert setter("recurrence") == "chunked"
        assert _ssmgrad.build_info()[key] == "recurrence"
        with pytest.raises(ValueError, match=f"_set_scan_{kernel}: mode"):
            setter("fast")
        with pytest.raises(TypeError):
            setter(1)
    finally:
        setter(old)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunked_unaligned_views_of_B_C(rng, chunked, dtype):
    """d_state 16: B and C are read in place; here as views one element off any alignment,
    rows n_group * d_state + 3 apart (as in a packed xBC tensor)."""
    inp = make_scan_inputs(rng, n_head=4, head_dim=4, d_state=16, n_group=2, n_seqs=2, n_t=100, ids=[1, 0],
                           n_rs=2, mamba2=True, dtype=dtype)
    grad = rng.standard_normal(scan_out_size(inp)).astype(dtype)
    want = ssmgrad.ssm_scan_back(*scan_args(inp), grad, return_dA=True)
    views = dict(inp)
    for k in ("B", "C"):
        v = inp[k]
        big = np.zeros(v.shape[:2] + (v.shape[2] * v.shape[3] + 3,), dtype=dtype)
        big[..., 1:1 + v.shape[2] * v.shape[3]] = v.reshape(v.shape[:2] + (-1,))
        views[k] = big[..., 1:1 + v.shape[2] * v.shape[3]].reshape(v.shape)
        assert views[k].ctypes.data % 64 != 0 and views[k].strides[-1] == v.itemsize
    got = ssmgrad.ssm_scan_back(*scan_args(views), grad, return_dA=True)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()
    ref = ref_scan_grads(*scan_args({k: (v.astype(np.float64) if v.dtype == dtype and dtype != np.int64 else v)
                                    for k, v in inp.items()}), grad.astype(np.float64))
    got_d = _split(got[0].astype(np.float64), inp)
    tol = 1e-4 if dtype == np.float32 else 1e-11
    for k in NAMES:
        assert_close(got_d[k], ref[k], atol=tol * (1 + np.abs(ref[k]).max()), rtol=0, name=f"d_{k}")


@pytest.mark.parametrize("head_dim,d_state,n_t,K,want", [
    (32, 64, 40, 1, "chunked"),       # both >= 32, state >= 2048, n_t >= 32
    (32, 64, 31, 1, "recurrence"),    # too short
    (16, 128, 40, 1, "recurrence"),   # head_dim < 32
    (64, 16, 40, 1, "recurrence"),    # d_state < 32
    (32, 32, 40, 1, "recurrence"),    # state of 1024 elements per head
    (32, 64, 40, 2, "recurrence"),    # snapshot slots: the chunked form has none
])
def test_auto_choice(rng, head_dim, d_state, n_t, K, want):
    """auto gives the same bits as the form its rule names (csrc/ssm_scan_back_recurrence.c, ssm_scan_back_chunked)."""
    inp = make_scan_inputs(rng, n_head=2, head_dim=head_dim, d_state=d_state, n_seqs=1, n_t=n_t, mamba2=True,
                           dtype=np.float32)
    grad = rng.standard_normal(scan_out_size(inp, K)).astype(np.float32)
    res = {}
    for form in ("auto", "recurrence", "chunked"):
        old = _ssmgrad._set_scan_back(form)
        try:
            res[form] = ssmgrad.ssm_scan_back(*scan_args(inp), grad, K=K).tobytes()
        finally:
            _ssmgrad._set_scan_back(old)
    assert res["auto"] == res[want]
    assert _ssmgrad._scan_forms(*scan_args(inp), K)["back"] == want    # what benchmarks/common.py counts FLOP by
    if K == 1:
        assert res["recurrence"] != res["chunked"]     # so the equality above tells them apart
