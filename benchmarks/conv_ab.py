"""Two builds of ssmgrad's conv kernels side by side in one process (interleaved rounds, 1 thread),
against a numpy copy of the same bytes timed in each round: how the conv's bandwidth changed.

    # build the other version (e.g. the parent commit) into a directory, then:
    git archive --format=tar <commit> | (mkdir /tmp/old && tar -x -C /tmp/old)
    pip install --no-build-isolation --no-deps --target /tmp/old-inst /tmp/old
    python benchmarks/conv_ab.py /tmp/old-inst [--n-t 512,2048,8192] [--rounds 25] [--fresh]

"new" is the ssmgrad installed in this Python. Bytes per call as in conv_bw.py (every input
read once, every output written once); % = the median over rounds of copy time / kernel time;
"best" = fastest copy / fastest kernel.
"""
import argparse
import glob
import importlib.util
import os
import statistics
import sys
import time

import numpy as np


def load(path):
    spec = importlib.util.spec_from_file_location("_ssmgrad", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="directory holding the other build's _ssmgrad*.so (pip install --target)")
    ap.add_argument("--n-t", default="512,2048,8192")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--fresh", action="store_true", help="fresh outputs instead of out=")
    args = ap.parse_args()
    old = load(glob.glob(os.path.join(args.old, "_ssmgrad*.so"))[0])
    sys.modules.pop("_ssmgrad", None)
    import ssmgrad
    new = load(glob.glob(os.path.join(os.path.dirname(os.path.dirname(ssmgrad.__file__)), "_ssmgrad*.so"))[0])
    d, K, R = 1792, 4, args.rounds
    print(f"d_inner {d}, d_conv {K}, float32, 1 thread, {'fresh outputs' if args.fresh else 'out='}, {R} rounds")
    for n_t in map(int, args.n_t.split(",")):
        rng = np.random.default_rng(0)
        sx = rng.standard_normal((1, d, K - 1 + n_t)).astype(np.float32)
        c = rng.standard_normal((d, K)).astype(np.float32)
        g = rng.standard_normal((1, n_t, d)).astype(np.float32)
        y, dsx, dc = np.empty_like(g), np.empty_like(sx), np.empty_like(c)
        nb = {"fwd": sx.nbytes + c.nbytes + y.nbytes, "d_sx": g.nbytes + c.nbytes + dsx.nbytes,
              "d_c": sx.nbytes + g.nbytes + dc.nbytes}
        src = np.ones(nb["fwd"] // 8, np.float32)
        dst = np.ones_like(src)
        o, o2 = (None, None) if args.fresh else (y, dsx)
        fns = {m: {"fwd": lambda m=mod: m.ssm_conv(sx, c, 1, o),
                   "d_sx": lambda m=mod: m.ssm_conv_back(sx, c, g, 1, o2),
                   "d_c": lambda m=mod: m.ssm_conv_back_weight(sx, c, g, 1, dc)} for m, mod in (("old", old), ("new", new))}
        want = [f() for f in fns["old"].values()]
        got = [f() for f in fns["new"].values()]
        same = all(np.array_equal(a, b) for a, b in zip(want, got))
        res = {}
        for r in range(R + 1):
            for name in nb:
                for m in ("old", "new"):
                    t0 = time.perf_counter()
                    np.copyto(dst, src)
                    tc = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    fns[m][name]()
                    tk = time.perf_counter() - t0
                    if r:
                        res.setdefault((m, name), []).append((tk, tc))
        for m in ("old", "new"):
            parts = [(n, nb[n], res[(m, n)]) for n in nb]
            parts.append(("bwd", nb["d_sx"] + nb["d_c"],
                          [(a[0] + b[0], a[1] + b[1]) for a, b in zip(res[(m, "d_sx")], res[(m, "d_c")])]))
            parts.append(("fwd+bwd", sum(nb.values()),
                          [tuple(map(sum, zip(*q))) for q in zip(*(res[(m, n)] for n in nb))]))
            print(f"n_t {n_t:5d} {m}: " + "  ".join(
                f"{n} {b / statistics.median(t for t, _ in v) / 1e9:5.2f} GB/s "
                f"{100 * statistics.median(cc / t for t, cc in v):3.0f}% (best {100 * min(cc for _, cc in v) / min(t for t, _ in v):3.0f}%)"
                for n, b, v in parts)
                + f"  {statistics.median(t for t, _ in parts[-1][2]) / n_t * 1e6:.3f} us/token")
        print(f"n_t {n_t:5d}: outputs of old and new bitwise {'identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
