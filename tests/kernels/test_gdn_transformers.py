"""GATED_DELTA_NET against stock transformers' own gated delta rule (Qwen3-Next's
torch_recurrent_gated_delta_rule and torch_chunk_gated_delta_rule, unpatched), a second oracle that
shares nothing with ssmgrad or tests/reference.py.

transformers runs its rule in float32 whatever the input dtype, repeats key heads interleaved
(value head h reads key head h // (H_v / H_k): head_bcast="interleaved") and keeps the state
untransposed, (batch, H_v, S_k, S_v); ssmgrad's state is its transpose. The comparison is at
float32 tolerances: ssmgrad runs in float64 on the same inputs and so is the more exact side.
"""

import numpy as np
import pytest
import torch

import ssmgrad
from reference import GDN_NAMES, gdn_args, make_gdn_inputs

import transformers.models.qwen3_next.modeling_qwen3_next as tq  # noqa: E402  (a missing oracle fails, never skips)

# transformers' float32 vs ssmgrad's float64, both on float64 inputs that are float32-exact. Measured
# (these cases): max abs error 8.4e-8 (recurrent) and 3.6e-7 (chunked) on o and the final state;
# on the gradients, max abs error / max(1, max|grad|) 1.4e-7 (recurrent) and 7.3e-7 (chunked, d_g).
# The tolerances leave ~10x.
FWD_ATOL = 4e-6
GRAD_ATOL = 8e-6


def _transformers_vjp(fn, inp, do, dstate):
    """o, final state and the gradients of sum(o * do) + sum(final * dstate) of transformers' rule."""
    t = {n: torch.tensor(a, dtype=torch.float32, requires_grad=True) for n, a in inp.items()}
    o, final = fn(t["q"], t["k"], t["v"], t["g"][..., 0], t["beta"][..., 0],
                  initial_state=t["state"].transpose(-1, -2), output_final_state=True)
    loss = (o * torch.tensor(do, dtype=torch.float32)).sum() + (final * torch.tensor(dstate, dtype=torch.float32)).sum()
    grads = torch.autograd.grad(loss, [t[n] for n in GDN_NAMES])
    return o.detach().double().numpy(), final.detach().double().numpy(), [g.double().numpy() for g in grads]


@pytest.mark.parametrize("which", ["recurrent", "chunk"])
@pytest.mark.parametrize("n_t,S,H_v,H_k", [(70, 8, 4, 2), (130, 16, 2, 1)])
def test_against_transformers(rng, which, n_t, S, H_v, H_k):
    fn = tq.torch_recurrent_gated_delta_rule if which == "recurrent" else tq.torch_chunk_gated_delta_rule
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=n_t, H_v=H_v, H_k=H_k, S=S, dtype=np.float32)
    inp = {n: a.astype(np.float64) for n, a in inp.items()}   # float32-exact float64 inputs
    do = rng.standard_normal(inp["v"].shape).astype(np.float32).astype(np.float64)
    dstate = rng.standard_normal(inp["state"].shape).astype(np.float32).astype(np.float64)
    o_t, final_t, grads_t = _transformers_vjp(fn, inp, do, dstate)

    out = ssmgrad.gated_delta_net(*gdn_args(inp), head_bcast="interleaved")
    o, slot0 = ssmgrad.split(out, inp["v"].shape, inp["state"].shape)
    assert np.max(np.abs(o - o_t)) < FWD_ATOL
    assert np.max(np.abs(slot0.transpose(0, 1, 3, 2) - final_t)) < FWD_ATOL

    grad = np.concatenate([do.reshape(-1), dstate.transpose(0, 1, 3, 2).reshape(-1)])
    gin = ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, head_bcast="interleaved")
    got = ssmgrad.split(gin, *(inp[n].shape for n in GDN_NAMES))
    for n, a, b in zip(GDN_NAMES, got, grads_t):
        err = np.max(np.abs(a - b))
        assert err < GRAD_ATOL * max(1.0, np.max(np.abs(b))), f"d_{n} vs transformers ({which}): max abs diff {err:.3e}"
