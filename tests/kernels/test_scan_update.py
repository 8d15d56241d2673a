"""ssmgrad.ssm_scan_update: the public in-place state update (a generation cache advanced by a few tokens).

Oracle: the float64 torch reference (tests/reference.py, ``ref_ssm_scan`` with ids = 0..n_seqs-1), for y and
for the states written over s. Both the in-place form (C-contiguous s, the one-token steps) and the general
form (strided s, overlapping inputs, longer calls) are checked, with several thread counts.
"""

import numpy as np
import pytest

import ssmgrad
from reference import make_scan_inputs, ref_scan_np

F64 = dict(atol=1e-13, rtol=1e-11)
F32 = dict(atol=2e-5, rtol=2e-5)

# name: (n_head, head_dim, d_state, n_group, n_seqs, n_t, mamba2)
CASES = {
    "m2_one_token": (4, 8, 16, 2, 3, 1, True),
    "m2_groups_ds19": (6, 5, 19, 3, 2, 1, True),
    "m2_four_tokens": (3, 4, 21, 1, 2, 4, True),
    "m2_long": (2, 3, 8, 1, 2, 70, True),             # beyond the decode path: the general form
    "m1_one_token": (40, 1, 16, 4, 2, 1, False),
    "m1_ds7_three_tokens": (9, 1, 7, 3, 2, 3, False),
}


def case(rng, name, dtype=np.float64):
    n_head, head_dim, d_state, n_group, n_seqs, n_t, mamba2 = CASES[name]
    return make_scan_inputs(rng, n_head=n_head, head_dim=head_dim, d_state=d_state, n_group=n_group,
                            n_seqs=n_seqs, n_t=n_t, ids=np.arange(n_seqs), n_rs=n_seqs, mamba2=mamba2, dtype=dtype)


def reference(inp):
    """(y, final states) of the torch reference, float64."""
    out = ref_scan_np(*(inp[k] for k in ("s", "x", "dt", "A", "B", "C")), np.arange(inp["x"].shape[0]))
    return ssmgrad.split(out, inp["x"].shape, inp["s"].shape)


def strided(a):
    buf = np.zeros(a.shape + (2,), a.dtype)
    buf[..., 0] = a
    return buf[..., 0]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_update_equals_reference(rng, restore_threads, force_threads, name, dtype):
    inp = case(rng, name, dtype)
    y_ref, s_ref = reference(inp)
    tol = F64 if dtype == np.float64 else F32
    ys = []
    for n in (1, 2, 3):
        ssmgrad.set_num_threads(n)
        s = inp["s"].copy()
        y = ssmgrad.ssm_scan_update(s, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
        assert y.dtype == dtype and y.shape == inp["x"].shape
        np.testing.assert_allclose(y, y_ref, **tol)
        np.testing.assert_allclose(s, s_ref, **tol)
        ys.append((y.copy(), s.copy()))
    for y, s in ys[1:]:                                  # bitwise the same for every thread count
        np.testing.assert_array_equal(y, ys[0][0])
        np.testing.assert_array_equal(s, ys[0][1])


def test_update_general_forms_equal_in_place_form(rng):
    """A strided s, and an x that lives inside s's memory, take the packed scan and a copy (the general
    kernel: the in-place form's values to rounding), and s (or its strided view) holds the final states."""
    inp = case(rng, "m2_one_token")
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    s_fast = inp["s"].copy()
    y_fast = ssmgrad.ssm_scan_update(s_fast, *args)

    s_strided = strided(inp["s"])
    y = ssmgrad.ssm_scan_update(s_strided, *args)
    np.testing.assert_allclose(y, y_fast, **F64)
    np.testing.assert_allclose(s_strided, s_fast, **F64)
    assert not np.array_equal(s_strided, inp["s"])

    # x stored inside s's memory: the kernel must read x before the states overwrite it
    big = np.concatenate([inp["s"].reshape(-1), inp["x"].reshape(-1)])
    s_view = big[: inp["s"].size].reshape(inp["s"].shape)
    x_view = big[inp["s"].size:].reshape(inp["x"].shape)
    s_alias = np.lib.stride_tricks.as_strided(big, shape=inp["s"].shape, strides=s_view.strides)
    x_alias = np.lib.stride_tricks.as_strided(big[inp["s"].size - 5:], shape=inp["x"].shape,
                                              strides=x_view.strides)      # overlaps s's last 5 entries
    x_before = x_alias.copy()
    s_before = s_alias.copy()
    y_ref, s_ref = reference(dict(inp, s=s_before, x=x_before))
    y = ssmgrad.ssm_scan_update(s_alias, x_alias, *args[1:])
    np.testing.assert_allclose(y, y_ref, **F64)
    np.testing.assert_allclose(s_alias, s_ref, **F64)


def test_update_advances_like_one_long_scan(rng):
    """Token by token through the cache == the whole sequence at once (generation's contract)."""
    inp = case(rng, "m2_four_tokens")
    y_ref, s_ref = reference(inp)
    s = inp["s"].copy()
    for t in range(inp["x"].shape[1]):
        sl = slice(t, t + 1)
        y = ssmgrad.ssm_scan_update(s, inp["x"][:, sl], inp["dt"][:, sl], inp["A"], inp["B"][:, sl], inp["C"][:, sl])
        np.testing.assert_allclose(y[:, 0], y_ref[:, t], **F64)
    np.testing.assert_allclose(s, s_ref, **F64)


def test_update_bad_input(rng):
    inp = case(rng, "m2_one_token")
    s, rest = inp["s"], (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    with pytest.raises(TypeError, match=r"ssm_scan_update: s must be a NumPy array"):
        ssmgrad.ssm_scan_update(s.tolist(), *rest)
    ro = s.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"ssm_scan_update: s must be writeable"):
        ssmgrad.ssm_scan_update(ro, *rest)
    with pytest.raises(ValueError, match=r"ssm_scan_update: s must be 4-D"):
        ssmgrad.ssm_scan_update(s[0], *rest)
    with pytest.raises(ValueError, match=r"s must hold one state per sequence"):
        ssmgrad.ssm_scan_update(s[:2].copy(), *rest)
    with pytest.raises(TypeError, match="'x'"):
        ssmgrad.ssm_scan_update(s.copy(), rest[0].astype(np.int32), *rest[1:])
    with pytest.raises(TypeError, match="'s'"):
        ssmgrad.ssm_scan_update(s.astype(np.int64), *rest)
    with pytest.raises(ValueError, match="'dt'"):
        ssmgrad.ssm_scan_update(s.copy(), rest[0], rest[1][:, :, :1], *rest[2:])
    # a failed call leaves s as it was
    before = s.copy()
    with pytest.raises(ValueError):
        ssmgrad.ssm_scan_update(s, rest[0], rest[1][:, :, :1], *rest[2:])
    np.testing.assert_array_equal(s, before)
