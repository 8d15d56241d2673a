"""SSM_CONV forward and both backwards (d_sx, d_c) against the float64 oracles."""

import numpy as np
import pytest

import ssmgrad
from reference import assert_close, fd_vjp, np_ssm_conv, ref_conv_grads, ref_conv_np

FWD_TOL = dict(atol=1e-13, rtol=1e-12)
GRAD_TOL = dict(atol=1e-12, rtol=1e-11)
FD_TOL = dict(atol=1e-7, rtol=1e-7)        # conv is linear in each argument: FD is nearly exact
F32_TOL = 2e-6                             # float32: within F32_TOL * (1 + max |value|); measured ~6e-8


def conv_inputs(rng, n_s, d_inner, d_conv, n_t, dtype=np.float64):
    sx = rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)).astype(dtype)
    c = rng.standard_normal((d_inner, d_conv)).astype(dtype)
    grad = rng.standard_normal((n_s, n_t, d_inner)).astype(dtype)
    return sx, c, grad


# (n_s, d_inner, d_conv, n_t): n_t 1, n_t > d_conv, several d_conv
SHAPES = [
    (1, 3, 4, 1), (2, 5, 4, 1), (2, 5, 4, 7), (3, 4, 2, 5), (2, 3, 3, 6), (1, 6, 5, 9),
    (2, 4, 1, 3), (2, 4, 6, 2), (1, 1, 4, 4),
    (2, 37, 4, 9),     # enough channels for vector loops, with a remainder
]


@pytest.mark.parametrize("shape", SHAPES)
def test_forward(rng, shape):
    sx, c, _ = conv_inputs(rng, *shape)
    y = ssmgrad.ssm_conv(sx, c)
    n_s, d_inner, d_conv, n_t = shape
    assert y.shape == (n_s, n_t, d_inner) and y.dtype == np.float64
    assert_close(y, ref_conv_np(sx, c), name="y vs torch reference", **FWD_TOL)
    assert_close(y, np_ssm_conv(sx, c), name="y vs numpy loop", **FWD_TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_vs_autograd(rng, shape):
    sx, c, grad = conv_inputs(rng, *shape)
    ref = ref_conv_grads(sx, c, grad)
    d_sx = ssmgrad.ssm_conv_back(sx, c, grad)
    d_c = ssmgrad.ssm_conv_back_weight(sx, c, grad)
    assert d_sx.shape == sx.shape and d_sx.dtype == np.float64
    assert d_c.shape == c.shape and d_c.dtype == np.float64
    assert_close(d_sx, ref["sx"], name="d_sx vs autograd", **GRAD_TOL)
    assert_close(d_c, ref["c"], name="d_c vs autograd", **GRAD_TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_vs_finite_differences(rng, one_thread, shape):
    """A plumbing check, not an oracle: the finite differences are those of ssmgrad's own forward,
    so they show the backward is the derivative of the forward, not that either is right. The
    oracles are tests/reference.py's torch reference (test_backward_vs_autograd) and NumPy loops."""
    sx, c, grad = conv_inputs(rng, *shape)
    fd_sx = fd_vjp(ssmgrad.ssm_conv, [sx, c], 0, grad)
    fd_c = fd_vjp(ssmgrad.ssm_conv, [sx, c], 1, grad)
    assert_close(ssmgrad.ssm_conv_back(sx, c, grad), fd_sx, name="d_sx vs finite differences", **FD_TOL)
    assert_close(ssmgrad.ssm_conv_back_weight(sx, c, grad), fd_c, name="d_c vs finite differences", **FD_TOL)


def _layouts(rng, sx):
    """The values of ``sx`` in several non-contiguous layouts."""
    n_s, d_inner, L = sx.shape
    step = np.zeros((n_s, d_inner, 2 * L))
    step[..., ::2] = sx
    transposed = np.ascontiguousarray(sx.transpose(0, 2, 1)).transpose(0, 2, 1)  # channel axis fastest
    wide = np.zeros((n_s + 1, d_inner + 2, L + 3))
    wide[1:, 2:, 3:] = sx
    flipped = np.ascontiguousarray(sx[:, ::-1, ::-1])[:, ::-1, ::-1]
    return {"step": step[..., ::2], "transposed": transposed, "subarray": wide[1:, 2:, 3:],
            "negative": flipped, "fortran": np.asfortranarray(sx)}


@pytest.mark.parametrize("layout", ["step", "transposed", "subarray", "negative", "fortran"])
@pytest.mark.parametrize("shape", [(2, 5, 4, 7), (3, 4, 2, 1)])
def test_non_contiguous(rng, layout, shape):
    sx, c, grad = conv_inputs(rng, *shape)
    v = _layouts(rng, sx)[layout]
    np.testing.assert_array_equal(v, sx)
    assert not v.flags.c_contiguous
    ref = ref_conv_grads(sx, c, grad)
    cT = np.asfortranarray(c)
    gT = np.ascontiguousarray(grad[..., ::-1])[..., ::-1]     # a negative-stride view, same values
    assert gT.strides[2] < 0
    for cc, gg in ((c, grad), (cT, gT)):
        assert_close(ssmgrad.ssm_conv(v, cc), ref_conv_np(sx, c), name=f"y ({layout})", **FWD_TOL)
        assert_close(ssmgrad.ssm_conv_back(v, cc, gg), ref["sx"], name=f"d_sx ({layout})", **GRAD_TOL)
        assert_close(ssmgrad.ssm_conv_back_weight(v, cc, gg), ref["c"], name=f"d_c ({layout})", **GRAD_TOL)


@pytest.mark.parametrize("n_s,n_t", [(2, 0), (0, 3), (0, 0)])
def test_empty(rng, n_s, n_t):
    sx, c, grad = conv_inputs(rng, n_s, 3, 4, n_t)
    y = ssmgrad.ssm_conv(sx, c)
    assert y.shape == (n_s, n_t, 3) and y.dtype == np.float64
    d_sx = ssmgrad.ssm_conv_back(sx, c, grad)
    d_c = ssmgrad.ssm_conv_back_weight(sx, c, grad)
    assert d_sx.shape == sx.shape and np.all(d_sx == 0)
    assert d_c.shape == c.shape and np.all(d_c == 0)


@pytest.mark.parametrize("shape", [(2, 5, 4, 1), (2, 5, 4, 7), (3, 8, 3, 9), (2, 37, 4, 9)])
def test_float32_close_to_float64(rng, shape):
    sx, c, grad = conv_inputs(rng, *shape, dtype=np.float32)
    y = ssmgrad.ssm_conv(sx, c)
    d_sx = ssmgrad.ssm_conv_back(sx, c, grad)
    d_c = ssmgrad.ssm_conv_back_weight(sx, c, grad)
    assert y.dtype == d_sx.dtype == d_c.dtype == np.float32
    ref_y = ref_conv_np(sx, c)
    ref = ref_conv_grads(sx, c, grad)
    for got, want, name in ((y, ref_y, "y"), (d_sx, ref["sx"], "d_sx"), (d_c, ref["c"], "d_c")):
        assert_close(got, want, atol=F32_TOL * (1 + np.abs(want).max()), rtol=0, name=f"{name} float32")


# float32 shapes that reach the cache-blocked AVX-512 kernels (csrc/ssm_conv_blk_body.h) where the
# CPU has AVX-512: channels in whole vectors and not, windows of 256 tokens crossed, several
# d_conv up to the longest they take (16) and one past it, and an 8 MB output. With d_conv 4
# the kernels take 64 channels (4 vectors) at a time and 16 for the rest, and write a y of
# at least 4 MiB with streaming stores when its rows are whole vectors: (1, 512, 4, 4200),
# (2, 256, 4, 2100) do, (1, 1000, 4, 1100) has groups, a tail of 40 channels and a 4.4 MB y
# written with plain stores (1000 is no multiple of 16). Without
# AVX-512 (or with SSMGRAD_NO_AVX512, see test_generic_kernels.py) the same cases run the
# kernels of ssm_conv_body.h.
BLOCKED_SHAPES = [
    (2, 100, 4, 600), (1, 64, 4, 513), (2, 37, 3, 257), (1, 48, 1, 40), (1, 48, 16, 300),
    (1, 33, 17, 50), (3, 16, 2, 15), (1, 512, 4, 4200), (2, 256, 4, 2100), (1, 1000, 4, 1100),
]


def _np_conv_all(sx, c, grad):
    """y, d_sx, d_c in float64 with whole-array numpy operations (the torch reference takes
    minutes at these sizes); checked against the torch reference in test_np_conv_all_oracle."""
    sx, c, grad = (a.astype(np.float64) for a in (sx, c, grad))
    n_s, d_inner, L = sx.shape
    d_conv = c.shape[1]
    n_t = L - (d_conv - 1)
    y = np.zeros((n_s, n_t, d_inner))
    d_sx = np.zeros_like(sx)
    d_c = np.zeros_like(c)
    gT = grad.transpose(0, 2, 1)                                   # (n_s, d_inner, n_t)
    for k in range(d_conv):
        y += (sx[:, :, k:k + n_t] * c[None, :, k:k + 1]).transpose(0, 2, 1)
        d_sx[:, :, k:k + n_t] += gT * c[None, :, k:k + 1]
        d_c[:, k] = np.einsum("sit,sit->i", gT, sx[:, :, k:k + n_t])
    return y, d_sx, d_c


def test_np_conv_all_oracle(rng):
    sx, c, grad = conv_inputs(rng, 2, 7, 3, 11)
    y, d_sx, d_c = _np_conv_all(sx, c, grad)
    ref = ref_conv_grads(sx, c, grad)
    assert_close(y, ref_conv_np(sx, c), name="numpy y", **FWD_TOL)
    assert_close(d_sx, ref["sx"], name="numpy d_sx", **GRAD_TOL)
    assert_close(d_c, ref["c"], name="numpy d_c", **GRAD_TOL)


@pytest.mark.parametrize("shape", BLOCKED_SHAPES)
def test_float32_blocked_shapes(rng, shape):
    sx, c, grad = conv_inputs(rng, *shape, dtype=np.float32)
    y = ssmgrad.ssm_conv(sx, c)
    d_sx = ssmgrad.ssm_conv_back(sx, c, grad)
    d_c = ssmgrad.ssm_conv_back_weight(sx, c, grad)
    for got, want, name in zip((y, d_sx, d_c), _np_conv_all(sx, c, grad), ("y", "d_sx", "d_c")):
        assert got.dtype == np.float32 and got.shape == want.shape
        assert_close(got, want, atol=F32_TOL * (1 + np.abs(want).max()), rtol=0, name=f"{name} float32 {shape}")


@pytest.mark.parametrize("shape", [(2, 100, 4, 600), (1, 512, 4, 4200), (2, 37, 3, 257)])
def test_float32_blocked_any_thread_count(rng, restore_threads, shape):
    sx, c, grad = conv_inputs(rng, *shape, dtype=np.float32)
    ssmgrad.set_num_threads(1)
    want = (ssmgrad.ssm_conv(sx, c), ssmgrad.ssm_conv_back(sx, c, grad), ssmgrad.ssm_conv_back_weight(sx, c, grad))
    for n in (2, 3, 5):
        ssmgrad.set_num_threads(n)
        got = (ssmgrad.ssm_conv(sx, c), ssmgrad.ssm_conv_back(sx, c, grad), ssmgrad.ssm_conv_back_weight(sx, c, grad))
        for g, w, name in zip(got, want, ("y", "d_sx", "d_c")):
            assert g.tobytes() == w.tobytes(), f"{name}: {n} threads differ from 1 thread at {shape}"


@pytest.mark.parametrize("shift", [0, 1, 5, 15])
def test_float32_streamed_y_at_any_alignment(rng, restore_threads, shift):
    # y of 4.2 MB with 256 channels: streamed, from the first channel at which y's rows are
    # 64-byte aligned; out= buffers shifted by `shift` floats from a 64-byte boundary move that
    # channel, and the thread splits move the group boundaries. Same bits as a fresh result,
    # and within float32 rounding of the float64 oracle.
    sx, c, grad = conv_inputs(rng, 1, 256, 4, 4100, dtype=np.float32)
    want = _np_conv_all(sx, c, grad)[0]
    n = 4100 * 256
    raw = np.full(n + 32, np.nan, np.float32)
    base = (-raw.ctypes.data // 4) % 16                      # floats to the first 64-byte boundary
    out = raw[base + shift:base + shift + n].reshape(1, 4100, 256)
    assert out.ctypes.data % 64 == 4 * shift
    fresh = None
    for thr in (1, 2, 3):
        ssmgrad.set_num_threads(thr)
        got = ssmgrad.ssm_conv(sx, c, out=out)
        assert got is out
        assert_close(out, want, atol=F32_TOL * (1 + np.abs(want).max()), rtol=0, name=f"y shift {shift} {thr}T")
        fresh = ssmgrad.ssm_conv(sx, c) if fresh is None else fresh
        assert out.tobytes() == fresh.tobytes(), f"y into a buffer shifted by {shift} floats, {thr} threads"
        out.fill(np.nan)
    assert np.isnan(raw[:base + shift]).all() and np.isnan(raw[base + shift + n:]).all()


def test_python_sequences(rng):
    sx, c, grad = conv_inputs(rng, 2, 3, 4, 3)
    assert ssmgrad.ssm_conv(sx.tolist(), c.tolist()).tobytes() == ssmgrad.ssm_conv(sx, c).tobytes()
    assert ssmgrad.ssm_conv_back(sx.tolist(), c.tolist(), grad.tolist()).tobytes() == \
        ssmgrad.ssm_conv_back(sx, c, grad).tobytes()
    assert ssmgrad.ssm_conv_back_weight(sx.tolist(), c.tolist(), grad.tolist()).tobytes() == \
        ssmgrad.ssm_conv_back_weight(sx, c, grad).tobytes()


def test_conv_then_scan_chain(rng):
    # the Mamba-2 layer order: conv over xBC channels, then the scan over views of its output;
    # the chained VJP (scan_back -> conv_back) equals autograd through both references
    import torch
    from reference import ref_ssm_conv, ref_ssm_scan, to_torch
    n_s, n_t, d_conv, n_head, head_dim, d_state = 2, 3, 4, 2, 2, 2
    d_inner, G = n_head * head_dim, d_state
    ch = d_inner + 2 * G
    sx = rng.standard_normal((n_s, ch, d_conv - 1 + n_t))
    c = rng.standard_normal((ch, d_conv))
    s = rng.standard_normal((n_s, n_head, head_dim, d_state))
    dt = rng.uniform(-2, 1, (n_s, n_t, n_head))
    A = -rng.uniform(0.2, 1.5, (n_head, 1))
    ids = np.arange(n_s)
    xBC = ssmgrad.ssm_conv(sx, c)                          # (n_s, n_t, ch)
    x = xBC[..., :d_inner].reshape(n_s, n_t, n_head, head_dim)
    B = xBC[..., d_inner:d_inner + G].reshape(n_s, n_t, 1, d_state)
    C = xBC[..., d_inner + G:].reshape(n_s, n_t, 1, d_state)
    out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
    grad = rng.standard_normal(out.size)
    gin = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad)
    _, d_x, _, d_B, d_C = ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)
    d_xBC = np.concatenate([d_x.reshape(n_s, n_t, -1), d_B.reshape(n_s, n_t, -1), d_C.reshape(n_s, n_t, -1)], -1)
    d_sx = ssmgrad.ssm_conv_back(sx, c, d_xBC)

    tsx = to_torch(sx, requires_grad=True)
    ty = ref_ssm_conv(tsx, to_torch(c))
    tx = ty[..., :d_inner].reshape(n_s, n_t, n_head, head_dim)
    tB = ty[..., d_inner:d_inner + G].reshape(n_s, n_t, 1, d_state)
    tC = ty[..., d_inner + G:].reshape(n_s, n_t, 1, d_state)
    tout = ref_ssm_scan(to_torch(s), tx, to_torch(dt), to_torch(A), tB, tC, ids)
    assert_close(out, tout.detach().numpy(), name="out (conv -> scan)", atol=1e-12, rtol=1e-10)
    (tout * torch.from_numpy(grad)).sum().backward()
    ref = tsx.grad.numpy()
    assert_close(d_sx, ref, name="d_sx through conv -> scan", atol=1e-11 * max(1, np.abs(ref).max()), rtol=1e-9)


# --------------------------------------------------------------------------- out=

_OUT_FNS = {
    "ssm_conv": (lambda sx, c, g, **kw: ssmgrad.ssm_conv(sx, c, **kw), lambda sx, c, g: (sx.shape[0], g.shape[1], sx.shape[1])),
    "ssm_conv_back": (lambda sx, c, g, **kw: ssmgrad.ssm_conv_back(sx, c, g, **kw), lambda sx, c, g: sx.shape),
    "ssm_conv_back_weight": (lambda sx, c, g, **kw: ssmgrad.ssm_conv_back_weight(sx, c, g, **kw),
                             lambda sx, c, g: c.shape),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 5, 4, 7), (1, 64, 4, 513), (2, 37, 3, 257)])
@pytest.mark.parametrize("fn", sorted(_OUT_FNS))
def test_out_receives_the_result(rng, restore_threads, fn, shape, dtype):
    # the blocked float32 kernels and the generic ones write every element of a reused buffer
    # (filled with NaN first), with the same bits as a fresh result, at any thread count
    call, out_shape = _OUT_FNS[fn]
    sx, c, grad = conv_inputs(rng, *shape, dtype=dtype)
    want = call(sx, c, grad)
    sx0, c0, g0 = sx.copy(), c.copy(), grad.copy()
    out = np.full(out_shape(sx, c, grad), np.nan, dtype=dtype)
    for n in (1, 2, 3):
        ssmgrad.set_num_threads(n)
        got = call(sx, c, grad, out=out)
        assert got is out
        assert out.tobytes() == want.tobytes(), f"{fn} out= differs from the fresh result ({n} threads)"
        out.fill(np.nan)
    for a, a0 in ((sx, sx0), (c, c0), (grad, g0)):
        assert a.tobytes() == a0.tobytes()


@pytest.mark.parametrize("fn", sorted(_OUT_FNS))
def test_out_bad(rng, fn):
    call, out_shape = _OUT_FNS[fn]
    sx, c, grad = conv_inputs(rng, 2, 5, 4, 7, dtype=np.float32)
    shape = out_shape(sx, c, grad)
    with pytest.raises(TypeError, match="'out' must be a numpy.ndarray"):
        call(sx, c, grad, out=np.zeros(shape, np.float32).tolist())
    with pytest.raises(TypeError, match="'out' must have the inputs' dtype float32"):
        call(sx, c, grad, out=np.zeros(shape, np.float64))
    wrong = shape[:-1] + (shape[-1] + 1,)
    with pytest.raises(ValueError, match=r"'out' has shape .*, expected \(" + ", ".join(map(str, shape))):
        call(sx, c, grad, out=np.zeros(wrong, np.float32))
    with pytest.raises(ValueError, match="'out' has shape"):
        call(sx, c, grad, out=np.zeros(shape + (1,), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        call(sx, c, grad, out=np.zeros(shape[::-1], np.float32).T)
    ro = np.zeros(shape, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        call(sx, c, grad, out=ro)
    # out sharing bytes with an input it reads: refused, and the input is left as it was
    names = {"ssm_conv": ("sx", "c"), "ssm_conv_back": ("c", "grad"), "ssm_conv_back_weight": ("sx", "grad")}[fn]
    for name in names:
        src = {"sx": sx, "c": c, "grad": grad}[name]
        n_out = int(np.prod(shape))
        buf = np.zeros(src.size + n_out, np.float32)
        buf[:src.size] = src.ravel()
        alias = buf[:src.size].reshape(src.shape)
        args = {"sx": sx, "c": c, "grad": grad, name: alias}
        before = alias.copy()
        with pytest.raises(ValueError, match=f"'out' overlaps the memory of argument '{name}'"):
            call(args["sx"], args["c"], args["grad"], out=buf[src.size - 1:src.size - 1 + n_out].reshape(shape))
        assert alias.tobytes() == before.tobytes()
        # right after it (no shared byte) is fine
        got = call(args["sx"], args["c"], args["grad"], out=buf[src.size:].reshape(shape))
        assert got.tobytes() == call(sx, c, grad).tobytes()
