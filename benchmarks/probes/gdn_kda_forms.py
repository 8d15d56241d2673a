#!/usr/bin/env python
"""The delta rule with the per-channel gate (KDA): its chunked form against the token recurrence.

    python benchmarks/probes/gdn_kda_forms.py                                   # H_v 32, H_k 16, S 128
    python benchmarks/probes/gdn_kda_forms.py --n-t 16,32,48,64 --shape 16,8,128   # the auto threshold

One thread (ssmgrad.set_num_threads(1)), float32, one sequence, interleaved heads (transformers' and
Kimi-Linear's layout), g of shape (1, n_t, H_v, S) = -softplus(.) as models feed it. Rows, each the median
of --reps calls after one warm-up, in the process' CPU time (time.process_time: it leaves out what other
processes take on a shared machine; --clock wall for time.perf_counter): ssmgrad.gated_delta_net with
form="recurrence" and form="chunked", the forward alone, the backward alone (gated_delta_net_back) and
their sum. The two forms are checked for agreement first (float32, a small shape).
"""
import argparse
import statistics
import time

import numpy as np

import ssmgrad

NAMES = ("q", "k", "v", "g", "beta", "state")


def inputs(rng, n_t, H_v, H_k, S):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k = f(1, n_t, H_k, S), f(1, n_t, H_k, S)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(q=q, k=k, v=f(1, n_t, H_v, S), g=-np.logaddexp(0, f(1, n_t, H_v, S) - 1).astype(np.float32),
                beta=(1 / (1 + np.exp(-f(1, n_t, H_v, 1)))).astype(np.float32), state=0.5 * f(1, H_v, S, S))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-t", default="64,512,2048")
    ap.add_argument("--shape", default="32,16,128", help="H_v,H_k,S")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    args = ap.parse_args()
    ssmgrad.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    H_v, H_k, S = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(0)
    kw = dict(head_bcast="interleaved")

    a = inputs(rng, 100, 4, 2, 16)   # agreement first
    arr = [a[n] for n in NAMES]
    grad = rng.standard_normal(a["v"].size + a["state"].size).astype(np.float32)
    fw = [ssmgrad.gated_delta_net(*arr, form=f, **kw) for f in ("recurrence", "chunked")]
    bw = [ssmgrad.gated_delta_net_back(*arr, grad, form=f, **kw) for f in ("recurrence", "chunked")]
    d = max(np.abs(fw[0] - fw[1]).max(), np.abs(bw[0] - bw[1]).max())
    print(f"check: KDA chunked vs recurrence, float32, n_t 100, S 16: max diff {d:.1e}")
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
        a = inputs(rng, n_t, H_v, H_k, S)
        arr = [a[n] for n in NAMES]
        grad = rng.standard_normal(a["v"].size + a["state"].size).astype(np.float32)
        res = {}
        for form in ("recurrence", "chunked"):
            res[f"{form} fwd"] = med(lambda: ssmgrad.gated_delta_net(*arr, form=form, **kw))
            res[f"{form} bwd"] = med(lambda: ssmgrad.gated_delta_net_back(*arr, grad, form=form, **kw))
            res[f"{form} fwd+bwd"] = res[f"{form} fwd"] + res[f"{form} bwd"]
        print(f"n_t {n_t} H_v {H_v} H_k {H_k} S {S}, 1 thread, {args.clock} ms, median of {args.reps}: "
              + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
        print(f"  recurrence / chunked: fwd {res['recurrence fwd'] / res['chunked fwd']:.2f}x, bwd "
              f"{res['recurrence bwd'] / res['chunked bwd']:.2f}x, fwd+bwd "
              f"{res['recurrence fwd+bwd'] / res['chunked fwd+bwd']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
