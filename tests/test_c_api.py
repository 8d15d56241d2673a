"""The C API: tests/c_api/test_c_api.c uses only csrc/ssmgrad.h and the kernel sources.

It is compiled here with the system C compiler (no Python headers, no OpenMP), run, and every
"max_err" / "bitwise" line it prints is checked, besides its exit code.
"""

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
PROGRAM = ROOT / "tests" / "c_api" / "test_c_api.c"


def kernel_sources():
    """csrc/*.c except the Python glue (the one file that includes Python.h)."""
    files = [f for f in sorted(CSRC.glob("*.c")) if "Python.h" not in f.read_text()]
    assert files, f"no kernel sources in {CSRC}"
    return files


def test_public_header_is_self_contained(tmp_path):
    # The header alone compiles in C and declares what the program needs.
    src = tmp_path / "h.c"
    src.write_text('#include "ssmgrad.h"\nint main(void) { return (int) sizeof(ssm_scan_params) == 0; }\n')
    r = subprocess.run([shutil.which("cc") or "cc", "-std=c11", "-Wall", "-Werror", "-I", str(CSRC),
                        str(src), "-o", str(tmp_path / "h")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (CSRC / "ssmgrad.h").read_text()
    assert "Python.h" not in text


def test_c_program(tmp_path):
    exe = tmp_path / "test_c_api"
    cmd = [shutil.which("cc") or "cc", "-O1", "-std=c11", "-Wall", "-I", str(CSRC), str(PROGRAM),
           *map(str, kernel_sources()), "-lm", "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"{' '.join(cmd)}\n{build.stderr}"

    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all C API checks passed" in run.stdout

    errs = {m[0]: (float(m[1]), float(m[2]))
            for m in re.findall(r"^max_err\s+(\S+)\s+(\S+)\s+tol\s+(\S+)", run.stdout, re.M)}
    bitwise = re.findall(r"^bitwise\s+(\S+)\s+(\S+)", run.stdout, re.M)
    # every op, both dtypes, both directions, both branches were checked
    for name in ("conv_f64_forward", "conv_f64_d_sx_vs_fd", "conv_f64_d_c_vs_fd", "conv_f32_forward",
                 "mamba2_K2_f64_forward", "mamba2_K2_f64_d_x_vs_fd", "mamba2_K2_f64_d_A_vs_fd",
                 "mamba2_K4_nt2_f64_d_s_vs_fd", "mamba1_f64_d_dt_vs_fd", "mamba1_f64_d_A_vs_fd",
                 "mamba1_f32_gin_vs_fd"):
        assert name in errs, f"{name} missing from the program's output"
    for name, (err, tol) in errs.items():
        assert err <= tol, f"{name}: {err:.3e} > {tol:.0e}"
    assert len(bitwise) >= 10 and all(ok == "ok" for _, ok in bitwise), bitwise
