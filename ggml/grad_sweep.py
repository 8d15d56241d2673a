"""test-backend-ops grad mode, one op at a time, parsed into per-case results.

Used by tests/ggml/test_ggml.py, and run by hand to record the baseline of the UNPATCHED build:

    bash ggml/build.sh --unpatched && cmake --build build/ggml-unpatched --target test-backend-ops
    python ggml/grad_sweep.py build/ggml-unpatched/bin/test-backend-ops --runs 2 --jobs 1 > ggml/grad_baseline_unpatched.txt

Why one op at a time: the whole grad sweep of this llama.cpp version aborts at
REGLU(type=f32,...,split) ("unsupported glu op for backward pass", ggml.c), a bug of that version;
run op by op, such an abort ends one op's run and is recorded, and the other ops still run.

How a case is read from the console output (the harness prints a header line "NAME(vars): OK"
for a case BEFORE it decides anything, then one more line; an unsupported case still ends with
"tests passed" and "Backend CPU: OK"):
  OK             header, then a final OK: the gradients were really checked against finite
                 differences (the final line is named after the SUM the harness adds on top)
  FAIL           a "compare failed"/"FAIL" line
  NOT_SUPPORTED  a "not supported" line (no parameters, a type other than F32, or an op the
                 backend does not run)
  SKIPPED        "skipping large tensors for speed" (more than grad_nmax() gradients)
  ABORTED        the process died inside the case
"""

import hashlib
import os
import re
import subprocess
import sys
import time

LINE = re.compile(r"^  (\S+?)\((.*)\): (.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_cases(stdout):
    """[(name, vars, status)] in the order the harness ran them; name is the header's op name."""
    cases = []
    cur = None  # (name, vars) of a case whose header was printed and whose result was not
    for raw in stdout.splitlines():
        m = LINE.match(ANSI.sub("", raw))
        if not m:
            continue
        name, vars_, rest = m.group(1), m.group(2), m.group(3).strip()
        if cur is None:
            if "not supported" in rest:            # printed without a header (e.g. output type != F32)
                cases.append((name, vars_, "NOT_SUPPORTED"))
            elif rest == "OK":
                cur = (name, vars_)
            else:
                raise ValueError("unexpected line outside a case: %r" % raw)
            continue
        if vars_ != cur[1]:
            raise ValueError("line of another case inside %r: %r" % (cur, raw))
        if "not supported" in rest:
            cases.append(cur + ("NOT_SUPPORTED",))
        elif "skipping large tensors" in rest:
            cases.append(cur + ("SKIPPED",))
        elif "compare failed" in rest:
            cases.append(cur + ("FAIL",))
        elif rest.endswith("FAIL"):
            continue                                # MAA / nonfinite detail; "compare failed" follows
        elif rest == "OK":
            cases.append(cur + ("OK",))
        else:
            raise ValueError("unexpected line in case %r: %r" % (cur, raw))
        cur = None
    if cur is not None:
        cases.append(cur + ("ABORTED",))
    return cases


def run_op(binary, op, threads=None, timeout=600, extra=()):
    """Runs `binary grad -o op [-t threads]` (-t is the patch's: the unpatched harness runs half
    the cores, 1 on a 2-core machine); returns (exit_class, cases, seconds, stdout, stderr).
    exit_class: "ok" (0), "fail" (1) or "signal N"/"exit N"."""
    t0 = time.monotonic()
    p = subprocess.run([binary, "grad", "-o", op, *(["-t", str(threads)] if threads else []), *extra],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                       env=dict(os.environ, TERM="dumb"))
    dt = time.monotonic() - t0
    out = p.stdout.decode(errors="replace")
    err = p.stderr.decode(errors="replace")
    rc = p.returncode
    exit_class = "ok" if rc == 0 else "fail" if rc == 1 else ("signal %d" % -rc if rc < 0 else "exit %d" % rc)
    return exit_class, parse_cases(out), dt, out, err


# Left out of the sweep for time: MUL_MAT alone took 471 s of the 631 s of a one-thread sweep of
# the unpatched build on this project's 2-core machine (shared), and over 600 s when two ops ran
# at a time; the patch does not touch MUL_MAT's code (ggml.c's backward case, the CPU mul_mat).
SLOW_OPS = {"MUL_MAT"}


def op_names(binary):
    """Every op name the harness can be filtered by: --list-ops, plus the names test cases give
    themselves (op_desc), read from `support` mode, which lists every case with its name."""
    names = set()
    out = subprocess.run([binary, "--list-ops"], stdout=subprocess.PIPE, check=True, timeout=120).stdout.decode()
    names.update(l.strip() for l in out.splitlines() if l.startswith("  "))
    out = subprocess.run([binary, "support", "-b", "CPU"], stdout=subprocess.PIPE, check=True, timeout=300).stdout.decode()
    for l in out.splitlines():
        m = LINE.match(ANSI.sub("", l))
        if m:
            names.add(m.group(1))
    return sorted(n for n in names if re.fullmatch(r"[A-Z0-9_]+", n) and n not in SLOW_OPS)


RAN = ("OK", "FAIL")


def _hash(lines):
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def summarize(exit_class, cases):
    """One run of one op: exit class, counts per status, and two hashes of the ordered case list:
    h_full over (case, status), h_ran with OK and FAIL both written RAN (the harness draws its
    inputs from std::random_device, so for some ops OK/FAIL changes from run to run)."""
    counts = {s: 0 for s in ("OK", "FAIL", "NOT_SUPPORTED", "SKIPPED", "ABORTED")}
    for _, _, st in cases:
        counts[st] += 1
    return {
        "exit": exit_class,
        "counts": counts,
        "h_full": _hash("%s(%s)\t%s" % c for c in cases),
        "h_ran": _hash("%s(%s)\t%s" % (n, v, "RAN" if st in RAN else st) for n, v, st in cases),
        "bad": _bad_list(cases),
    }


def _bad_list(cases, n_fail=3):
    """the aborted case and the first few failed ones, for a reader of the baseline"""
    fails = ["%s(%s)=FAIL" % c[:2] for c in cases if c[2] == "FAIL"]
    more = ["(+%d more FAIL)" % (len(fails) - n_fail)] if len(fails) > n_fail else []
    return fails[:n_fail] + more + ["%s(%s)=ABORTED" % c[:2] for c in cases if c[2] == "ABORTED"]


def merge_runs(runs):
    """Baseline entry of an op from several runs: flaky if h_full differs between runs (then only
    h_ran, the NOT_SUPPORTED/SKIPPED/ABORTED statuses and the abort are compared)."""
    first = runs[0]
    for r in runs[1:]:
        if r["h_ran"] != first["h_ran"] or r["exit"].startswith("signal") != first["exit"].startswith("signal"):
            raise RuntimeError("the case list or an abort changed between runs of the same build: %r vs %r" % (first, r))
    flaky = len({r["h_full"] for r in runs}) > 1 or len({r["exit"] for r in runs}) > 1
    return dict(first, flaky=flaky)


def format_line(op, s):
    c = s["counts"]
    return "\t".join([op, s["exit"], "flaky" if s["flaky"] else "stable",
                      "OK=%d FAIL=%d NOT_SUPPORTED=%d SKIPPED=%d ABORTED=%d" % (
                          c["OK"], c["FAIL"], c["NOT_SUPPORTED"], c["SKIPPED"], c["ABORTED"]),
                      s["h_full"], s["h_ran"], " ".join(s["bad"]) or "-"])


def read_baseline(path):
    base = {}
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            op, exit_class, flaky, counts, h_full, h_ran, bad = line.rstrip("\n").split("\t", 6)
            base[op] = {"exit": exit_class, "flaky": flaky == "flaky",
                        "counts": {k: int(v) for k, v in (kv.split("=") for kv in counts.split())},
                        "h_full": h_full, "h_ran": h_ran, "bad": bad}
    return base


def differences(op, base, now):
    """What changed in `now` (summarize() of a run) against the baseline entry `base`: [] if nothing."""
    diffs = []
    if base["flaky"]:
        if now["h_ran"] != base["h_ran"]:
            diffs.append("case list or NOT_SUPPORTED/SKIPPED/ABORTED statuses changed")
        if now["exit"].startswith("signal") or base["exit"].startswith("signal"):
            if now["exit"] != base["exit"]:
                diffs.append("exit %s, baseline %s" % (now["exit"], base["exit"]))
    else:
        if now["h_full"] != base["h_full"]:
            diffs.append("case results changed: %s, baseline %s" % (now["counts"], base["counts"]))
        if now["exit"] != base["exit"]:
            diffs.append("exit %s, baseline %s" % (now["exit"], base["exit"]))
    return diffs


def sweep(binary, ops, jobs=2, threads=None):
    """{op: summarize(...)} and {op: seconds}, `jobs` ops at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(op):
        exit_class, cases, dt, _, _ = run_op(binary, op, threads=threads)
        return op, summarize(exit_class, cases), dt

    # the slow ops first, so that they do not end up alone at the tail
    order = sorted(ops, key=lambda o: o not in ("ROPE", "IM2COL", "RMS_NORM", "CPY"))
    res, secs = {}, {}
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        for op, s, dt in ex.map(one, order):
            res[op], secs[op] = s, dt
    return res, secs


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description="record the grad-mode baseline of a test-backend-ops binary")
    ap.add_argument("binary")
    ap.add_argument("--runs", type=int, default=2, help="sweeps to run, to tell flaky ops (default 2)")
    ap.add_argument("--jobs", type=int, default=2, help="ops run at a time (default 2)")
    a = ap.parse_args(argv[1:])
    ops = op_names(a.binary)
    runs = []
    for i in range(a.runs):
        t0 = time.monotonic()
        res, secs = sweep(a.binary, ops, jobs=a.jobs)
        runs.append(res)
        print("# run %d: %d ops, %.0f s wall, slowest: %s" % (i + 1, len(ops), time.monotonic() - t0, ", ".join(
            "%s %.0f s" % (o, secs[o]) for o in sorted(secs, key=secs.get, reverse=True)[:3])), file=sys.stderr)
    print("# test-backend-ops grad -o OP, one op at a time, %d runs: %s" % (a.runs, a.binary))
    print("# op\texit\tflaky|stable\tcounts\th_full\th_ran\tFAIL/ABORTED cases of the first run")
    for op in ops:
        print(format_line(op, merge_runs([r[op] for r in runs])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
