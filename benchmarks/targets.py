"""The "Scan targets" table of results.md: one row per target that docs/performance.md states,
computed from the data of one bench.py run (its table, the compiled peer, the training-scale
shapes, the decode step, the interleaved sweep, the FMA peak and the copy bandwidth)."""

import statistics

from bench_decode import DECODE_SHAPES

# Mamba-1's documented floor, ns per state update (forward, backward): docs/performance.md counts the
# multiplies and FMAs per 16 updates of the AVX-512 loops (15.5 forward, 39.5 backward) at one 512-bit
# FMA per cycle and this machine's 3.65 GHz (benchmarks/probes/peak.c).
M1_FLOOR_NS = {"fwd": 0.27, "bwd": 0.68}


def rng_txt(v, fmt="{:.3g}", unit=""):
    v = sorted(v)
    return (fmt.format(v[0]) + unit) if len(v) == 1 or fmt.format(v[0]) == fmt.format(v[-1]) \
        else f"{fmt.format(v[0])}–{fmt.format(v[-1])}{unit}"


def _compiled_rows(add, ok_rows):
    """Mamba-2 fwd+bwd against the compiled SSD, 1 thread."""
    # 1. Mamba-2 fwd+bwd vs the compiled SSD, 1 thread
    pairs = []
    for r in ok_rows:
        if r["impl"] == "ssd_compiled" and r["threads"] == 1:
            sgr = next((q for q in ok_rows if q["impl"] == "ssmgrad" and
                        (q["shape"], q["n_seqs"], q["n_t"], q["threads"]) == (r["shape"], r["n_seqs"], r["n_t"], 1)), None)
            if sgr:
                pairs.append((r["fb"] / sgr["fb"], r["fb_min"] / sgr["fb_min"], f"{r['shape']} {r['n_t']}"))
    if pairs:
        cases = ", ".join(f"{c} {m:.2f}x" for m, _, c in pairs)
        add(f"Mamba-2 fwd+bwd, compiled SSD / ssmgrad, 1 thread ({cases})", rng_txt([p[0] for p in pairs], unit="x"),
            rng_txt([p[1] for p in pairs], unit="x"), ">= 3x", min(p[0] for p in pairs) >= 3)
    else:
        add("Mamba-2 fwd+bwd, compiled SSD / ssmgrad, 1 thread", "not measured", "-", ">= 3x", None)


def _peak_rows(add, rows, ok_rows, peak):
    """Mamba-2 % of the FMA peak per thread, backward / forward."""
    # 2, 3. Mamba-2 % of the FMA peak per thread, backward / forward: the compiled-peer cases'
    # ssmgrad rows (130m and 2.7B, n_t >= 512) and the main table's Mamba-2 rows at n_t >= 512
    m2 = [r for r in ok_rows if r["impl"] == "ssmgrad"]
    m2 += [r for r in rows if r["impl"] == "ssmgrad" and r["shape"] == "mamba2" and not r.get("failed")
           and r["n_t"] >= 512 and "thr_f" in r]
    if m2 and peak:
        f_med = [100 * r["thr_f"] / r["threads"] / peak for r in m2]
        f_min = [100 * r["thr_f"] * r["fwd"] / r["fwd_min"] / r["threads"] / peak for r in m2]
        b_med = [100 * r["thr_b"] / r["threads"] / peak for r in m2]
        b_min = [100 * r["thr_b"] * r["bwd"] / r["bwd_min"] / r["threads"] / peak for r in m2]
        add(f"Mamba-2 forward, % of one core's FMA peak ({peak:.1f} GFLOP/s) per thread, {len(m2)} cells",
            rng_txt(f_med, "{:.0f}", "%"), rng_txt(f_min, "{:.0f}", "%"), ">= 80%", min(f_med) >= 80)
        add("Mamba-2 backward, % of the FMA peak per thread, same cells", rng_txt(b_med, "{:.0f}", "%"),
            rng_txt(b_min, "{:.0f}", "%"), ">= 70%", min(b_med) >= 70)
    else:
        add("Mamba-2 forward / backward, % of the FMA peak", "not measured" + ("" if peak else " (no peak)"), "-",
            ">= 80% / >= 70%", None)
    if m2:
        ratio = [r["bwd"] / r["fwd"] for r in m2]
        add("Mamba-2 backward / forward, same cells", rng_txt(ratio, "{:.2f}"),
            rng_txt([r["bwd_min"] / r["fwd_min"] for r in m2], "{:.2f}"), "<= 2.3", max(ratio) <= 2.3)


def _m1_rows(add, rows, shapes):
    """Mamba-1 ns per state update against the floor."""
    # 4. Mamba-1 ns per state update (per thread), main table n_t >= 512
    if "mamba1" in shapes:
        p = shapes["mamba1"][1]
        m1 = [r for r in rows if r["impl"] == "ssmgrad" and r["shape"] == "mamba1" and not r.get("failed")
              and r["n_t"] >= 512]
        for d in ("fwd", "bwd"):
            ns = [r[d] * r["threads"] / (r["n_t"] * p["n_head"] * p["head_dim"] * p["d_state"]) * 1e9 for r in m1]
            ns_min = [r[d + "_min"] * r["threads"] / (r["n_t"] * p["n_head"] * p["head_dim"] * p["d_state"]) * 1e9
                      for r in m1]
            floor = M1_FLOOR_NS[d]
            target = f"<= {1.5 * floor:.3g} (1.5x the floor {floor:g})" if floor else \
                "within 1.5x of the floor: see docs/performance.md"
            add(f"Mamba-1 ns per state update per thread, {'forward' if d == 'fwd' else 'backward'} "
                f"(n_t {sorted({r['n_t'] for r in m1})}, threads {sorted({r['threads'] for r in m1})})",
                rng_txt(ns) if ns else "not measured", rng_txt(ns_min) if ns else "-", target,
                (max(ns) <= 1.5 * floor) if (floor and ns) else None)


def _falcon_rows(add, train_rows, t1):
    """Mamba-1 against the torch loop at Falcon-Mamba-7B's width."""
    # 5. Mamba-1 vs the torch loop at Falcon-Mamba-7B's width, 1 thread
    fal = {r["impl"]: r for r in train_rows if r["shape"] == "falcon7b" and r["threads"] == t1 and "failed" not in r
           and r["n_seqs"] == 1}
    if "ssmgrad" in fal and "loop" in fal:
        s_, l_ = fal["ssmgrad"], fal["loop"]
        add(f"Mamba-1 fwd+bwd, torch loop / ssmgrad, Falcon-Mamba-7B width, 1x{s_['n_t']}, {t1} thread",
            f"{l_['fb'] / s_['fb']:.2f}x", f"{l_['fb_min'] / s_['fb_min']:.2f}x", ">= 6x", l_["fb"] / s_["fb"] >= 6)
    else:
        add("Mamba-1 fwd+bwd vs torch loop, Falcon-Mamba-7B width", "not measured (no falcon7b 1-sequence case with "
            "the loop in this run's training shapes)", "-", ">= 6x", None)


def _decode_rows(add, dec):
    """The decode step against a copy of its state."""
    # 6. decode / a copy of the state
    for shape in DECODE_SHAPES:
        v = [(thr, d) for (sh, thr), d in (dec or {}).items() if sh == shape]
        if not v:
            add(f"decode step / state copy, {shape}", "not measured", "-", "<= 1.5x", None)
            continue
        med = [statistics.median(d["update"]) / statistics.median(d["copy"]) for _, d in v]
        fast = [min(d["update"]) / min(d["copy"]) for _, d in v]
        add(f"decode step (ssm_scan_update) / state copy, {shape} layer, threads {[t for t, _ in v]}",
            ", ".join(f"{t}T {x:.2f}x" for (t, _), x in zip(v, med)),
            ", ".join(f"{t}T {x:.2f}x" for (t, _), x in zip(v, fast)), "<= 1.5x", max(med) <= 1.5)


def _conv_rows(add, rows, shapes, threads, inter, bw):
    """The conv's time per token growth and share of the copy's bandwidth."""
    # 7. conv: growth of the time per token 512 -> 8192 (interleaved rounds), share of the copy's bandwidth at 8192
    for shape, (kind, p) in shapes.items():
        if kind != "conv":
            continue
        g_med, g_min = [], []
        for thr in threads:
            a, b = inter.get((shape, 512, thr)), inter.get((shape, 8192, thr))
            if a and b:
                g_med.append((thr, 100 * (statistics.median(b) / 8192 / (statistics.median(a) / 512) - 1)))
                g_min.append((thr, 100 * (min(b) / 8192 / (min(a) / 512) - 1)))
        if g_med:
            add(f"conv {shape}: growth of fwd+bwd time per token, n_t 512 -> 8192 (interleaved rounds)",
                ", ".join(f"{t}T {x:+.0f}%" for t, x in g_med), ", ".join(f"{t}T {x:+.0f}%" for t, x in g_min),
                "<= 25%", max(x for _, x in g_med) <= 25)
        else:
            add(f"conv {shape}: growth of time per token 512 -> 8192", "not measured (n_t 512 and 8192 needed)", "-",
                "<= 25%", None)
        r = next((q for q in rows if q["impl"] == "ssmgrad" and q["shape"] == shape and q["n_t"] == 8192
                  and q["threads"] == 1 and not q.get("failed")), None)
        if r and bw:
            f_, b_ = 100 * r["thr_f"] / bw, 100 * r["thr_b"] / bw
            add(f"conv {shape}: share of the copy's bandwidth ({bw:.3g} GB/s) at n_t 8192, 1 thread, fwd / bwd",
                f"{f_:.0f}% / {b_:.0f}%",
                f"{f_ * r['fwd'] / r['fwd_min']:.0f}% / {b_ * r['bwd'] / r['bwd_min']:.0f}%", ">= 60%",
                min(f_, b_) >= 60)
        else:
            add(f"conv {shape}: share of the copy's bandwidth at n_t 8192", "not measured", "-", ">= 60%", None)


def scan_targets(rows, comp_rows, train_rows, dec, inter, shapes, threads, peak, bw):
    """The scan targets of docs/performance.md, each row computed from this run's data: (measure, medians,
    fastest runs, target, met/missed)."""
    out = ["| measure | measured (medians) | fastest runs | target | result |", "|---|---|---|---|---|"]

    def add(measure, med, fast, target, ok):
        out.append(f"| {measure} | {med} | {fast} | {target} | {'-' if ok is None else ('met' if ok else 'MISSED')} |")

    ok_rows = [r for r in comp_rows if "failed" not in r]
    _compiled_rows(add, ok_rows)
    _peak_rows(add, rows, ok_rows, peak)
    _m1_rows(add, rows, shapes)
    _falcon_rows(add, train_rows, min(threads))
    _decode_rows(add, dec)
    _conv_rows(add, rows, shapes, threads, inter, bw)
    return out
