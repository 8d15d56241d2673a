"""The conv's bandwidth: GB/s of ssm_conv (fwd) and ssm_conv_back + ssm_conv_back_weight
(bwd) against a numpy copy of the same number of bytes, in interleaved rounds, on one thread.

Bytes moved, float32, per call: every input read once, every output written once.
    fwd  ssm_conv:             sx + c read, y written
    bwd  ssm_conv_back:        grad + c read, d_sx written
         ssm_conv_back_weight: sx + grad read, d_c written
(so bwd = 2 grad + sx + d_sx + 2 c + d_c). The copy is np.copyto of half that many bytes into a
buffer written before (read + write = the same bytes). Each round times, in turn: the copy of
fwd's bytes, fwd, the copy of bwd's bytes, bwd; the figure is the median over rounds of
(bytes / time), and the % is the median over rounds of the ratio to the copy of the same round
(so load from other processes that comes and goes hits both sides alike). Outputs are written
into buffers allocated once (`out=`, the kernels' own speed) unless --fresh (the default call:
every result a new array, whose pages the kernel faults in).

    python benchmarks/conv_bw.py [--n-t 512,2048,8192] [--rounds 15] [--fresh] [--cold] [--threads 1]

With warm inputs (the default) the n_t 512 case (7 MB in, 7 MB out) stays in a 32 MB L3 between
calls, and so does the copy of its bytes; --cold makes every size come from memory.
"""
import argparse
import statistics
import time

import numpy as np

import ssmgrad as sg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-t", default="512,2048,8192")
    ap.add_argument("--d-inner", type=int, default=1792)
    ap.add_argument("--d-conv", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fresh", action="store_true", help="fresh output arrays (the default call) instead of out=")
    ap.add_argument("--cold", action="store_true", help="read 96 MB before each timed call (the copies too), so "
                                                        "every n_t reads its inputs from memory")
    args = ap.parse_args()
    sg.set_num_threads(args.threads)
    d, K = args.d_inner, args.d_conv
    evict = np.ones((96 << 20) // 4, dtype=np.float32)
    print(f"conv bandwidth: d_inner {d}, d_conv {K}, float32, {args.threads} thread(s), "
          f"{'fresh outputs' if args.fresh else 'out= buffers'}, {'cold' if args.cold else 'warm'} inputs, "
          f"{args.rounds} interleaved rounds, "
          f"SIMD {_simd()}")
    print(f"{'n_t':>6} {'part':>7} {'MB':>7} {'GB/s':>7} {'copy GB/s':>9} {'% copy':>7} {'us/token':>9}")
    per_token = {}
    for n_t in [int(x) for x in args.n_t.split(",")]:
        rng = np.random.default_rng(n_t)
        sx = rng.standard_normal((1, d, K - 1 + n_t)).astype(np.float32)
        c = rng.standard_normal((d, K)).astype(np.float32)
        g = rng.standard_normal((1, n_t, d)).astype(np.float32)
        y, dsx, dc = np.empty_like(g), np.empty_like(sx), np.empty_like(c)
        b_f = sx.nbytes + c.nbytes + y.nbytes
        b_x = g.nbytes + c.nbytes + dsx.nbytes
        b_c = sx.nbytes + g.nbytes + dc.nbytes
        src = {k: np.ones(nb // 8, np.float32) for k, nb in (("f", b_f), ("x", b_x), ("c", b_c))}
        dst = {k: np.ones_like(v) for k, v in src.items()}

        def fwd():
            return sg.ssm_conv(sx, c) if args.fresh else sg.ssm_conv(sx, c, out=y)

        def bwd_x():
            return sg.ssm_conv_back(sx, c, g) if args.fresh else sg.ssm_conv_back(sx, c, g, out=dsx)

        def bwd_c():
            return sg.ssm_conv_back_weight(sx, c, g) if args.fresh else sg.ssm_conv_back_weight(sx, c, g, out=dc)

        def timed(f):
            if args.cold:
                float(evict.sum())
            t0 = time.perf_counter()
            r = f()
            dt = time.perf_counter() - t0
            del r
            return dt

        res = {k: [] for k in ("f", "cf", "x", "cx", "c", "cc")}
        for r in range(args.rounds + 1):
            t = {}
            for k, f in (("f", fwd), ("x", bwd_x), ("c", bwd_c)):
                t["c" + k] = timed(lambda: np.copyto(dst[k], src[k]))
                t[k] = timed(f)
            if r:
                for k, v in t.items():
                    res[k].append(v)

        def tot(keys):
            return [sum(v) for v in zip(*(res[k] for k in keys))]
        for name, keys, nb in (("fwd", "f", b_f), ("  d_sx", "x", b_x), ("  d_c", "c", b_c),
                               ("bwd", "xc", b_x + b_c), ("fwd+bwd", "fxc", b_f + b_x + b_c)):
            tk, tc = tot(keys), tot("c" + k for k in keys)
            gbs = nb / statistics.median(tk) / 1e9
            cgbs = nb / statistics.median(tc) / 1e9
            pct = 100 * statistics.median(c_ / k_ for k_, c_ in zip(tk, tc))
            print(f"{n_t:6d} {name:>7} {nb / 1e6:7.1f} {gbs:7.2f} {cgbs:9.2f} {pct:6.0f}% "
                  f"{statistics.median(tk) / n_t * 1e6:9.3f}")
            per_token[n_t] = statistics.median(tk) / n_t
    if len(per_token) > 1:
        v = list(per_token.values())
        print(f"fwd+bwd time per token over n_t {list(per_token)}: spread {100 * (max(v) / min(v) - 1):.0f}% "
              f"(max / min - 1)")


def _simd():
    import io
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        sg.show_config()
    for line in buf.getvalue().splitlines():
        if "SIMD selected" in line:
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    main()
