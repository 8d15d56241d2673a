#!/usr/bin/env python
"""The conv's forward + both backwards per token in four variants: fresh or reused outputs, warm or
cold inputs.

    python benchmarks/bench_conv_variants.py           # n_t 512, 2048, 8192; 1 and 2 threads
    python benchmarks/bench_conv_variants.py --quick   # tiny shapes: a smoke test

Variants taken in turn (round-robin): outputs fresh (the default call) or written into reused
buffers (`out=`), inputs warm (the same arrays again) or cold (64 MB read in between). Reports the
spread of time per token over n_t and the share of numpy's copy bandwidth. ssmgrad's conv is
validated against the float64 reference first. Writes conv_variants.md (--out, default a temp
dir); bench.py puts the same lines in results.md's targets section.
"""

import statistics
import sys
import time

import numpy as np

from common import (FULL_SHAPES, QUICK_SHAPES, conv_inputs, copy_bandwidth, load_ssmgrad, log, parser,
                    settings, validate_first, write_section)

def conv_variants(sg, shapes, sizes, threads, rounds, log):
    """Conv forward + both backwards per token, in four variants taken in turn (round-robin):
    outputs fresh (the default call) or written into reused buffers (``out=``), and inputs warm
    (the same arrays again: at n_t 512 they stay in the 32 MB L3 between calls) or cold (64 MB
    read in between, so every n_t streams its inputs from memory). Returns
    {(shape, n_t, threads, variant): [seconds per fwd+bwd]} and the results agree bitwise."""
    times = {}
    evict = np.ones((96 << 20) // 4, dtype=np.float32)
    for shape, (kind, p) in shapes.items():
        if kind != "conv":
            continue
        for n_t in sizes:
            rng = np.random.default_rng(n_t)
            a = conv_inputs(p, n_t, np.float32, rng)
            sx, c = a["sx"], a["c"]
            g = rng.standard_normal((1, n_t, p["d_inner"])).astype(np.float32)
            outs = (np.empty((1, n_t, p["d_inner"]), np.float32), np.empty_like(sx), np.empty_like(c))
            want = (sg.ssm_conv(sx, c), sg.ssm_conv_back(sx, c, g), sg.ssm_conv_back_weight(sx, c, g))

            def call(reuse):
                if reuse:
                    return (sg.ssm_conv(sx, c, out=outs[0]), sg.ssm_conv_back(sx, c, g, out=outs[1]),
                            sg.ssm_conv_back_weight(sx, c, g, out=outs[2]))
                return sg.ssm_conv(sx, c), sg.ssm_conv_back(sx, c, g), sg.ssm_conv_back_weight(sx, c, g)
            for r in range(rounds + 1):
                for thr in threads:
                    sg.set_num_threads(thr)
                    for variant in ("fresh warm", "out= warm", "fresh cold", "out= cold"):
                        if "cold" in variant:
                            float(evict.sum())
                        t0 = time.perf_counter()
                        res = call(variant.startswith("out="))
                        dt = time.perf_counter() - t0
                        if not r:
                            assert all(np.array_equal(u, v) for u, v in zip(res, want)), (shape, n_t, variant)
                        else:
                            times.setdefault((shape, n_t, thr, variant), []).append(dt)
                        del res
            del outs, want
        log(f"  {shape:9s} conv variants: {rounds} rounds of n_t {sizes} x threads {threads}")
    sg.set_num_threads(max(threads))
    return times


def conv_variant_lines(cv, shapes, threads, bw):
    """The conv targets (docs/performance.md) per variant of conv_variants: spread of time per token over n_t 512 to
    8192, and GB/s of the bytes fwd + bwd must move at the largest n_t on one thread."""
    lines = []
    for shape, (kind, p) in shapes.items():
        if kind != "conv":
            continue
        for variant in ("fresh warm", "out= warm", "fresh cold", "out= cold"):
            for thr in threads:
                pts = sorted((n_t, statistics.median(v) / n_t) for (sh, n_t, th, va), v in cv.items()
                             if sh == shape and th == thr and va == variant and 512 <= n_t <= 8192)
                if len(pts) < 2:
                    continue
                v = [q[1] for q in pts]
                n_big = pts[-1][0]
                moved = 4 * (2 * ((p["d_conv"] - 1 + n_big) * p["d_inner"]) + 3 * n_big * p["d_inner"])
                gbs = moved / (v[-1] * n_big) / 1e9
                bw_txt = f"; at n_t {n_big} {gbs:.3g} GB/s = {100 * gbs / bw:.0f}% of the copy" if bw and thr == 1 else ""
                lines.append(f"- conv {shape} {thr}T, {variant}: fwd+bwd us/token over n_t "
                             f"{[q[0] for q in pts]}: " + ", ".join(f"{x * 1e6:.3g}" for x in v)
                             + f", spread {100 * (max(v) / min(v) - 1):.0f}% (target 25%){bw_txt}.")
    if lines:
        lines.append("- (conv variants: medians of rounds taken in turn; `out=` reuses one output buffer per "
                     "result, `cold` reads 64 MB before each call so the inputs come from memory; bytes moved: "
                     "sx and grad read twice, y, d_sx written, c and d_c ignored; the copy is numpy's "
                     "single-thread copyto into a buffer written before.)")
    return lines


def conv_variants_section(sg, shapes, sizes, threads, quick, bw):
    """The variants' lines for the conv shapes of ``shapes`` at the n_t of ``sizes``."""
    cv = conv_variants(sg, shapes, sorted(n for n in sizes if n >= (0 if quick else 512)), threads,
                       2 if quick else 7, log)
    return conv_variant_lines(cv, shapes, threads, bw)


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--nt", help="comma-separated n_t (default 512,2048,8192; quick 64,256,1024)")
    args = ap.parse_args(argv)
    s = settings(args)
    sg = load_ssmgrad()
    shapes = {k: v for k, v in (QUICK_SHAPES if args.quick else FULL_SHAPES).items() if v[0] == "conv"}
    sizes = [int(v) for v in args.nt.split(",")] if args.nt else ([64, 256, 1024] if args.quick else [512, 2048, 8192])
    failures, val_lines = validate_first(sg, {"conv": ["ssmgrad"]}, s["cfg"])
    section = []
    if not failures:
        bw = copy_bandwidth(64 << 20 if args.quick else 512 << 20)
        section = ["## Conv: fresh and reused outputs, warm and cold inputs", "",
                   f"numpy copy bandwidth {bw:.3g} GB/s."]
        section += conv_variants_section(sg, shapes, sizes, s["threads"], args.quick, bw)
    return write_section(sg, args, "conv_variants", section, val_lines, failures)


if __name__ == "__main__":
    sys.exit(main())
