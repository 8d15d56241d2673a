#!/usr/bin/env python
"""Interleaved A/B timing of several builds of ssmgrad (e.g. two compilers, or before/after).

    # each DIR is a source tree built in place, e.g.
    #   CC=clang python setup.py build_ext --inplace      (in a copy of the tree)
    python benchmarks/ab_builds.py --rounds 8 DIR_A DIR_B [DIR_C ...]

Each round starts one fresh process per build (in alternating order) that imports ssmgrad from
that DIR only (checked), validates (first round) its outputs and gradients at the timed shapes
against the float64 torch reference of tests/reference.py (max error relative to the largest
value < 1e-3), and times each op on one thread: the median of repeated calls for about 0.6 s,
each call timed in CPU time of the calling thread (time.thread_time: with one thread set the
kernels run on it), so that time spent descheduled on a busy machine is not counted (cache and
core sharing with other processes still are). Printed per op: the median over rounds of each
build's time, and the median over rounds of its ratio to the first build's time in the same
round, so that load that changes between rounds cancels out.
Ops: scan and scan_back at Mamba-1 (1536 heads x 1 x d_state 16) and Mamba-2 (24 heads x 64 x
128) shapes, conv, conv_back, conv_back_weight at d_inner 1536, d_conv 4; n_t 512, float32.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r'''
import json, os, sys, time
d = os.path.realpath(sys.argv[1])
n_t = int(sys.argv[2])
sys.path.insert(0, d)
import numpy as np
import ssmgrad
import _ssmgrad
assert os.path.realpath(_ssmgrad.__file__).startswith(d + os.sep), _ssmgrad.__file__
ssmgrad.set_num_threads(1)
rng = np.random.default_rng(0)
f32 = np.float32
times, errs = {}, {}


def timeit(name, fn, secs=0.6):
    fn()
    ts = []
    t_end = time.perf_counter() + secs
    while time.perf_counter() < t_end or len(ts) < 5:
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    ts.sort()
    times[name] = ts[len(ts) // 2]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


validate = sys.argv[4] == "1"
if validate:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(sys.argv[3])), "..", "tests"))
    import reference  # noqa: E402  (the torch float64 reference of the test suite)

for shape, (h, hd, n, m1) in {"mamba1": (1536, 1, 16, True), "mamba2": (24, 64, 128, False)}.items():
    g = 1
    s = rng.standard_normal((1, h, hd, n)).astype(f32)
    x = rng.standard_normal((1, n_t, h, hd)).astype(f32)
    dt = rng.standard_normal((1, n_t, h)).astype(f32)
    A = -np.abs(rng.standard_normal((h, n) if m1 else (h, 1))).astype(f32)
    B = rng.standard_normal((1, n_t, g, n)).astype(f32)
    C = rng.standard_normal((1, n_t, g, n)).astype(f32)
    ids = np.zeros(1, np.int64)
    out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
    grad = rng.standard_normal(out.shape).astype(f32)
    if validate:
        errs[f"scan_{shape}"] = rel_err(out, reference.ref_scan_np(s, x, dt, A, B, C, ids))
        want = reference.ref_scan_grads(s, x, dt, A, B, C, ids, grad)
        gin = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad)
        errs[f"scan_back_{shape}"] = rel_err(gin, np.concatenate([want[k].ravel() for k in "s x dt B C".split()]))
    timeit(f"scan_{shape}", lambda: ssmgrad.ssm_scan(s, x, dt, A, B, C, ids))
    timeit(f"scan_back_{shape}", lambda: ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad))
d_inner, d_conv = 1536, 4
sx = rng.standard_normal((1, d_inner, d_conv - 1 + n_t)).astype(f32)
c = rng.standard_normal((d_inner, d_conv)).astype(f32)
gy = rng.standard_normal((1, n_t, d_inner)).astype(f32)
if validate:
    errs["conv"] = rel_err(ssmgrad.ssm_conv(sx, c), reference.ref_conv_np(sx, c))
    want = reference.ref_conv_grads(sx, c, gy)
    errs["conv_back"] = rel_err(ssmgrad.ssm_conv_back(sx, c, gy), want["sx"])
    errs["conv_back_weight"] = rel_err(ssmgrad.ssm_conv_back_weight(sx, c, gy), want["c"])
timeit("conv", lambda: ssmgrad.ssm_conv(sx, c))
timeit("conv_back", lambda: ssmgrad.ssm_conv_back(sx, c, gy))
timeit("conv_back_weight", lambda: ssmgrad.ssm_conv_back_weight(sx, c, gy))
print(json.dumps({"times": times, "errs": errs, "simd": ssmgrad._ext.build_info()["simd_compiled"]}))
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="source trees with an in-place build")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--n-t", type=int, default=512)
    ap.add_argument("--ops", default="", help="comma-separated subset of the ops to print")
    args = ap.parse_args()
    dirs = [os.path.realpath(d) for d in args.dirs]
    data = {d: {} for d in dirs}
    for r in range(args.rounds):
        for d in (dirs if r % 2 == 0 else dirs[::-1]):
            out = subprocess.run([sys.executable, "-c", WORKER, d, str(args.n_t), os.path.abspath(__file__),
                                  "1" if r == 0 else "0"], capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{d}: {out.stderr}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            bad = {k: e for k, e in res["errs"].items() if not e < 1e-3}
            if bad:
                sys.exit(f"{d}: outputs differ from the float64 reference: {bad}")
            if r == 0:
                print(f"{d}: {res['simd']}; max rel. err vs reference {max(res['errs'].values()):.1e}")
            for k, v in res["times"].items():
                data[d].setdefault(k, []).append(v)
    ref = dirs[0]
    names = [os.path.basename(d) for d in dirs]
    print(f"\n{'op (us, x vs ' + names[0] + ')':28s} " + " ".join(f"{n:>16s}" for n in names))
    for op in data[ref]:
        if args.ops and op not in args.ops.split(","):
            continue
        cells = []
        for d in dirs:
            ratio = statistics.median(b / a for a, b in zip(data[ref][op], data[d][op]))
            cells.append(f"{statistics.median(data[d][op]) * 1e6:9.0f} x{ratio:4.2f}")
        print(f"{op:28s} " + " ".join(f"{c:>16s}" for c in cells))


if __name__ == "__main__":
    main()
