#!/usr/bin/env python
"""ssmgrad's GATED_DELTA_NET against transformers' torch_chunk_gated_delta_rule (eager), side by side.

    python benchmarks/gdn_bench.py                         # H_v 16, H_k 8, S 128, n_t 512, 1 thread
    python benchmarks/gdn_bench.py --shape 32,16 --n-t 512,2048 --reps 5

1. Validate: ssmgrad and transformers' chunked rule (stock, unpatched) at a small shape with the
   benchmark's head layout, float32, against each other: o, final state and every gradient (the test
   suite checks both against the float64 oracle; this makes sure the timed calls compute the same).
2. Time (float32, one sequence, one thread for both: torch.set_num_threads(1), ssmgrad's own count 1):
   forward, and forward + backward (transformers: autograd of o and the final state; ssmgrad:
   gated_delta_net then gated_delta_net_back), medians over --reps runs after one warm-up.
3. Decode: one token (n_t = 1) of ssmgrad's forward against np.copyto of the state's bytes.

ssmgrad takes the interleaved head broadcast transformers uses (head_bcast="interleaved"). Its form is
the token recurrence (the chunked form is not written yet). FLOP per state element and token: forward
8 (decay, k dot, rank-1 update, q dot), backward about 2x that plus a recomputed forward.
"""
import argparse
import statistics
import sys
import time

import numpy as np
import torch

import ssmgrad

import transformers.models.qwen3_next.modeling_qwen3_next as tq


def inputs(rng, n_t, H_v, H_k, S):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k = f(1, n_t, H_k, S), f(1, n_t, H_k, S)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(q=q, k=k, v=f(1, n_t, H_v, S), g=-np.logaddexp(0, f(1, n_t, H_v, 1) - 1).astype(np.float32),
                beta=(1 / (1 + np.exp(-f(1, n_t, H_v, 1)))).astype(np.float32), state=0.5 * f(1, H_v, S, S))


NAMES = ("q", "k", "v", "g", "beta", "state")


def ssm_fwd(a):
    return ssmgrad.gated_delta_net(*(a[n] for n in NAMES), head_bcast="interleaved")


def ssm_fwd_bwd(a, grad):
    ssm_fwd(a)
    return ssmgrad.gated_delta_net_back(*(a[n] for n in NAMES), grad, head_bcast="interleaved")


def hf_call(a, grad=None):
    t = {n: torch.from_numpy(a[n]).requires_grad_(grad is not None) for n in NAMES}
    o, final = tq.torch_chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"][..., 0], t["beta"][..., 0],
                                               initial_state=t["state"].transpose(-1, -2), output_final_state=True)
    if grad is None:
        return o, final, None
    do, dstate = grad
    grads = torch.autograd.grad((o * do).sum() + (final * dstate).sum(), [t[n] for n in NAMES])
    return o, final, grads


def validate(rng, H_v, H_k):
    a = inputs(rng, 100, H_v, H_k, 16)
    do = torch.randn(a["v"].shape)
    dstate = torch.randn(a["state"].shape).transpose(-1, -2)           # transformers' (.., S_k, S_v)
    o, final, grads = hf_call(a, (do, dstate))
    out = ssm_fwd(a)
    o_s, s_s = ssmgrad.split(out, a["v"].shape, a["state"].shape)
    grad = np.concatenate([do.numpy().reshape(-1), dstate.transpose(-1, -2).numpy().reshape(-1)])
    gin = ssmgrad.split(ssm_fwd_bwd(a, grad), *(a[n].shape for n in NAMES))
    errs = {"o": np.abs(o_s - o.detach().numpy()).max(),
            "state": np.abs(s_s.transpose(0, 1, 3, 2) - final.detach().numpy()).max()}
    errs.update({f"d_{n}": np.abs(x - y.numpy()).max() / max(1.0, np.abs(y.numpy()).max())
                 for n, x, y in zip(NAMES, gin, grads)})
    bad = {k: v for k, v in errs.items() if not v < 1e-4}
    print("validate (float32, n_t 100, S 16): max diffs " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    if bad:
        sys.exit(f"validation failed: {bad}")


def median_ms(fn, reps):
    fn()                                   # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="16,8", help="H_v,H_k (S is 128)")
    ap.add_argument("--n-t", default="512", help="comma-separated token counts")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    H_v, H_k = map(int, args.shape.split(","))
    S = 128
    torch.set_num_threads(1)
    ssmgrad.set_num_threads(1)
    rng = np.random.default_rng(0)
    validate(rng, H_v, H_k)
    print(f"\nH_v {H_v}, H_k {H_k}, S {S}, float32, 1 thread, medians of {args.reps} (ms)")
    print(f"{'n_t':>6} {'hf fwd':>9} {'ssm fwd':>9} {'ratio':>6} {'hf f+b':>9} {'ssm f+b':>9} {'ratio':>6} {'ssm GFLOP/s fwd':>16}")
    for n_t in map(int, args.n_t.split(",")):
        a = inputs(rng, n_t, H_v, H_k, S)
        do, dstate = torch.randn(a["v"].shape), torch.randn(a["state"].shape)
        grad = np.concatenate([do.numpy().reshape(-1), dstate.transpose(-1, -2).numpy().reshape(-1)])
        with torch.no_grad():
            hf_f = median_ms(lambda: hf_call(a), args.reps)
        hf_fb = median_ms(lambda: hf_call(a, (do, dstate)), args.reps)
        s_f = median_ms(lambda: ssm_fwd(a), args.reps)
        s_fb = median_ms(lambda: ssm_fwd_bwd(a, grad), args.reps)
        gflops = 8 * n_t * H_v * S * S / (s_f * 1e-3) / 1e9
        print(f"{n_t:>6} {hf_f:>9.1f} {s_f:>9.1f} {hf_f / s_f:>5.2f}x {hf_fb:>9.1f} {s_fb:>9.1f} {hf_fb / s_fb:>5.2f}x "
              f"{gflops:>16.1f}")
    a = inputs(rng, 1, H_v, H_k, S)
    dst = np.empty_like(a["state"])
    t_dec = median_ms(lambda: ssm_fwd(a), 50)
    t_copy = median_ms(lambda: np.copyto(dst, a["state"]), 50)
    print(f"\ndecode (n_t 1): ssmgrad {t_dec * 1e3:.1f} us, np.copyto of the state {t_copy * 1e3:.1f} us, "
          f"ratio {t_dec / t_copy:.2f}")


if __name__ == "__main__":
    main()
