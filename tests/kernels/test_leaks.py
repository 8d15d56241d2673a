"""Leak tests: 10,000 calls of every public function (error paths included) with the same arguments.

For each call pattern:
  * the reference count of every argument (and of the small objects passed through, e.g. shape
    tuples) is the same after 10,000 calls as before (sys.getrefcount);
  * a fresh result is owned only by the caller (refcount 2 inside sys.getrefcount(result));
  * the number of memory blocks the interpreter has allocated (sys.getallocatedblocks) does not
    grow by more than 200 over the calls (a leaked exception message, tuple or array header per
    call would add >= 10,000) — with PYTHONMALLOC=malloc (the sanitizer run) this counter is 0
    and the check is vacuous, which is why RSS is also checked;
  * RSS (/proc/self/statm) after the calls is within RSS_SLACK_BYTES of RSS after a 1,000-call
    warm-up; the arrays are sized so that leaking any one of them per call (>= 2 KiB) would add
    >= 20 MiB. Under the ASan preload (.ci/sanitize.sh) ASan's exact count of live heap bytes
    is used instead of RSS (freed memory sits in ASan's quarantine, so RSS would grow).

The iteration count can be lowered with SSMGRAD_LEAK_ITERS (the sanitizer run keeps the default).
"""

import ctypes
import gc
import os
import sys

import numpy as np
import pytest

import ssmgrad

ITERS = int(os.environ.get("SSMGRAD_LEAK_ITERS", "10000"))
WARMUP = 1000
RSS_SLACK_BYTES = 4 << 20
BLOCK_SLACK = 200
PAGE = os.sysconf("SC_PAGE_SIZE")


def _asan_allocated_bytes():
    """Under the ASan preload (the sanitizer run) RSS is meaningless (freed memory sits in ASan's
    quarantine); ASan's own count of live heap bytes is exact, so it replaces RSS there."""
    try:
        fn = ctypes.CDLL(None).__sanitizer_get_current_allocated_bytes
    except (AttributeError, OSError):
        return None
    fn.restype = ctypes.c_size_t
    return fn


ASAN_ALLOCATED = _asan_allocated_bytes()


def rss_bytes():
    if ASAN_ALLOCATED is not None:
        return int(ASAN_ALLOCATED())
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def inputs(dtype=np.float32):
    """Tiny shapes, but every array >= 2 KiB so that leaking one per call is visible in RSS."""
    rng = np.random.default_rng(0)
    n_rs, n_head, head_dim, d_state, n_group, n_seqs, n_t = 3, 4, 8, 16, 2, 2, 4
    s = rng.standard_normal((n_rs, n_head, head_dim, d_state)).astype(dtype)
    x = rng.standard_normal((n_seqs, n_t, n_head, head_dim)).astype(dtype)
    dt = rng.standard_normal((n_seqs, n_t, n_head)).astype(dtype)
    A1 = -np.abs(rng.standard_normal((n_head, d_state))).astype(dtype)
    A2 = -np.abs(rng.standard_normal((n_head, 1))).astype(dtype)
    B = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(dtype)
    C = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(dtype)
    ids = np.array([2, 0], dtype=np.int32)
    n_out = x.size + n_seqs * n_head * head_dim * d_state
    grad = rng.standard_normal(n_out).astype(dtype)
    grad3 = rng.standard_normal(x.size + 3 * n_seqs * n_head * head_dim * d_state).astype(dtype)
    sx = rng.standard_normal((2, 64, 3 + 8)).astype(dtype)
    c = rng.standard_normal((64, 4)).astype(dtype)
    gy = rng.standard_normal((2, 8, 64)).astype(dtype)
    return dict(s=s, x=x, dt=dt, A1=A1, A2=A2, B=B, C=C, ids=ids, grad=grad, grad3=grad3, sx=sx, c=c, gy=gy)


def _patterns():
    d = inputs()
    d64 = inputs(np.float64)
    s, x, dt, A1, A2, B, C, ids = (d[k] for k in ("s", "x", "dt", "A1", "A2", "B", "C", "ids"))
    grad, grad3, sx, c, gy = (d[k] for k in ("grad", "grad3", "sx", "c", "gy"))
    bad_ids = np.array([3, 0], dtype=np.int32)
    x_int = x.astype(np.int32)
    shapes = (s.shape, x.shape, dt.shape, B.shape, C.shape)
    n_gin = sum(int(np.prod(sh)) for sh in shapes)
    gin = np.zeros(n_gin, np.float32)
    x_view = np.asfortranarray(x)[:, ::-1]                  # forces the glue's conversion path
    ids_list = [2, 0]
    rng = np.random.default_rng(1)
    gq = rng.standard_normal((2, 4, 2, 16)).astype(np.float32)          # q, k, v, g (KDA): 4 KiB each
    gdn = (gq, gq[:, :, :, ::-1], gq * 0.5, -np.abs(gq), np.full((2, 4, 2, 1), 0.5, np.float32),
           rng.standard_normal((2, 2, 16, 16)).astype(np.float32))
    gdn_grad = rng.standard_normal(gq.size + 2 * gdn[5].size).astype(np.float32)
    # name -> (callable, positional args, kwargs, expected exception or None)
    return {
        "gated_delta_net_K2": (ssmgrad.gated_delta_net, gdn, {"K": 2}, None),
        "gated_delta_net_back_K2": (ssmgrad.gated_delta_net_back, gdn + (gdn_grad,),
                                    {"K": 2, "head_bcast": "interleaved"}, None),
        "err_gdn_shape": (ssmgrad.gated_delta_net, gdn[:4] + (gdn[4][:, :-1], gdn[5]), {}, ValueError),
        "err_gdn_dtype": (ssmgrad.gated_delta_net, gdn[:5] + (gdn[5].astype(np.float64),), {}, TypeError),
        "err_gdn_back_grad": (ssmgrad.gated_delta_net_back, gdn + (gdn_grad[:-1],), {"K": 2}, ValueError),
        "ssm_conv": (ssmgrad.ssm_conv, (sx, c), {}, None),
        "ssm_conv_back": (ssmgrad.ssm_conv_back, (sx, c, gy), {}, None),
        "ssm_conv_back_weight": (ssmgrad.ssm_conv_back_weight, (sx, c, gy), {}, None),
        "ssm_conv_f64": (ssmgrad.ssm_conv, (d64["sx"], d64["c"]), {}, None),
        "ssm_scan": (ssmgrad.ssm_scan, (s, x, dt, A1, B, C, ids), {}, None),
        "ssm_scan_K3": (ssmgrad.ssm_scan, (s, x, dt, A2, B, C, ids), {"K": 3}, None),
        "ssm_scan_strided_list_ids": (ssmgrad.ssm_scan, (s, x_view, dt, A1, B, C, ids_list), {}, None),
        "ssm_scan_back": (ssmgrad.ssm_scan_back, (s, x, dt, A1, B, C, ids, grad), {}, None),
        "ssm_scan_back_dA": (ssmgrad.ssm_scan_back, (s, x, dt, A1, B, C, ids, grad), {"return_dA": True}, None),
        "ssm_scan_back_K3_dA": (ssmgrad.ssm_scan_back, (s, x, dt, A2, B, C, ids, grad3),
                                {"K": 3, "return_dA": True}, None),
        "split": (ssmgrad.split, (gin,) + shapes, {}, None),
        # error paths
        "err_conv_dtype": (ssmgrad.ssm_conv, (sx, c.astype(np.float64)), {}, TypeError),
        "err_conv_shape": (ssmgrad.ssm_conv, (sx, c[:-1]), {}, ValueError),
        "err_conv_back_grad": (ssmgrad.ssm_conv_back, (sx, c, gy[:, 1:]), {}, ValueError),
        "err_conv_back_weight_grad": (ssmgrad.ssm_conv_back_weight, (sx, c, gy[:, 1:]), {}, ValueError),
        "err_scan_ids": (ssmgrad.ssm_scan, (s, x, dt, A1, B, C, bad_ids), {}, ValueError),
        "err_scan_int": (ssmgrad.ssm_scan, (s, x_int, dt, A1, B, C, ids), {}, TypeError),
        "err_scan_shape": (ssmgrad.ssm_scan, (s, x, dt[:, :-1], A1, B, C, ids), {}, ValueError),
        "err_scan_K_mamba1": (ssmgrad.ssm_scan, (s, x, dt, A1, B, C, ids), {"K": 2}, ValueError),
        "err_scan_back_grad": (ssmgrad.ssm_scan_back, (s, x, dt, A1, B, C, ids, grad[:-1]), {}, ValueError),
        "err_scan_back_ids": (ssmgrad.ssm_scan_back, (s, x, dt, A1, B, C, bad_ids, grad), {}, ValueError),
        "err_scan_back_mixed": (ssmgrad.ssm_scan_back, (s, x, dt, A1, B, C, ids, grad.astype(np.float64)), {},
                                TypeError),
        "err_scan_back_obj": (ssmgrad.ssm_scan_back, (s, x, dt, A1, B, C, ids, object()), {}, (TypeError, ValueError)),
        "err_split": (ssmgrad.split, (gin, s.shape, x.shape), {}, ValueError),
        "err_kwarg": (ssmgrad.ssm_scan, (s, x, dt, A1, B, C, ids), {"bogus": 1}, TypeError),
    }


PATTERNS = sorted(_patterns())
# These run on 2 compute threads (a leaked thread stack or per-call scratch shows up in RSS); the
# rest on 1 thread, which is several times faster per call on this 2-core machine.
THREADED = {"ssm_scan_back_dA": 2, "ssm_conv_back": 2, "ssm_scan": 2, "gated_delta_net_back_K2": 2}


def _call(fn, args, kwargs, exc):
    if exc is None:
        return fn(*args, **kwargs)
    try:
        fn(*args, **kwargs)
    except exc as e:
        return e
    raise AssertionError(f"{fn.__name__} did not raise {exc}")


@pytest.mark.parametrize("name", PATTERNS)
def test_no_leak(name, restore_threads):
    ssmgrad.set_num_threads(THREADED.get(name, 1))
    fn, args, kwargs, exc = _patterns()[name]
    # watch the arguments and the elements of tuple arguments (shapes) and of kwargs
    # (small ints are shared process-wide, their counts move with unrelated code: not watched)
    watched = [a for a in list(args) + [e for a in args if isinstance(a, (tuple, list)) for e in a]
               + list(kwargs.values()) if not isinstance(a, (int, bool))]

    first = _call(fn, args, kwargs, exc)
    if exc is None:
        again = _call(fn, args, kwargs, exc)
        for r1, r2 in zip(first if isinstance(first, tuple) else (first,),
                          again if isinstance(again, tuple) else (again,)):
            np.testing.assert_array_equal(r1, r2)
        del again
        # a fresh result is owned by the caller only (+1 for getrefcount's own argument)
        res = _call(fn, args, kwargs, exc)
        # (counted outside `assert`: pytest's assert rewriting keeps temporaries alive)
        if isinstance(res, tuple):
            counts = [sys.getrefcount(res[i]) for i in range(len(res))]
            assert counts == [2] * len(res), f"{name}: results have extra references: {counts}"
        else:
            count = sys.getrefcount(res)
            assert count == 2, f"{name}: result has {count - 2} extra references"
        del res
    del first

    for _ in range(WARMUP):
        _call(fn, args, kwargs, exc)
    gc.collect()
    refs = [sys.getrefcount(a) for a in watched]
    blocks = sys.getallocatedblocks()
    rss = rss_bytes()
    for _ in range(ITERS):
        _call(fn, args, kwargs, exc)
    gc.collect()
    rss_after = rss_bytes()
    blocks_after = sys.getallocatedblocks()
    refs_after = [sys.getrefcount(a) for a in watched]

    assert refs_after == refs, f"{name}: argument refcounts changed {refs} -> {refs_after}"
    assert blocks_after - blocks <= BLOCK_SLACK, (
        f"{name}: allocated blocks grew by {blocks_after - blocks} over {ITERS} calls")
    assert rss_after - rss <= RSS_SLACK_BYTES, (
        f"{name}: RSS grew by {(rss_after - rss) / 2**20:.1f} MiB over {ITERS} calls")


def test_split_views_release_their_base():
    """Each view returned by split holds one reference to the packed array, released with it."""
    packed = np.zeros(24)
    before = sys.getrefcount(packed)
    for _ in range(ITERS):
        a, b = ssmgrad.split(packed, (2, 3), (3, 6))
        assert sys.getrefcount(packed) == before + 2
        del a, b
    assert sys.getrefcount(packed) == before


def test_thread_count_api_no_leak():
    before = ssmgrad.get_num_threads()
    try:
        blocks = sys.getallocatedblocks()
        for i in range(ITERS):
            ssmgrad.set_num_threads(1 + i % 2)
            ssmgrad.get_num_threads()
            try:
                ssmgrad.set_num_threads("x")
            except TypeError:
                pass
        gc.collect()
        assert sys.getallocatedblocks() - blocks <= BLOCK_SLACK
    finally:
        ssmgrad.set_num_threads(before)
