#!/usr/bin/env python
"""ssmgrad's calls next to one busy process against the same calls on a quiet machine.

    python benchmarks/bench_busy.py                    # about 2 minutes
    python benchmarks/bench_busy.py --quick            # a smoke test

Small and medium scan calls are timed next to one busy process (a Python loop spinning on one core)
and without it, in alternating phases of one child process; ratio of medians, for ssmgrad's
defaults and for the former defaults (spinning OpenMP threads, threads from 2^16 multiply-adds).
ssmgrad is validated against the float64 reference first. Writes busy.md (--out, default a temp
dir); bench.py puts the same table in results.md ("Next to a busy process").
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from common import (FULL_SHAPES, fmt_ms, load_ssmgrad, log, parser, scan_inputs, scan_sizes, settings,
                    validate_first, write_section)

# Calls timed next to one busy process (a Python loop spinning on one core), against the same
# calls on the machine as it otherwise is, in alternating phases of one child process: the
# spinner is stopped (SIGSTOP) for the quiet phases and continued for the busy ones, so load
# from elsewhere falls on both alike. Each variant runs in fresh processes because the OpenMP
# runtime reads its wait policy once, when it is loaded.
BUSY_CALLS = [   # label, shape, n_t, forward only?
    ("small: Mamba-2 forward, n_t=1 (decode step)", "mamba2", 1, True),
    ("small: Mamba-2 fwd+bwd, n_t=8", "mamba2", 8, False),
    ("medium: Mamba-2 fwd+bwd, n_t=64", "mamba2", 64, False),
    ("medium: Mamba-1 fwd+bwd, n_t=256", "mamba1", 256, False),
]
BUSY_VARIANTS = [   # label, environment, min work per thread (None: the build's default)
    ("ssmgrad's defaults", {}, None),
    # the OpenMP runtimes' own defaults (libgomp spins 300000 times, libomp 200 ms) and the old
    # work threshold: ssmgrad's former defaults
    ("the former defaults (spinning OpenMP threads, threads from 2^16 multiply-adds)",
     {"GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}, 1 << 16),
]


def busy_child(spec):
    import signal
    import ssmgrad as sg
    import _ssmgrad
    if spec["min_work"] is not None:
        _ssmgrad._set_min_work_per_thread(spec["min_work"])
    sg.set_num_threads(spec["threads"])
    calls = []
    for label, shape, n_t, fwd_only in BUSY_CALLS:
        p = FULL_SHAPES[shape][1]
        a = scan_inputs(p, n_t, np.float32, np.random.default_rng(n_t))
        args = [a[k] for k in ("s", "x", "dt", "A", "B", "C", "ids")]
        g = np.ones(sum(scan_sizes(p, n_t)), np.float32)
        calls.append((label, (lambda a=args: sg.ssm_scan(*a)) if fwd_only else
                      (lambda a=args, g=g: (sg.ssm_scan(*a), sg.ssm_scan_back(*a, g)))))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.kill(spinner.pid, signal.SIGSTOP)
    res = {label: {"quiet": [], "busy": []} for label, _ in calls}
    try:
        for _, fn in calls:
            fn()
        for r in range(spec["rounds"]):
            for phase in ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet"):
                if phase == "busy":
                    os.kill(spinner.pid, signal.SIGCONT)
                    time.sleep(0.05)
                for label, fn in calls:
                    for _ in range(spec["reps"]):
                        t0 = time.perf_counter()
                        fn()
                        res[label][phase].append(time.perf_counter() - t0)
                if phase == "busy":
                    os.kill(spinner.pid, signal.SIGSTOP)
    finally:
        spinner.kill()
        spinner.wait()
    print(json.dumps(res))


def busy_machine(threads, rounds, reps, log, repeats=2):
    """{variant: {call: {"quiet": [...], "busy": [...]}}}: children of each variant alternate."""
    out = {label: {c[0]: {"quiet": [], "busy": []} for c in BUSY_CALLS} for label, _, _ in BUSY_VARIANTS}
    base_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    for rep in range(repeats):
        for label, env, min_work in BUSY_VARIANTS:
            log(f"  busy machine: {label} ({rep + 1}/{repeats})")
            spec = dict(threads=threads, rounds=rounds, reps=reps, min_work=min_work)
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--busy-child", json.dumps(spec)],
                               env=dict(base_env, **env), capture_output=True, text=True, timeout=3600)
            if r.returncode != 0:
                raise RuntimeError(f"busy-machine child failed: {r.stderr[-2000:]}")
            for call, v in json.loads(r.stdout.strip().splitlines()[-1]).items():
                for phase in ("quiet", "busy"):
                    out[label][call][phase] += v[phase]
    return out


def busy_table(res, threads):
    md = [f"ssmgrad on {threads} threads, float32, one sequence; medians over the samples of each phase, "
          "ratio = busy median / quiet median, and the busy phase's 90th percentile over the quiet median:", "",
          "| call | " + " | ".join(f"{v} quiet ms | busy ms | ratio | p90 ratio" for v in res) + " |",
          "|---|" + "---:|---:|---:|---:|" * len(res)]
    for call in next(iter(res.values())):
        cells = []
        for v in res.values():
            q, b = statistics.median(v[call]["quiet"]), statistics.median(v[call]["busy"])
            p90 = float(np.percentile(v[call]["busy"], 90))
            cells.append(f"{fmt_ms(q)} | {fmt_ms(b)} | {b / q:.2f}x | {p90 / q:.1f}x")
        md.append(f"| {call} | " + " | ".join(cells) + " |")
    first = next(iter(res))
    worst = max(statistics.median(v["busy"]) / statistics.median(v["quiet"]) for v in res[first].values())
    md += ["", f"Target, next to one busy process no call above 2.5x its quiet time: worst ratio of "
           f"medians, {first}: {worst:.2f}x ({'met' if worst <= 2.5 else 'MISSED'})."]
    return md


BUSY_INTRO = ("One busy process (a Python loop on one core) beside ssmgrad's calls, in phases alternating with "
              "quiet ones (`python benchmarks/bench_busy.py` runs only this).")


def busy_section(threads, quick):
    """The section's lines, at the largest thread count."""
    res = busy_machine(max(threads), 2 if quick else 8, 2 if quick else 10, log)
    return ["", "## Next to a busy process", "", BUSY_INTRO, ""] + busy_table(res, max(threads))


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--busy-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.busy_child:
        busy_child(json.loads(args.busy_child))
        return 0
    s = settings(args)
    sg = load_ssmgrad()
    failures, val_lines = validate_first(sg, {"mamba1": ["ssmgrad"], "mamba2": ["ssmgrad"]}, s["cfg"])
    section = [] if failures else busy_section(s["threads"], args.quick)
    return write_section(sg, args, "busy", section, val_lines, failures)


if __name__ == "__main__":
    sys.exit(main())
