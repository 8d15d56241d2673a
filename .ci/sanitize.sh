#!/usr/bin/env bash
# Sanitizer pass: build the extension with AddressSanitizer + UndefinedBehaviorSanitizer in a
# private copy of the source tree and run the kernel and glue tests against that build
# (tests/kernels/ and ssmgrad.torch's adapter, tests/torch/test_torch_adapter.py; the other
# layers of tests/ exercise ssmgrad inside other software, transformers, ggml and llama.cpp,
# training, torch.compile, the sdist and the docs' examples, not new paths of the C code, and ran
# in the main pass).
# Zero reports allowed: any ASan/UBSan report (in pytest itself or in any child process it
# starts, e.g. the bad-input fuzz batches) makes this script exit non-zero.
#
# How:
# - The copy lives in a fresh temporary directory, so the in-place build in the work tree can
#   never shadow it: pytest runs from the copy, PYTHONPATH is the copy, and the script asserts
#   that every loaded ssmgrad module (the package and its compiled extension) comes from the copy
#   and that the extension really links the sanitizer runtimes.
# - python itself is not instrumented, so the ASan runtime is preloaded (LD_PRELOAD), and
#   PYTHONMALLOC=malloc routes Python's allocations through ASan's malloc (so a stray write into
#   a NumPy buffer or a Python object is caught, not hidden inside pymalloc arenas).
# - detect_leaks=0: the interpreter's own never-freed allocations would be reported as leaks
#   (noise); leaks of ssmgrad are covered by tests/kernels/test_leaks.py (refcounts, blocks, RSS).
# - allocator_may_return_null=1: the bad-input tests ask for absurd allocations and expect a
#   MemoryError; by default ASan would abort on them instead of returning NULL.
# - Every report goes to a log file (log_path) as well as aborting the process; after each step
#   the script fails if any log file holds anything but ASan's expected "failed to allocate"
#   warnings, so a report in a child process whose exit status is swallowed still counts.
# - The pure-C driver tests/c_api/test_c_api.c (kernels only, no Python) also runs, built with
#   the sanitizers at every pass of the run-time SIMD dispatch, and built plain under valgrind
#   memcheck.
# - Checked end to end: an out-of-bounds write injected into the glue (one byte past the gradient
#   array) or into a kernel (one element past y) makes this script fail with the ASan report.
# - torch (the test oracle) loads and runs fine under the ASan preload (checked below before the
#   suite runs), so the kernel and glue tests, torch-based oracle comparisons included, run sanitized.
# - Random budgets are shrunk (SSMGRAD_FUZZ_EXAMPLES, default 40 per property; SSMGRAD_BAD_INPUT_RANDOM,
#   default 100 random bad-input cases) because sanitized code is 2-5x slower; the main pass runs
#   the full budgets; set them in the environment to change them.
#
# Usage: .ci/sanitize.sh [pytest args, default: the copy's tests/kernels and tests/torch/test_torch_adapter.py;
#        -m "not integration" always]
#        (relative test paths resolve inside the copy; KEEP_SANITIZER_DIR=1 keeps the temp copy)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(${PYTHON:-python3} -c 'import sys; print(sys.executable)')"
CC="${CC:-gcc}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ssmgrad-sanitize.XXXXXX")"
if [ "${KEEP_SANITIZER_DIR:-0}" != "1" ]; then
    trap 'rm -rf "$WORK"' EXIT
fi
SRC="$WORK/src"
LOGS="$WORK/reports"
mkdir -p "$SRC" "$LOGS"
echo "sanitize: copy of $ROOT in $SRC"

tar -C "$ROOT" --exclude=./.git --exclude=./build --exclude='*.so' --exclude='__pycache__' \
    --exclude='*.egg-info' --exclude=.pytest_cache --exclude=.hypothesis -cf - . | tar -C "$SRC" -xf -

SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
LIBASAN="$("$CC" -print-file-name=libasan.so)"
[ -e "$LIBASAN" ] || { echo "sanitize: $CC has no libasan.so" >&2; exit 1; }

# 0. the toolchain really reports: a deliberate overflow must abort with an ASan report.
cat > "$WORK/canary.c" <<'EOF'
#include <stdlib.h>
int main(int argc, char ** argv) { int * a = malloc(2 * sizeof(int)); (void) argv; a[argc + 1] = 1; free(a); return 0; }
EOF
"$CC" $SAN -g "$WORK/canary.c" -o "$WORK/canary"
if ASAN_OPTIONS=detect_leaks=0 "$WORK/canary" > "$WORK/canary.log" 2>&1; then
    echo "sanitize: the ASan canary did not fail; the sanitizer does not work here" >&2
    exit 1
fi
grep -q "AddressSanitizer: heap-buffer-overflow" "$WORK/canary.log" \
    || { echo "sanitize: the ASan canary failed without a report:" >&2; cat "$WORK/canary.log" >&2; exit 1; }

# 1. sanitized build (setup.py's own flags plus CFLAGS/LDFLAGS from the environment)
echo "sanitize: [${SECONDS} s] building with $SAN"
# At -O2 (SSMGRAD_OPT; the release build is -O3): under the sanitizers gcc compiles the largest
# kernel file (ssm_scan_back_f32_v4.c) in about 32 CPU s at -O2 against 72 s at -O3, and -O2 still
# vectorises and inlines. (CFLAGS come before setup.py's own flags, so an -O level there would lose.)
# -g1: line tables only (what the reports' stack traces print: file and line), not the full debug
# information of Python's -g: 14% less compile time under the sanitizers
( cd "$SRC" && CC="$CC" SSMGRAD_OPT=-O2 CFLAGS="$SAN -g1" LDFLAGS="$SAN" "$PY" setup.py build_ext --inplace -j 2 ) \
    > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log" >&2; echo "sanitize: build failed" >&2; exit 1; }
echo "sanitize: [${SECONDS} s] built"

# libstdc++ is preloaded too: ASan resolves its __cxa_throw interceptor when it starts, and a C++
# extension loaded later (matplotlib's ft2font, imported by some tests) aborts with "CHECK failed
# ... real___cxa_throw" on its first exception otherwise.
LIBSTDCXX="$("$CC" -print-file-name=libstdc++.so.6)"
export LD_PRELOAD="$LIBASAN:$LIBSTDCXX${LD_PRELOAD:+:$LD_PRELOAD}"
export PYTHONMALLOC=malloc
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:abort_on_error=1:log_path=$LOGS/asan:log_exe_name=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$LOGS/ubsan:log_exe_name=1"
export PYTHONPATH="$SRC"
export PYTHONDONTWRITEBYTECODE=1
export SSMGRAD_FUZZ_EXAMPLES="${SSMGRAD_FUZZ_EXAMPLES:-40}"
export SSMGRAD_BAD_INPUT_RANDOM="${SSMGRAD_BAD_INPUT_RANDOM:-100}"     # random bad-input cases (main pass: 400)

# A report is any line in a log file except the expected warning for a refused absurd allocation
# (the bad-input tests ask for those on purpose; allocator_may_return_null turns them into NULL).
fail_on_reports() {
    local f bad=0
    for f in "$LOGS"/*; do
        [ -e "$f" ] || continue
        if grep -Ev "^==.*==WARNING: AddressSanitizer failed to allocate 0x[0-9a-f]+ bytes$|^$" "$f" > /dev/null; then
            echo "==== sanitizer report $f" >&2
            head -c 20000 "$f" >&2
            bad=1
        fi
    done
    [ "$bad" -eq 0 ] || { echo "sanitize: sanitizer reports found" >&2; exit 1; }
}

# 2. the sanitized build is the one imported, and torch works under the preload
cd "$SRC"
trap 'status=$?; [ $status -eq 0 ] || fail_on_reports; exit $status' ERR
"$PY" - "$SRC" <<'EOF'
import os, subprocess, sys
src = os.path.realpath(sys.argv[1])
import numpy as np
import ssmgrad
# every loaded module of the project: the package, its submodules and its compiled extension
# (whatever it is called, e.g. ssmgrad._ext or _ssmgrad)
mods = {n: os.path.realpath(m.__file__) for n, m in list(sys.modules.items())
        if "ssmgrad" in n.lower() and getattr(m, "__file__", None)}
exts = [f for f in mods.values() if f.endswith(".so")]
assert exts, f"no compiled ssmgrad module loaded: {mods}"
for n, f in mods.items():
    assert f.startswith(src + os.sep), f"{n} imported from {f}, not from the sanitized copy {src}"
for so in exts:
    ldd = subprocess.run(["ldd", so], capture_output=True, text=True).stdout
    assert "libasan" in ldd and "libubsan" in ldd, f"{so} is not sanitized:\n{ldd}"
y = ssmgrad.ssm_conv(np.ones((1, 2, 4)), np.ones((2, 2)))
assert y.shape == (1, 3, 2) and (y == 2).all()
import torch
t = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
(t @ t).sum().backward()
assert t.grad is not None
print("sanitize: imported", ", ".join(sorted(exts)), "| torch", torch.__version__, "runs under ASan")
EOF
fail_on_reports

# 3. the pure-C driver (tests/c_api/test_c_api.c: only csrc/ssmgrad.h and the kernel sources, no
#    Python) linked with the sanitized kernels, and built plain and run under valgrind memcheck (which also
#    sees uninitialised reads, which ASan does not). The kernels dispatch SIMD at run time from
#    cpuid, and valgrind reports a CPU without AVX-512, so memcheck runs a non-AVX-512 clone.
C_DRIVER="$SRC/tests/c_api/test_c_api.c"
if [ -f "$C_DRIVER" ]; then
    # the kernels: csrc/*.c and csrc/inst/*.c (the CPython glue lives in csrc/glue/). Not
    # `grep -L Python.h`: GNU grep >= 3.5 exits 1 from -L when no file holds the pattern, which
    # set -e took for a failure once the glue had left csrc/
    KERNELS=$(ls "$SRC"/csrc/*.c "$SRC"/csrc/inst/*.c)
    # shellcheck disable=SC2086
    if grep -l "Python.h" $KERNELS >&2; then
        echo "sanitize: the kernel sources above include Python.h; the glue belongs in csrc/glue/" >&2; exit 1
    fi
    # the sanitized driver links the kernels' objects of step 1's build (the same sources compiled
    # with $SAN, at -O2; no OpenMP in them) instead of compiling every kernel again
    # under the sanitizers (the costliest compile of this script); only the driver is compiled here
    SAN_OBJS=()
    for k in $KERNELS; do
        rel="${k#"$SRC"/}"
        o="$(find "$SRC/build" -path "*/${rel%.c}.o" | head -n 1)"
        [ -n "$o" ] || { echo "sanitize: step 1 built no object of $k" >&2; exit 1; }
        SAN_OBJS+=("$o")
    done
    # shellcheck disable=SC2086
    "$CC" $SAN -O1 -g1 -std=c11 -I "$SRC/csrc" "$C_DRIVER" "${SAN_OBJS[@]}" -lm -o "$WORK/c_driver_san" \
        > "$WORK/c_build.log" 2>&1 || { cat "$WORK/c_build.log" >&2; echo "sanitize: C driver build failed" >&2; exit 1; }
    # the C driver is sanitized itself: no preload (LD_PRELOAD is only for python)
    # once at the pass this CPU picks and once capped to each other pass of the run-time SIMD dispatch
    # (the program's --simd=, as tests/kernels/test_c_api.py runs the plain build), so every level's
    # kernels run sanitized on the driver's cases
    simd_args=("")
    case "$(uname -m)" in x86_64|amd64) simd_args+=(--simd=x86-64-v3 --simd=x86-64 --simd=v4-no-vec64) ;; esac
    for arg in "${simd_args[@]}"; do
        # shellcheck disable=SC2086
        LD_PRELOAD= "$WORK/c_driver_san" $arg > "$WORK/c_driver_san.log" 2>&1 \
            || { cat "$WORK/c_driver_san.log" >&2; echo "sanitize: C driver ${arg:-(default pass)} failed under ASan/UBSan" >&2; exit 1; }
        grep -q "all C API checks passed" "$WORK/c_driver_san.log" \
            || { cat "$WORK/c_driver_san.log" >&2; echo "sanitize: C driver ${arg:-(default pass)}: no pass line" >&2; exit 1; }
        fail_on_reports
        echo "sanitize: [${SECONDS} s] C driver OK under ASan+UBSan, $(grep -m1 "^simd selected" "$WORK/c_driver_san.log")${arg:+ ($arg)}"
    done
    if command -v valgrind > /dev/null; then
        # at -O0: memcheck sees the loads and stores the source makes, and the compile takes 12 CPU s
        # against 34 at -O1 (the ASan runs above test the kernels as optimised, at -O2)
        # shellcheck disable=SC2086
        "$CC" -O0 -g1 -std=c11 -I "$SRC/csrc" "$C_DRIVER" $KERNELS -lm -o "$WORK/c_driver" > "$WORK/c_build2.log" 2>&1 \
            || { cat "$WORK/c_build2.log" >&2; exit 1; }
        # --no-fd: the driver skips its finite differences, which run only the naive reference (no
        # kernel), twice per input: 98% of the program's time; under memcheck the run takes 2 s with
        # --no-fd against about 110 s without (Zen 4). Every kernel call and every other check stays.
        # An uninitialised read and a leak put into ssm_conv_f64 fail it. Without --track-origins; on a failure
        # the run is repeated with it, for the report that says where an uninitialised value came from
        VG=(valgrind -q --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite,indirect)
        if ! LD_PRELOAD= "${VG[@]}" "$WORK/c_driver" --no-fd > "$WORK/c_driver_vg.log" 2>&1; then
            LD_PRELOAD= "${VG[@]}" --track-origins=yes "$WORK/c_driver" --no-fd > "$WORK/c_driver_vg.log" 2>&1 || true
            cat "$WORK/c_driver_vg.log" >&2; echo "sanitize: valgrind memcheck reported errors" >&2; exit 1
        fi
        grep -q "all C API checks passed" "$WORK/c_driver_vg.log"
        echo "sanitize: [${SECONDS} s] C driver OK under valgrind memcheck"
    else
        # a missing valgrind is a skip on a workstation, a failure under CI=true (.ci/run installs it)
        # or with SSMGRAD_REQUIRE_VALGRIND=1
        ci="${CI:-}"
        if [ "${ci,,}" = "true" ] || [ "${SSMGRAD_REQUIRE_VALGRIND:-0}" = "1" ]; then
            echo "sanitize: valgrind not installed (CI=true or SSMGRAD_REQUIRE_VALGRIND=1: a failure, not a skip)" >&2
            exit 1
        fi
        echo "sanitize: valgrind not installed; the memcheck run of the C driver did not run" >&2
    fi
fi

# 4. the kernel and glue tests: tests/kernels/ (the C kernels through the NumPy API and the glue),
#    and ssmgrad.torch's adapter, which hands torch's own buffers to the glue without a copy. The
#    other layers (torch/, transformers/, ggml/, package/) run ssmgrad inside other software
#    through the same entry points and run in the main pass (the ggml ones would also build an
#    unsanitized ggml with cmake, which would inherit the ASan preload).
if [ $# -gt 0 ]; then TESTS=("$@"); else TESTS=("$SRC/tests/kernels" "$SRC/tests/torch/test_torch_adapter.py"); fi
echo "sanitize: [${SECONDS} s] running pytest -m 'not integration' ${TESTS[*]#"$SRC"/} (SSMGRAD_FUZZ_EXAMPLES=$SSMGRAD_FUZZ_EXAMPLES)"
set +e
# Left to the main pass: the C driver that tests/kernels/test_c_api.py compiles and runs (a plain
# build with $CC, not instrumented: step 3 ran the sanitized one at every SIMD pass), the aarch64
# run under qemu (a cross-compiled program, not this build), and tests/kernels/test_scan_hashes.py and
# test_gdn_hashes.py (their golden bits are the default build's, and instrumented code may be compiled
# differently); and
# tests/kernels/test_numerics_edges.py's 8192-token error-growth cases (their float64 NumPy oracle
# loops over tokens in Python and takes ~10 s a case under the preload, ~230 s in all, against ~1.5 s
# in the main pass): the same kernel paths over several chunks, with K > 1 and duplicate ids, run
# sanitized in test_scan_back_chunked.py and test_scan_fwd_chunked.py (n_t 70-140).
"$PY" -m pytest -p no:cacheprovider -q --durations=15 -m "not integration" \
    --deselect tests/kernels/test_c_api.py::test_c_program --deselect tests/kernels/test_c_api.py::test_c_program_each_simd_pass \
    --deselect tests/kernels/test_c_api.py::test_c_program_aarch64_under_qemu --deselect tests/kernels/test_scan_hashes.py \
    --deselect tests/kernels/test_gdn_hashes.py \
    --deselect tests/kernels/test_numerics_edges.py::test_long_sequence_forward_backward \
    "${TESTS[@]}" 2>&1 | tee "$WORK/pytest.log"
status=${PIPESTATUS[0]}
set -e
fail_on_reports
if grep -Eq "ERROR: AddressSanitizer|AddressSanitizer: CHECK failed|runtime error:|SUMMARY: (Address|UndefinedBehavior)Sanitizer" "$WORK/pytest.log"; then
    echo "sanitize: a sanitizer report appeared in the pytest output" >&2
    exit 1
fi
if [ "$status" -ne 0 ]; then
    echo "sanitize: pytest failed under the sanitizers (exit $status)" >&2
    exit "$status"
fi
echo "sanitize: [${SECONDS} s] OK, zero ASan/UBSan reports"
