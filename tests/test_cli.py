"""`python -m ssmgrad` and its subcommands, run as a user would (in a subprocess).

check: the self-check must pass and print every gradient's error against finite differences;
a deliberately broken gradient must make it fail (exit 1). bench: the table with the PyTorch
peers, each agreeing with ssmgrad. info: the build facts.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, code=None):
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "ssmgrad", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_check_passes_and_reports_every_gradient():
    r = run("check", "--n-t", "16", "--threads", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    for op, grads in (("scan Mamba-1", "s x dt A B C"), ("scan Mamba-2", "s x dt A B C"), ("conv", "sx c")):
        for g in grads.split():
            line = re.search(rf"{op}\s+d_{g}\s+(\S+)\s+\S+\s+ok", r.stdout)
            assert line and float(line.group(1)) < 1e-6, (op, g, r.stdout)
    assert "all checks passed" in r.stdout


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


def test_bench_table_with_torch_peers():
    r = run("bench", "--n-t", "16", "--repeat", "1", "--threads", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    for peer in ("torch loop", "torch ssd", "torch F.conv1d"):
        rows = [ln for ln in r.stdout.splitlines() if peer in ln]
        assert rows and all(ln.rstrip().endswith("yes") for ln in rows), (peer, r.stdout)


def test_info():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "ssmgrad" in r.stdout and "OpenMP" in r.stdout and "SIMD selected" in r.stdout
