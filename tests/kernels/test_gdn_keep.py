"""The chunked forward's kept chunks, read by the backward: ssmgrad.gated_delta_net(keep_states=True) and
gated_delta_net_back(chunk_states=...) (ssmgrad.h: gdn_fwd_keep_*, gdn_back_kept_*, gdn_chunk_states).

Where the call takes a chunked form (the scalar gate's or the per-channel gate's), the forward keeps per
(sequence, value head) and 64-token chunk what the backward's own pass over the chunks would compute: the
state before the chunk, its rows Y_t = v_t - gamma_t H0^T k_t and delta_t, and its products K K^T and Q K^T
(with the per-channel gate their decays included) and, with the scalar gate, T = (I + A)^-1; the backward
reads them instead of that pass and of recomputing them at every chunk.
- The kept values against the oracle: tests/reference.py's token recurrence in torch (shares no code with
  the kernels) for the states, and the spec's definitions of Y, delta, K K^T, Q K^T and T evaluated on them
  here in float64 NumPy, float64 and float32.
- The backward with them gives the bits of the backward without them, for every case of the chunked
  tests' tables (both gates, both broadcasts), each SIMD pass, 1 and 3 threads, float32 and float64, a
  nonzero gradient on the final-state region; and the forward's output is the plain forward's bits.
- The backward reads them: other values give other gradients; a strided array is read as it stands.
- Where the call takes the recurrence (form, K > 1, the automatic rule) nothing is kept (an empty array)
  and the backward ignores what it is given.
- Bad chunk_states: a wrong shape is a ValueError naming chunk_states with the expected shape, another
  dtype a TypeError; the inputs and chunk_states are never written.
"""

import numpy as np
import pytest
import torch

import _ssmgrad
import ssmgrad
from reference import GDN_NAMES, gdn_args, gdn_out_size, make_gdn_inputs, ref_gated_delta_net, to_torch
from test_gdn_chunked import CASES as SCALAR_CASES
from test_gdn_kda_chunked import CASES as KDA_CASES

C = 64
GATES = {"scalar": (SCALAR_CASES, False), "kda": (KDA_CASES, True)}


def _pad(S):
    return (S + 15) // 16 * 16


def _inputs(rng, gate, case, dtype=np.float64):
    cases, kda = GATES[gate]
    n_seqs, n_seqs_k, n_t, H_v, H_k, S = cases[case]
    return make_gdn_inputs(rng, n_seqs=n_seqs, n_seqs_k=n_seqs_k, n_t=n_t, H_v=H_v, H_k=H_k, S=S, kda=kda,
                           dtype=dtype)


def _part_sizes(S, kda):
    """The kept entry's parts and their elements: H0, Y, Dl, KK, QK, and T with the scalar gate"""
    Sp = _pad(S)
    return [("H0", Sp * Sp), ("Y", C * Sp), ("delta", C * Sp), ("KK", C * C), ("QK", C * C)] + \
        ([] if kda else [("T", C * C)])


def _entry_parts(kept, S, kda):
    """The kept array's parts: H0 (.., Sp, Sp), Y, Dl (.., C, Sp), KK, QK and with the scalar gate T (.., C, C)"""
    Sp = _pad(S)
    lead = kept.shape[:-1]
    at = [0] + [n for _, n in _part_sizes(S, kda)]
    assert kept.shape[-1] == sum(at)
    offs = np.cumsum(at)
    shapes = [(Sp, Sp), (C, Sp), (C, Sp), (C, C), (C, C)] + ([] if kda else [(C, C)])
    return [kept[..., offs[i]:offs[i + 1]].reshape(lead + shapes[i]) for i in range(len(shapes))]


def _oracle(inp, head_bcast="tiled"):
    """The oracle's per-chunk values, float64: H0[n, h, c] (S, S) untransposed, Y, Dl (n_t rows), and per
    chunk KK, QK and T (from the definitions, with the chunk's cumulative gates). With the per-channel gate
    KK and QK have the decays in and KK no diagonal; with the scalar gate they are plain K K^T and Q K^T,
    lower parts with the diagonal, and T = (I + A)^-1, A = strictly lower diag(beta) (K K^T (.) D)."""
    a = {k: inp[k].astype(np.float64) for k in GDN_NAMES}
    n_seqs_k, n_t, H_k, S = a["q"].shape
    n_seqs, H_v = a["v"].shape[0], a["v"].shape[2]
    with torch.no_grad():
        out = ref_gated_delta_net(*(to_torch(a[k]) for k in GDN_NAMES), K=n_t, head_bcast=head_bcast).numpy()
    slots = out[a["v"].size:].reshape(n_t, n_seqs, H_v, S, S)          # slot s: after token n_t - 1 - s
    # after[t]: the state after token t - 1 (after[0] the start state), untransposed: [n, h, i, j]
    after = [a["state"].transpose(0, 1, 3, 2)] + [slots[n_t - 1 - t].transpose(0, 1, 3, 2) for t in range(n_t)]
    heads = np.arange(H_v)
    kh = heads % H_k if head_bcast == "tiled" else heads // (H_v // H_k)
    nk = np.arange(n_seqs) // (n_seqs // n_seqs_k)
    qv, kv = a["q"][nk][:, :, kh], a["k"][nk][:, :, kh]               # (n_seqs, n_t, H_v, S)
    v, g, beta = a["v"], a["g"], a["beta"][..., 0]
    nc = (n_t + C - 1) // C
    H0 = np.stack([after[C * c] for c in range(nc)], 2)               # (n_seqs, H_v, nc, S, S)
    Y, Dl = np.zeros(v.shape), np.zeros(v.shape)
    KK = np.zeros((n_seqs, H_v, nc, C, C))
    QK = np.zeros((n_seqs, H_v, nc, C, C))
    T = np.zeros((n_seqs, H_v, nc, C, C))
    kda = g.shape[-1] > 1
    for c in range(nc):
        t0, t1 = C * c, min(C * (c + 1), n_t)
        G = np.cumsum(g[:, t0:t1], axis=1)                            # (n_seqs, L, H_v, 1 or S)
        for t in range(t0, t1):
            gam = np.exp(G[:, t - t0])                                # (n_seqs, H_v, 1 or S): decays over i
            # Y_t = v_t - (gamma_t (.) H0)^T k_t;  delta_t = beta_t (v_t - (a_t (.) S_{t-1})^T k_t)
            Y[:, t] = v[:, t] - np.einsum("nhij,nhi->nhj", H0[:, :, c], gam * kv[:, t])
            Dl[:, t] = beta[:, t, :, None] * (v[:, t] - np.einsum("nhij,nhi->nhj", after[t],
                                                                  np.exp(g[:, t]) * kv[:, t]))
            for s in range(t0, t + 1):
                e = np.exp(G[:, t - t0] - G[:, s - t0])               # exp(G_t - G_s) per channel
                if kda:
                    if s < t:
                        KK[:, :, c, t - t0, s - t0] = np.sum(kv[:, t] * kv[:, s] * e, -1)
                    QK[:, :, c, t - t0, s - t0] = np.sum(qv[:, t] * kv[:, s] * e, -1)
                else:
                    KK[:, :, c, t - t0, s - t0] = np.sum(kv[:, t] * kv[:, s], -1)
                    QK[:, :, c, t - t0, s - t0] = np.sum(qv[:, t] * kv[:, s], -1)
        if not kda:
            L = t1 - t0
            Gc = G[..., 0].transpose(0, 2, 1)                          # (n_seqs, H_v, L)
            D = np.tril(np.exp(Gc[:, :, :, None] - Gc[:, :, None, :]), -1)
            A = beta[:, t0:t1].transpose(0, 2, 1)[..., None] * KK[:, :, c, :L, :L] * D
            T[:, :, c, :L, :L] = np.linalg.inv(np.eye(L) + A)
    return H0, Y, Dl, KK, QK, T


def _rows(x, n_t, nc):
    """(n_seqs, n_t, H_v, S) rows as the kept layout's (n_seqs, H_v, nc, C, S), zero past n_t"""
    n_seqs, _, H_v, S = x.shape
    r = np.zeros((n_seqs, nc * C, H_v, S))
    r[:, :n_t] = x
    return r.reshape(n_seqs, nc, C, H_v, S).transpose(0, 3, 1, 2, 4)


def _rel(got, want):
    return np.abs(got - want).max() / max(1.0, np.abs(want).max())


# The kept values against the oracle on the same values, relative to max(1, max |ref|). Measured over the
# tables' cases (both gates): float64 2.1e-15 (the states; Y 3.1e-16, delta 7.8e-16, the products 4.4e-16,
# T 2.2e-16), float32 2.7e-7 (the scalar gate's K K^T, its diagonal included; T 9.4e-8, the states 9.5e-8);
# margins 480x (float64 rounding only) and 3.7x.
KEPT_TOL = {np.float64: 1e-12, np.float32: 1e-6}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("gate,case", [(g, c) for g in GATES for c in GATES[g][0]])
def test_kept_values_are_the_chunks(rng, gate, case, dtype):
    inp = _inputs(rng, gate, case, dtype)
    kda = gate == "kda"
    out, kept = ssmgrad.gated_delta_net(*gdn_args(inp), form="chunked", keep_states=True)
    assert np.array_equal(out, ssmgrad.gated_delta_net(*gdn_args(inp), form="chunked"))   # the same output
    n_seqs, n_t, H_v, S = inp["v"].shape
    nc = (n_t + C - 1) // C
    assert kept.shape[:3] == (n_seqs, H_v, nc) and kept.dtype == dtype and kept.ctypes.data % 64 == 0
    parts = _entry_parts(kept, S, kda)
    want = _oracle(inp)
    tol = KEPT_TOL[dtype]
    H0, Y, Dl = parts[:3]
    Sp = _pad(S)
    # padding, and rows past n_t, are zero
    assert not H0[..., S:].any() and not H0[..., S:, :].any() and not Y[..., S:].any() and not Dl[..., S:].any()
    checks = [("H0", H0[..., :S, :S], want[0]), ("Y", Y[..., :S], _rows(want[1], n_t, nc)),
              ("delta", Dl[..., :S], _rows(want[2], n_t, nc))]
    checks += [("KK", parts[3], want[3]), ("QK", parts[4], want[4])] + ([] if kda else [("T", parts[5], want[5])])
    for name, got, ref in checks:
        err = _rel(got, ref)
        assert err <= tol, f"{gate} {case} {name}: {err:.3g} > {tol:.1g}"
    assert Sp * Sp + 2 * C * Sp + (2 if kda else 3) * C * C == kept.shape[-1]


def _back(inp, grad, kept=None, **kw):
    return ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, form="chunked", chunk_states=kept, **kw)


@pytest.mark.parametrize("simd", ["auto", "v4-no-vec64", "x86-64-v3", "x86-64"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("gate", list(GATES))
def test_backward_with_them_is_bitwise_the_backward(rng, force_threads, restore_threads, gate, dtype, simd):
    old = _ssmgrad._set_simd(simd)
    try:
        for case in GATES[gate][0]:
            for bc in ("tiled", "interleaved"):
                inp = _inputs(rng, gate, case, dtype)
                ssmgrad.set_num_threads(1)
                out, kept = ssmgrad.gated_delta_net(*gdn_args(inp), head_bcast=bc, form="chunked", keep_states=True)
                grad = rng.standard_normal(out.shape).astype(dtype)      # the final-state region too
                ssmgrad.set_num_threads(3)
                out3, kept3 = ssmgrad.gated_delta_net(*gdn_args(inp), head_bcast=bc, form="chunked",
                                                      keep_states=True)
                assert np.array_equal(out3, out) and np.array_equal(kept3, kept), (case, bc)
                assert np.array_equal(out, ssmgrad.gated_delta_net(*gdn_args(inp), head_bcast=bc, form="chunked"))
                for nth in (1, 3):
                    ssmgrad.set_num_threads(nth)
                    want = _back(inp, grad, head_bcast=bc)
                    got = _back(inp, grad, kept, head_bcast=bc)
                    assert np.array_equal(got, want), (case, bc, nth)
    finally:
        _ssmgrad._set_simd(old)


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_automatic_form_at_a_real_shape(rng, gate, dtype):
    """S 128, H_v 4 over H_k 2, 2 sequences, 130 tokens (the scalar gate chunked by the automatic rule; the
    per-channel gate asked for): kept and read, the same bits."""
    kda = gate == "kda"
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=130, H_v=4, H_k=2, S=128, kda=kda, dtype=dtype)
    form = "chunked" if kda else "auto"
    out, kept = ssmgrad.gated_delta_net(*gdn_args(inp), form=form, keep_states=True)
    assert kept.shape == (2, 4, 3, 128 * 128 + 2 * 64 * 128 + (2 if kda else 3) * 64 * 64)
    grad = rng.standard_normal(out.shape).astype(dtype)
    assert np.array_equal(_back(inp, grad, kept, head_bcast="tiled") if not kda else
                          ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, form=form, chunk_states=kept),
                          ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, form=form))


@pytest.mark.parametrize("gate", list(GATES))
def test_the_backward_reads_them(rng, gate):
    inp = _inputs(rng, gate, "nt200_S19")
    out, kept = ssmgrad.gated_delta_net(*gdn_args(inp), form="chunked", keep_states=True)
    grad = rng.standard_normal(out.shape)
    want = _back(inp, grad)
    hi = 0
    for name, n in _part_sizes(19, gate == "kda"):
        lo, hi = hi, hi + n
        other = kept.copy()
        other[0, 1, 1, lo:hi] *= 1.5                 # one part of one chunk of one head
        assert not np.array_equal(_back(inp, grad, other), want), name
    assert hi == kept.shape[-1]
    # a strided array is read as it stands (a dense copy)
    wide = np.zeros(kept.shape[:-1] + (2 * kept.shape[-1],))
    wide[..., ::2] = kept
    assert np.array_equal(_back(inp, grad, wide[..., ::2]), want)


@pytest.mark.parametrize("what", ["recurrence", "K2", "auto_short", "auto_kda"])
def test_nothing_kept_where_the_call_takes_the_recurrence(rng, what):
    kda = what == "auto_kda"
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=20 if what == "auto_short" else 70, H_v=2, H_k=1, S=4, kda=kda)
    K = 2 if what == "K2" else 1
    form = "recurrence" if what == "recurrence" else "chunked" if what == "K2" else "auto"
    out, kept = ssmgrad.gated_delta_net(*gdn_args(inp), K=K, form=form, keep_states=True)
    assert kept.shape == (0,)
    assert np.array_equal(out, ssmgrad.gated_delta_net(*gdn_args(inp), K=K, form=form))
    grad = rng.standard_normal(gdn_out_size(inp, K))
    want = ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, K=K, form=form)
    junk = np.full((2, 2, 2, 3), np.nan)             # ignored, whatever it is: the call recomputes
    for given in (kept, junk):
        assert np.array_equal(ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, K=K, form=form,
                                                           chunk_states=given), want)


@pytest.mark.parametrize("gate", list(GATES))
def test_bad_chunk_states(rng, gate):
    inp = _inputs(rng, gate, "nt130_seq_bcast")
    before = {k: v.copy() for k, v in inp.items()}
    out, kept = ssmgrad.gated_delta_net(*gdn_args(inp), form="chunked", keep_states=True)
    H_v, E = kept.shape[1], kept.shape[-1]
    grad = rng.standard_normal(out.shape)
    with pytest.raises(ValueError, match=rf"argument 'chunk_states' has shape \(4, {H_v}, 2, {E}\), "
                                         rf"expected \(4, {H_v}, 3, {E}\)"):
        _back(inp, grad, kept[:, :, :2])
    with pytest.raises(ValueError, match="'chunk_states' must be 4-D"):
        _back(inp, grad, kept.reshape(-1))
    with pytest.raises(TypeError, match="'chunk_states' has dtype float32 but 'q' has dtype float64"):
        _back(inp, grad, kept.astype(np.float32))
    with pytest.raises(TypeError, match="'chunk_states' must be a float32 or float64 array"):
        _back(inp, grad, kept.astype(np.int64))
    with pytest.raises(ValueError, match="keep_states=True returns fresh arrays; out must be None"):
        ssmgrad.gated_delta_net(*gdn_args(inp), form="chunked", keep_states=True, out=np.empty(out.shape))
    kept_before = kept.copy()
    _back(inp, grad, kept)
    assert np.array_equal(kept, kept_before)
    for k, v in before.items():
        assert np.array_equal(inp[k], v), k


@pytest.mark.parametrize("gate", list(GATES))
def test_torch_training_reads_the_forward_chunks(rng, monkeypatch, gate):
    """ssmgrad.torch.gated_delta_net with a gradient wanted runs the forward that keeps the chunks (the scalar
    gate with any form but "recurrence", the per-channel gate with "chunked") and hands them to the backward,
    eager and compiled: the gradients are the bits of the recomputing backward's; without a gradient, and
    with "recurrence", the plain forward."""
    import ssmgrad.torch as st
    kda = gate == "kda"
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=70, H_v=2, H_k=1, S=32, kda=kda)
    form = "chunked" if kda else "auto"
    seen = []
    real_back = ssmgrad.gated_delta_net_back

    def back(*args, chunk_states=None, **kw):
        seen.append(None if chunk_states is None else chunk_states.shape)
        return real_back(*args, chunk_states=chunk_states, **kw)

    monkeypatch.setattr(ssmgrad, "gated_delta_net_back", back)
    tensors = [torch.from_numpy(inp[k]).requires_grad_() for k in GDN_NAMES]

    def f(*ts, form=form):
        return (st.gated_delta_net(*ts, form=form) ** 2).sum()

    grads = torch.autograd.grad(f(*tensors), tensors)
    E = 32 * 32 + 128 * 32 + (8192 if kda else 12288)
    assert seen == [(1, 2, 2, E)]
    torch._dynamo.reset()
    cgrads = torch.autograd.grad(torch.compile(f, fullgraph=True)(*tensors), tensors)
    assert seen[1:] == [(1, 2, 2, E)]
    out = ssmgrad.gated_delta_net(*gdn_args(inp), form=form)
    want = ssmgrad.split(real_back(*gdn_args(inp), 2 * out, form=form), *(inp[k].shape for k in GDN_NAMES))
    for a, b, w in zip(grads, cgrads, want):
        assert torch.equal(a, b) and np.array_equal(a.numpy(), w)
    seen.clear()
    torch.autograd.grad(f(*tensors, form="recurrence"), tensors)
    assert seen == [None]
    torch._dynamo.reset()
