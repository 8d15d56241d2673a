"""The C API: tests/c_api/test_c_api.c uses only csrc/ssmgrad.h and the kernel sources.

It is compiled here with the C compiler ($CC, else cc; no Python headers, no OpenMP; each file through
ccache when it is installed), run, and every "max_err" / "bitwise" line it prints is checked, besides
its exit code: once for the SIMD pass this CPU picks, once capped to each lower x86-64 pass and once
in the AVX-512 pass without its 64-byte vector kernels (params.simd, from the program's --simd=NAME),
and once cross-compiled for aarch64 and run under qemu-aarch64.
"""

import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
PROGRAM = ROOT / "tests" / "c_api" / "test_c_api.c"


def kernel_sources():
    """csrc/*.c and csrc/inst/*.c: the kernels (the Python glue lives in csrc/glue/ and includes Python.h)."""
    files = [f for f in sorted(CSRC.glob("*.c")) + sorted(CSRC.glob("inst/*.c")) if "Python.h" not in f.read_text()]
    assert files, f"no kernel sources in {CSRC}"
    return files


def c_compiler():
    """$CC when set (as for the extension's build: .ci/compilers.sh sets it), else cc."""
    return os.environ.get("CC") or shutil.which("cc") or "cc"


def build_program(cc, flags, exe, jobs=2):
    """Compiles the driver and the kernel sources with `cc flags`, each to an object of its own, `jobs` at a
    time, and links them into exe. The commands run in the tree's root and name the sources by relative
    paths, so ccache, when installed, serves a file of the same bytes compiled with the same command from
    any copy of the tree (tests/package/test_sdist.py runs test_c_program again from the unpacked sdist)."""
    cmd = shlex.split(cc)
    if shutil.which("ccache") and os.path.basename(cmd[0]) != "ccache":
        cmd = ["ccache", *cmd]
    objdir = Path(str(exe) + ".objs")
    objdir.mkdir()
    sources = [PROGRAM, *kernel_sources()]
    objects = [objdir / f"{i}_{src.stem}.o" for i, src in enumerate(sources)]

    def compile_one(src, obj):
        c = [*cmd, *flags, "-I", "csrc", "-c", str(src.relative_to(ROOT)), "-o", str(obj)]
        return c, subprocess.run(c, cwd=ROOT, capture_output=True, text=True, timeout=300)
    with ThreadPoolExecutor(jobs) as pool:
        for c, r in pool.map(compile_one, sources, objects):
            assert r.returncode == 0, f"{' '.join(c)}\n{r.stderr}"
    link = [*shlex.split(cc), *flags, *map(str, objects), "-lm", "-o", str(exe)]
    r = subprocess.run(link, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(link)}\n{r.stderr}"
    return exe


def test_public_header_is_self_contained(tmp_path):
    # The header alone compiles in C and declares what the program needs.
    src = tmp_path / "h.c"
    src.write_text('#include "ssmgrad.h"\nint main(void) { return (int) sizeof(ssm_scan_params) == 0; }\n')
    r = subprocess.run([c_compiler(), "-std=c11", "-Wall", "-Werror", "-I", str(CSRC),
                        str(src), "-o", str(tmp_path / "h")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = (CSRC / "ssmgrad.h").read_text()
    assert "Python.h" not in text


def require_tool(name, package):
    """The path of a tool the test needs; skip without it, except under CI=true, where .ci/run
    installs it and its absence is a failure."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} not found (Debian package {package})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg + ": CI=true, and .ci/run installs it", pytrace=False)
        pytest.skip(msg)
    return path


def check_output(stdout):
    """Every check the program makes is there and within its tolerance."""
    assert "all C API checks passed" in stdout
    errs = {m[0]: (float(m[1]), float(m[2]))
            for m in re.findall(r"^max_err\s+(\S+)\s+(\S+)\s+tol\s+(\S+)", stdout, re.M)}
    bitwise = re.findall(r"^bitwise\s+(\S+)\s+(\S+)", stdout, re.M)
    # every op, both dtypes, both directions, both branches were checked
    for name in ("conv_f64_forward", "conv_f64_d_sx_vs_fd", "conv_f64_d_c_vs_fd", "conv_f32_forward",
                 "mamba2_K2_f64_forward", "mamba2_K2_f64_d_x_vs_fd", "mamba2_K2_f64_d_A_vs_fd",
                 "mamba2_K4_nt2_f64_d_s_vs_fd", "mamba1_f64_d_dt_vs_fd", "mamba1_f64_d_A_vs_fd",
                 "mamba1_f32_gin_vs_fd", "mamba2_chunked_nt70_f64_forward", "mamba2_chunked_nt70_f32_forward",
                 "mamba2_chunked_nt70_f64_d_x_vs_fd", "mamba2_recurrence_nt70_f64_forward",
                 "mamba2_recurrence_nt70_f64_d_B_vs_fd"):
        assert name in errs, f"{name} missing from the program's output"
    for name, (err, tol) in errs.items():
        assert err <= tol, f"{name}: {err:.3e} > {tol:.0e}"
    assert len(bitwise) >= 10 and all(ok == "ok" for _, ok in bitwise), bitwise


def selected(stdout):
    m = re.search(r"^simd selected: (.*)$", stdout, re.M)
    assert m, "the program did not print the SIMD pass it runs"
    return m.group(1)


@pytest.fixture(scope="module")
def c_program(tmp_path_factory):
    return build_program(c_compiler(), ["-O1", "-std=c11", "-Wall"], tmp_path_factory.mktemp("c_api") / "test_c_api")


def run_program(cmd, env=None, drop=()):
    # the program is not instrumented: no sanitizer runtime preloaded into it (or into qemu)
    # when the suite runs under .ci/sanitize.sh; drop: more variables of this environment to leave out
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and k not in drop}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(base, **(env or {})))
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    check_output(run.stdout)
    return run.stdout


def test_c_program(c_program):
    out = run_program([str(c_program)])
    # the forward's chunk states read by the backward (ssm_scan_keep_f64 / ssm_scan_back_kept_f64) were checked
    assert "bitwise mamba2_chunked_nt70_f64_gin_kept" in out and "mamba2_chunked_nt70_f64_last_kept_is_final" in out
    # and the Gated DeltaNet's kept chunks (gdn_fwd_keep_* / gdn_back_kept_*), both gates, float64 and float32
    for gate in ("scalar", "kda"):
        assert f"bitwise gdn_{gate}_f64_gin_kept" in out and f"bitwise gdn_{gate}_f32_gin_kept" in out, gate
    if platform.machine() in ("x86_64", "AMD64"):
        assert selected(out).split()[0] in LEVELS, selected(out)


# params.simd caps the pass the kernels take, so that every pass of the runtime dispatch runs
# the checks on any x86-64 machine, not only the one the CPU picks.
LEVELS = ["x86-64", "x86-64-v3", "x86-64-v4"]


@pytest.mark.parametrize("cap", ["x86-64", "x86-64-v3", "v4-no-vec64"])
def test_c_program_each_simd_pass(c_program, cap):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"runtime SIMD dispatch is x86-64 only (this is {platform.machine()})")
    # the CPU's own level, whatever cap the suite itself runs under (--no-fd: only the line it prints
    # is wanted here; test_c_program runs every check uncapped)
    probe = subprocess.run([str(c_program), "--no-fd"], capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    native = selected(probe.stdout).split()[0]
    out = run_program([str(c_program), f"--simd={cap}"])
    want = LEVELS[min(LEVELS.index(cap.replace("v4-no-vec64", "x86-64-v4")), LEVELS.index(native))]
    assert selected(out).split()[0] == want, (selected(out), want)


def test_c_program_aarch64_under_qemu(tmp_path):
    """The kernels on ARM: the program cross-compiled for aarch64 (static, so no ARM libraries
    are needed at run time), warnings as errors (no x86-only code outside its guards), and run
    under qemu's user-mode emulation with the same checks."""
    cc = require_tool("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu")
    qemu = require_tool("qemu-aarch64", "qemu-user")
    exe = build_program(cc, ["-O2", "-static", "-std=c11", "-Wall", "-Werror"], tmp_path / "test_c_api_aarch64")
    head = exe.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, "not an aarch64 ELF"
    out = run_program([qemu, str(exe)])
    assert "aarch64" in selected(out) and "no runtime dispatch" in selected(out), selected(out)


# The kernels' choices (the scan's forms, the SIMD pass) travel in the params: the environment
# variables are read once, by the glue at import, and the private hooks set the same defaults.
# A choice made through the hooks gives the bits the same choice gives through the environment,
# in a fresh process. The oracle is that process; that the choice reaches the kernels at all is
# shown by the forms' bits differing from the other form's, and for the SIMD pass by what
# build_info reports (two passes may give the same bits); the C program above chooses the form
# and the pass through its params directly.
CHOICE_SCRIPT = r"""
import hashlib, sys
import numpy as np
import ssmgrad, _ssmgrad
for hook, value in (a.split("=") for a in sys.argv[1:]):
    getattr(_ssmgrad, hook)(value)
rng = np.random.default_rng(5)
n_rs, n_head, hd, ds, n_t = 3, 4, 64, 128, 70
f = np.float32
s = rng.standard_normal((n_rs, n_head, hd, ds)).astype(f)
x = rng.standard_normal((2, n_t, n_head, hd)).astype(f)
dt = rng.standard_normal((2, n_t, n_head)).astype(f)
A = -np.exp(rng.standard_normal((n_head, 1))).astype(f)
B = rng.standard_normal((2, n_t, 2, ds)).astype(f)
C = rng.standard_normal((2, n_t, 2, ds)).astype(f)
ids = np.array([2, 0], np.int64)
out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
gin, dA = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, rng.standard_normal(out.shape).astype(f), return_dA=True)
sx = rng.standard_normal((2, 48, 3 + 300)).astype(f)
c = rng.standard_normal((48, 4)).astype(f)
y = ssmgrad.ssm_conv(sx, c)
info = _ssmgrad.build_info()
print(hashlib.sha256(out.tobytes()).hexdigest(), hashlib.sha256(gin.tobytes() + dA.tobytes()).hexdigest(),
      hashlib.sha256(y.tobytes()).hexdigest(), info["simd_selected"].split()[0], info["avx512_kernels"],
      info["scan_fwd"], info["scan_back"])
"""

CHOICES = {   # the environment's setting -> the hook's
    "SSMGRAD_SCAN_FWD=chunked": "_set_scan_fwd=chunked",
    "SSMGRAD_SCAN_FWD=recurrence": "_set_scan_fwd=recurrence",
    "SSMGRAD_SCAN_BACK=chunked": "_set_scan_back=chunked",
    "SSMGRAD_SCAN_BACK=recurrence": "_set_scan_back=recurrence",
    "SSMGRAD_SIMD=x86-64-v3": "_set_simd=x86-64-v3",
    "SSMGRAD_SIMD=x86-64": "_set_simd=x86-64",
    "SSMGRAD_NO_AVX512=1": "_set_simd=v4-no-vec64",
}
CHOICE_VARS = ("SSMGRAD_SCAN_FWD", "SSMGRAD_SCAN_BACK", "SSMGRAD_SIMD", "SSMGRAD_NO_AVX512")


def _choice_hashes(env_setting=None, hook=None):
    env = {k: v for k, v in os.environ.items() if k not in CHOICE_VARS and k != "PYTEST_ADDOPTS"}
    if env_setting:
        k, v = env_setting.split("=")
        env[k] = v
    r = subprocess.run([sys.executable, "-c", CHOICE_SCRIPT, *([hook] if hook else [])], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@pytest.fixture(scope="module")
def default_hashes():
    return _choice_hashes()


@pytest.mark.parametrize("env_setting", list(CHOICES))
def test_choice_through_hook_matches_environment(env_setting, default_hashes):
    by_env = _choice_hashes(env_setting=env_setting)
    by_hook = _choice_hashes(hook=CHOICES[env_setting])
    assert by_hook == by_env
    # the choice takes: the forced form (or pass) differs in bits from the other one, where the
    # shape's automatic choice is the one forced it is the default's bits
    if env_setting.startswith("SSMGRAD_SCAN_FWD"):
        other = _choice_hashes(env_setting="SSMGRAD_SCAN_FWD=" + ("recurrence" if "chunked" in env_setting else "chunked"))
        assert by_env[0] != other[0] and by_env[1:3] == other[1:3]
    elif env_setting.startswith("SSMGRAD_SCAN_BACK"):
        other = _choice_hashes(env_setting="SSMGRAD_SCAN_BACK=" + ("recurrence" if "chunked" in env_setting else "chunked"))
        assert by_env[1] != other[1] and by_env[0] == other[0] and by_env[2] == other[2]
    elif platform.machine() in ("x86_64", "AMD64") and "avx512f" in Path("/proc/cpuinfo").read_text():
        # on an AVX-512 CPU every SIMD setting leaves the pass (or the kernels) it picks by itself
        assert by_env[3:5] != default_hashes[3:5]
