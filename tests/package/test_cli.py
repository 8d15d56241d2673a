"""`python -m ssmgrad` and its subcommands, run as a user would (in a subprocess).

check: the self-check must pass and print every gradient's error against finite differences
(the scan's, the conv's, the Gated DeltaNet's with both gates and both forms); a deliberately
broken gradient of the scan or of the Gated DeltaNet must make it fail (exit 1). bench: the table
with the PyTorch peers (the Gated DeltaNet's: transformers' chunked rule), each agreeing with
ssmgrad; a peer that disagrees makes it exit 1. info: the build facts. Each subcommand's --help lists its own
options; bad option values exit 2 with one line on stderr and no traceback; no command means
`check`; the progress line of bench appears only when stderr is a terminal.
"""
import os
import pty
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, code=None):
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "ssmgrad", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_check_passes_and_reports_every_gradient():
    r = run("check", "--n-t", "16", "--threads", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    # the shapes it checks, as the code builds them
    assert re.search(r"scan Mamba-1\s+n_rs=3 n_head=4 head_dim=1 d_state=5 n_group=2 n_t=6 n_seqs=2, A \(4, 5\)",
                     r.stdout), r.stdout
    assert re.search(r"scan Mamba-2\s+n_rs=3 n_head=4 head_dim=3 d_state=5 n_group=2 n_t=6 n_seqs=2, A \(4, 1\)",
                     r.stdout), r.stdout
    assert re.search(r"conv\s+n_s=2 d_inner=3 d_conv=4 n_t=7", r.stdout), r.stdout
    for gate, last in (("g", "1"), ("KDA", "S")):
        assert re.search(rf"gdn {gate}\s+n_seqs=2 n_seqs_k=1 H_v=2 H_k=1 S=4 n_t=66, g \(n_seqs, n_t, H_v, {last}\), "
                         r"K=1, forms recurrence, chunked", r.stdout), r.stdout
    assert "n_t = 16" in r.stdout
    # the timings are wall clock: the table says that they depend on the machine's load
    assert re.search(r"Time per call, .*medians \(wall clock: they depend on what else the machine runs\):", r.stdout), r.stdout
    gdn = [f"gdn {gate} {form}" for gate in ("g", "KDA") for form in ("rec", "chunked")]
    for op, grads in [("scan Mamba-1", "s x dt A B C"), ("scan Mamba-2", "s x dt A B C"), ("conv", "sx c")] + \
            [(op, "q k v g beta state") for op in gdn]:
        for g in grads.split():
            line = re.search(rf"^  {op}\s+d_{g}\s+(\S+)\s+\S+\s+ok$", r.stdout, re.M)
            assert line and float(line.group(1)) < 1e-6, (op, g, r.stdout)
    for op in gdn:
        for what in ("fwd", "bwd"):
            line = re.search(rf"^  {op}\s+{what} f32 vs f64\s+(\S+)\s+\S+\s+ok$", r.stdout, re.M)
            assert line and float(line.group(1)) < 1e-5, (op, what, r.stdout)
    # the GDN timings: both forms at the Qwen3-Next-like shapes, the per-channel gate at 16/16
    for layer in ("GDN 16/16", "GDN 32/16", "KDA 16/16"):
        for form in ("rec", "chunked"):
            assert re.search(rf"^  {layer} {form}\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d\s+-$", r.stdout, re.M), \
                (layer, form, r.stdout)
    assert "FAIL" not in r.stdout and "all checks passed" in r.stdout


def test_check_fails_on_a_wrong_gradient():
    # the same self-check with ssm_scan_back's d_dt region scaled: it must exit 1
    code = (
        "import sys, numpy as np, ssmgrad, ssmgrad.__main__ as m\n"
        "real = ssmgrad.ssm_scan_back\n"
        "def bad(*a, **k):\n"
        "    r = real(*a, **k)\n"
        "    gin = r[0] if isinstance(r, tuple) else r\n"
        "    s, x, dt = a[0], a[1], a[2]\n"
        "    o = np.asarray(s).size + np.asarray(x).size\n"
        "    gin[o:o + np.asarray(dt).size] *= 1.001\n"
        "    return r\n"
        "ssmgrad.ssm_scan_back = bad\n"
        "sys.exit(m.main(['check', '--n-t', '8', '--threads', '1']))\n")
    r = run(code=code)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL" in r.stdout


@pytest.mark.parametrize("region", ["g", "state"])
def test_check_fails_on_a_wrong_gdn_gradient(region):
    # the self-check with one region of gated_delta_net_back's result scaled (d_g: the gate's
    # gradient, scalar and per-channel; d_state: the last region): it must exit 1, and the rows that
    # fail are that region's, in every GDN case, and no other row
    code = (
        "import sys, numpy as np, ssmgrad, ssmgrad.__main__ as m\n"
        "real = ssmgrad.gated_delta_net_back\n"
        "def bad(*a, **k):\n"
        "    gin = real(*a, **k)\n"
        f"    i = m.GDN_NAMES.index({region!r})\n"
        "    o = sum(np.asarray(x).size for x in a[:i])\n"
        "    gin[o:o + np.asarray(a[i]).size] *= 1.001\n"
        "    return gin\n"
        "ssmgrad.gated_delta_net_back = bad\n"
        "sys.exit(m.main(['check', '--n-t', '8', '--threads', '1']))\n")
    r = run(code=code)
    assert r.returncode == 1, r.stdout + r.stderr
    failed = [ln.split() for ln in r.stdout.splitlines() if ln.rstrip().endswith("FAIL")]
    assert sorted(f[:4] for f in failed) == sorted(["gdn", gate, form, "d_" + region]
                                                   for gate in ("g", "KDA") for form in ("rec", "chunked")), r.stdout
    assert "4 check(s) FAILED" in r.stdout


def test_bench_table_with_torch_peers():
    r = run("bench", "--n-t", "16", "--repeat", "1", "--threads", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "timing" not in r.stderr and "\r" not in r.stderr, f"progress line written to a pipe: {r.stderr!r}"
    for peer in ("torch loop", "torch ssd", "torch F.conv1d", "hf chunk rule"):
        rows = [ln for ln in r.stdout.splitlines() if peer in ln and not ln.lstrip().startswith("(")]
        assert rows and all(ln.rstrip().endswith("yes") for ln in rows), (peer, r.stdout)
    # the Gated DeltaNet peer at both Qwen3-Next-like shapes, beside ssmgrad's chunked form
    for layer in ("GDN 16/16 chunked", "GDN 32/16 chunked"):
        assert re.search(rf"^  {layer}\s+hf chunk rule\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+yes$", r.stdout, re.M), \
            (layer, r.stdout)


def test_bench_fails_on_a_disagreeing_gdn_peer():
    # transformers' rule with its final state scaled: bench must not time it, say NO and exit 1
    code = (
        "import sys, ssmgrad._bench_peers as p, ssmgrad.__main__ as m\n"
        "real = p.gdn_chunk_transformers\n"
        "def bad(*a):\n"
        "    o, final = real(*a)\n"
        "    return o, final * 1.01\n"
        "p.gdn_chunk_transformers = bad\n"
        "sys.exit(m.main(['bench', '--n-t', '8', '--repeat', '1', '--threads', '1']))\n")
    r = run(code=code)
    assert r.returncode == 1, r.stdout + r.stderr
    bad = [ln for ln in r.stdout.splitlines() if "hf chunk rule" in ln and "NO" in ln]
    assert len(bad) == 2 and all("not timed" in ln for ln in bad), r.stdout
    others = [ln for ln in r.stdout.splitlines() if re.search(r"torch (loop|ssd|F\.conv1d)", ln)]
    assert others and all(ln.rstrip().endswith("yes") for ln in others), r.stdout


def test_info():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "ssmgrad" in r.stdout and "OpenMP" in r.stdout and "SIMD selected" in r.stdout


def test_bench_progress_only_on_a_terminal():
    # the same bench with stderr on a pseudo-terminal: there the progress line appears
    master, slave = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "ssmgrad", "bench", "--n-t", "8", "--repeat", "1", "--threads", "1"],
                           stdout=subprocess.PIPE, stderr=slave, text=True, timeout=600, cwd=ROOT)
        os.close(slave)
        slave = None
        chunks = []
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:           # EIO: the terminal's other end is closed and drained
                break
            if not b:
                break
            chunks.append(b)
    finally:
        if slave is not None:
            os.close(slave)
        os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0, p.stdout + err
    assert "timing Mamba-2-130m scan" in err, repr(err[:500])


def test_subcommand_help_describes_own_options():
    b = run("bench", "--help")
    c = run("check", "--help")
    top = run("--help")
    assert b.returncode == c.returncode == top.returncode == 0
    assert b.stdout.startswith("usage: python -m ssmgrad bench")
    for opt in ("--threads", "--n-t", "--repeat"):
        assert opt in b.stdout, (opt, b.stdout)
    assert c.stdout.startswith("usage: python -m ssmgrad check")
    assert "--threads" in c.stdout and "--n-t" in c.stdout and "--repeat" not in c.stdout, c.stdout
    for cmd in ("check", "bench", "info"):
        assert cmd in top.stdout


def test_bad_values_exit_2_with_one_line():
    for args, what in ((["bench", "--threads", "0"], "--threads"), (["check", "--threads", "0"], "--threads"),
                       (["--threads", "-1"], "--threads"), (["bench", "--n-t", "-5"], "--n-t"),
                       (["check", "--n-t", "-1"], "--n-t"), (["bench", "--repeat", "0"], "--repeat"),
                       (["bench", "--threads", "two"], "--threads"),
                       (["bench", "--threads", str(10 ** 12)], "--threads"), (["frobnicate"], "invalid choice")):
        r = run(*args)
        assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and what in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)
        assert r.stdout == "", (args, r.stdout)


def test_no_command_runs_check():
    # the README's `python -m ssmgrad`: the self-check with its defaults (check's own work is
    # replaced by a marker here; test_check_* run the real one)
    code = ("import sys, ssmgrad.__main__ as m\n"
            "m.cmd_check = lambda a: print('CHECK', a.command, a.n_t, a.threads) or 0\n"
            "assert m.main([]) == 0\n"
            "assert m.main(['--n-t', '16']) == 0\n")
    r = run(code=code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["CHECK check 512 None", "CHECK check 16 None"], r.stdout
