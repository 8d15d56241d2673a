"""The forward's chunk states, read by the backward: ssmgrad.ssm_scan(keep_states=True) and
ssm_scan_back(chunk_states=...) (ssmgrad.h: ssm_scan_keep_*, ssm_scan_back_kept_*).

Where both kernels take the chunked form, the chunked forward keeps each (sequence, head)'s state after
every 64 tokens and the backward reads them instead of recomputing them by its own pass over the chunks.
- The states against the oracle: tests/reference.py's token recurrence in torch (shares no code with the
  kernels) run over the first 64 (c + 1) tokens, float64 and float32.
- The backward with the states gives the bits of the backward without them (the forward's products are that
  pass's, element for element), for every case of the chunked tests' table, each SIMD pass, 1 and 3 threads,
  float32 and float64, a nonzero gradient on the final-state region, duplicate ids and extra state rows.
- The backward reads them: other states give other gradients.
- Where either kernel takes the recurrence (or K > 1, Mamba-1) the forward keeps nothing (an empty array)
  and the backward ignores what it is given.
- Bad chunk_states: a wrong shape is a ValueError naming chunk_states with the expected shape, another dtype
  a TypeError; the inputs are never written.
"""

import numpy as np
import pytest
import torch

import _ssmgrad
import ssmgrad
from reference import (CHUNKED_CASES, make_mamba2_case, make_scan_inputs, scan_args, scan_out_size, scan_states,
                       to_torch)

Q = 64


@pytest.fixture
def forms():
    """both kernels forced to the chunked form (the table's shapes are below the automatic thresholds)"""
    old_f, old_b = _ssmgrad._set_scan_fwd("chunked"), _ssmgrad._set_scan_back("chunked")
    try:
        yield
    finally:
        _ssmgrad._set_scan_fwd(old_f)
        _ssmgrad._set_scan_back(old_b)


def _n_chunks(n_t):
    return (n_t + Q - 1) // Q


# The states against the float64 recurrence on the same values, relative to max(1, max |ref|). Measured over
# the table's cases: float64 5.7e-15, float32 2.0e-7; margins 175x (float64 rounding only) and 5x.
STATE_TOL = {np.float64: 1e-12, np.float32: 1e-6}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", CHUNKED_CASES)
def test_states_are_the_states_after_each_chunk(rng, forms, name, dtype):
    inp = make_mamba2_case(rng, CHUNKED_CASES[name], dtype)
    out, kept = ssmgrad.ssm_scan(*scan_args(inp), keep_states=True)
    s, x = inp["s"], inp["x"]
    n_seqs, n_t, n_head, head_dim = x.shape
    nc = _n_chunks(n_t)
    assert kept.shape == (n_seqs, n_head, nc, head_dim, s.shape[3]) and kept.dtype == dtype
    assert np.array_equal(out, ssmgrad.ssm_scan(*scan_args(inp)))          # the same output
    # the last entry is the final state, bit for bit
    final = ssmgrad.split(out, x.shape, (n_seqs,) + s.shape[1:])[1]
    assert np.array_equal(kept[:, :, -1], final)
    # every entry against the oracle's states (float64 recurrence on the same values)
    args = [to_torch(inp[k].astype(np.float64)) for k in ("s", "x", "dt", "A", "B", "C")]
    _, slots = scan_states(*args, inp["ids"], K=n_t)       # slot k: the state after n_t - k tokens
    tol = STATE_TOL[dtype]
    for c in range(nc):
        t_end = min(Q * (c + 1), n_t)
        ref = slots[n_t - t_end].numpy()
        err = np.abs(kept[:, :, c] - ref).max() / max(1.0, np.abs(ref).max())
        assert err <= tol, f"{name} chunk {c}: {err:.3g} > {tol:.1g}"


def _grads(inp, grad, kept=None):
    return ssmgrad.ssm_scan_back(*scan_args(inp), grad, return_dA=True, chunk_states=kept)


# Long enough that a unit's d_B / d_C partial sums pass 1 MB in float32 (2 n_t d_state elements), where the
# backward given the states runs the chunks outermost, all of a unit's heads at once (csrc/
# ssm_scan_back_chunked_body.h, ssm_back_unit_by_chunk: the same sums in the same order): units of 3 heads with
# duplicate ids and extra state rows; head_dim 17 (the y gradient's padded rows); 7 heads in runs of 3, 4 (one
# sequence and group: 2 runs for 2 threads).
# (n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs) as CHUNKED_CASES
BY_CHUNK_CASES = {
    "nt1100_groups_dup_extra": (6, 16, 128, 2, 2, 1100, [1, 1], 3),
    "nt1030_hd17": (4, 17, 128, 1, 1, 1030, [0], 1),
    "nt1030_runs_2_2_3": (7, 32, 128, 1, 1, 1030, [0], 1),
}


@pytest.mark.parametrize("simd", ["auto", "v4-no-vec64", "x86-64-v3", "x86-64"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_backward_with_the_states_is_bitwise_the_backward(rng, forms, force_threads, restore_threads, dtype, simd):
    old = _ssmgrad._set_simd(simd)
    try:
        for name, case in (CHUNKED_CASES | BY_CHUNK_CASES).items():
            inp = make_mamba2_case(rng, case, dtype)
            out, kept = ssmgrad.ssm_scan(*scan_args(inp), keep_states=True)
            grad = rng.standard_normal(out.shape).astype(dtype)      # the final-state region too
            for nth in (1, 3):
                ssmgrad.set_num_threads(nth)
                want, want_dA = _grads(inp, grad)
                got, got_dA = _grads(inp, grad, kept)
                assert np.array_equal(got, want) and np.array_equal(got_dA, want_dA), (name, nth)
    finally:
        _ssmgrad._set_simd(old)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_automatic_forms_at_a_real_shape(rng, dtype):
    """The automatic rules at a Mamba-2 layer's head shape (64 x 128, two groups, 130 tokens: both forms
    chunked): states kept and read, the same bits."""
    inp = make_scan_inputs(rng, n_head=4, head_dim=64, d_state=128, n_group=2, n_seqs=2, n_t=130, mamba2=True,
                           dtype=dtype)
    assert _ssmgrad._scan_forms(*scan_args(inp), 1) | {"back_units": 0} == \
        {"fwd": "chunked", "back": "chunked", "back_units": 0}
    out, kept = ssmgrad.ssm_scan(*scan_args(inp), keep_states=True)
    assert kept.shape == (2, 4, 3, 64, 128)
    grad = rng.standard_normal(out.shape).astype(dtype)
    want, got = _grads(inp, grad), _grads(inp, grad, kept)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_the_backward_reads_the_states(rng, forms):
    inp = make_mamba2_case(rng, CHUNKED_CASES["nt150_groups"], np.float64)
    out, kept = ssmgrad.ssm_scan(*scan_args(inp), keep_states=True)
    grad = rng.standard_normal(out.shape)
    want = _grads(inp, grad)[0]
    other = kept.copy()
    other[:, :, 0] *= 1.5                   # the state after the first chunk only
    got = _grads(inp, grad, other)[0]
    assert not np.array_equal(got, want)
    # and a strided array is read as it stands (a dense copy)
    wide = np.zeros(kept.shape[:-1] + (2 * kept.shape[-1],))
    wide[..., ::2] = kept
    assert np.array_equal(_grads(inp, grad, wide[..., ::2])[0], want)


@pytest.mark.parametrize("what", ["recurrence_fwd", "recurrence_back", "K2", "mamba1"])
def test_nothing_kept_where_a_kernel_is_not_chunked(rng, what):
    mamba1 = what == "mamba1"
    inp = make_scan_inputs(rng, n_head=2, head_dim=3, d_state=4, n_seqs=2, n_t=70, mamba2=not mamba1)
    K = 2 if what == "K2" else 1
    fwd = "recurrence" if what == "recurrence_fwd" else "chunked"
    back = "recurrence" if what == "recurrence_back" else "chunked"
    old_f, old_b = _ssmgrad._set_scan_fwd(fwd), _ssmgrad._set_scan_back(back)
    try:
        out, kept = ssmgrad.ssm_scan(*scan_args(inp), K=K, keep_states=True)
        assert kept.shape == (0,)
        assert np.array_equal(out, ssmgrad.ssm_scan(*scan_args(inp), K=K))
        grad = rng.standard_normal(scan_out_size(inp, K))
        want = ssmgrad.ssm_scan_back(*scan_args(inp), grad, K=K)
        # ignored, whatever it is: the call recomputes
        junk = np.full((2, 2, 2, 3, 4), np.nan)
        for given in (kept, junk):
            assert np.array_equal(ssmgrad.ssm_scan_back(*scan_args(inp), grad, K=K, chunk_states=given), want)
    finally:
        _ssmgrad._set_scan_fwd(old_f)
        _ssmgrad._set_scan_back(old_b)


def test_bad_chunk_states(rng, forms):
    inp = make_mamba2_case(rng, CHUNKED_CASES["nt130_dup_extra"], np.float64)
    before = {k: v.copy() for k, v in inp.items()}
    out, kept = ssmgrad.ssm_scan(*scan_args(inp), keep_states=True)
    grad = rng.standard_normal(out.shape)
    with pytest.raises(ValueError, match=r"argument 'chunk_states' has shape \(3, 2, 2, 2, 3\), "
                                         r"expected \(3, 2, 3, 2, 3\)"):
        ssmgrad.ssm_scan_back(*scan_args(inp), grad, chunk_states=kept[:, :, :2])
    with pytest.raises(ValueError, match="'chunk_states' must be 5-D"):
        ssmgrad.ssm_scan_back(*scan_args(inp), grad, chunk_states=kept.reshape(-1))
    with pytest.raises(TypeError, match="'chunk_states' has dtype float32 but 's' has dtype float64"):
        ssmgrad.ssm_scan_back(*scan_args(inp), grad, chunk_states=kept.astype(np.float32))
    with pytest.raises(TypeError, match="'chunk_states' must be a float32 or float64 array"):
        ssmgrad.ssm_scan_back(*scan_args(inp), grad, chunk_states=kept.astype(np.int64))
    kept_before = kept.copy()
    ssmgrad.ssm_scan_back(*scan_args(inp), grad, chunk_states=kept)
    assert np.array_equal(kept, kept_before)
    for k, v in before.items():
        assert np.array_equal(inp[k], v), k


def test_torch_training_reads_the_forward_states(rng, monkeypatch):
    """ssmgrad.torch.ssm_scan with a gradient wanted runs the forward that keeps the states and hands them
    to the backward (eager and compiled); without a gradient, the plain forward."""
    import ssmgrad.torch as st
    inp = make_scan_inputs(rng, n_head=2, head_dim=64, d_state=128, n_seqs=1, n_t=70, mamba2=True)
    seen = []
    real_back = ssmgrad.ssm_scan_back

    def back(*args, chunk_states=None, **kw):
        seen.append(None if chunk_states is None else chunk_states.shape)
        return real_back(*args, chunk_states=chunk_states, **kw)

    monkeypatch.setattr(ssmgrad, "ssm_scan_back", back)
    tensors = [torch.from_numpy(inp[k]).requires_grad_() for k in ("s", "x", "dt", "A", "B", "C")]
    ids = torch.from_numpy(inp["ids"].astype(np.int64))

    def f(*ts):
        return (st.ssm_scan(*ts, ids) ** 2).sum()

    grads = torch.autograd.grad(f(*tensors), tensors)
    assert seen == [(1, 2, 2, 64, 128)]
    torch._dynamo.reset()
    cgrads = torch.autograd.grad(torch.compile(f, fullgraph=True)(*tensors), tensors)
    assert seen[1:] == [(1, 2, 2, 64, 128)]
    for a, b in zip(grads, cgrads):
        assert torch.equal(a, b)
