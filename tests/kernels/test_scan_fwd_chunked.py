"""The chunked (matrix-product, SSD) form of the Mamba-2 scan forward (csrc/ssm_scan_chunked.c, chunks of
SSM_CHUNK_T = 64 tokens, blocks of at most SSM_FBH = 8 heads of one group), forced with
_ssmgrad._set_scan_fwd("chunked") (SSMGRAD_SCAN_FWD), against the float64 torch reference
(tests/reference.py, ref_scan_np: ggml's token recurrence) and against the recurrence form.

Shapes: n_t below, at and across chunk boundaries, just above the decode path (n_t = 5), groups
and blocks cut inside a group, duplicate ids and extra state rows, nonzero initial states, dt above
ggml's softplus threshold 20 and very negative, decays that underflow (the exp's slow path),
strided inputs, float32 against float64, 1 / 2 / 3 threads bitwise identical, and the auto rule.
"""

import numpy as np
import pytest

import _ssmgrad
import ssmgrad
from reference import (CHUNKED_CASES, assert_close, make_mamba2_case, make_scan_inputs, ref_scan_np, scaled_tol,
                       scan_args)

FWD_TOL = dict(atol=1e-13, rtol=1e-11)     # tests/kernels/test_scan.py's, float64


@pytest.fixture
def chunked():
    old = _ssmgrad._set_scan_fwd("chunked")
    try:
        yield
    finally:
        _ssmgrad._set_scan_fwd(old)


def _fwd(inp, form, K=1):
    old = _ssmgrad._set_scan_fwd(form)
    try:
        return ssmgrad.ssm_scan(*scan_args(inp), K=K)
    finally:
        _ssmgrad._set_scan_fwd(old)


# (n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs)
CASES = {
    "nt5": (2, 3, 4, 1, 2, 5, [1, 0], 2),                 # just above the decode path: one short chunk
    **CHUNKED_CASES,
    "nt90_blocks": (20, 4, 8, 2, 2, 90, [0, 2], 3),          # 10 heads per group: blocks of 8 + 2
    "nt140_hd64_ds128": (2, 64, 128, 1, 1, 140, [0], 1),     # a real head (Mamba-2), short
}


def _inputs(rng, name, dtype=np.float64):
    return make_mamba2_case(rng, CASES[name], dtype)


@pytest.mark.parametrize("name", CASES)
def test_chunked_vs_reference(rng, chunked, name):
    inp = _inputs(rng, name)
    assert np.any(inp["s"] != 0)                   # nonzero initial states
    out = ssmgrad.ssm_scan(*scan_args(inp))
    ref = ref_scan_np(*scan_args(inp))
    assert_close(out, ref, name="out vs torch reference", **scaled_tol(FWD_TOL, ref))


@pytest.mark.parametrize("name", ["nt5", "nt65", "nt150_groups", "nt130_dup_extra", "nt90_blocks", "nt140_hd64_ds128"])
def test_chunked_float32_vs_float64_reference(rng, chunked, name):
    inp64 = _inputs(rng, name)
    inp32 = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in inp64.items()}
    out = ssmgrad.ssm_scan(*scan_args(inp32))
    assert out.dtype == np.float32
    ref = ref_scan_np(*scan_args(inp64))
    assert_close(out.astype(np.float64), ref, atol=2e-5 * (1 + np.abs(ref).max()), rtol=0, name="f32 vs f64 ref")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["nt65", "nt130_dup_extra", "nt90_blocks", "nt200_ds19_hd17"])
def test_chunked_vs_recurrence(rng, dtype, name):
    """The two forms agree to rounding, and the switch reaches the kernel (in float32 they round
    differently, so the chunked tests do not silently run the recurrence)."""
    inp = _inputs(rng, name, dtype)
    rec, chk = _fwd(inp, "recurrence"), _fwd(inp, "chunked")
    tol = 2e-5 if dtype == np.float32 else 1e-12
    assert_close(chk.astype(np.float64), rec.astype(np.float64), atol=tol * (1 + np.abs(rec).max()), rtol=0,
                 name="chunked vs recurrence")
    if dtype == np.float32:
        assert rec.tobytes() != chk.tobytes()


def test_chunked_extra_rows_and_duplicates(rng, chunked):
    """Slot q is sequence q's final state, whatever ids[q] (duplicates included); s is not written."""
    inp = _inputs(rng, "nt130_dup_extra")
    s_before = inp["s"].copy()
    out = ssmgrad.ssm_scan(*scan_args(inp))
    assert np.array_equal(inp["s"], s_before)
    n_head, head_dim, d_state, _, n_seqs, n_t, _, _ = CASES["nt130_dup_extra"]
    n_y = n_seqs * n_t * n_head * head_dim
    assert out.size == n_y + n_seqs * n_head * head_dim * d_state
    states = out[n_y:].reshape(n_seqs, n_head, head_dim, d_state)
    ref = ref_scan_np(*scan_args(inp))[n_y:].reshape(states.shape)
    assert_close(states, ref, name="final states", **scaled_tol(FWD_TOL, ref))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunked_softplus_threshold_and_extremes(rng, chunked, dtype):
    """dt on both sides of ggml's threshold 20 (softplus(dt) = dt above it) and very negative
    (softplus ~ 0: the decay 1 and no input), with decays of sp ~ 20 kept away from exact 0."""
    inp = _inputs(rng, "nt150_groups")
    dt = inp["dt"]
    dt[..., ::4] = 20.0 + rng.uniform(0.01, 2.0, size=dt[..., ::4].shape)
    dt[..., 1::4] = 20.0 - rng.uniform(0.01, 2.0, size=dt[..., 1::4].shape)
    dt[..., 2::4] = -30.0 - rng.uniform(0.0, 10.0, size=dt[..., 2::4].shape)
    inp["A"] = inp["A"] * 0.01
    ref = ref_scan_np(*scan_args(inp))
    cast = {k: (v.astype(dtype) if v.dtype == np.float64 else v) for k, v in inp.items()}
    out = ssmgrad.ssm_scan(*scan_args(cast)).astype(np.float64)
    if dtype == np.float64:
        assert_close(out, ref, name="out vs torch reference", **scaled_tol(FWD_TOL, ref))
    else:
        assert_close(out, ref, atol=2e-5 * (1 + np.abs(ref).max()), rtol=0, name="f32 vs f64 ref")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunked_underflowing_decays(rng, chunked, dtype):
    """sp * A of about -40 per token: within a chunk e^(l_t - l_tau) spans far more than the fast
    exp's range (the chunk then takes SSM_EXP, which flushes to 0 as the recurrence's products do)."""
    inp = _inputs(rng, "nt150_groups")
    inp["dt"][...] = rng.uniform(19.0, 22.0, size=inp["dt"].shape)
    inp["A"][...] = -2.0
    ref = ref_scan_np(*scan_args(inp))
    cast = {k: (v.astype(dtype) if v.dtype == np.float64 else v) for k, v in inp.items()}
    out = ssmgrad.ssm_scan(*scan_args(cast)).astype(np.float64)
    assert np.all(np.isfinite(out))
    tol = 2e-5 if dtype == np.float32 else 1e-12
    assert_close(out, ref, atol=tol * (1 + np.abs(ref).max()), rtol=0, name="out vs torch reference")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunked_strided_inputs(rng, chunked, dtype):
    """Non-contiguous x, B, C, dt, s: the same bits as their contiguous copies."""
    inp = _inputs(rng, "nt150_groups", dtype)
    want = ssmgrad.ssm_scan(*scan_args(inp))
    strided = {}
    for k, v in inp.items():
        if k in ("x", "B", "C", "dt", "s"):
            big = np.zeros(v.shape[:-1] + (2 * v.shape[-1],), dtype=v.dtype)
            big[..., ::2] = v
            strided[k] = big[..., ::2]
            assert not strided[k].flags.c_contiguous
        else:
            strided[k] = v
    assert ssmgrad.ssm_scan(*scan_args(strided)).tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunked_bitwise_across_threads(rng, restore_threads, force_threads, chunked, dtype):
    """Thread splits that cut groups and blocks at different heads: the same bits."""
    inp = make_scan_inputs(rng, n_head=20, head_dim=4, d_state=16, n_group=2, n_seqs=3, n_t=140, ids=[3, 0, 3],
                           n_rs=5, mamba2=True, dtype=dtype)
    res = {}
    for n in (1, 2, 3):
        ssmgrad.set_num_threads(n)
        res[n] = ssmgrad.ssm_scan(*scan_args(inp)).tobytes()
    ref = ref_scan_np(*scan_args({k: (v.astype(np.float64) if v.dtype == dtype else v) for k, v in inp.items()}))
    got = np.frombuffer(res[1], dtype=dtype).astype(np.float64)
    tol = 2e-5 if dtype == np.float32 else 1e-12
    assert_close(got, ref, atol=tol * (1 + np.abs(ref).max()), rtol=0, name="1 thread vs reference")
    assert res[2] == res[1] and res[3] == res[1]


def test_K_above_1_mamba1_and_decode_take_the_recurrence(rng):
    """The chunked form covers Mamba-2 with K == 1 and n_t > 4; forcing it leaves other calls
    bitwise unchanged."""
    inp = make_scan_inputs(rng, n_head=2, head_dim=3, d_state=4, n_seqs=2, n_t=70, mamba2=True, dtype=np.float32)
    assert _fwd(inp, "chunked", K=3).tobytes() == _fwd(inp, "recurrence", K=3).tobytes()
    inp1 = make_scan_inputs(rng, n_head=3, head_dim=1, d_state=4, n_seqs=2, n_t=70, mamba2=False, dtype=np.float32)
    assert _fwd(inp1, "chunked").tobytes() == _fwd(inp1, "recurrence").tobytes()
    inp4 = make_scan_inputs(rng, n_head=2, head_dim=8, d_state=16, n_seqs=2, n_t=4, mamba2=True, dtype=np.float32)
    assert _fwd(inp4, "chunked").tobytes() == _fwd(inp4, "recurrence").tobytes()


@pytest.mark.parametrize("head_dim,d_state,n_t,K,want", [
    (32, 128, 64, 1, "chunked"),      # head_dim >= 32, d_state >= 128, n_t >= 64
    (32, 128, 63, 1, "recurrence"),   # too short
    (16, 128, 64, 1, "recurrence"),   # head_dim < 32
    (64, 64, 64, 1, "recurrence"),    # d_state < 128
    (32, 128, 64, 2, "recurrence"),   # snapshot slots: the chunked form has none
])
def test_auto_choice(rng, head_dim, d_state, n_t, K, want):
    """auto gives the same bits as the form its rule names (csrc/ssm_scan_forms.c, ssm_scan_fwd_chunked)."""
    inp = make_scan_inputs(rng, n_head=2, head_dim=head_dim, d_state=d_state, n_seqs=1, n_t=n_t, mamba2=True,
                           dtype=np.float32)
    res = {form: _fwd(inp, form, K=K).tobytes() for form in ("auto", "recurrence", "chunked")}
    assert res["auto"] == res[want]
    assert _ssmgrad._scan_forms(*scan_args(inp), K)["fwd"] == want    # what benchmarks/common.py counts FLOP by
    if K == 1:
        assert res["recurrence"] != res["chunked"]     # so the equality above tells them apart
