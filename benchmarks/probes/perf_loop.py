#!/usr/bin/env python
"""Run one ssmgrad op over and over, for a sampling profiler.

    perf record -o /tmp/p.data python benchmarks/probes/perf_loop.py scan_back mamba2 512 [--kept]
    perf report -i /tmp/p.data --stdio --sort sym | head -20

ops: scan, scan_back (shapes mamba1, mamba2); conv, conv_back, conv_back_weight (shape conv1536).
Inputs are built once, before the loop (float32, one sequence, the shapes of benchmarks/bench.py);
the loop runs about --seconds seconds, so the op dominates the samples. Prints the mean time per
call and per token. Uses the in-place build of this checkout when there is one.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))   # the checkout

import ssmgrad  # noqa: E402

SCAN = {"mamba1": (1536, 1, 16, True), "mamba2": (24, 64, 128, False)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("op", choices=["scan", "scan_back", "conv", "conv_back", "conv_back_weight"])
    ap.add_argument("shape", choices=["mamba1", "mamba2", "conv1536"])
    ap.add_argument("n_t", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--kept", action="store_true",
                    help="scan_back with the forward's chunk states (keep_states=True), as training runs it")
    args = ap.parse_args()
    ssmgrad.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    f32, n_t = np.float32, args.n_t
    if args.op.startswith("scan"):
        if args.shape not in SCAN:
            ap.error("scan ops take mamba1 or mamba2")
        h, hd, n, m1 = SCAN[args.shape]
        a = (rng.standard_normal((1, h, hd, n)).astype(f32), rng.standard_normal((1, n_t, h, hd)).astype(f32),
             rng.uniform(-7, -2, (1, n_t, h)).astype(f32), -rng.uniform(0.5, 8, (h, n if m1 else 1)).astype(f32),
             rng.standard_normal((1, n_t, 1, n)).astype(f32), rng.standard_normal((1, n_t, 1, n)).astype(f32),
             np.zeros(1, np.int64))
        if args.op == "scan":
            def call():
                return ssmgrad.ssm_scan(*a)
        else:
            g = rng.standard_normal(ssmgrad.ssm_scan(*a).shape).astype(f32)
            kept = ssmgrad.ssm_scan(*a, keep_states=True)[1] if args.kept else None

            def call():
                return ssmgrad.ssm_scan_back(*a, g, chunk_states=kept)
    else:
        if args.shape != "conv1536":
            ap.error("conv ops take conv1536")
        sx = rng.standard_normal((1, 1536, n_t + 3)).astype(f32)
        c = rng.standard_normal((1536, 4)).astype(f32)
        g = rng.standard_normal((1, n_t, 1536)).astype(f32)
        fn = {"conv": lambda: ssmgrad.ssm_conv(sx, c), "conv_back": lambda: ssmgrad.ssm_conv_back(sx, c, g),
              "conv_back_weight": lambda: ssmgrad.ssm_conv_back_weight(sx, c, g)}[args.op]

        def call():
            return fn()
    call()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        call()
        calls += 1
    per = (time.perf_counter() - t0) / calls
    print(f"{args.op} {args.shape} n_t={n_t} {args.threads}T: {calls} calls, {per * 1e3:.3g} ms per call, "
          f"{per / n_t * 1e6:.3g} us per token")


if __name__ == "__main__":
    main()
