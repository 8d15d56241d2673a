#!/usr/bin/env python
"""The delta rule's token recurrence: the scalar gate against the per-channel gate (KDA), K 1 and 4 snapshots.

    python benchmarks/probes/gdn_recurrence_gates.py            # 7 rounds
    python benchmarks/probes/gdn_recurrence_gates.py --rounds 15

One thread, float32, one sequence, n_t 512, H_v 16, H_k 8, S 128, form="recurrence" (K > 1 runs it
whatever the form; K 1 forced so that the four rows time the same code). Each round times every
configuration once, forward (gated_delta_net) then backward (gated_delta_net_back), in the process' CPU
time (time.process_time); printed: the median over the rounds, in ms. To compare two builds, run this
from fresh processes alternating between them (PYTHONPATH pointing at each build's extension).
"""
import argparse
import statistics
import time

import numpy as np

import ssmgrad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    ssmgrad.set_num_threads(1)
    n_t, H_v, H_k, S = 512, 16, 8, 128
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k = f(1, n_t, H_k, S), f(1, n_t, H_k, S)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, state = f(1, n_t, H_v, S), 0.5 * f(1, H_v, S, S)
    beta = (1 / (1 + np.exp(-f(1, n_t, H_v, 1)))).astype(np.float32)
    gates = {"scalar": -np.logaddexp(0, f(1, n_t, H_v, 1) - 1).astype(np.float32),
             "kda": -np.logaddexp(0, f(1, n_t, H_v, S) - 1).astype(np.float32)}
    grads = {K: rng.standard_normal(v.size + K * state.size).astype(np.float32) for K in (1, 4)}
    cfg = [(gate, K) for gate in ("scalar", "kda") for K in (1, 4)]
    res = {(c, d): [] for c in cfg for d in ("fwd", "bwd")}

    def timed(fn):
        t = time.process_time()
        fn()
        return (time.process_time() - t) * 1e3

    for gate, K in cfg:   # warm-up
        ssmgrad.gated_delta_net(q, k, v, gates[gate], beta, state, K=K, form="recurrence")
    for _ in range(args.rounds):
        for gate, K in cfg:
            g = gates[gate]
            res[((gate, K), "fwd")].append(
                timed(lambda: ssmgrad.gated_delta_net(q, k, v, g, beta, state, K=K, form="recurrence")))
            res[((gate, K), "bwd")].append(
                timed(lambda: ssmgrad.gated_delta_net_back(q, k, v, g, beta, state, grads[K], K=K, form="recurrence")))
    print(f"n_t {n_t} H_v {H_v} H_k {H_k} S {S}, 1 thread, float32, CPU ms, median of {args.rounds} rounds:")
    for gate, K in cfg:
        print(f"  {gate:6s} K {K}: forward {statistics.median(res[((gate, K), 'fwd')]):6.1f}, "
              f"backward {statistics.median(res[((gate, K), 'bwd')]):6.1f}")


if __name__ == "__main__":
    main()
