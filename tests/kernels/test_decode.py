"""The forward scan's decode path (csrc/ssm_scan_decode.c): calls of n_t <= 4 tokens whose state, B and
C rows (and Mamba-1's A rows) are contiguous skip the general kernel's transposed scratch state.

Oracles: the float64 torch reference (tests/reference.py) and the general path, forced by a
strided view of the same data. ``_ssmgrad._scan_work_bytes`` tells which path a call takes (0:
the decode path), so that a change cannot turn the path off unnoticed. Run the file with
SSMGRAD_SIMD=x86-64-v3 and =x86-64 too: the AVX-512 pass has vector code of its own.
"""

import numpy as np
import pytest

import _ssmgrad
import ssmgrad
from reference import assert_close, make_scan_inputs, ref_scan_np, scan_args

FWD_TOL = dict(atol=1e-13, rtol=1e-11)      # float64 vs the float64 reference (as in test_scan.py)
F32_TOL = dict(atol=2e-5, rtol=2e-5)        # float32 vs the same reference, on O(1) values

# name: (n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs, mamba2)
CASES = {
    # Mamba-2 (A per head): d_state a multiple of 16 (the AVX-512 vector rows), and with a remainder
    "m2_ds64":          (4, 16, 64, 2, 2, 1, [1, 0], 2, True),
    "m2_ds19_groups":   (6, 5, 19, 3, 2, 1, [0, 1], 2, True),
    "m2_ds8_hd1":       (8, 1, 8, 4, 1, 1, [0], 1, True),
    "m2_dup_extra":     (2, 3, 32, 1, 4, 1, [4, 0, 4, 4], 6, True),
    "m2_nt2":           (4, 3, 16, 2, 2, 2, [1, 0], 2, True),
    "m2_nt4":           (3, 4, 21, 1, 3, 4, [2, 2, 0], 3, True),
    # Mamba-1 (A per state), one row per head: whole runs of 8 heads of one group, a group border
    # inside a run (10 heads per group), a tail of heads, and 2 chunks of 16 states per row
    "m1_40h_5g":        (40, 1, 16, 5, 2, 1, [1, 1], 3, False),
    "m1_40h_4g":        (40, 1, 16, 4, 2, 1, [0, 2], 3, False),
    "m1_13h_ds32":      (13, 1, 32, 1, 1, 1, [0], 1, False),
    "m1_ds7":           (9, 1, 7, 3, 2, 1, [1, 0], 2, False),
    "m1_ds20":          (9, 1, 20, 1, 2, 1, [0, 1], 2, False),
    "m1_hd2":           (4, 2, 16, 2, 2, 1, [0, 1], 2, False),
    "m1_nt3":           (17, 1, 16, 1, 2, 3, [1, 0], 2, False),
    "m1_dup_extra":     (16, 1, 16, 2, 3, 1, [3, 1, 3], 5, False),
}


def inputs(rng, name, dtype=np.float64):
    n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs, mamba2 = CASES[name]
    return make_scan_inputs(rng, n_head=n_head, head_dim=head_dim, d_state=d_state, n_group=n_group,
                            n_seqs=n_seqs, n_t=n_t, ids=ids, n_rs=n_rs, mamba2=mamba2, dtype=dtype)


def work_bytes(inp, K=1, nthreads=1):
    return _ssmgrad._scan_work_bytes(*scan_args(inp), K, nthreads)


def strided(a):
    """The values of ``a`` in a view whose last axis has element stride 2 (and a copy's memory)."""
    buf = np.zeros(a.shape + (2,), a.dtype)
    buf[..., 0] = a
    return buf[..., 0]


def run(inp, K=1):
    return ssmgrad.ssm_scan(*scan_args(inp), K=K)


@pytest.mark.parametrize("name", CASES)
def test_decode_vs_reference(rng, name):
    inp = inputs(rng, name)
    assert work_bytes(inp) == 0, "the decode path should take this call"
    assert_close(run(inp), ref_scan_np(*scan_args(inp)), name="decode path vs torch reference", **FWD_TOL)


@pytest.mark.parametrize("name", CASES)
def test_decode_float32(rng, name):
    inp = inputs(rng, name)
    inp32 = {k: (v.astype(np.float32) if k != "ids" else v) for k, v in inp.items()}
    assert work_bytes(inp32) == 0
    out = run(inp32)
    assert out.dtype == np.float32
    assert_close(out, ref_scan_np(*scan_args(inp)), name="float32 decode path vs float64 reference", **F32_TOL)


@pytest.mark.parametrize("name", ["m2_ds64", "m2_ds19_groups", "m1_40h_4g", "m1_ds20", "m1_hd2", "m1_nt3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_vs_general_path(rng, name, dtype):
    """The same values through strided views of s, B and C take the general kernel: the states agree
    to rounding (the same expressions), y to the rounding of a sum over d_state in another order."""
    inp = inputs(rng, name, dtype)
    fast = run(inp)
    for key in ("s", "B", "C"):
        other = dict(inp, **{key: strided(inp[key])})
        assert work_bytes(other) > 0, f"a strided {key} should take the general path"
        general = run(other)
        tol = dict(atol=1e-14, rtol=1e-13) if dtype == np.float64 else dict(atol=3e-6, rtol=3e-6)
        scale = max(1.0, float(np.abs(general).max()))
        assert_close(fast, general, name=f"decode vs general path ({key} strided)",
                     atol=tol["atol"] * scale, rtol=tol["rtol"])


def test_mamba1_strided_A_falls_back(rng):
    inp = inputs(rng, "m1_40h_5g")
    other = dict(inp, A=strided(inp["A"]))
    assert work_bytes(other) > 0
    assert_close(run(other), ref_scan_np(*scan_args(inp)), name="general path vs reference", **FWD_TOL)


def test_many_tokens_take_the_general_path(rng):
    inp = make_scan_inputs(rng, n_head=4, head_dim=2, d_state=16, n_t=5)
    assert work_bytes(inp) > 0
    inp["x"] = inp["x"][:, :4]
    inp["dt"], inp["B"], inp["C"] = inp["dt"][:, :4], inp["B"][:, :4], inp["C"][:, :4]
    assert work_bytes(inp) == 0


@pytest.mark.parametrize("n_t,K", [(1, 1), (1, 3), (2, 2), (2, 5), (3, 3), (4, 2), (4, 6)])
@pytest.mark.parametrize("d_state", [16, 5])
def test_decode_snapshots_K(rng, n_t, K, d_state):
    inp = make_scan_inputs(rng, n_head=4, head_dim=3, d_state=d_state, n_group=2, n_seqs=3, n_t=n_t,
                           ids=[1, 2, 1], n_rs=3, mamba2=True)
    assert work_bytes(inp, K) == 0
    out = run(inp, K)
    assert_close(out, ref_scan_np(*scan_args(inp), K=K), name=f"K={K} slots vs reference", **FWD_TOL)
    y, st = ssmgrad.split(out, inp["x"].shape, (K, 3) + inp["s"].shape[1:])
    assert np.all(st[n_t:] == 0), "slots no token reaches must be exactly zero"


def test_x_and_dt_views(rng):
    """x and dt with any strides (views into larger buffers, a negative stride) stay on the decode
    path, read element by element."""
    inp = inputs(rng, "m2_nt2")
    big_x = rng.standard_normal(inp["x"].shape[:-1] + (2 * inp["x"].shape[-1],))
    big_x[..., ::-2] = inp["x"][..., ::-1]
    x_view = big_x[..., ::-2][..., ::-1]
    dt_view = np.ascontiguousarray(inp["dt"][:, :, ::-1])[:, :, ::-1]
    other = dict(inp, x=x_view, dt=dt_view)
    assert not x_view.flags.c_contiguous and dt_view.strides[-1] < 0
    assert work_bytes(other) == 0
    np.testing.assert_array_equal(run(other), run(inp))


@pytest.mark.parametrize("mamba2", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_dt_edges_and_exp_range(rng, mamba2, dtype):
    """dt on both sides of ggml's softplus threshold 20, and decays whose exponent is beyond the
    fast exp's range (Mamba-1 rows then take the general exp for their chunk of states)."""
    n_head = 24
    inp = make_scan_inputs(rng, n_head=n_head, head_dim=1 if not mamba2 else 4, d_state=16, n_seqs=2, n_t=1,
                           ids=[0, 1], mamba2=mamba2)
    edges = np.array([19.0, 19.999, 20.0, 20.001, 21.0, 40.0, -30.0, 0.0, 5.0, 300.0, 1000.0, -1.0])
    inp["dt"][:] = np.resize(edges, n_head)
    inp["A"][: n_head // 2] *= 0.01          # some heads keep their state at dt = 1000 ...
    inp["A"][n_head // 2:] *= 8.0            # ... others underflow to 0 past the fast exp's range
    inp = {k: (v.astype(dtype) if k != "ids" else v) for k, v in inp.items()}
    assert work_bytes(inp) == 0
    out = run(inp)
    ref = ref_scan_np(*scan_args(inp))
    tol = FWD_TOL if dtype == np.float64 else dict(atol=2e-5, rtol=1e-5)
    scale = max(1.0, float(np.abs(ref).max()))
    assert_close(out, ref, name="dt edges vs reference", atol=tol["atol"] * scale, rtol=tol["rtol"])


@pytest.mark.parametrize("name", ["m2_ds64", "m2_dup_extra", "m1_40h_4g", "m1_nt3", "m1_hd2"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_threads_bitwise(rng, restore_threads, force_threads, name, dtype):
    inp = inputs(rng, name, dtype)
    outs = []
    for n in (1, 2, 3):
        ssmgrad.set_num_threads(n)
        outs.append(run(inp))
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])


def test_inputs_unchanged_and_out_fresh(rng):
    inp = inputs(rng, "m2_dup_extra")
    before = {k: v.copy() for k, v in inp.items()}
    out = run(inp)
    for k, v in inp.items():
        np.testing.assert_array_equal(v, before[k])
        assert not np.shares_memory(out, v)


# ---------------------------------------------------------------------------------------------
# _ssmgrad._ssm_scan_update: the in-place cache update ssmgrad/transformers.py uses in generation

def update_args(inp):
    return (inp["s"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], np.arange(inp["x"].shape[0]))


@pytest.mark.parametrize("name", ["m2_ds64", "m2_ds19_groups", "m2_nt4", "m1_40h_4g", "m1_ds7", "m1_nt3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scan_update_in_place_equals_ssm_scan(rng, restore_threads, force_threads, name, dtype):
    n_seqs = CASES[name][4]
    inp = inputs(rng, name, dtype)
    inp["s"] = inp["s"][:1].repeat(n_seqs, axis=0) + rng.standard_normal((n_seqs,) + inp["s"].shape[1:]).astype(dtype)
    inp["ids"] = np.arange(n_seqs)
    out = run(inp)
    y_ref, st_ref = ssmgrad.split(out, inp["x"].shape, inp["s"].shape)
    for n in (1, 2, 3):
        ssmgrad.set_num_threads(n)
        s = inp["s"].copy()
        y = _ssmgrad._ssm_scan_update(*update_args(dict(inp, s=s)), n)
        assert y is not None and y.dtype == dtype and y.shape == inp["x"].shape
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_array_equal(s, st_ref)


def test_scan_update_declines_and_leaves_s(rng):
    """Where it does not apply it returns None and writes nothing."""
    inp = inputs(rng, "m2_nt2")          # n_seqs 2
    inp["s"] = inp["s"][:2].copy()
    cases = {
        "ids not the identity": lambda a: a[:6] + (np.array([1, 0]),),
        "more state rows than sequences": lambda a: (np.concatenate([a[0], a[0]]),) + a[1:],
        "s not contiguous": lambda a: (strided(a[0]),) + a[1:],
        "B strided (general path)": lambda a: a[:4] + (strided(a[4]),) + a[5:],
        "x inside s's memory": lambda a: (a[0], a[0].reshape(-1)[: a[1].size].reshape(a[1].shape)) + a[2:],
    }
    for why, make in cases.items():
        args = make(update_args(inp))
        before = args[0].copy()
        assert _ssmgrad._ssm_scan_update(*args, 1) is None, why
        np.testing.assert_array_equal(args[0], before, err_msg=why)
    ro = inp["s"].copy()
    ro.flags.writeable = False
    assert _ssmgrad._ssm_scan_update(*((ro,) + update_args(inp)[1:]), 1) is None


def test_scan_update_bad_input_errors(rng):
    inp = inputs(rng, "m2_nt2")
    inp["s"] = inp["s"][:2].copy()
    args = update_args(inp)
    with pytest.raises(TypeError, match="'x'"):
        _ssmgrad._ssm_scan_update(args[0], args[1].astype(np.int32), *args[2:], 1)
    with pytest.raises(ValueError, match="'dt'"):
        _ssmgrad._ssm_scan_update(args[0], args[1], args[2][:, :1], *args[3:], 1)
    with pytest.raises(ValueError, match="ids"):
        _ssmgrad._ssm_scan_update(*args[:6], np.array([0, 7]), 1)
