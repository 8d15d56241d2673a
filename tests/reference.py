"""Oracles for the ssmgrad tests, written from the spec (docs/ssm-ops.md).

Two independent oracles, both in float64:

* the torch reference (``ref_ssm_conv``, ``ref_ssm_scan``; benchmarks/ and examples/ load this
  file by path to validate against the same one) that loops over tokens and lets torch.autograd
  produce the vector-Jacobian products (``ref_conv_grads``,
  ``ref_scan_grads``). A vector-Jacobian product (VJP) of f at x with g is g^T J_f(x): what a
  backward pass returns for the upstream gradient g;
* pure NumPy: the forwards (``np_ssm_conv``, ``np_ssm_scan``), their hand-written backwards
  (``np_ssm_conv_back``, ``np_ssm_conv_back_weight``, ``np_ssm_scan_back``: the spec's reverse
  recurrence) and a central finite-difference VJP (``fd_vjp``) that needs no torch at all.

Shape legend (NumPy order, ggml ``ne`` reversed):
    sx  (n_s, d_inner, d_conv-1+n_t)        c  (d_inner, d_conv)        y (n_s, n_t, d_inner)
    s   (n_rs, n_head, head_dim, d_state)   x  (n_seqs, n_t, n_head, head_dim)
    dt  (n_seqs, n_t, n_head)               A  (n_head, d_state) Mamba-1 | (n_head, 1) Mamba-2
    B,C (n_seqs, n_t, n_group, d_state)     ids (n_seqs,) ints in [0, n_rs)
    out 1-D [y | K state slots (K, n_seqs, n_head, head_dim, d_state)]
"""

import numpy as np

SOFTPLUS_THRESHOLD = 20.0


def to_torch(a, requires_grad=False):
    """A float64 torch tensor holding a copy of ``a`` (never shares memory with it)."""
    import torch
    t = torch.tensor(np.array(a, dtype=np.float64, copy=True), dtype=torch.float64)
    return t.requires_grad_(requires_grad)


def _ids_tensor(ids, n_seqs):
    import torch
    if isinstance(ids, torch.Tensor):
        ids = ids.to(torch.int64).reshape(-1)
    else:                                                        # a NumPy array (any strides) or a list
        ids = torch.tensor([int(i) for i in ids], dtype=torch.int64)
    if ids.shape != (n_seqs,):
        raise ValueError(f"ids: expected {n_seqs} ids, got shape {tuple(ids.shape)}")
    return ids


def scan_states(s, x, dt, A, B, C, ids, K=1):
    """The spec's recurrence token by token, in torch (imported here, so that the NumPy oracles serve
    processes without it): (y, slots), slots[k] the state after n_t-k tokens (k = 0: the final
    state; k >= n_t, k >= 1: zeros). Per token t and head h (group g = h // (n_head // n_group)):
        d = softplus(dt[t, h]);  H = H * exp(d * A[h]) + (d * x[t, h]) outer B[t, g];  y[t, h] = H . C[t, g]
    Each token's inputs are taken once with unbind (indexing inside the loop makes autograd
    accumulate a full-size gradient per token)."""
    import torch
    import torch.nn.functional as F
    n_seqs, n_t, n_head, head_dim = x.shape
    group = torch.arange(n_head) // (n_head // B.shape[2])      # the group of each head
    Bh, Ch = B[:, :, group, None, :], C[:, :, group, None, :]    # (n_seqs, n_t, n_head, 1, d_state)
    H = s[_ids_tensor(ids, n_seqs)]                              # (n_seqs, n_head, head_dim, d_state)
    states, ys = [H], []
    for x_t, dt_t, B_t, C_t in zip(x.unbind(1), dt.unbind(1), Bh.unbind(1), Ch.unbind(1)):
        d = F.softplus(dt_t, threshold=SOFTPLUS_THRESHOLD)[:, :, None]   # (n_seqs, n_head, 1)
        H = H * torch.exp(d * A)[:, :, None, :] + (d * x_t)[..., None] * B_t
        ys.append((H * C_t).sum(-1))                             # (n_seqs, n_head, head_dim)
        states.append(H)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)
    slots = [states[n_t - k] if k == 0 or k < n_t else torch.zeros_like(H) for k in range(K)]
    return y, slots


def ref_ssm_scan(s, x, dt, A, B, C, ids, K=1):
    """The scan reference: packed 1-D [y | K state slots] (slot k: the state after n_t-k tokens,
    zeros for k >= n_t, k >= 1); ``s`` is gathered by ``ids`` (its gradient scatter-adds); ids a
    tensor, an array or a list. Torch tensors in, a torch tensor out."""
    import torch
    y, slots = scan_states(s, x, dt, A, B, C, ids, K)
    return torch.cat([y.reshape(-1)] + [st.reshape(-1) for st in slots])


def ref_ssm_conv(sx, c):
    """The conv reference: y[s, t, i] = sum_k sx[s, i, t+k] * c[i, k]; torch tensors
    sx (n_s, d_inner, d_conv-1+n_t), c (d_inner, d_conv) -> y (n_s, n_t, d_inner)."""
    import torch
    n_s, d_inner, n_cols = sx.shape
    if n_cols < c.shape[1]:                                      # n_t = 0: unfold needs one window
        return sx.new_zeros((n_s, 0, d_inner))
    windows = sx.unfold(2, c.shape[1], 1)                        # (n_s, d_inner, n_t, d_conv)
    return torch.einsum("sitk,ik->sti", windows, c)


def _vjp(f, named, grad):
    """Gradients of sum(f(**tensors) * grad) w.r.t. each numpy array in ``named`` (float64)."""
    import torch
    tensors = {k: to_torch(v, requires_grad=True) for k, v in named.items()}
    out = f(**tensors)
    g = to_torch(grad).reshape(out.shape)
    leaves = list(tensors.values())
    if out.requires_grad:
        grads = torch.autograd.grad((out * g).sum(), leaves, allow_unused=True)
    else:
        grads = [None] * len(leaves)
    res = {}
    for (k, v), gr in zip(tensors.items(), grads):
        res[k] = np.zeros(v.shape) if gr is None else gr.detach().numpy().astype(np.float64)
    return res


def ref_conv_grads(sx, c, grad):
    """{'sx': d_sx, 'c': d_c} as float64 numpy arrays, via torch.autograd."""
    return _vjp(ref_ssm_conv, {"sx": sx, "c": c}, grad)


def ref_scan_grads(s, x, dt, A, B, C, ids, grad, K=1):
    """{'s','x','dt','A','B','C'} float64 numpy VJPs of ``ref_ssm_scan`` with the packed ``grad``."""
    def f(s, x, dt, A, B, C):
        return ref_ssm_scan(s, x, dt, A, B, C, ids, K=K)
    return _vjp(f, {"s": s, "x": x, "dt": dt, "A": A, "B": B, "C": C}, grad)


def ref_conv_np(sx, c):
    """Forward of the torch reference as a float64 numpy array."""
    import torch
    with torch.no_grad():
        return ref_ssm_conv(to_torch(sx), to_torch(c)).numpy()


def ref_scan_np(s, x, dt, A, B, C, ids, K=1):
    """Forward of the torch reference as a float64 numpy array (1-D packed)."""
    import torch
    with torch.no_grad():
        return ref_ssm_scan(*(to_torch(a) for a in (s, x, dt, A, B, C)), ids, K=K).numpy()


# ---------------------------------------------------------------------------------------------
# Pure NumPy oracles (no torch autograd): float64 recurrences written from the spec, vectorised
# over sequences and heads but looping over tokens (fast enough for 8192 tokens), the backward as
# the spec's reverse recurrence; central finite differences. IEEE arithmetic throughout (errstate
# ignores overflow/invalid), so NaN/Inf inputs propagate as the spec's formulas say.

def np_softplus(v):
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(v <= SOFTPLUS_THRESHOLD, np.log1p(np.exp(np.minimum(v, SOFTPLUS_THRESHOLD))), v)


def np_softplus_deriv(v):
    v = np.asarray(v, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        sig = 1.0 / (1.0 + np.exp(-np.minimum(v, SOFTPLUS_THRESHOLD)))
    return np.where(v <= SOFTPLUS_THRESHOLD, sig, 1.0)


def np_ssm_conv(sx, c):
    """y (n_s, n_t, d_inner) = sum_k sx[:, :, t+k] * c[:, k]."""
    sx = np.asarray(sx, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    n_s, d_inner, n_cols = sx.shape
    d_conv = c.shape[1]
    n_t = n_cols - (d_conv - 1)
    y = np.zeros((n_s, n_t, d_inner))
    with np.errstate(all="ignore"):
        for k in range(d_conv):
            y = y + np.transpose(sx[:, :, k:k + n_t], (0, 2, 1)) * c[:, k]
    return y


def np_ssm_conv_back(sx, c, g):
    """d_sx of sum(np_ssm_conv(sx, c) * g)."""
    sx = np.asarray(sx, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    n_t = g.shape[1]
    d_sx = np.zeros(sx.shape)
    with np.errstate(all="ignore"):
        for k in range(c.shape[1]):
            d_sx[:, :, k:k + n_t] += np.transpose(g, (0, 2, 1)) * c[:, k][None, :, None]
    return d_sx


def np_ssm_conv_back_weight(sx, c, g):
    """d_c of sum(np_ssm_conv(sx, c) * g)."""
    sx = np.asarray(sx, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    n_t = g.shape[1]
    d_c = np.zeros(np.shape(c))
    with np.errstate(all="ignore"):
        for k in range(d_c.shape[1]):
            d_c[:, k] = np.einsum("sti,sit->i", g, sx[:, :, k:k + n_t])
    return d_c


def _np_scan_prep(s, x, dt, A, B, C, ids):
    s, x, dt, A, B, C = (np.asarray(a, dtype=np.float64) for a in (s, x, dt, A, B, C))
    ids = np.asarray(ids).astype(np.int64).reshape(-1)
    n_head = s.shape[1]
    n_group = B.shape[2]
    gidx = np.arange(n_head) // max(1, n_head // max(1, n_group))
    return s, x, dt, A, B, C, ids, gidx


def np_ssm_scan(s, x, dt, A, B, C, ids, K=1, keep_states=False):
    """Packed [y | K slots] in float64; with keep_states also returns H_t for t = 0..n_t
    (shape (n_t+1, n_seqs, n_head, head_dim, d_state)), the decays a_t (index t-1) and sp."""
    s, x, dt, A, B, C, ids, gidx = _np_scan_prep(s, x, dt, A, B, C, ids)
    n_rs, n_head, head_dim, d_state = s.shape
    n_seqs, n_t = x.shape[:2]
    sp = np_softplus(dt)                                          # (n_seqs, n_t, n_head)
    H = s[ids].copy() if n_seqs else np.zeros((0, n_head, head_dim, d_state))
    y = np.zeros(x.shape)
    slots = np.zeros((K, n_seqs, n_head, head_dim, d_state))
    Hs = [H] if keep_states else None
    decays = [] if keep_states else None
    with np.errstate(all="ignore"):
        for t in range(n_t):
            a = np.exp(sp[:, t, :, None] * A[None])               # (n_seqs, n_head, d_state|1)
            Bt = B[:, t][:, gidx]                                 # (n_seqs, n_head, d_state)
            Ct = C[:, t][:, gidx]
            H = H * a[:, :, None, :] + Bt[:, :, None, :] * (x[:, t] * sp[:, t, :, None])[..., None]
            y[:, t] = (H * Ct[:, :, None, :]).sum(-1)
            k = n_t - (t + 1)
            if 1 <= k < K:
                slots[k] = H
            if keep_states:
                Hs.append(H)
                decays.append(a)
    slots[0] = H
    out = np.concatenate([y.ravel(), slots.ravel()])
    if keep_states:
        return out, Hs, decays, sp
    return out


def np_ssm_scan_back(s, x, dt, A, B, C, ids, grad, K=1):
    """Reverse recurrence of the spec (section 3 'Backward' and 6): float64 dict of gradients
    {'s','x','dt','A','B','C'}."""
    _, Hs, decays, sp = np_ssm_scan(s, x, dt, A, B, C, ids, K=K, keep_states=True)
    s, x, dt, A, B, C, ids, gidx = _np_scan_prep(s, x, dt, A, B, C, ids)
    n_rs, n_head, head_dim, d_state = s.shape
    n_seqs, n_t = x.shape[:2]
    n_group = B.shape[2]
    grad = np.asarray(grad, dtype=np.float64).reshape(-1)
    n_y = x.size
    Gy = grad[:n_y].reshape(x.shape)
    GS = grad[n_y:].reshape(K, n_seqs, n_head, head_dim, d_state)
    d = {k: np.zeros(v.shape) for k, v in (("s", s), ("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C))}
    mamba2 = A.shape[1] == 1

    def group_sum(v):                                             # (n_seqs, n_head, d_state) -> groups
        return v.reshape(n_seqs, n_group, n_head // n_group, d_state).sum(2)

    L = GS[0].copy()
    with np.errstate(all="ignore"):
        for t in range(n_t, 0, -1):                               # token index i = t-1
            i = t - 1
            if t < n_t:
                L = L * decays[t][:, :, None, :]                  # a_{t+1}
                k = n_t - t
                if k < K:
                    L = L + GS[k]
            Bt = B[:, i][:, gidx]
            Ct = C[:, i][:, gidx]
            L = L + Gy[:, i][..., None] * Ct[:, :, None, :]
            a = decays[i]                                         # a_t: (n_seqs, n_head, d_state|1)
            spt = sp[:, i]                                        # (n_seqs, n_head)
            xt = x[:, i]                                          # (n_seqs, n_head, head_dim)
            d["C"][:, i] = group_sum((Gy[:, i][..., None] * Hs[t]).sum(2))
            LB = (L * Bt[:, :, None, :]).sum(-1)                  # (n_seqs, n_head, head_dim)
            d["x"][:, i] = spt[..., None] * LB
            d["B"][:, i] = group_sum(spt[..., None] * (L * xt[..., None]).sum(2))
            D = (L * Hs[t - 1]).sum(2)                            # (n_seqs, n_head, d_state)
            Aa = a * A[None]                                      # (n_seqs, n_head, d_state|1)
            d_sp = (xt * LB).sum(-1) + (D * Aa).sum(-1)
            d["dt"][:, i] = d_sp * np_softplus_deriv(dt[:, i])
            contrib = D * a * spt[..., None]
            d["A"] += contrib.sum(-1, keepdims=True).sum(0) if mamba2 else contrib.sum(0)
        if n_t > 0:
            L = L * decays[0][:, :, None, :]                      # dLoss/dH_0 = a_1 * L_1
    np.add.at(d["s"], ids, L)
    return d


def fd_vjp(f, args, i, grad, eps=1e-6):
    """Central finite-difference VJP: d/d args[i] of sum(f(*args) * grad), float64, no torch.

    ``args`` is a sequence of arrays; only ``args[i]`` is perturbed (on a private float64 copy),
    so aliased arguments get their partial derivative, not the total one."""
    args = list(args)
    base = np.array(args[i], dtype=np.float64, copy=True)
    g = np.asarray(grad, dtype=np.float64).reshape(-1)
    res = np.zeros(base.shape)
    flat = base.reshape(-1)                                  # view of base
    for j in range(flat.size):
        old = flat[j]
        flat[j] = old + eps
        args[i] = base.copy()
        fp = np.asarray(f(*args), dtype=np.float64).reshape(-1) @ g
        flat[j] = old - eps
        args[i] = base.copy()
        fm = np.asarray(f(*args), dtype=np.float64).reshape(-1) @ g
        flat[j] = old
        res.reshape(-1)[j] = (fp - fm) / (2 * eps)
    return res


def max_abs_diff(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def assert_close(actual, expected, atol, rtol, name):
    """Elementwise |actual - expected| <= atol + rtol*|expected|, with the max diff in the message."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != expected {expected.shape}"
    if actual.size == 0:
        return
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values in result"
    err = np.abs(actual - expected)
    bound = atol + rtol * np.abs(expected)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), (
        f"{name}: max abs diff {err.max():.3e} (max rel {np.max(err / np.maximum(np.abs(expected), 1e-300)):.3e}); "
        f"worst at flat index {worst}: got {actual.reshape(-1)[worst]!r}, expected {expected.reshape(-1)[worst]!r}, "
        f"atol={atol:g} rtol={rtol:g}")


# ---------------------------------------------------------------------------------------------
# Input builders shared by the test files.

# Mamba-2 cases of the chunked forms' tests (tests/kernels/test_scan_fwd_chunked.py, test_scan_back_chunked.py),
# each (n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs); each file adds its own.
CHUNKED_CASES = {
    "nt63": (2, 3, 5, 1, 1, 63, [0], 1),
    "nt64": (2, 4, 3, 1, 1, 64, [0], 1),
    "nt65": (2, 2, 4, 1, 2, 65, [1, 0], 2),
    "nt150_groups": (4, 3, 6, 2, 2, 150, [0, 1], 2),
    "nt130_dup_extra": (2, 2, 3, 1, 3, 130, [3, 1, 3], 5),
    "nt129_group_per_head": (3, 2, 17, 3, 1, 129, [0], 1),
    "nt200_ds19_hd17": (2, 17, 19, 1, 1, 200, [0], 1),
    "nt100_ds16_dup": (3, 4, 16, 1, 3, 100, [1, 0, 1], 2),   # d_state a multiple of 16: B, C read in place
    "nt100_hd16_ds16": (3, 16, 16, 1, 2, 100, [1, 0], 2),    # head_dim a multiple of 16 too: x / dy rows in place
}


def make_mamba2_case(rng, case, dtype=np.float64):
    """make_scan_inputs for a Mamba-2 case given as (n_head, head_dim, d_state, n_group, n_seqs, n_t,
    ids, n_rs): the case tables of the chunked-form tests."""
    n_head, head_dim, d_state, n_group, n_seqs, n_t, ids, n_rs = case
    return make_scan_inputs(rng, n_head=n_head, head_dim=head_dim, d_state=d_state, n_group=n_group,
                            n_seqs=n_seqs, n_t=n_t, ids=ids, n_rs=n_rs, mamba2=True, dtype=dtype)


def scaled_tol(tol, ref):
    """tol (atol, rtol) with atol scaled by max(1, max|ref|)."""
    scale = max(1.0, float(np.max(np.abs(ref)))) if np.size(ref) else 1.0
    return dict(atol=tol["atol"] * scale, rtol=tol["rtol"])


def make_scan_inputs(rng, *, n_head, head_dim, d_state, n_group=1, n_seqs=2, n_t=3, mamba2=None,
                     n_rs=None, ids=None, dtype=np.float64):
    """Random scan inputs (dict s, x, dt, A, B, C, ids). ``mamba2`` defaults to head_dim > 1.
    A is negative and dt mostly below 1, as in real models, so the states stay O(1)."""
    if mamba2 is None:
        mamba2 = head_dim > 1
    if ids is None:
        n_rs = n_seqs if n_rs is None else n_rs
        ids = rng.permutation(n_rs)[:n_seqs]
    ids = np.asarray(ids, dtype=np.int32)
    if n_rs is None:
        n_rs = int(ids.max()) + 1 if ids.size else 1
    f = lambda *shape: rng.standard_normal(shape).astype(dtype)
    return dict(
        s=f(n_rs, n_head, head_dim, d_state),
        x=f(n_seqs, n_t, n_head, head_dim),
        dt=(rng.uniform(-3.0, 1.0, (n_seqs, n_t, n_head))).astype(dtype),
        A=(-np.exp(rng.uniform(-1.5, 0.5, (n_head, 1 if mamba2 else d_state)))).astype(dtype),
        B=f(n_seqs, n_t, n_group, d_state),
        C=f(n_seqs, n_t, n_group, d_state),
        ids=ids,
    )


def scan_out_size(inp, K=1):
    s, x = inp["s"], inp["x"]
    n_seqs = x.shape[0]
    return x.size + K * n_seqs * int(np.prod(s.shape[1:]))


def scan_args(inp):
    return tuple(inp[k] for k in ("s", "x", "dt", "A", "B", "C", "ids"))


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet (GATED_DELTA_NET, /work/shared/spec/gated-delta-net.md; docs in ssmgrad.gated_delta_net)
#
#   q, k   (n_seqs_k, n_t, H_k, S)     v (n_seqs, n_t, H_v, S)     g (n_seqs, n_t, H_v, 1 or S)
#   beta   (n_seqs, n_t, H_v, 1)       state (n_seqs, H_v, S, S), transposed: state[n, h, j, i] = S[i][j]
#   out    1-D [o (n_seqs, n_t, H_v, S) | K slots (n_seqs, H_v, S, S) transposed like state]

GDN_NAMES = ("q", "k", "v", "g", "beta", "state")     # the inputs, and the regions of gin, in order


def ref_gated_delta_net(q, k, v, g, beta, state, K=1, head_bcast="tiled"):
    """The spec's recurrence in torch, on the untransposed state S[i][j] (i: key channel, j: value
    channel), all (sequence, head) pairs at once. Returns the packed 1-D output; slots the op does
    not write (s >= n_t, except slot 0 when K == 1) are 0."""
    import math
    import torch
    n_seqs_k, n_t, H_k, S = q.shape
    n_seqs, H_v = v.shape[0], v.shape[2]
    heads = torch.arange(H_v)
    kh = heads % H_k if head_bcast == "tiled" else heads // (H_v // H_k)
    nk = torch.arange(n_seqs) // (n_seqs // n_seqs_k)
    qv = q[nk][:, :, kh]                                    # (n_seqs, n_t, H_v, S), one row per value head
    kv = k[nk][:, :, kh]
    St = state.transpose(-1, -2)                            # (n_seqs, H_v, S, S): St[n, h, i, j] = S[i][j]
    outs, after = [], []
    for t in range(n_t):
        a = torch.exp(g[:, t])                              # (n_seqs, H_v, 1 or S)
        St = a.unsqueeze(-1) * St                           # S <- diag(a) S
        u = torch.einsum("nhij,nhi->nhj", St, kv[:, t])     # S^T k
        d = beta[:, t] * (v[:, t] - u)                      # delta
        St = St + kv[:, t].unsqueeze(-1) * d.unsqueeze(-2)  # S + k delta^T
        outs.append(torch.einsum("nhij,nhi->nhj", St, qv[:, t]) / math.sqrt(S))
        after.append(St)
    o = torch.stack(outs, 1) if n_t else v.new_zeros(v.shape)
    slots = []
    for s in range(K):
        if s < n_t:
            slots.append(after[n_t - 1 - s].transpose(-1, -2))
        elif s == 0 and n_t == 0 and K == 1:   # ggml copies the start state only with K == 1
            slots.append(state)
        else:
            slots.append(state.new_zeros(state.shape))
    return torch.cat([o.reshape(-1)] + [x.reshape(-1) for x in slots])


def ref_gdn_np(q, k, v, g, beta, state, K=1, head_bcast="tiled"):
    """ref_gated_delta_net on NumPy arrays, as a float64 NumPy array (for finite differences)."""
    import torch
    with torch.no_grad():
        return ref_gated_delta_net(*(to_torch(a) for a in (q, k, v, g, beta, state)), K=K,
                                   head_bcast=head_bcast).numpy()


def ref_gdn_grads(q, k, v, g, beta, state, grad, K=1, head_bcast="tiled"):
    """torch.autograd's VJP of ref_gated_delta_net (float64): a dict name -> gradient."""
    f = lambda **t: ref_gated_delta_net(**t, K=K, head_bcast=head_bcast)
    return _vjp(f, dict(q=q, k=k, v=v, g=g, beta=beta, state=state), grad)


def exact_exp(x):
    """exp(x) of a float64 array from exactly rounded operations only (+, -, *, /, rint, ldexp), so its
    bits are the same on every IEEE host: numpy's own np.exp and np.log take AVX-512 or AVX2 code by
    the CPU at load time, with other last bits (NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL" shows it),
    and glibc's libm picks its variant by the CPU too. For inputs whose bits must not depend on the host
    (the golden hash files, benchmarks/hash_golden.py); within a few ulp of exp, |x| < 700."""
    x = np.asarray(x, dtype=np.float64)
    k = np.rint(x * (1.0 / 0.6931471805599453))
    r = (x - k * 0.693145751953125) - k * 1.4286068203094173e-06     # ln 2 in two parts: |r| <= 0.35
    p = np.ones_like(r)
    for i in range(17, 0, -1):                                          # Horner: sum of r^i / i!
        p = 1.0 + p * r / float(i)
    return np.ldexp(p, k.astype(np.int64))


def exact_softplus(v):
    """log(1 + exp(v)) of a float64 array from exactly rounded operations only (exact_exp's reason):
    max(v, 0) + log1p(e), e = exp(-|v|) in (0, 1], log1p(e) = 2 atanh(z), z = e / (2 + e) <= 1/3."""
    v = np.asarray(v, dtype=np.float64)
    e = exact_exp(-np.abs(v))
    z = e / (2.0 + e)
    z2, acc = z * z, np.zeros_like(z)
    for n in range(20, -1, -1):                                         # sum of z^(2n+1) / (2n+1)
        acc = 1.0 / float(2 * n + 1) + acc * z2
    return np.maximum(v, 0.0) + 2.0 * z * acc


def make_gdn_inputs(rng, *, n_seqs=2, n_seqs_k=None, n_t=5, H_v=2, H_k=1, S=4, kda=False, dtype=np.float64,
                    l2norm=True, exact=False):
    """Random Gated DeltaNet inputs (dict q, k, v, g, beta, state) as models feed them: q and k
    L2-normalized per head (llama.cpp and transformers do it before the op; it keeps the state
    bounded), g = -softplus(.) < 0, beta = sigmoid(.) in (0, 1). exact=True: the softplus, the
    sigmoid and the norms from exactly rounded operations only (exact_exp), the same bits on every
    host (the golden hash files: benchmarks/gdn_hashes.py)."""
    n_seqs_k = n_seqs if n_seqs_k is None else n_seqs_k
    f = lambda *shape: rng.standard_normal(shape)
    q, k = f(n_seqs_k, n_t, H_k, S), f(n_seqs_k, n_t, H_k, S)
    if l2norm:
        for a in (q, k):
            if exact:                              # the squares summed in index order, elementwise
                ss = np.zeros(a.shape[:-1] + (1,))
                for i in range(S):
                    ss = ss + a[..., i:i + 1] * a[..., i:i + 1]
                a /= np.sqrt(ss)
            else:
                a /= np.linalg.norm(a, axis=-1, keepdims=True)
    raw_g = f(n_seqs, n_t, H_v, S if kda else 1) - 1.0
    v = f(n_seqs, n_t, H_v, S)
    raw_beta = f(n_seqs, n_t, H_v, 1)
    softplus, exp = (exact_softplus, exact_exp) if exact else (lambda a: np.logaddexp(0.0, a), np.exp)
    return {name: a.astype(dtype) for name, a in dict(
        q=q, k=k, v=v, g=-softplus(raw_g), beta=1.0 / (1.0 + exp(-raw_beta)),
        state=0.5 * f(n_seqs, H_v, S, S)).items()}


def gdn_out_size(inp, K=1):
    return inp["v"].size + K * inp["state"].size


def gdn_args(inp):
    return tuple(inp[k] for k in GDN_NAMES)
