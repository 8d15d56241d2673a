#!/usr/bin/env python
"""ssmgrad against the PyTorch CPU peers of SSM_SCAN and SSM_CONV at the real layer shapes, side by side.

    python benchmarks/bench_kernels.py                 # n_t 128, 512, 2048 (+ 8192 ssmgrad only), 1 and 2 threads
    python benchmarks/bench_kernels.py --quick         # tiny shapes: a smoke test
    python benchmarks/bench_kernels.py --only mamba2,ssd --threads 1

Float32, one sequence: the Mamba-130m scan, the Mamba-2-130m scan and the conv with 1536 and 1792
channels. Every implementation is validated against the float64 reference first (a failing one is
not timed); then forward, backward and forward+backward medians, the torch results compared with
ssmgrad's at the timed shape (`agree`), ssmgrad's 1 -> 2 thread bitwise comparison and the
backward's peak memory; then the interleaved sweep (7 rounds of fwd+bwd at every (n_t, threads) in
turn) from which the time-per-token spread and thread speedups come. Writes kernels.md and
kernels.png (--out, default a temp dir); bench.py puts the same sections in results.md.
"""

import json
import os
import statistics
import sys
import tempfile

import numpy as np

from common import (AGREE_TOL, FULL_SHAPES, IMPL_LABEL, QUICK_SHAPES, SG_MIN_REPS, SHAPE_LABEL, conv_inputs,
                    copy_bandwidth, fmt_ms, fmt_ratio, load_ssmgrad, log, measure, measure_memory, numpy_exp_ns,
                    parser, rel_err, scan_flops, scan_inputs, scan_peer, scan_sizes, settings, sg_conv_runner,
                    sg_scan_runner, torch_conv_runner, torch_scan_runner, validate_first, write_section)

TORCH_IMPLS = {"scan_m1": ["loop", "pscan"], "scan_m2": ["loop", "ssd"], "conv": ["conv1d"]}


def write_plot(rows, path, shapes):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [s for s in shapes if any(r["shape"] == s for r in rows)]
    ncol = min(2, len(names))
    nrow = (len(names) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.2 * ncol, 4.4 * nrow), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    colors = {"ssmgrad": "C0", "loop": "C1", "ssd": "C2", "pscan": "C3", "conv1d": "C4"}
    for ax, shape in zip(axes.flat, names):
        series = {}
        for r in rows:
            if r["shape"] == shape and r.get("fb"):
                series.setdefault((r["impl"], r["threads"]), []).append((r["n_t"], r["fb"] / r["n_t"] * 1e6))
        for (impl, thr), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors.get(impl, "k"),
                    linestyle="-" if thr == min(k[1] for k in series) else "--",
                    label=f"{IMPL_LABEL.get(impl, impl)}, {thr}T")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("n_t (tokens)")
        ax.set_ylabel("fwd+bwd time per token (us)")
        ax.set_title(SHAPE_LABEL.get(shape, shape), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("ssmgrad vs PyTorch CPU, float32, one sequence: fwd+bwd time per token "
                 "(solid: fewest threads, dashed: more)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows):
    head = ("| shape | n_t | thr | implementation | reps | fwd ms | bwd ms | fwd+bwd ms | us/token | "
            "x ssmgrad fwd | x bwd | x fwd+bwd | ssmgrad fwd | ssmgrad bwd | bwd extra MB | notes |")
    out = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        if r.get("failed"):
            out.append(f"| {r['shape']} | {r['n_t']} | {r['threads']} | {IMPL_LABEL.get(r['impl'], r['impl'])} | - | - | - | - | - "
                       f"| - | - | - | - | - | - | not timed: {r['failed']} |")
            continue
        us_tok = r["fb"] / r["n_t"] * 1e6
        thr_unit = "GB/s" if r["kind"] == "conv" else "GFLOP/s"
        tf = f"{r['thr_f']:.3g} {thr_unit}" if r.get("thr_f") else "-"
        tb = f"{r['thr_b']:.3g} {thr_unit}" if r.get("thr_b") else "-"
        mem = f"{max(r['mem'], 0.0):.1f}" if r.get("mem") is not None and r["mem"] == r["mem"] else "-"
        out.append(f"| {r['shape']} | {r['n_t']} | {r['threads']} | {IMPL_LABEL.get(r['impl'], r['impl'])} | {r['reps']} "
                   f"| {fmt_ms(r['fwd'])} | {fmt_ms(r['bwd'])} | {fmt_ms(r['fb'])} | {us_tok:.3g} "
                   f"| {fmt_ratio(r.get('ratio_f'))} | {fmt_ratio(r.get('ratio_b'))} | {fmt_ratio(r.get('ratio_fb'))} "
                   f"| {tf} | {tb} | {mem} | {'; '.join(r.get('notes', []))} |")
    return out


def interleaved_sweep(sg, shapes, sizes, threads, rounds, log):
    """ssmgrad fwd+bwd of every (n_t, threads) of a shape, taken in turn, ``rounds`` times after
    one untimed round: on this shared VM, load that comes and goes during one table cell moved
    that cell's median by up to 50%, while a round-robin spreads it over every size and thread
    count alike. Returns {(shape, n_t, threads): [seconds per fwd+bwd, one per round]}."""
    times = {}
    for shape, (kind, p) in shapes.items():
        runs = {}
        for n_t in sizes:
            rng = np.random.default_rng(n_t)
            if kind == "scan":
                a = scan_inputs(p, n_t, np.float32, rng)
                n_y, n_s = scan_sizes(p, n_t)
                runs[n_t] = sg_scan_runner(sg, a, rng.standard_normal(n_y + n_s).astype(np.float32))
            else:
                a = conv_inputs(p, n_t, np.float32, rng)
                grad = rng.standard_normal((1, n_t, p["d_inner"])).astype(np.float32)
                runs[n_t] = sg_conv_runner(sg, a, grad, [])
        for r in range(rounds + 1):
            for n_t in sizes:
                for thr in threads:
                    sg.set_num_threads(thr)
                    t_f, t_b, res = runs[n_t]()
                    del res
                    if r:
                        times.setdefault((shape, n_t, thr), []).append(t_f + t_b)
        del runs
        log(f"  {shape:9s} interleaved sweep: {rounds} rounds of n_t {sizes} x threads {threads}")
    sg.set_num_threads(max(threads))
    return times


def _get(rows, shape, n_t, thr, impl="ssmgrad"):
    for r in rows:
        if (r["shape"], r["n_t"], r["threads"], r["impl"]) == (shape, n_t, thr, impl) and not r.get("failed"):
            return r
    return None


def _ok(rows):
    return [r for r in rows if r["impl"] == "ssmgrad" and not r.get("failed")]


def _speed_lines(rows, shapes, nts, threads):
    """Scan speed: GFLOP/s, ns per state update, backward / forward, fastest torch / ssmgrad."""
    lines = []
    sgr = _ok(rows)
    big = max(nts)
    t1 = min(threads)
    if "mamba2" in shapes:
        vals = [(thr, _get(rows, "mamba2", big, thr)) for thr in threads]
        txt = ", ".join(f"{thr}T {r['thr_f'] / thr:.3g}" for thr, r in vals if r)
        lines.append(f"- Mamba-2 scan forward, n_t={big}: GFLOP/s per thread {txt} (target >= 50% of one core's FMA peak).")
    if "mamba1" in shapes:
        r = _get(rows, "mamba1", big, t1)
        if r:
            p = shapes["mamba1"][1]
            upd = big * p["n_head"] * p["head_dim"] * p["d_state"]
            ns, ex = r['fwd'] / upd * 1e9 * t1, numpy_exp_ns()
            lines.append(f"- Mamba-1 scan forward, n_t={big}, {t1}T: {ns:.3g} ns per state update "
                         f"per thread (ggml about 5 ns; target <= 0.5 ns); numpy's float32 exp in the same run "
                         f"{ex:.3g} ns per element (24,576 in cache): {ns / ex:.2f}x it (target <= 1x).")
    ratios = [(r["bwd"] / r["fwd"], r) for r in sgr if r["kind"] == "scan" and r["n_t"] in nts]
    if ratios:
        worst, r = max(ratios, key=lambda x: x[0])
        lines.append(f"- Backward / forward time (scan, ssmgrad): worst {worst:.2f} at {r['shape']} n_t={r['n_t']} "
                     f"{r['threads']}T (target <= 3).")
    best_torch = []
    for r in sgr:
        if r["kind"] != "scan":
            continue
        peers = [q for q in rows if (q["shape"], q["n_t"], q["threads"]) == (r["shape"], r["n_t"], r["threads"])
                 and q["impl"] != "ssmgrad" and not q.get("failed")]
        if peers:
            q = min(peers, key=lambda q: q["fb"])
            best_torch.append((q["fb"] / r["fb"], r, q))
    if best_torch:
        worst = min(best_torch, key=lambda x: x[0])
        lines.append("- fwd+bwd, fastest PyTorch / ssmgrad (scan): " + ", ".join(
            f"{r['shape']} n_t={r['n_t']} {r['threads']}T {v:.3g}x ({IMPL_LABEL[q['impl']]})" for v, r, q in best_torch)
            + f". Smallest {worst[0]:.3g}x (target >= 30x).")
    return lines


def _memory_lines(rows, shapes, nts, sizes):
    """The backward's extra memory of Mamba-2 at n_t in ``sizes`` (None: the largest of the table)."""
    lines = []
    big = max(nts)
    if "mamba2" not in shapes:
        return lines
    rows = [r for r in _ok(rows) if r["shape"] == "mamba2" and r.get("mem") is not None
            and (r["n_t"] == big if sizes is None else r["n_t"] in sizes)]
    if sizes is None:
        mems = [f"{r['threads']}T {r['mem']:.1f} MB" for r in rows]
        if mems:
            lines.append(f"- Backward peak memory beyond inputs and output, Mamba-2 n_t={big}: {', '.join(mems)} "
                         f"(target < 32 MB; storing every state would be "
                         f"{big * 24 * 64 * 128 * 4 / 1e9:.2g} GB).")
    else:
        mems = [f"n_t={r['n_t']} {r['threads']}T {r['mem']:.1f} MB" for r in rows]
        if mems:
            lines.append(f"- backward extra memory, Mamba-2-130m: {', '.join(mems)} (targets <= 32 MB at 2048, "
                         f"<= 48 MB at 8192).")
    return lines


def _per_token_lines(shapes, threads, inter):
    """Spread of the time per token over n_t (interleaved rounds)."""
    lines = []
    for shape in shapes:
        for thr in threads:
            pts = sorted((n_t, statistics.median(v) / n_t, min(v) / n_t)
                         for (sh, n_t, th), v in inter.items() if sh == shape and th == thr)
            if len(pts) >= 2:
                v, w = [p[1] for p in pts], [p[2] for p in pts]
                lines.append(f"- Time per token, {shape} {thr}T, fwd+bwd over n_t {[p[0] for p in pts]} "
                             f"(interleaved rounds): medians " + ", ".join(f"{x * 1e6:.3g}" for x in v)
                             + f" us, spread {100 * (max(v) / min(v) - 1):.0f}% (fastest runs: "
                             + ", ".join(f"{x * 1e6:.3g}" for x in w)
                             + f" us, {100 * (max(w) / min(w) - 1):.0f}%) (target within 15%).")
    return lines


def _thread_lines(rows, shapes, nts, sweep, threads, inter):
    """1 -> 2 threads: speedups (interleaved rounds) and bitwise identity."""
    lines = []
    if len(threads) >= 2:
        ta, tb = min(threads), max(threads)
        for shape in shapes:
            sp, sp_min, bits = [], [], []
            for n_t in sorted(set(nts) | set(sweep)):
                r2 = _get(rows, shape, n_t, tb)
                v1, v2 = inter.get((shape, n_t, ta)), inter.get((shape, n_t, tb))
                if v1 and v2:
                    sp.append(f"{n_t}: {statistics.median(v1) / statistics.median(v2):.2f}x")
                    sp_min.append(f"{min(v1) / min(v2):.2f}x")
                    bits.append(r2.get("bitwise") if r2 else None)
            if sp:
                same = "all bitwise identical" if all(bits) else "NOT bitwise identical: see notes"
                lines.append(f"- {ta} -> {tb} threads, {shape} fwd+bwd (interleaved rounds): {', '.join(sp)} "
                             f"(fastest runs: {', '.join(sp_min)}); {same} (target >= 1.7x, identical).")
    return lines


def _conv_lines(rows, shapes, nts, threads, bw, inter):
    """The conv against numpy's copy bandwidth; its time per token over n_t."""
    lines = []
    sgr = _ok(rows)
    big = max(nts)
    convs = [r for r in sgr if r["kind"] == "conv" and r["n_t"] == big]
    if convs and bw:
        lines.append(f"- Conv at n_t={big}: " + ", ".join(
            f"{r['shape']} {r['threads']}T fwd {r['thr_f']:.3g} / bwd {r['thr_b']:.3g} GB/s" for r in convs)
            + f"; numpy single-thread copy moves {bw:.3g} GB/s on this machine (target: within 2x of the bandwidth limit).")
    # conv time per token over n_t, conv bandwidth, the backward's extra memory
    for shape in shapes:
        if shapes[shape][0] != "conv":
            continue
        for thr in threads:
            pts = sorted((n_t, statistics.median(v) / n_t, min(v) / n_t)
                         for (sh, n_t, th), v in inter.items() if sh == shape and th == thr and 512 <= n_t <= 8192)
            if len(pts) >= 2:
                v, w = [p[1] for p in pts], [p[2] for p in pts]
                lines.append(f"- conv time per token, {shape} {thr}T over n_t {[p[0] for p in pts]}: medians "
                             + ", ".join(f"{x * 1e6:.3g}" for x in v) + f" us, spread {100 * (max(v) / min(v) - 1):.0f}% "
                             f"(fastest runs {100 * (max(w) / min(w) - 1):.0f}%) (target within 25%).")
    for r in sgr:
        if r["kind"] == "conv" and r["n_t"] == 8192 and r["threads"] == 1 and bw:
            lines.append(f"- conv {r['shape']} n_t=8192 1T: fwd {r['thr_f']:.3g} GB/s ({100 * r['thr_f'] / bw:.0f}% of "
                         f"the copy), bwd {r['thr_b']:.3g} GB/s ({100 * r['thr_b'] / bw:.0f}%) (target >= 60%).")
    return lines


def summary(rows, shapes, nts, sweep, threads, bw, inter):
    """The scan-speed, conv-bandwidth and time-per-token targets (docs/performance.md), each with the
    measured value, computed from the rows (and, for the time-per-token spread and the thread
    speedups, from the interleaved sweep ``inter``)."""
    return (_speed_lines(rows, shapes, nts, threads) + _memory_lines(rows, shapes, nts, None)
            + _per_token_lines(shapes, threads, inter) + _thread_lines(rows, shapes, nts, sweep, threads, inter)
            + _conv_lines(rows, shapes, nts, threads, bw, inter) + _memory_lines(rows, shapes, nts, (2048, 8192)))


def torch_impls_for(shapes, shape, only_impls):
    """The torch peers timed at a shape of the table (all of its kind, or those of --only)."""
    kind, p = shapes[shape]
    names = TORCH_IMPLS["conv" if kind == "conv" else ("scan_m1" if p["m1"] else "scan_m2")]
    return [n for n in names if n in only_impls] if only_impls else names


def kernels_want(shapes, only_impls):
    """{validation key: implementations} for the table's shapes."""
    want = {}
    for shape, (kind, p) in shapes.items():
        key = "conv" if kind == "conv" else shape
        want.setdefault(key, ["ssmgrad"])
        want[key] += [i for i in torch_impls_for(shapes, shape, only_impls) if i not in want[key]]
    return want


def _cell(sg, kind, p, n_t):
    """The float32 inputs of one (shape, n_t) cell, its incoming gradient, and what it moves or computes."""
    rng = np.random.default_rng(n_t)
    if kind == "scan":
        a = scan_inputs(p, n_t, np.float32, rng)
        n_y, n_s = scan_sizes(p, n_t)
        grad = rng.standard_normal(n_y + n_s).astype(np.float32)
        flop_f, flop_b, forms = scan_flops(sg, a, p)
        return dict(a=a, grad=grad, n_y=n_y, work_f=flop_f, work_b=flop_b, forms=forms)
    a = conv_inputs(p, n_t, np.float32, rng)
    grad = rng.standard_normal((1, n_t, p["d_inner"])).astype(np.float32)
    n_sx, n_c, n_y = a["sx"].size, a["c"].size, grad.size
    return dict(a=a, grad=grad, n_y=n_y, work_f=4 * (n_sx + n_c + n_y),
                work_b=4 * ((n_y + n_c + n_sx) + (n_y + n_sx + n_c)))        # d_sx, then d_c


def _time_ssmgrad(sg, row, cell, s):
    """Times ssmgrad in one cell into ``row``; returns its outputs."""
    split_times = []
    a, grad = cell["a"], cell["grad"]
    run = sg_scan_runner(sg, a, grad) if row["kind"] == "scan" else sg_conv_runner(sg, a, grad, split_times)
    # ssmgrad gets at least SG_MIN_REPS samples: the n_t = 8192 sweep would get 3,
    # and a median of 3 on this shared VM moved the time-per-token spread by 10%
    m, res = measure(run, s["budget"], s["max_reps"], min_reps=1 if s["quick"] else SG_MIN_REPS)
    row.update(m, thr_f=cell["work_f"] / m["fwd"] / 1e9, thr_b=cell["work_b"] / m["bwd"] / 1e9)
    if row["kind"] == "scan":
        row["forms"] = cell["forms"]
    else:
        timed = split_times[1:] or split_times          # without the warm-up run
        ds = statistics.median(t[0] for t in timed)
        dc = statistics.median(t[1] for t in timed)
        row["notes"].append(f"bwd = d_sx {fmt_ms(ds)} + d_c {fmt_ms(dc)} ms")
    return res


def _thread_check(rows, row, sg_results, res):
    """Against the first thread count's outputs of the same cell: bitwise, and the speedup."""
    key = (row["shape"], row["n_t"])
    if key not in sg_results:
        sg_results[key] = (row["threads"], res)
        return
    thr0, res0 = sg_results[key]
    same = all(np.array_equal(u, v) for u, v in zip(res0, res))
    r0 = next(r for r in rows if (r["shape"], r["n_t"], r["threads"], r["impl"]) == key + (thr0, "ssmgrad"))
    row["bitwise"] = same
    row["notes"].append(f"{r0['fb'] / row['fb']:.2f}x vs {thr0}T, " + ("bitwise identical" if same else "NOT bitwise identical"))


def _agree(sg, kind, a, res, sg_out):
    """Worst relative difference of a torch result from ssmgrad's, output and every gradient."""
    if kind == "scan":
        y, fin, grads = res
        out = np.concatenate([y.numpy().ravel(), fin.numpy().ravel()])
        parts = sg.split(sg_out[1], a["s"].shape, a["x"].shape, a["dt"].shape, a["B"].shape, a["C"].shape)
        return max([rel_err(out, sg_out[0])] + [rel_err(g.numpy(), q) for g, q in zip(grads, parts)])
    y, grads = res
    return max(rel_err(y.numpy(), sg_out[0]), rel_err(grads[0].numpy(), sg_out[1]), rel_err(grads[1].numpy(), sg_out[2]))


def _time_peer(sg, impl, base, cell, s, sg_row, sg_out):
    """One torch peer's row in a cell, with its ratios to ssmgrad and its agreement with it."""
    import peers as ti
    kind, a, grad = base["kind"], cell["a"], cell["grad"]
    if kind == "scan":
        run = torch_scan_runner(scan_peer(impl, s["cfg"]), a, grad, cell["n_y"])
    else:
        run = torch_conv_runner(ti.CONV_IMPLS[impl], a, grad)
    m, res = measure(run, s["budget"], s["max_reps"])
    trow = dict(base, impl=impl, notes=[], **m)
    trow.update(ratio_f=m["fwd"] / sg_row["fwd"], ratio_b=m["bwd"] / sg_row["bwd"], ratio_fb=m["fb"] / sg_row["fb"])
    worst = _agree(sg, kind, a, res, sg_out)              # the same numbers as ssmgrad's, at the timed shape?
    trow["notes"].append(f"agree {worst:.0e}" + ("" if worst <= AGREE_TOL else " MISMATCH"))
    if m["reps"] == "1*":
        trow["notes"].append("single run")
    return trow


def _time_cell(sg, shapes, shape, n_t, cell, peers_, thr, s, failures, rows, sg_results, no_mem):
    import torch
    kind, p = shapes[shape]
    vkey = "conv" if kind == "conv" else shape
    sg.set_num_threads(thr)
    torch.set_num_threads(thr)
    base = dict(shape=shape, kind=kind, n_t=n_t, threads=thr)
    row = dict(base, impl="ssmgrad", notes=[])
    if f"{vkey}/ssmgrad" in failures:
        rows.append(dict(row, failed="failed validation: " + failures[f"{vkey}/ssmgrad"]))
        return
    res = _time_ssmgrad(sg, row, cell, s)
    _thread_check(rows, row, sg_results, res)
    if not no_mem:
        row["mem"], reset = measure_memory(kind, p, n_t, thr)
        if not reset:
            row["notes"].append("peak not reset: memory is an upper bound")
    rows.append(row)
    log(f"  {shape:9s} n_t={n_t:5d} {thr}T ssmgrad        fwd {fmt_ms(row['fwd'])} ms, bwd {fmt_ms(row['bwd'])} ms"
        f" ({row['reps']} reps)")
    for impl in peers_:
        if f"{vkey}/{impl}" in failures:
            rows.append(dict(base, impl=impl, notes=[], failed="failed validation: " + failures[f"{vkey}/{impl}"]))
            continue
        trow = _time_peer(sg, impl, base, cell, s, row, res)
        rows.append(trow)
        log(f"  {shape:9s} n_t={n_t:5d} {thr}T {impl:14s} fwd {fmt_ms(trow['fwd'])} ms, bwd {fmt_ms(trow['bwd'])} ms"
            f" ({trow['reps']} reps), fwd+bwd {trow['ratio_fb']:.3g}x ssmgrad")


def kernels_table(sg, shapes, nts, sweep, s, failures, only_impls, no_mem):
    """The rows of the main table: every (shape, n_t, threads) cell, ssmgrad then its torch peers
    (ssmgrad alone at the n_t of ``sweep``)."""
    rows, sg_results = [], {}            # (shape, n_t) -> (threads, outputs) of the first thread count
    for shape, (kind, p) in shapes.items():
        for n_t in nts + sweep:
            cell = _cell(sg, kind, p, n_t)
            peers_ = [] if n_t in sweep else torch_impls_for(shapes, shape, only_impls)
            for thr in s["threads"]:
                _time_cell(sg, shapes, shape, n_t, cell, peers_, thr, s, failures, rows, sg_results, no_mem)
            sg_results.pop((shape, n_t), None)            # compared with every thread count: free it
    return rows


def results_header(shapes, sweep, budget, quick):
    """The "Results" section's heading and legend."""
    return ["", "## Results", "",
            "float32, one sequence. Times are medians over `reps` repeats after one warm-up (`1*`: a single run, "
            "the warm-up itself, because one run exceeded twice the per-cell budget of "
            f"{budget:g} s). `x ssmgrad` = torch time / ssmgrad time. "
            "Throughput columns: GFLOP/s for the scan on the count of the form each kernel takes (common.py's "
            "scan_flops: the recurrence 5 FLOP per state update forward, 14 Mamba-2 / 19 Mamba-1 backward; the chunked "
            "Mamba-2 forward 4 N P + P (Q + 1) per token and head plus N (Q + 1) per token and block of 8 heads, the "
            "chunked backward 10 P N + 2 Q P per token and head plus 3 Q N per token and unit of heads, Q = 64), GB/s of bytes moved for the conv. `bwd extra MB`: peak RSS of one ssmgrad backward beyond "
            "its inputs and output (fresh subprocess). torch fwd records autograd; torch bwd is autograd.grad "
            "w.r.t. s, x, dt, B, C (A frozen) or sx, c. `agree`: worst max|torch - ssmgrad| / max|ssmgrad| over the "
            f"output and every gradient at the timed shape (flagged above {AGREE_TOL:g}). n_t = "
            f"{', '.join(map(str, sweep))}: ssmgrad only (linearity sweep).", "",
            "Shapes: " + "; ".join(f"`{k}` = {SHAPE_LABEL[k]}" + (" (quick: scaled down " + json.dumps(v[1]) + ")" if quick else "")
                                   for k, v in shapes.items()), ""]


def add_kernel_flags(ap):
    ap.add_argument("--only", default="", help="comma-separated shapes (mamba1, mamba2, conv1536, conv1792) "
                                               "and/or implementations (loop, ssd, pscan, conv1d, ssd_compiled: "
                                               "ssd also selects the compiled SSD); ssmgrad always runs")
    ap.add_argument("--nt", help="comma-separated n_t for the side-by-side table (default 128,512,2048)")
    ap.add_argument("--sweep", help="extra n_t timed for ssmgrad only (default 8192)")
    ap.add_argument("--no-mem", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-plot", action="store_true")


def table_settings(ap, args):
    """(shapes, nts, sweep, only_impls) from --quick, --only, --nt, --sweep."""
    quick = args.quick
    shapes = dict(QUICK_SHAPES if quick else FULL_SHAPES)
    nts = [int(v) for v in args.nt.split(",")] if args.nt else ([64, 256] if quick else [128, 512, 2048])
    sweep = [int(v) for v in args.sweep.split(",") if v] if args.sweep is not None else ([1024] if quick else [8192])
    sweep = [v for v in sweep if v not in nts]
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    only_shapes = [w for w in only if w in shapes]
    only_impls = [w for w in only if w in IMPL_LABEL and w != "ssmgrad"]
    unknown = [w for w in only if w not in shapes and w not in IMPL_LABEL]
    if unknown:
        ap.error(f"--only: unknown name(s) {unknown}; shapes {list(shapes)}, implementations {list(IMPL_LABEL)}")
    if only_shapes:
        shapes = {k: v for k, v in shapes.items() if k in only_shapes}
    return shapes, nts, sweep, only_impls


def sweep_rounds(sg, shapes, nts, sweep, threads, quick, failures):
    """The interleaved sweep of the shapes that passed validation."""
    ok_shapes = {k: v for k, v in shapes.items()
                 if f"{'conv' if v[0] == 'conv' else k}/ssmgrad" not in failures}
    return ok_shapes, interleaved_sweep(sg, ok_shapes, sorted(set(nts) | set(sweep)), threads, 2 if quick else 7, log)


def plot(rows, out_dir, shapes, name):
    try:
        write_plot(rows, os.path.join(out_dir, name), list(shapes))
        log(f"wrote {os.path.join(out_dir, name)}")
    except ImportError:
        log("matplotlib is not installed: no plot (pip install matplotlib)")


def main(argv=None):
    ap = parser(__doc__)
    add_kernel_flags(ap)
    args = ap.parse_args(argv)
    s = settings(args)
    shapes, nts, sweep, only_impls = table_settings(ap, args)
    sg = load_ssmgrad()
    failures, val_lines = validate_first(sg, kernels_want(shapes, only_impls), s["cfg"])
    rows = kernels_table(sg, shapes, nts, sweep, s, failures, only_impls, args.no_mem)
    _, inter = sweep_rounds(sg, shapes, nts, sweep, s["threads"], args.quick, failures)
    bw = copy_bandwidth(64 << 20 if args.quick else 512 << 20)
    section = results_header(shapes, sweep, s["budget"], args.quick) + table(rows)
    section += ["", "## Against the targets: scan speed, conv bandwidth, time per token", ""]
    section += summary(rows, shapes, nts, sweep, s["threads"], bw, inter)
    status = write_section(sg, args, "kernels", section, val_lines, failures)
    if not args.no_plot:
        plot(rows, args.out or tempfile.gettempdir(), shapes, "kernels.png")
    return status


if __name__ == "__main__":
    sys.exit(main())
