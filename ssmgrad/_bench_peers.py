"""The PyTorch CPU formulations that `python -m ssmgrad bench` times beside ssmgrad (pure torch,
never calling ssmgrad's kernels; imported only when torch is installed), and benchmarks/ too
(through benchmarks/peers.py, which adds the reference they are validated against, tests/reference.py).
They live in the package because that command must find them without the repository.

Every scan function computes the op of the spec (docs/ssm-ops.md) (softplus inside, initial state
``s[ids]``, y from the UPDATED state, final state out) and returns ``(y, final)``:

    s   (n_rs, n_head, head_dim, d_state)   x  (n_seqs, n_t, n_head, head_dim)
    dt  (n_seqs, n_t, n_head)               A  (n_head, d_state) Mamba-1 | (n_head, 1) Mamba-2
    B,C (n_seqs, n_t, n_group, d_state)     ids (n_seqs,) int64 tensor
    y   (n_seqs, n_t, n_head, head_dim)     final (n_seqs, n_head, head_dim, d_state)

Forward is plain torch; backward is torch.autograd (mambapy's pscan brings its own autograd Function).

    scan_loop   a token loop, every per-token slice taken once with unbind
    scan_ssd    Mamba-2 only: the chunked "SSD" algorithm in matmul form (Mamba-2 paper, listing 1),
                with the inter-chunk recurrence as one (n_chunks+1)^2 decay matmul
    scan_pscan  Mamba-1: mambapy's Blelloch parallel scan over (deltaA, deltaB*x), the initial state
                folded into the first input term (pscan itself starts from a zero state)
    conv_conv1d depthwise F.conv1d(groups=d_inner); returns a transposed view (n_s, n_t, d_inner)
    gdn_chunk_transformers
                the Gated DeltaNet (scalar gate) through transformers' torch_chunk_gated_delta_rule
                (plain torch, 64-token chunks; the peer benchmarks/gdn_bench.py times), in ssmgrad's
                layouts: q, k, v, g, beta, state as ssmgrad.gated_delta_net takes them, value head h
                reading key head h // (H_v // H_k) (head_bcast="interleaved"); returns (o, final
                state) with the final state transposed like ssmgrad's, (n_seqs, H_v, S, S)
"""

import torch
import torch.nn.functional as F


def _per_head(B, n_head):
    """(n_seqs, n_t, n_group, d_state) -> (n_seqs, n_t, n_head, d_state); head h uses group h // (n_head // n_group)."""
    n_group = B.shape[2]
    if n_group == 1:
        return B.expand(-1, -1, n_head, -1)                      # a view: no copy
    return B.repeat_interleave(n_head // n_group, dim=2)


def scan_loop(s, x, dt, A, B, C, ids):
    """A token loop: (y, final state). Everything that does not depend on the state is computed for
    all tokens at once, and every per-token slice is taken once with unbind (indexing a tensor inside
    the loop makes autograd accumulate a full-size gradient per token: 100x slower)."""
    n_head = x.shape[2]
    sp = F.softplus(dt, threshold=20.0)                          # (n_seqs, n_t, n_head): v if v > 20
    a = torch.exp(sp[..., None] * A).unsqueeze(3)                # (n_seqs, n_t, n_head, 1, d_state | 1)
    xs = (x * sp[..., None]).unsqueeze(-1)                       # (n_seqs, n_t, n_head, head_dim, 1)
    Bh = _per_head(B, n_head).unsqueeze(3)                       # (n_seqs, n_t, n_head, 1, d_state)
    Ch = _per_head(C, n_head).unsqueeze(3)                       # (n_seqs, n_t, n_head, 1, d_state)
    H = s[ids]                                                   # (n_seqs, n_head, head_dim, d_state)
    ys = []
    for a_t, xs_t, B_t, C_t in zip(a.unbind(1), xs.unbind(1), Bh.unbind(1), Ch.unbind(1)):
        H = torch.addcmul(H * a_t, xs_t, B_t)                    # H*a + (x*sp) outer B
        ys.append((H * C_t).sum(-1))                             # (n_seqs, n_head, head_dim); faster than H @ C_t here
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)
    return y, H


def scan_ssd(s, x, dt, A, B, C, ids, chunk=64):
    """Mamba-2 (A of shape (n_head, 1)) in chunked matmul form; n_t is zero-padded to a multiple of
    ``chunk`` (padded tokens: log-decay 0, input 0, so the final state is untouched)."""
    n_seqs, n_t, n_head, head_dim = x.shape
    n_group, d_state = B.shape[2], B.shape[3]
    if A.shape[1] != 1:
        raise ValueError("scan_ssd needs the Mamba-2 A shape (n_head, 1)")
    b, g, hg, p, n, L = n_seqs, n_group, n_head // n_group, head_dim, d_state, chunk
    sp = F.softplus(dt)                                          # (b, T, h)
    la = sp * A[:, 0]                                            # log decay per token and head
    X = x * sp[..., None]                                        # (b, T, h, p)
    pad = (-n_t) % L
    if pad:
        la = F.pad(la, (0, 0, 0, pad))
        X = F.pad(X, (0, 0, 0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    nc = (n_t + pad) // L
    Xc = X.reshape(b, nc, L, g, hg, p).permute(0, 3, 4, 1, 2, 5)    # (b, g, hg, nc, L, p)
    Bc = B.reshape(b, nc, L, g, n).permute(0, 3, 1, 2, 4)           # (b, g, nc, L, n)
    Cc = C.reshape(b, nc, L, g, n).permute(0, 3, 1, 2, 4)           # (b, g, nc, L, n)
    cum = la.reshape(b, nc, L, g, hg).permute(0, 3, 4, 1, 2).cumsum(-1)  # (b, g, hg, nc, L)

    # 1. within a chunk: Y_diag[l] = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) X_s
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))
    CB = Cc @ Bc.transpose(-1, -2)                               # (b, g, nc, L, L), shared by the group's heads
    Y = (CB[:, :, None] * seg) @ Xc                              # (b, g, hg, nc, L, p)

    # 2. each chunk's own contribution to the state at its end (from a zero state), kept as (n, p)
    decay_to_end = torch.exp(cum[..., -1:] - cum)                # (b, g, hg, nc, L)
    chunk_states = Bc.transpose(-1, -2)[:, :, None] @ (Xc * decay_to_end[..., None])  # (b, g, hg, nc, n, p)

    # 3. across chunks: entering[c] = sum_{c' <= c} exp(Z[c] - Z[c']) * S[c'], S[0] = initial state
    H0 = s[ids].reshape(b, g, hg, p, n).transpose(-1, -2)         # (b, g, hg, n, p)
    S = torch.cat([H0[:, :, :, None], chunk_states], dim=3)      # (b, g, hg, nc+1, n, p)
    Z = F.pad(cum[..., -1], (1, 0)).cumsum(-1)                   # (b, g, hg, nc+1)
    causal_c = torch.ones(nc + 1, nc + 1, dtype=torch.bool, device=x.device).tril()
    decay_chunk = torch.exp((Z[..., :, None] - Z[..., None, :]).masked_fill(~causal_c, float("-inf")))
    states = (decay_chunk @ S.flatten(-2)).unflatten(-1, (n, p))  # (b, g, hg, nc+1, n, p)

    # 4. the state entering each chunk, seen by its tokens: Y_off[l] = exp(cum_l) * C_l . H_in
    Y = Y + (Cc[:, :, None] @ states[:, :, :, :-1]) * torch.exp(cum)[..., None]
    y = Y.permute(0, 3, 4, 1, 2, 5).reshape(b, nc * L, n_head, p)[:, :n_t]
    final = states[:, :, :, -1].transpose(-1, -2).reshape(b, n_head, p, n)
    return y, final


def scan_pscan(s, x, dt, A, B, C, ids):
    """Mamba-1 (A of shape (n_head, d_state)) through mambapy.pscan: H_t = deltaA_t * H_{t-1} + BX_t
    from H = 0, so the initial state enters as deltaA_1 * H_0 added to BX_1."""
    from mambapy.pscan import pscan

    n_seqs, n_t, n_head, head_dim = x.shape
    d_state = B.shape[3]
    if A.shape[1] != d_state:
        raise ValueError("scan_pscan needs the Mamba-1 A shape (n_head, d_state)")
    D = n_head * head_dim
    sp = F.softplus(dt)                                          # (b, T, h)
    dA = torch.exp(sp[..., None] * A)                            # (b, T, h, n)
    if head_dim > 1:
        dA = dA[:, :, :, None].expand(-1, -1, -1, head_dim, -1)
    dA = dA.reshape(n_seqs, n_t, D, d_state)
    Bh = _per_head(B, n_head)
    BX = ((x * sp[..., None])[..., None] * Bh[:, :, :, None, :]).reshape(n_seqs, n_t, D, d_state)
    H0 = s[ids].reshape(n_seqs, 1, D, d_state)
    BX = torch.cat([BX[:, :1] + dA[:, :1] * H0, BX[:, 1:]], dim=1)
    Hs = pscan(dA, BX)                                           # (b, T, D, n): every state
    Ch = _per_head(C, n_head)                                    # (b, T, h, n)
    y = (Hs.view(n_seqs, n_t, n_head, head_dim, d_state) * Ch[:, :, :, None, :]).sum(-1)
    final = Hs[:, -1].reshape(n_seqs, n_head, head_dim, d_state)
    return y, final


def conv_conv1d(sx, c):
    """sx (n_s, d_inner, d_conv-1+n_t), c (d_inner, d_conv) -> y (n_s, n_t, d_inner) as a transposed view."""
    return F.conv1d(sx, c.unsqueeze(1), groups=c.shape[0]).transpose(1, 2)


def gdn_chunk_transformers(q, k, v, g, beta, state):
    """transformers' stock torch_chunk_gated_delta_rule (ImportError without transformers); g and beta
    of shape (n_seqs, n_t, H_v, 1), state[n, h, j, i] = S[i][j] as in ssmgrad."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    if g.shape[-1] != 1:
        raise ValueError("gdn_chunk_transformers takes the scalar gate only, g of shape (n_seqs, n_t, H_v, 1)")
    o, final = torch_chunk_gated_delta_rule(q, k, v, g[..., 0], beta[..., 0], initial_state=state.transpose(-1, -2),
                                            output_final_state=True)
    return o, final.transpose(-1, -2)


SCAN_IMPLS = {"loop": scan_loop, "ssd": scan_ssd, "pscan": scan_pscan}
CONV_IMPLS = {"conv1d": conv_conv1d}
