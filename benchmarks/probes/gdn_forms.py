#!/usr/bin/env python
"""The Gated DeltaNet's forms side by side: chunked, recurrence, and transformers' eager chunked rule.

    python benchmarks/probes/gdn_forms.py                              # scalar gate, H_v 16, H_k 8, S 128, n_t 512
    python benchmarks/probes/gdn_forms.py --n-t 8,16,32,64 --parts ssmgrad   # the auto threshold
    python benchmarks/probes/gdn_forms.py --gate kda --shape 32,16,128 --n-t 64,512,2048   # the per-channel gate

One thread for everything (torch.set_num_threads(1), ssmgrad.set_num_threads(1)), float32, one
sequence, interleaved heads (transformers' and Kimi-Linear's layout); g = -softplus(.) as models feed
it, of shape (1, n_t, H_v, 1) (--gate scalar) or (1, n_t, H_v, S) (--gate kda). Rows, each the median
of --reps calls after one warm-up: ssmgrad.gated_delta_net with form="recurrence" and form="chunked",
the forward alone, the backward alone (gated_delta_net_back) and their sum; with --parts hf (scalar
gate only) transformers' torch_chunk_gated_delta_rule (stock, eager) forward under no_grad and forward
+ autograd of o and the final state. --clock cpu (the default) times the process' CPU time
(time.process_time), which leaves out what other processes take on a shared machine; wall is
time.perf_counter. The two forms are checked for agreement first (float32, a small shape).
"""
import argparse
import statistics
import time

import numpy as np

import ssmgrad

NAMES = ("q", "k", "v", "g", "beta", "state")
FORMS = ("recurrence", "chunked")


def inputs(rng, n_t, H_v, H_k, S, gate):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k = f(1, n_t, H_k, S), f(1, n_t, H_k, S)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = -np.logaddexp(0, f(1, n_t, H_v, S if gate == "kda" else 1) - 1).astype(np.float32)
    return dict(q=q, k=k, v=f(1, n_t, H_v, S), g=g,
                beta=(1 / (1 + np.exp(-f(1, n_t, H_v, 1)))).astype(np.float32), state=0.5 * f(1, H_v, S, S))


def hf_call(a, grad=None):
    import torch
    import transformers.models.qwen3_next.modeling_qwen3_next as tq
    t = {n: torch.from_numpy(a[n]).requires_grad_(grad is not None) for n in NAMES}
    o, final = tq.torch_chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"][..., 0], t["beta"][..., 0],
                                               initial_state=t["state"].transpose(-1, -2), output_final_state=True)
    if grad is not None:
        do, ds = grad
        torch.autograd.grad((o * do).sum() + (final * ds).sum(), [t[n] for n in NAMES])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate", choices=["scalar", "kda"], default="scalar")
    ap.add_argument("--n-t", default="512")
    ap.add_argument("--shape", default="16,8,128", help="H_v,H_k,S")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    ap.add_argument("--parts", default=None, help="ssmgrad and/or hf (default: both for the scalar gate, "
                    "ssmgrad for kda)")
    args = ap.parse_args()
    parts = (args.parts or ("ssmgrad,hf" if args.gate == "scalar" else "ssmgrad")).split(",")
    if "hf" in parts and args.gate == "kda":
        ap.error("--parts hf runs transformers' scalar-gate rule: not with --gate kda")
    if "hf" in parts:
        import torch
        torch.set_num_threads(1)
    ssmgrad.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    H_v, H_k, S = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(0)
    kw = dict(head_bcast="interleaved")

    a = inputs(rng, 100, 4, 2, 16, args.gate)   # agreement first
    arr = [a[n] for n in NAMES]
    grad = rng.standard_normal(a["v"].size + a["state"].size).astype(np.float32)
    fw = [ssmgrad.gated_delta_net(*arr, form=f, **kw) for f in FORMS]
    bw = [ssmgrad.gated_delta_net_back(*arr, grad, form=f, **kw) for f in FORMS]
    d = max(np.abs(fw[0] - fw[1]).max(), np.abs(bw[0] - bw[1]).max())
    print(f"check: {args.gate} gate, chunked vs recurrence, float32, n_t 100, S 16: max diff {d:.1e}")
    assert d < 1e-4

    def med(f):
        f()
        ts = []
        for _ in range(args.reps):
            t = clock()
            f()
            ts.append(clock() - t)
        return statistics.median(ts) * 1e3

    for n_t in (int(x) for x in args.n_t.split(",")):
        a = inputs(rng, n_t, H_v, H_k, S, args.gate)
        arr = [a[n] for n in NAMES]
        grad = rng.standard_normal(a["v"].size + a["state"].size).astype(np.float32)
        res = {}
        if "ssmgrad" in parts:
            for form in FORMS:
                res[f"{form} fwd"] = med(lambda: ssmgrad.gated_delta_net(*arr, form=form, **kw))
                res[f"{form} bwd"] = med(lambda: ssmgrad.gated_delta_net_back(*arr, grad, form=form, **kw))
                res[f"{form} fwd+bwd"] = res[f"{form} fwd"] + res[f"{form} bwd"]
        if "hf" in parts:
            import torch
            do, ds = torch.randn(a["v"].shape), torch.randn(a["state"].shape)
            with torch.no_grad():
                res["hf eager fwd"] = med(lambda: hf_call(a))
            res["hf eager fwd+bwd"] = med(lambda: hf_call(a, (do, ds)))
        print(f"n_t {n_t} H_v {H_v} H_k {H_k} S {S}, {args.gate} gate, 1 thread, {args.clock} ms, median of "
              f"{args.reps}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
        if "ssmgrad" in parts:
            r = {p: res[f"recurrence {p}"] / res[f"chunked {p}"] for p in ("fwd", "bwd", "fwd+bwd")}
            print("  recurrence / chunked: " + ", ".join(f"{p} {v:.2f}x" for p, v in r.items()), flush=True)
        if "ssmgrad" in parts and "hf" in parts:
            print(f"  eager / chunked: fwd {res['hf eager fwd'] / res['chunked fwd']:.2f}x, fwd+bwd "
                  f"{res['hf eager fwd+bwd'] / res['chunked fwd+bwd']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
