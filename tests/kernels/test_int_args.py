"""Integer arguments: K (NumPy and torch APIs) and set_num_threads follow one rule.

An integer is anything with __index__ (a Python int, NumPy integers) except bool: 2.7, "3",
True, np.float64(2) and None raise TypeError in both APIs alike; out-of-range values raise
ValueError at the door, never later inside a call. K is keyword-only in both APIs. Results with a
NumPy-int K / thread count equal those with the plain int (and the torch reference).
"""
import numpy as np
import pytest
import torch

import ssmgrad
import ssmgrad.torch as st
from reference import assert_close, make_scan_inputs, ref_scan_np, scan_args

BAD_TYPES = [2.7, "3", True, False, np.float64(2.0), None, np.bool_(True), [2]]


@pytest.fixture
def m2(rng):
    inp = make_scan_inputs(rng, n_head=4, head_dim=3, d_state=5, n_group=2, n_seqs=2, n_t=4, n_rs=3)
    return scan_args(inp)


def _torch_args(args):
    return [torch.from_numpy(a) for a in args[:6]] + [torch.from_numpy(args[6])]


@pytest.mark.parametrize("K", BAD_TYPES, ids=repr)
def test_bad_K_type_is_typeerror_in_both_apis(m2, K):
    g = np.ones(ssmgrad.ssm_scan(*m2, K=2).size)
    with pytest.raises(TypeError, match="K must be an integer"):
        ssmgrad.ssm_scan(*m2, K=K)
    with pytest.raises(TypeError, match="K must be an integer"):
        ssmgrad.ssm_scan_back(*m2, g, K=K)
    with pytest.raises(TypeError, match="K must be an integer"):
        st.ssm_scan(*_torch_args(m2), K=K)


@pytest.mark.parametrize("K", [0, -1, np.int32(0), -(2 ** 70)], ids=repr)
def test_K_below_1_is_valueerror_in_both_apis(m2, K):
    with pytest.raises(ValueError, match="K must be >= 1"):
        ssmgrad.ssm_scan(*m2, K=K)
    with pytest.raises(ValueError, match="K must be >= 1"):
        st.ssm_scan(*_torch_args(m2), K=K)


def test_K_is_keyword_only_in_both_apis(m2):
    with pytest.raises(TypeError):
        ssmgrad.ssm_scan(*m2, 2)
    with pytest.raises(TypeError):
        st.ssm_scan(*_torch_args(m2), 2)


@pytest.mark.parametrize("K", [2, np.int64(2), np.uint8(2)], ids=repr)
def test_numpy_int_K_works_in_both_apis(m2, K):
    want = ref_scan_np(*m2, K=2)
    assert_close(ssmgrad.ssm_scan(*m2, K=K), want, 1e-12, 1e-10, "numpy API")
    got = st.ssm_scan(*_torch_args(m2), K=K)
    assert_close(got.numpy(), want, 1e-12, 1e-10, "torch API")


@pytest.mark.parametrize("n", [np.int64(2), np.int32(1), np.uint16(3), 2], ids=repr)
def test_set_num_threads_accepts_numpy_ints(restore_threads, m2, n):
    want = ref_scan_np(*m2)
    ssmgrad.set_num_threads(n)
    assert ssmgrad.get_num_threads() == int(n) and type(ssmgrad.get_num_threads()) is int
    assert_close(ssmgrad.ssm_scan(*m2), want, 1e-12, 1e-10, f"{n!r} threads")


@pytest.mark.parametrize("n", [0, -1, ssmgrad.MAX_THREADS + 1, 2 ** 31, 2 ** 40, np.int64(2 ** 40)], ids=repr)
def test_set_num_threads_out_of_range_is_valueerror(restore_threads, n):
    before = ssmgrad.get_num_threads()
    with pytest.raises(ValueError, match="set_num_threads: n must be"):
        ssmgrad.set_num_threads(n)
    assert ssmgrad.get_num_threads() == before


@pytest.mark.parametrize("n", BAD_TYPES, ids=repr)
def test_set_num_threads_bad_type_is_typeerror(restore_threads, n):
    before = ssmgrad.get_num_threads()
    with pytest.raises(TypeError, match="n must be an integer"):
        ssmgrad.set_num_threads(n)
    assert ssmgrad.get_num_threads() == before


def test_max_threads_runs(restore_threads, m2):
    """The largest accepted count gives working calls (the glue uses one thread per unit of work)."""
    want = ref_scan_np(*m2)
    ssmgrad.set_num_threads(ssmgrad.MAX_THREADS)
    assert_close(ssmgrad.ssm_scan(*m2), want, 1e-12, 1e-10, "MAX_THREADS")
    sx = np.ones((1, 3, 5))
    assert (ssmgrad.ssm_conv(sx, np.ones((3, 2))) == 2).all()
