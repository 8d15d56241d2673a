"""The Mamba-2 scan forward's two forms side by side: the token recurrence and the chunked
(matrix-product, SSD) form, interleaved in one run (the machine may be shared: the ratio of
medians of alternating calls is the figure to read, not the absolute times).

    python benchmarks/ab_scan_fwd.py [--nt 16,64,512,2048,8192] [--threads 1,2] [--reps 7]
                                     [--shapes 130m,2.7b,grouped] [--dtype float32|float64] [--peer]

Each shape is first checked: the two forms' outputs agree to float32 rounding. GFLOP/s columns:
the recurrence's count, 5 FLOP per state element and token (2 mul + 1 add for the update, 2 for
y); the chunked form's count per token and head, 4 N P (C.S0 and B^T.(decay Xs)) + P (Q + 1)
(the lower-triangular (L o CB).Xs) plus, per token and block of up to 8 heads of a group, N (Q + 1)
(C.B^T, lower triangle), with N = d_state, P = head_dim, Q = 64. Compare them with the core's FMA
peak (benchmarks/peak.c: 117 GFLOP/s on the reference machine, idle).

--peer also times forward+backward against the project's PyTorch SSD formulation
(ssmgrad/_torch_peers.scan_ssd), validated against ssmgrad's output first, interleaved too.
"""
import argparse
import statistics
import time

import numpy as np

import ssmgrad

from ab_scan_back import SHAPES, inputs

Q, FBH = 64, 8


def flops(n_head, head_dim, d_state, n_group, n_t):
    N, P = d_state, head_dim
    hpg = n_head // n_group
    blocks = n_group * -(-hpg // FBH)
    rec = 5.0 * N * P * n_head * n_t
    chk = n_t * (n_head * (4.0 * N * P + P * (Q + 1)) + blocks * N * (Q + 1))
    return rec, chk


def peer_fb(args, grad_y, grad_s, torch, scan_ssd):
    s, x, dt, A, B, C, ids = args
    t = [torch.from_numpy(a).requires_grad_(a.dtype != np.int32) for a in (s, x, dt, A, B, C)]
    y, fin = scan_ssd(*t, torch.from_numpy(ids.astype(np.int64)))
    ((y * grad_y).sum() + (fin * grad_s).sum()).backward()
    return y.detach().numpy(), fin.detach().numpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nt", default="16,64,512,2048,8192")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shapes", default="130m,2.7b,grouped")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--peer", action="store_true")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ext = ssmgrad._ext
    dtype = np.dtype(a.dtype)
    if a.peer:
        import torch
        from ssmgrad._torch_peers import scan_ssd
    hdr = ("| shape | n_t | threads | recurrence ms | chunked ms | chunked/recurrence | auto picks | "
           "recurrence GFLOP/s | chunked GFLOP/s (chunked count) |")
    if a.peer:
        hdr += " ssmgrad fwd+bwd ms | torch SSD fwd+bwd ms | SSD / ssmgrad |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for name in a.shapes.split(","):
        nh, hd, ds, ng = SHAPES[name]
        for n_t in map(int, a.nt.split(",")):
            args = inputs(rng, nh, hd, ds, ng, n_t, dtype)
            res = {}
            for mode in ("recurrence", "chunked"):
                ext._set_scan_fwd(mode)
                res[mode] = ssmgrad.ssm_scan(*args)
            ext._set_scan_fwd("auto")
            auto = ssmgrad.ssm_scan(*args)
            picks = [m for m in res if res[m].tobytes() == auto.tobytes()]
            r0, r1 = res["recurrence"], res["chunked"]
            err = float(np.max(np.abs(r0 - r1)) / max(1.0, float(np.max(np.abs(r0)))))
            assert err < (1e-4 if dtype == np.float32 else 1e-12), (name, n_t, err)
            if a.peer:
                grad = rng.standard_normal(r0.shape).astype(dtype)
                n_y = n_t * nh * hd
                gy = torch.from_numpy(grad[:n_y].reshape(1, n_t, nh, hd))
                gs = torch.from_numpy(grad[n_y:].reshape(1, nh, hd, ds))
                y, fin = peer_fb(args, gy, gs, torch, scan_ssd)
                perr = float(np.max(np.abs(np.concatenate([y.ravel(), fin.ravel()]) - auto))
                             / max(1.0, float(np.max(np.abs(auto)))))
                assert perr < 1e-3, ("torch SSD disagrees", name, n_t, perr)
            f_rec, f_chk = flops(nh, hd, ds, ng, n_t)
            for nth in map(int, a.threads.split(",")):
                ssmgrad.set_num_threads(nth)
                if a.peer:
                    torch.set_num_threads(nth)
                t = {"recurrence": [], "chunked": [], "ours_fb": [], "peer_fb": []}
                for _ in range(a.reps):
                    for mode in ("recurrence", "chunked"):
                        ext._set_scan_fwd(mode)
                        t0 = time.perf_counter()
                        ssmgrad.ssm_scan(*args)
                        t[mode].append(time.perf_counter() - t0)
                    ext._set_scan_fwd("auto")
                    if a.peer:
                        t0 = time.perf_counter()
                        ssmgrad.ssm_scan(*args)
                        ssmgrad.ssm_scan_back(*args, grad, return_dA=True)
                        t["ours_fb"].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        peer_fb(args, gy, gs, torch, scan_ssd)
                        t["peer_fb"].append(time.perf_counter() - t0)
                m = {k: statistics.median(v) for k, v in t.items() if v}
                line = (f"| {name} | {n_t} | {nth} | {m['recurrence'] * 1e3:.3g} | {m['chunked'] * 1e3:.3g} | "
                        f"{m['chunked'] / m['recurrence']:.2f} | {'/'.join(picks)} | {f_rec / m['recurrence'] / 1e9:.3g} | "
                        f"{f_chk / m['chunked'] / 1e9:.3g} |")
                if a.peer:
                    line += f" {m['ours_fb'] * 1e3:.3g} | {m['peer_fb'] * 1e3:.3g} | {m['peer_fb'] / m['ours_fb']:.2f} |"
                print(line, flush=True)
    ext._set_scan_fwd("auto")


if __name__ == "__main__":
    main()
