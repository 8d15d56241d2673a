"""The Mamba-2 scan backward's two forms side by side: the checkpointed reverse recurrence and
the chunked (matrix-product) form, interleaved in one run (the machine may be shared: the
ratio of medians of alternating calls is the figure to read, not the absolute times).

    python benchmarks/ab_scan_back.py [--nt 512,2048,8192] [--threads 1,2] [--reps 5] [--shapes 130m,2.7b,grouped]
                                      [--dtype float32|float64]

Each call is first checked: the two forms' gradients agree to float32 rounding.
"""
import argparse
import statistics
import time

import numpy as np

import ssmgrad

SHAPES = {  # name: (n_head, head_dim, d_state, n_group)
    "130m": (24, 64, 128, 1),
    "2.7b": (80, 64, 128, 1),
    "grouped": (128, 64, 128, 8),
}


def inputs(rng, n_head, head_dim, d_state, n_group, n_t, dtype=np.float32):
    s = rng.standard_normal((1, n_head, head_dim, d_state)).astype(dtype) * 0.1
    x = rng.standard_normal((1, n_t, n_head, head_dim)).astype(dtype)
    dt = (rng.standard_normal((1, n_t, n_head)) * 0.5 - 2.0).astype(dtype)
    A = -np.exp(rng.standard_normal((n_head, 1))).astype(dtype)
    B = rng.standard_normal((1, n_t, n_group, d_state)).astype(dtype) * 0.3
    C = rng.standard_normal((1, n_t, n_group, d_state)).astype(dtype) * 0.3
    ids = np.zeros(1, dtype=np.int32)
    return s, x, dt, A, B, C, ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nt", default="512,2048,8192")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="130m,2.7b,grouped")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ext = ssmgrad._ext
    print("| shape | n_t | threads | fwd ms | bwd recurrence ms | bwd chunked ms | chunked/recurrence | bwd/fwd rec | bwd/fwd chunked |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.shapes.split(","):
        nh, hd, ds, ng = SHAPES[name]
        for n_t in map(int, a.nt.split(",")):
            dtype = np.dtype(a.dtype)
            args = inputs(rng, nh, hd, ds, ng, n_t, dtype)
            out = ssmgrad.ssm_scan(*args)
            grad = rng.standard_normal(out.shape).astype(dtype)
            for nth in map(int, a.threads.split(",")):
                ssmgrad.set_num_threads(nth)
                res = {}
                for mode in ("recurrence", "chunked"):
                    ext._set_scan_back(mode)
                    res[mode] = ssmgrad.ssm_scan_back(*args, grad, return_dA=True)
                g0, g1 = res["recurrence"][0], res["chunked"][0]
                err = float(np.max(np.abs(g0 - g1)) / max(1.0, float(np.max(np.abs(g0)))))
                assert err < (1e-4 if dtype == np.float32 else 1e-12), (name, n_t, err)
                t = {"fwd": [], "recurrence": [], "chunked": []}
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    ssmgrad.ssm_scan(*args)
                    t["fwd"].append(time.perf_counter() - t0)
                    for mode in ("recurrence", "chunked"):
                        ext._set_scan_back(mode)
                        t0 = time.perf_counter()
                        ssmgrad.ssm_scan_back(*args, grad, return_dA=True)
                        t[mode].append(time.perf_counter() - t0)
                m = {k: statistics.median(v) * 1e3 for k, v in t.items()}
                print(f"| {name} | {n_t} | {nth} | {m['fwd']:.2f} | {m['recurrence']:.2f} | {m['chunked']:.2f} | "
                      f"{m['chunked'] / m['recurrence']:.2f} | {m['recurrence'] / m['fwd']:.2f} | "
                      f"{m['chunked'] / m['fwd']:.2f} |", flush=True)
    ext._set_scan_back("auto")


if __name__ == "__main__":
    main()
