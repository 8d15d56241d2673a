#!/usr/bin/env bash
# Compiler matrix: build the extension with each of several C compilers, each in a private copy
# of the source tree, print what `python -m ssmgrad info` says of the build (compiler, SIMD
# dispatch, OpenMP), and run the kernel and glue tests against that build (tests/kernels/; the
# other layers of tests/, ssmgrad.torch, transformers, ggml, the package, run the same kernels
# through the same entry points and do not depend on the C compiler: they ran in the main pass).
# Fails if any build, check or suite fails, or if a compiler warns.
#
# The default build (gcc 12 on Debian 12) is the one the README's `pip install` makes and the
# main suite tests; this adds:
#   gcc-11      GCC 11 (Ubuntu 22.04's and RHEL 9's default), with OpenMP (libgomp)
#   clang       clang (14 on Debian 12), with OpenMP (libomp-dev)
#   clang-noomp clang without OpenMP (SSMGRAD_OPENMP=0: the kernels' thread slices run serially);
#               the thread runner's tests only (below)
# .ci/run installs the compilers (Debian packages gcc-11, clang, libomp-dev).
#
# How (as .ci/sanitize.sh): each build lives in a fresh temporary copy, built in place with
# `setup.py build_ext --inplace` and CC set; pytest runs from the copy with PYTHONPATH on it, so
# an installed ssmgrad can never shadow it, and the script checks that every loaded ssmgrad
# module comes from the copy and that the build reports the compiler it was given. CC stays set
# for pytest too, so tests/kernels/test_c_api.py compiles its pure-C driver with the same compiler.
#
# Usage: .ci/compilers.sh [NAME ...]   (default: gcc-11 clang clang-noomp)
#        extra pytest args through SSMGRAD_COMPILERS_PYTEST_ARGS (default: none)
#        KEEP_COMPILERS_DIR=1 keeps the temporary copies
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$(${PYTHON:-python3} -c 'import sys; print(sys.executable)')"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ssmgrad-compilers.XXXXXX")"
if [ "${KEEP_COMPILERS_DIR:-0}" != "1" ]; then
    trap 'rm -rf "$WORK"' EXIT
fi

# NAME -> "CC OPENMP(1/0) TESTS expected-compiler-prefix-in-info"
#   TESTS kernels: tests/kernels/ (the C kernels through the NumPy API, the glue, the C driver)
#   TESTS threads: the tests of the glue's thread runner only (below)
spec() {
    case "$1" in
        gcc-11) echo "gcc-11 1 kernels GCC 11." ;;
        gcc-12) echo "gcc-12 1 kernels GCC 12." ;;
        clang) echo "clang 1 kernels clang" ;;
        clang-noomp) echo "clang 0 threads clang" ;;
        *) echo "compilers: unknown build $1 (known: gcc-11 gcc-12 clang clang-noomp)" >&2; return 1 ;;
    esac
}

NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(gcc-11 clang clang-noomp)
# shellcheck disable=SC2206
PYTEST_ARGS=(${SSMGRAD_COMPILERS_PYTEST_ARGS:-})

# ccache, when installed (.ci/run installs it), in a cache of this run only: a kernel source's compile
# command is the same with and without OpenMP (setup.py gives the flag to the glue only), so
# clang-noomp compiles only the glue and takes clang's kernel objects from the cache. The copies live
# in different directories: CCACHE_NOHASHDIR keeps the directory (named in -g's debug info) out of the
# hash, and CCACHE_BASEDIR makes the paths under $WORK relative.
CCACHE=()
if command -v ccache > /dev/null; then
    CCACHE=(ccache)
    export CCACHE_DIR="$WORK/ccache" CCACHE_BASEDIR="$WORK" CCACHE_NOHASHDIR=1
fi

failed=()
summary=()
for name in "${NAMES[@]}"; do
    read -r cc omp tests want_compiler <<< "$(spec "$name")"
    command -v "$cc" > /dev/null || { echo "compilers: $cc not found (.ci/run installs it from Debian)" >&2; exit 1; }
    SRC="$WORK/$name"
    mkdir -p "$SRC"
    tar -C "$ROOT" --exclude=./.git --exclude=./build --exclude='*.so' --exclude='__pycache__' \
        --exclude='*.egg-info' --exclude=.pytest_cache --exclude=.hypothesis -cf - . | tar -C "$SRC" -xf -
    t0=$(date +%s)
    echo "==== compilers: $name (CC=$cc, SSMGRAD_OPENMP=$omp): $("$cc" --version | head -1)"
    # CFLAGS=-g0 (after Python's own flags, which hold -g): no debug information, about a quarter less compile
    # time (the largest kernel file at -O3: GCC 11 2.8 CPU s against 4.0, clang 5.3 against 7.0); -g does not
    # change the code a compiler generates
    if ! ( cd "$SRC" && CC="${CCACHE[*]}${CCACHE:+ }$cc" CFLAGS="${CFLAGS:+$CFLAGS }-g0" SSMGRAD_OPENMP="$omp" \
            "$PY" setup.py build_ext --inplace -j 2 ) \
            > "$WORK/$name.build.log" 2>&1; then
        cat "$WORK/$name.build.log" >&2
        echo "compilers: $name: build failed" >&2
        failed+=("$name (build)")
        continue
    fi
    if grep -E "(warning|error):" "$WORK/$name.build.log" >&2; then
        echo "compilers: $name: the compiler warned (above)" >&2
        failed+=("$name (warnings)")
        continue
    fi
    t1=$(date +%s)
    # the build is the one imported, and it says which compiler, dispatch and OpenMP it got
    if ! ( cd "$SRC" && PYTHONPATH="$SRC" "$PY" - "$SRC" "$want_compiler" "$omp" <<'EOF'
import os, sys
src, want_compiler, omp = os.path.realpath(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
import ssmgrad
mods = {n: os.path.realpath(m.__file__) for n, m in list(sys.modules.items())
        if "ssmgrad" in n.lower() and getattr(m, "__file__", None)}
assert any(f.endswith(".so") for f in mods.values()), f"no compiled ssmgrad module loaded: {mods}"
for n, f in mods.items():
    assert f.startswith(src + os.sep), f"{n} imported from {f}, not from the copy {src}"
info = ssmgrad._ext.build_info()
assert f"compiler: {want_compiler}" in info["simd_compiled"], (want_compiler, info["simd_compiled"])
assert info["openmp"] == omp, ("OpenMP", omp, info)
EOF
    ); then
        echo "compilers: $name: the build is not the one imported, or not what was asked for" >&2
        failed+=("$name (build facts)")
        continue
    fi
    ( cd "$SRC" && PYTHONPATH="$SRC" "$PY" -m ssmgrad info )
    set +e
    # random budgets as in .ci/sanitize.sh: this pass checks the build on the main pass's cases and
    # a sample of the random ones (the main pass runs the full budgets). The aarch64 run under qemu
    # is left to the main pass: aarch64-linux-gnu-gcc builds it whatever CC is.
    # tests/kernels/test_scan_hashes.py and test_gdn_hashes.py hold the default build's bits (other
    # compilers round differently).
    # So are the reruns of the scan and conv tests at the other SIMD passes (test_generic_kernels.py,
    # the costliest file of tests/kernels/): the main pass (gcc 12) and the sanitizer pass run them; here each
    # compiler's build is checked at the pass this CPU selects.
    # SSMGRAD_OPENMP reaches pytest too: tests that need OpenMP skip (not fail, under CI=true) when
    # it says the build was made without it.
    # Without OpenMP only the glue changes: the glue (csrc/glue/) is the one source with OpenMP in
    # it, and setup.py gives -fopenmp to the glue only, so the kernel objects are the clang build's
    # (the same commands), which that build runs through tests/kernels/. So clang-noomp runs
    # the tests of what differs, the thread runner: slices run one after another, bitwise equal to
    # one thread, from many Python threads at once, after fork, the thread count's rules.
    if [ "$tests" = threads ]; then
        # the premise, checked: no OpenMP in any kernel source or header (the glue aside)
        # shellcheck disable=SC2046
        if grep -lE "pragma +omp|_OPENMP|\bomp_" "$SRC"/csrc/*.c "$SRC"/csrc/inst/*.c "$SRC"/csrc/*.h >&2; then
            echo "compilers: $name: the kernel sources above use OpenMP, so a build without it changes them: run tests/kernels/ for it" >&2
            failed+=("$name (OpenMP in the kernels)")
            set -e
            continue
        fi
        TESTS=("$SRC/tests/kernels/test_threads.py" "$SRC/tests/kernels/test_concurrency.py"
               "$SRC/tests/kernels/test_thread_default.py" "$SRC/tests/kernels/test_int_args.py")
    else
        TESTS=("$SRC/tests/kernels")
    fi
    ( cd "$SRC" && CC="$cc" SSMGRAD_OPENMP="$omp" PYTHONPATH="$SRC" PYTHONDONTWRITEBYTECODE=1 \
        SSMGRAD_FUZZ_EXAMPLES="${SSMGRAD_FUZZ_EXAMPLES:-40}" SSMGRAD_BAD_INPUT_RANDOM="${SSMGRAD_BAD_INPUT_RANDOM:-100}" \
        "$PY" -m pytest -p no:cacheprovider -q --durations=15 -m "not integration" "${PYTEST_ARGS[@]}" \
            --deselect tests/kernels/test_c_api.py::test_c_program_aarch64_under_qemu \
            --deselect tests/kernels/test_generic_kernels.py --deselect tests/kernels/test_scan_hashes.py \
            --deselect tests/kernels/test_gdn_hashes.py "${TESTS[@]}" )
    status=$?
    set -e
    t2=$(date +%s)
    summary+=("$name: build $((t1 - t0)) s, suite $((t2 - t1)) s, pytest exit $status")
    [ "$status" -eq 0 ] || failed+=("$name (pytest exit $status)")
done

echo "==== compilers: summary"
for line in "${summary[@]}"; do echo "  $line"; done
if [ ${#failed[@]} -gt 0 ]; then
    echo "compilers: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "compilers: OK (${NAMES[*]})"
