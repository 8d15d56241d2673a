"""Bad input to gated_delta_net / gated_delta_net_back: TypeError for dtypes, ValueError naming the
argument with the expected and the actual shape, nothing computed."""

import re

import numpy as np
import pytest

import ssmgrad
from reference import GDN_NAMES, gdn_out_size, make_gdn_inputs

FNS = ("gated_delta_net", "gated_delta_net_back")


@pytest.fixture
def inp(rng):
    return make_gdn_inputs(rng, n_seqs=4, n_seqs_k=2, n_t=3, H_v=4, H_k=2, S=5, kda=True)


def call(fn, inp, **kw):
    args = [inp[n] for n in GDN_NAMES]
    if fn == "gated_delta_net_back":
        K = kw.get("K", 1)
        args.append(inp.get("grad", np.zeros(gdn_out_size(inp, max(int(K), 1)))))
    return getattr(ssmgrad, fn)(*args, **kw)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("name", GDN_NAMES)
def test_int_dtype(inp, fn, name):
    inp[name] = inp[name].astype(np.int64)
    with pytest.raises(TypeError, match=rf"{fn}: argument '{name}' must be a float32 or float64 array, got dtype int64"):
        call(fn, inp)


@pytest.mark.parametrize("fn", FNS)
def test_mixed_dtypes(inp, fn):
    inp["v"] = inp["v"].astype(np.float32)
    with pytest.raises(TypeError, match=rf"{fn}: argument 'v' has dtype float32 but 'q' has dtype float64"):
        call(fn, inp)


def test_grad_dtype(inp):
    inp["grad"] = np.zeros(gdn_out_size(inp), np.float32)
    with pytest.raises(TypeError, match="argument 'grad' has dtype float32 but 'q' has dtype float64"):
        call("gated_delta_net_back", inp)


# name, bad shape, the message's expected shape and legend
BAD_SHAPES = [
    ("k", (2, 3, 2, 4), r"argument 'k' has shape \(2, 3, 2, 4\), expected \(2, 3, 2, 5\) = \(n_seqs_k, n_t, H_k, S\), the shape of q"),
    ("v", (4, 2, 4, 5), r"argument 'v' has shape \(4, 2, 4, 5\), expected \(4, 3, 4, 5\) = \(n_seqs, n_t, H_v, S\)"),
    ("v", (4, 3, 4, 6), r"argument 'v' has shape \(4, 3, 4, 6\), expected \(4, 3, 4, 5\)"),
    ("g", (4, 3, 4, 2), r"argument 'g' has shape \(4, 3, 4, 2\), expected \(4, 3, 4, 5\) = \(n_seqs, n_t, H_v, 1\) or \(n_seqs, n_t, H_v, S\)"),
    ("g", (4, 3, 2, 1), r"argument 'g' has shape \(4, 3, 2, 1\), expected \(4, 3, 4, 1\)"),
    ("beta", (4, 3, 4, 5), r"argument 'beta' has shape \(4, 3, 4, 5\), expected \(4, 3, 4, 1\) = \(n_seqs, n_t, H_v, 1\)"),
    ("state", (4, 4, 5, 4), r"argument 'state' has shape \(4, 4, 5, 4\), expected \(4, 4, 5, 5\) = \(n_seqs, H_v, S, S\)"),
    ("state", (3, 4, 5, 5), r"argument 'state' has shape \(3, 4, 5, 5\), expected \(4, 4, 5, 5\)"),
]


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("name,shape,msg", BAD_SHAPES, ids=[f"{b[0]}{i}" for i, b in enumerate(BAD_SHAPES)])
def test_bad_shape(inp, fn, name, shape, msg):
    inp[name] = np.zeros(shape)
    with pytest.raises(ValueError, match=rf"{fn}: {msg}"):
        call(fn, inp)


@pytest.mark.parametrize("fn", FNS)
def test_wrong_ndim(inp, fn):
    inp["beta"] = inp["beta"][..., 0]
    with pytest.raises(ValueError, match=rf"{fn}: argument 'beta' must be 4-D \(n_seqs, n_t, H_v, 1\), got shape \(4, 3, 4\)"):
        call(fn, inp)


@pytest.mark.parametrize("fn", FNS)
def test_heads_not_dividing(rng, fn):
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=3, H_v=3, H_k=2, S=4)
    with pytest.raises(ValueError, match=rf"{fn}: argument 'q' has H_k = 2 heads \(its axis 2\), which must be >= 1 "
                                         r"and divide v's H_v = 3"):
        call(fn, inp)


@pytest.mark.parametrize("fn", FNS)
def test_seqs_not_dividing(rng, fn):
    inp = make_gdn_inputs(rng, n_seqs=3, n_seqs_k=2, n_t=3, H_v=2, H_k=1, S=4)
    with pytest.raises(ValueError, match=rf"{fn}: argument 'q' has n_seqs_k = 2 sequences \(its axis 0\), which must "
                                         r"be >= 1 and divide v's n_seqs = 3"):
        call(fn, inp)


@pytest.mark.parametrize("fn", FNS)
def test_bad_K(inp, fn):
    with pytest.raises(ValueError, match=rf"{fn}: K must be >= 1, got 0"):
        call(fn, inp, K=0)
    with pytest.raises(TypeError, match=rf"{fn}: K must be an integer, got float 2.0"):
        call(fn, inp, K=2.0)


@pytest.mark.parametrize("fn", FNS)
def test_bad_head_bcast(inp, fn):
    with pytest.raises(ValueError, match=rf"{fn}: head_bcast must be 'tiled' or 'interleaved', got 'repeat'"):
        call(fn, inp, head_bcast="repeat")


def test_bad_grad_size(inp):
    n = gdn_out_size(inp, 2)
    inp["grad"] = np.zeros(n)
    with pytest.raises(ValueError, match=re.escape(f"gated_delta_net_back: argument 'grad' has shape ({n},), expected "
                                                   f"({gdn_out_size(inp)},) = (N_o + K*N_s,)")):
        call("gated_delta_net_back", inp, K=1)
    inp["grad"] = np.zeros((1, n))
    with pytest.raises(ValueError, match="argument 'grad' must be 1-D"):
        call("gated_delta_net_back", inp, K=2)


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("name", GDN_NAMES)
def test_a_list_takes_the_dtype_of_the_array_arguments(inp, fn, name):
    """A Python list converts to float64 on its own; beside float32 arrays it converts to float32 (as the
    scan's arguments do), instead of a dtype error that blames an array argument: the same bytes as the
    call with the array."""
    args = [inp[n].astype(np.float32) for n in GDN_NAMES]
    if fn == "gated_delta_net_back":
        args.append(np.random.default_rng(3).standard_normal(gdn_out_size(inp)).astype(np.float32))
    want = getattr(ssmgrad, fn)(*args)
    i = GDN_NAMES.index(name)
    args[i] = args[i].tolist()
    got = getattr(ssmgrad, fn)(*args)
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes()


# ---------------------------------------------------------------- out= (a reused output buffer)

@pytest.mark.parametrize("K", [1, 5])
def test_out_same_result(rng, K):
    """out= receives the packed result: the same bits as a fresh output, whatever the buffer held
    (the unwritten slots s >= n_t are 0 there too), and it is the array returned."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=3, H_v=4, H_k=2, S=32, dtype=np.float32)
    want = ssmgrad.gated_delta_net(*(inp[n] for n in GDN_NAMES), K=K)
    buf = np.full(want.shape, np.nan, np.float32)
    got = ssmgrad.gated_delta_net(*(inp[n] for n in GDN_NAMES), K=K, out=buf)
    assert got is buf
    np.testing.assert_array_equal(got, want)


def test_out_bad(inp):
    n = gdn_out_size(inp)
    with pytest.raises(TypeError, match=r"gated_delta_net: argument 'out' must have the inputs' dtype float64"):
        call("gated_delta_net", inp, out=np.zeros(n, np.float32))
    with pytest.raises(TypeError, match=r"gated_delta_net: argument 'out' must be a numpy.ndarray or None"):
        call("gated_delta_net", inp, out=[0.0] * n)
    with pytest.raises(ValueError, match=rf"gated_delta_net: argument 'out' has shape \({n + 1},\), expected \({n},\)"):
        call("gated_delta_net", inp, out=np.zeros(n + 1))
    with pytest.raises(ValueError, match=r"gated_delta_net: argument 'out' must be C-contiguous, aligned and writeable"):
        call("gated_delta_net", inp, out=np.zeros(2 * n)[::2])
    big = np.zeros(n + inp["state"].size)
    inp["state"] = big[n - 1:n - 1 + inp["state"].size].reshape(inp["state"].shape)   # one shared element
    with pytest.raises(ValueError, match=r"gated_delta_net: argument 'out' overlaps the memory of argument 'state'"):
        call("gated_delta_net", inp, out=big[:n])
