#!/usr/bin/env python
"""One decode step of one layer against a copy of its state.

    python benchmarks/bench_decode.py                  # 2000 rounds, 1 and 2 threads, about a second
    python benchmarks/bench_decode.py --quick          # 200 rounds

One-token `ssm_scan_update` (the in-place generate path) and `ssm_scan` with n_t = 1 for the
Mamba-2-130m layer (24x64x128 state) and the Mamba-130m layer (1536x16, A per state), one sequence,
against `np.copyto` of the state into a second buffer of the same size (the bytes the update must
read once and write once), taking turns within each round in rotating order. ssmgrad is validated
against the float64 reference first; the update's y and state are checked against ssm_scan's.
Writes decode.md (--out, default a temp dir); bench.py puts the same section in results.md.
"""

import statistics
import sys
import time

import numpy as np

from common import (SCAN_ARGS, TOL, TRAIN_SHAPES, load_ssmgrad, log, parser, rel_err, scan_inputs, settings,
                    validate_first, write_section)

DECODE_SHAPES = ["m2_130m", "m1_130m"]      # keys of TRAIN_SHAPES: one layer's state, one sequence


def decode_vs_copy(sg, threads, rounds, log):
    """One-token decode of one layer against one copy of its state, in the same rounds: each round
    times, in turn, ``ssm_scan_update`` (the in-place generate path), ``ssm_scan`` with n_t = 1 (the
    packed output) and ``np.copyto`` of the state's bytes into a second buffer (the state read once
    and written once, as the update must), so the three see the same cache state and the same load.
    Returns {(shape, threads): {call: [seconds]}} and {shape: state bytes}; checks first that the
    update's y and state equal ssm_scan's to float32 rounding."""
    out, nbytes = {}, {}
    for shape in DECODE_SHAPES:
        p = TRAIN_SHAPES[shape]
        a = scan_inputs(p, 1, np.float32, np.random.default_rng(11))
        args = [a[k] for k in ("x", "dt", "A", "B", "C")]
        s = a["s"].copy()                                         # the cache row, advanced in place
        y = sg.ssm_scan_update(s, *args)
        ref = sg.split(sg.ssm_scan(*(a[k] for k in SCAN_ARGS), a["ids"]), a["x"].shape, a["s"].shape)
        err = max(rel_err(y, ref[0]), rel_err(s, ref[1]))
        if err > TOL["float32"]:
            raise RuntimeError(f"decode {shape}: ssm_scan_update differs from ssm_scan by {err:.1e}")
        dst = np.empty_like(s)
        nbytes[shape] = s.nbytes
        full = [a[k] for k in SCAN_ARGS] + [a["ids"]]
        calls = [("update", lambda: sg.ssm_scan_update(s, *args)), ("scan n_t=1", lambda: sg.ssm_scan(*full)),
                 ("copy", lambda: np.copyto(dst, s))]
        for thr in threads:
            sg.set_num_threads(thr)
            res = {name: [] for name, _ in calls}
            for r in range(rounds + 10):                          # 10 untimed rounds: pool, caches
                for i in range(len(calls)):
                    name, fn = calls[(i + r) % len(calls)]         # rotate the order: none always first
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                    if r >= 10:
                        res[name].append(dt)
            out[(shape, thr)] = res
        log(f"  decode {shape}: {rounds} rounds x threads {threads}, state {s.nbytes / 1e3:.0f} kB")
    sg.set_num_threads(max(threads))
    return out, nbytes


def decode_lines(dec, nbytes):
    md = ["One-token decode of one layer (one sequence, float32) against `np.copyto` of its state into a second "
          "buffer (the bytes the update must read and write), timed in the same rounds in rotating order; "
          "`ratio` = decode / copy, of the medians and of the fastest runs. `update` is "
          "`ssmgrad.ssm_scan_update` (the in-place generate path), `scan n_t=1` is `ssmgrad.ssm_scan` (packed "
          "output, a fresh array). The copy is single-threaded at every thread count.", "",
          "| layer | state kB | thr | update us | scan n_t=1 us | copy us | update / copy | fastest | "
          "scan n_t=1 / copy | fastest | rounds |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, thr), v in dec.items():
        med = {k: statistics.median(x) for k, x in v.items()}
        lo = {k: min(x) for k, x in v.items()}
        md.append(f"| {shape} | {nbytes[shape] / 1e3:.0f} | {thr} | {med['update'] * 1e6:.3g} | {med['scan n_t=1'] * 1e6:.3g} "
                  f"| {med['copy'] * 1e6:.3g} | {med['update'] / med['copy']:.2f}x | {lo['update'] / lo['copy']:.2f}x "
                  f"| {med['scan n_t=1'] / med['copy']:.2f}x | {lo['scan n_t=1'] / lo['copy']:.2f}x | {len(v['copy'])} |")
    return md


def decode_section(sg, threads, quick):
    """(measurements, section lines) for the decode step against a copy of the state."""
    dec, nbytes = decode_vs_copy(sg, threads, 200 if quick else 2000, log)
    return dec, ["", "## Decode step against a copy of its state", ""] + decode_lines(dec, nbytes)


def main(argv=None):
    args = parser(__doc__).parse_args(argv)
    s = settings(args)
    sg = load_ssmgrad()
    failures, val_lines = validate_first(sg, {"mamba1": ["ssmgrad"], "mamba2": ["ssmgrad"]}, s["cfg"])
    section = [] if failures else decode_section(sg, s["threads"], args.quick)[1]
    return write_section(sg, args, "decode", section, val_lines, failures)


if __name__ == "__main__":
    sys.exit(main())
