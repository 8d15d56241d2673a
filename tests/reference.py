"""Oracles for the ssmgrad tests, written from the spec (docs/ssm-ops.md).

Two independent oracles, both in float64:

* a torch reference (``ref_ssm_conv``, ``ref_ssm_scan``) that loops over tokens and lets
  torch.autograd produce the vector-Jacobian products (``ref_conv_grads``, ``ref_scan_grads``);
* pure NumPy: scalar-loop forwards (``np_ssm_conv``, ``np_ssm_scan``) and a central
  finite-difference VJP (``fd_vjp``) that needs no torch at all.

Shape legend (NumPy order, ggml ``ne`` reversed):
    sx  (n_s, d_inner, d_conv-1+n_t)        c  (d_inner, d_conv)        y (n_s, n_t, d_inner)
    s   (n_rs, n_head, head_dim, d_state)   x  (n_seqs, n_t, n_head, head_dim)
    dt  (n_seqs, n_t, n_head)               A  (n_head, d_state) Mamba-1 | (n_head, 1) Mamba-2
    B,C (n_seqs, n_t, n_group, d_state)     ids (n_seqs,) ints in [0, n_rs)
    out 1-D [y | K state slots (K, n_seqs, n_head, head_dim, d_state)]
"""

import numpy as np
import torch

SOFTPLUS_THRESHOLD = 20.0


def to_torch(a, requires_grad=False):
    """A float64 torch tensor holding a copy of ``a`` (never shares memory with it)."""
    t = torch.tensor(np.array(a, dtype=np.float64, copy=True), dtype=torch.float64)
    return t.requires_grad_(requires_grad)


def _ids_tensor(ids):
    if isinstance(ids, torch.Tensor):
        return ids.to(torch.int64)
    return torch.as_tensor(np.asarray(ids).astype(np.int64).reshape(-1))


def ref_softplus(v):
    # The clamp keeps exp() finite on the branch torch.where discards, so the gradient of the
    # discarded branch is 0 * finite instead of 0 * inf = NaN.
    t = SOFTPLUS_THRESHOLD
    return torch.where(v <= t, torch.log1p(torch.exp(torch.clamp(v, max=t))), v)


def ref_ssm_conv(sx, c):
    """y[s, t, i] = sum_k sx[s, i, t+k] * c[i, k]; sx (n_s, d_inner, d_conv-1+n_t), c (d_inner, d_conv)."""
    n_s, d_inner, n_cols = sx.shape
    d_conv = c.shape[1]
    n_t = n_cols - (d_conv - 1)
    ys = []
    for t in range(n_t):
        acc = sx[:, :, t] * c[:, 0]
        for k in range(1, d_conv):
            acc = acc + sx[:, :, t + k] * c[:, k]
        ys.append(acc)                                      # (n_s, d_inner)
    if not ys:
        return sx.new_zeros((n_s, 0, d_inner))
    return torch.stack(ys, dim=1)                           # (n_s, n_t, d_inner)


def ref_ssm_scan(s, x, dt, A, B, C, ids, K=1):
    """Packed 1-D [y | K state slots]; slot 0 final state, slot k state after n_t-k tokens,
    slots k >= n_t (k >= 1) zero. ``s`` is gathered by ``ids`` (its gradient scatter-adds)."""
    n_rs, n_head, head_dim, d_state = s.shape
    n_seqs, n_t = x.shape[0], x.shape[1]
    n_group = B.shape[2]
    assert n_head % n_group == 0
    group_of_head = torch.arange(n_head) // (n_head // n_group)
    ids_t = _ids_tensor(ids)
    assert ids_t.shape == (n_seqs,)

    H = s[ids_t]                                            # (n_seqs, n_head, head_dim, d_state)
    ys, states = [], [H]                                    # states[t] = state after t tokens
    for t in range(n_t):
        sp = ref_softplus(dt[:, t])                         # (n_seqs, n_head)
        a = torch.exp(sp[:, :, None] * A[None])             # (n_seqs, n_head, d_state or 1)
        Bt = B[:, t][:, group_of_head]                      # (n_seqs, n_head, d_state)
        Ct = C[:, t][:, group_of_head]
        xsp = x[:, t] * sp[:, :, None]                      # (n_seqs, n_head, head_dim)
        H = H * a[:, :, None, :] + Bt[:, :, None, :] * xsp[..., None]
        ys.append((H * Ct[:, :, None, :]).sum(-1))          # (n_seqs, n_head, head_dim)
        states.append(H)
    if ys:
        y = torch.stack(ys, dim=1)                          # (n_seqs, n_t, n_head, head_dim)
    else:
        y = x.new_zeros((n_seqs, 0, n_head, head_dim))
    slots = []
    for k in range(K):
        if k == 0 or k < n_t:
            slots.append(states[n_t - k])
        else:
            slots.append(s.new_zeros((n_seqs, n_head, head_dim, d_state)))
    return torch.cat([y.reshape(-1)] + [st.reshape(-1) for st in slots])


def _vjp(f, named, grad):
    """Gradients of sum(f(**tensors) * grad) w.r.t. each numpy array in ``named`` (float64)."""
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
    with torch.no_grad():
        return ref_ssm_conv(to_torch(sx), to_torch(c)).numpy()


def ref_scan_np(s, x, dt, A, B, C, ids, K=1):
    """Forward of the torch reference as a float64 numpy array (1-D packed)."""
    with torch.no_grad():
        return ref_ssm_scan(*(to_torch(a) for a in (s, x, dt, A, B, C)), ids, K=K).numpy()


# ---------------------------------------------------------------------------------------------
# Pure NumPy oracles (no torch): scalar loops written straight from the spec, and central
# finite differences.

def np_softplus(v):
    v = float(v)
    return np.log1p(np.exp(v)) if v <= SOFTPLUS_THRESHOLD else v


def np_ssm_conv(sx, c):
    sx = np.asarray(sx, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    n_s, d_inner, n_cols = sx.shape
    d_conv = c.shape[1]
    n_t = n_cols - (d_conv - 1)
    y = np.zeros((n_s, n_t, d_inner))
    for q in range(n_s):
        for t in range(n_t):
            for i in range(d_inner):
                acc = 0.0
                for k in range(d_conv):
                    acc += sx[q, i, t + k] * c[i, k]
                y[q, t, i] = acc
    return y


def np_ssm_scan(s, x, dt, A, B, C, ids, K=1):
    s, x, dt, A, B, C = (np.asarray(a, dtype=np.float64) for a in (s, x, dt, A, B, C))
    ids = np.asarray(ids).reshape(-1)
    n_rs, n_head, head_dim, d_state = s.shape
    n_seqs, n_t = x.shape[:2]
    n_group = B.shape[2]
    heads_per_group = n_head // n_group
    y = np.zeros((n_seqs, n_t, n_head, head_dim))
    slots = np.zeros((K, n_seqs, n_head, head_dim, d_state))
    for q in range(n_seqs):
        H = s[int(ids[q])].copy()
        if n_t == 0:
            slots[0, q] = H
        for t in range(n_t):
            for h in range(n_head):
                g = h // heads_per_group
                sp = np_softplus(dt[q, t, h])
                for n in range(d_state):
                    a = np.exp(sp * A[h, 0 if A.shape[1] == 1 else n])
                    for p in range(head_dim):
                        H[h, p, n] = H[h, p, n] * a + B[q, t, g, n] * (x[q, t, h, p] * sp)
                for p in range(head_dim):
                    y[q, t, h, p] = sum(H[h, p, n] * C[q, t, g, n] for n in range(d_state))
            k = n_t - (t + 1)                               # H is now the state after t+1 tokens
            if k < K:
                slots[k, q] = H
    return np.concatenate([y.ravel(), slots.ravel()])


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
