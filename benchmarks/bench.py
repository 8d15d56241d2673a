#!/usr/bin/env python
"""ssmgrad against the fastest PyTorch CPU formulations of SSM_SCAN and SSM_CONV: every benchmark
script in one run, assembled into benchmarks/results.md (and results.png).

    python benchmarks/bench.py                    # full run (minutes): writes benchmarks/results.md and results.png
    python benchmarks/bench.py --quick            # smoke test (< 1 min), tiny shapes, writes to a temp dir
    python benchmarks/bench.py --only mamba2,ssd --threads 1 --out /tmp/b
    python benchmarks/bench.py --busy             # only the busy-machine measurement (~2 min)
    python benchmarks/bench.py --with-avx2        # AVX-512 host: then the same capped to AVX2, in the same results.md

Each part is a script of its own (run alone, it validates what it times and writes its own section):
bench_kernels.py (the main table, the targets it measures, the interleaved sweep),
bench_conv_variants.py, bench_busy.py, bench_train_shapes.py, bench_compiled.py, bench_decode.py;
targets.py computes the "Scan targets" table from them all, common.py holds what they share. Here:

1. Validate once, before any timing, every implementation any part will time, against the float64
   reference (tests/reference.py, the test suite's oracle); a failing one is reported and not timed.
2. The main table (bench_kernels.py), then the training-scale shapes, the compiled peer, the
   decode step, the interleaved sweep, the conv variants and the busy machine.
3. Write results.md: the machine, each part's section, the scan targets and the validation table.
"""

import datetime
import os
import shutil
import sys
import tempfile
import time

from common import (HERE, add_with_avx2_flag, avx2_report, check_with_avx2, copy_bandwidth, cpu_snapshot, fma_peak, load_ssmgrad, log,
                    machine_description, other_load, parser, settings, validate_first, validation_lines)
import bench_busy
import bench_compiled
import bench_conv_variants
import bench_decode
import bench_kernels
import bench_train_shapes
from targets import scan_targets


def cli(argv):
    ap = parser(__doc__, out_help="directory for results.md and results.png (default: benchmarks/, or a temp "
                                  "dir with --quick)")
    bench_kernels.add_kernel_flags(ap)
    bench_compiled.add_compile_flags(ap)
    ap.add_argument("--no-compiled", action="store_true",
                    help="skip the compiled peer (torch.compile of the SSD form: one compile per shape and thread count)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-step vs state-copy measurement")
    ap.add_argument("--busy", action="store_true", help="only the busy-machine measurement: calls next to one "
                                                            "busy process vs quiet, ssmgrad's defaults vs before")
    ap.add_argument("--no-busy", action="store_true", help="skip the busy-machine measurement")
    ap.add_argument("--no-train", action="store_true", help="skip the training-scale shapes (batches, 2.7B, grouped, Falcon-Mamba)")
    ap.add_argument("--train-only", action="store_true",
                    help="only validation and the training-scale shapes; writes train.md in --out (default a temp dir)")
    add_with_avx2_flag(ap)
    args = ap.parse_args(argv)
    check_with_avx2(ap, args)
    if args.with_avx2 and (args.busy or args.train_only):
        ap.error("--with-avx2 takes the full run (not --busy, --train-only)")
    return ap, args


def plan(ap, args):
    """What this run times: settings, the table's shapes and n_t, the training and compiled cases."""
    s = settings(args)
    shapes, nts, sweep, only_impls = bench_kernels.table_settings(ap, args)
    if args.train_only:
        shapes = {}
    train_cases = [] if args.no_train else (bench_train_shapes.QUICK_TRAIN_CASES if args.quick
                                            else bench_train_shapes.TRAIN_CASES)
    comp_cases = []             # with the Mamba-2 shape, unless the implementations named leave out SSD
    if "mamba2" in shapes and not args.no_compiled and (not only_impls or {"ssd", "ssd_compiled"} & set(only_impls)):
        comp_cases = bench_compiled.compiled_cases(args.quick, nts, only_impls)
    comp_threads = [int(v) for v in args.compiled_threads.split(",")]
    return dict(s, shapes=shapes, nts=nts, sweep=sweep, only_impls=only_impls, train_cases=train_cases,
                comp_cases=comp_cases, comp_threads=comp_threads)


def wanted(p):
    """{validation key: implementations} over every part of the run."""
    want = bench_train_shapes.train_want(p["train_cases"])
    for key, impls in bench_kernels.kernels_want(p["shapes"], p["only_impls"]).items():
        want.setdefault(key, ["ssmgrad"])
        want[key] += [i for i in impls if i not in want[key]]
    for _, _, _, peers in p["comp_cases"]:
        want.setdefault("mamba2", ["ssmgrad"])
        want["mamba2"] += [i for i in peers if i not in want["mamba2"]]
    return want


def train_only(sg, args, train_rows, train_md, peak, load_start, val_lines, failures):
    md = [f"# ssmgrad training-scale shapes (`python benchmarks/bench.py {' '.join(sys.argv[1:])}`)", ""]
    md += machine_description(sg) + [f"- load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end", ""]
    md += train_md + [""] + bench_train_shapes.train_targets(train_rows, peak)
    md += ["", "## Validation (before timing)", ""] + val_lines + [""]
    out = args.out or tempfile.gettempdir()
    with open(os.path.join(out, "train.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    log(f"wrote {os.path.join(out, 'train.md')}")
    return 1 if failures else 0


def measure_all(sg, args, p, failures):
    """Every part's measurements and sections, in the order of the run."""
    r = dict(load_start=os.getloadavg(), cpu_start=cpu_snapshot())
    r["rows"] = bench_kernels.kernels_table(sg, p["shapes"], p["nts"], p["sweep"], p, failures, p["only_impls"],
                                            args.no_mem)
    r["peak"] = fma_peak(log)
    r["train_rows"], r["train_md"] = [], []
    if p["train_cases"]:
        log("training-scale shapes ...")
        r["train_rows"], r["train_md"] = bench_train_shapes.train_section(
            sg, p["train_cases"], p["threads"], p["budget"], p["max_reps"], failures, p["cfg"], args.no_mem, log)
        if args.train_only:
            return r
    r["comp_rows"], r["comp_md"] = [], []
    if p["comp_cases"]:
        r["comp_rows"], r["comp_md"] = bench_compiled.compiled_section(sg, p["comp_cases"], p["comp_threads"], p,
                                                                       failures, p["inductor_dir"])
    r["dec"], r["dec_md"] = (None, []) if args.no_decode else bench_decode.decode_section(sg, p["threads"], p["quick"])
    ok_shapes, r["inter"] = bench_kernels.sweep_rounds(sg, p["shapes"], p["nts"], p["sweep"], p["threads"], p["quick"],
                                                       failures)
    cv = bench_conv_variants.conv_variants(sg, ok_shapes, sorted(n for n in set(p["nts"]) | set(p["sweep"])
                                                          if n >= (0 if p["quick"] else 512)),
                                           p["threads"], 2 if p["quick"] else 7, log)
    r["busy_md"] = [] if args.no_busy else bench_busy.busy_section(p["threads"], p["quick"])
    sg.set_num_threads(max(p["threads"]))
    r["bw"] = copy_bandwidth(64 << 20 if p["quick"] else 512 << 20)
    r["cv_md"] = bench_conv_variants.conv_variant_lines(cv, p["shapes"], p["threads"], r["bw"])
    r["load_end"], r["others"] = os.getloadavg(), other_load(r["cpu_start"], cpu_snapshot())
    return r


def header(sg, argv, p, r, t_start):
    """The title and the machine, with the run's load."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [f"# ssmgrad benchmarks{' (QUICK smoke test: tiny shapes, not representative)' if p['quick'] else ''}", "",
          f"Generated {now} by `{cmd.strip()}` in {time.time() - t_start:.0f} s.", ""]
    md += machine_description(sg)
    others, load_start = r["others"], r["load_start"]
    busy = (f"; other processes used {others[0]:.2f} cores on average during the timing (hypervisor steal "
            f"{others[1]:.2f})" if others else "")
    md.append(f"- Threads timed: {', '.join(map(str, p['threads']))} (ssmgrad.set_num_threads and torch.set_num_threads); "
              f"load average {load_start[0]:.2f} at start, {r['load_end'][0]:.2f} at end (this run's own threads "
              f"included){busy}; numpy copy bandwidth {r['bw']:.3g} GB/s.")
    md.append(f"- One core's float32 FMA peak (benchmarks/probes/peak.c): {r['peak']:.1f} GFLOP/s." if r["peak"] else
              "- One core's FMA peak: not measured (benchmarks/probes/peak.c needs AVX-512 and a C compiler).")
    if (others[0] if others else load_start[0]) > 0.1 * (os.cpu_count() or 1):
        md.append("- **The machine was not idle** (above): times, thread speedups and the sweep are "
                  "noisy; rerun on an idle machine before quoting them.")
    return md


def report(sg, argv, p, r, t_start, val_lines, failures):
    """results.md's lines; the main table apart (printed too)."""
    tab = bench_kernels.table(r["rows"])
    md = header(sg, argv, p, r, t_start)
    md += bench_kernels.results_header(p["shapes"], p["sweep"], p["budget"], p["quick"]) + tab
    md += ["", "## Against the targets: scan speed, conv bandwidth, time per token", ""]
    md += bench_kernels.summary(r["rows"], p["shapes"], p["nts"], p["sweep"], p["threads"], r["bw"], r["inter"])
    md += r["cv_md"] + r["busy_md"]
    if r["train_md"]:
        md += bench_train_shapes.train_header() + r["train_md"] + [""]
        md += bench_train_shapes.train_targets(r["train_rows"], r["peak"])
    md += r["comp_md"] + r["dec_md"]
    md += ["", "## Scan targets: compiled peer, FMA peak, decode", "",
           "Computed from this run's tables above (medians, and the same ratios of the fastest runs); "
           "`-`: no verdict (not measured). What limits each missed one: docs/performance.md." + ("" if not p["quick"] else
           " QUICK run: tiny shapes, the verdicts mean nothing."), ""]
    md += scan_targets(r["rows"], r["comp_rows"], r["train_rows"], r["dec"], r["inter"], p["shapes"], p["threads"],
                       r["peak"], r["bw"])
    return md + validation_lines(val_lines, failures) + [""], tab


def main(argv=None):
    ap, args = cli(argv)
    if args.busy:
        print("\n".join(bench_busy.busy_section([int(v) for v in args.threads.split(",")], args.quick)[5:]))
        return 0
    t_start = time.time()
    p = plan(ap, args)
    out_dir = args.out or (os.path.join(tempfile.gettempdir(), "ssmgrad-bench-quick") if args.quick else HERE)
    os.makedirs(out_dir, exist_ok=True)
    sg = load_ssmgrad()
    p["inductor_dir"] = bench_compiled.fresh_inductor_cache() if p["comp_cases"] else None
    failures, val_lines = validate_first(sg, wanted(p), p["cfg"])
    r = measure_all(sg, args, p, failures)
    if args.train_only:
        return train_only(sg, args, r["train_rows"], r["train_md"], r["peak"], r["load_start"], val_lines, failures)
    md, tab = report(sg, argv, p, r, t_start, val_lines, failures)
    print("\n".join(tab))
    if args.with_avx2:   # (the busy-machine part once: it compares ssmgrad's thread defaults, not the ISA)
        md += avx2_report("bench.py", sys.argv[1:] if argv is None else argv, "results.md", ["--no-busy", "--no-plot"])
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(md))
    log(f"wrote {os.path.join(out_dir, 'results.md')}")
    if p["inductor_dir"]:
        shutil.rmtree(p["inductor_dir"], ignore_errors=True)
    if not args.no_plot:
        bench_kernels.plot(r["rows"], out_dir, p["shapes"], "results.png")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
