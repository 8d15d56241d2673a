"""benchmarks/common.py's --with-avx2 (bench.py, gdn_bench.py: both ISAs' rows in one results file): the
capped rerun's command line keeps the run's own flags and drops --out, --isa and --with-avx2 (in either
spelling), and the flag is refused where it cannot mean anything (with --isa, or on a host without AVX-512).
The capped run itself is the script's own --isa avx2 path (its ISA check, common.check_isa, exits when the
cap does not take)."""

import argparse
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import common  # noqa: E402

pytestmark = pytest.mark.integration   # the benchmarks' code, not the C code: the main pass runs it


def test_the_capped_rerun_drops_out_isa_and_itself():
    argv = ["--shapes", "32,16;16,16", "--out", "benchmarks/results_gdn.md", "--reps=7", "--with-avx2",
            "--isa=native", "--n-t", "512", "--out=x.md", "--isa", "native", "--no-layer"]
    assert common._without_flags(argv, {"--out", "--isa"}, {"--with-avx2"}) == \
        ["--shapes", "32,16;16,16", "--reps=7", "--n-t", "512", "--no-layer"]


def _parse(argv):
    ap = argparse.ArgumentParser()
    common.add_isa_flag(ap)
    common.add_with_avx2_flag(ap)
    args = ap.parse_args(argv)
    common.check_with_avx2(ap, args)
    return args


def test_with_avx2_is_refused_beside_isa(capsys):
    with pytest.raises(SystemExit):
        _parse(["--with-avx2", "--isa", "avx2"])
    assert "--with-avx2 runs the capped pass itself" in capsys.readouterr().err


def test_with_avx2_needs_an_avx512_host(monkeypatch, capsys):
    monkeypatch.setattr(common, "host_isa", lambda: "AVX2")
    with pytest.raises(SystemExit):
        _parse(["--with-avx2"])
    assert "this host's widest ISA is AVX2" in capsys.readouterr().err
    monkeypatch.setattr(common, "host_isa", lambda: "AVX-512")
    assert _parse(["--with-avx2"]).with_avx2
    assert not _parse([]).with_avx2


def test_the_cap_turns_numpy_avx512_code_off():
    """isa_env("avx2") also caps numpy (its exp is Mamba-1's yardstick): in a process with that environment,
    numpy's own feature table reports none of its AVX-512 groups on."""
    import subprocess
    groups = common.numpy_avx512_groups()
    if not groups:
        pytest.skip("numpy runs no AVX-512 code on this CPU: there is nothing to cap")
    env = dict(os.environ, **common.isa_env("avx2"))
    code = ("import sys; sys.path.insert(0, %r); import common; print(repr(common.numpy_avx512_groups()))"
            % os.path.join(ROOT, "benchmarks"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "''", f"numpy still runs {r.stdout.strip()} under {env['NPY_DISABLE_CPU_FEATURES']!r}"
