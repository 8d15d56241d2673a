#!/usr/bin/env bash
# Build ggml with ssmgrad's SSM_CONV_BACK / SSM_SCAN_BACK, and ggml's test-backend-ops, into build/ggml/.
#
#   bash ggml/build.sh              patched build:   build/ggml/bin/{test-backend-ops,ssm-back-check[,train_mamba],
#                                                    llama-finetune,llama-tokenize}
#   bash ggml/build.sh --unpatched  reference build: build/ggml-unpatched/bin/{test-backend-ops,llama-finetune,
#                                                    llama-tokenize}
#
# Where ggml comes from: the sdist of llama-cpp-python==0.3.36 on PyPI carries the full llama.cpp
# tree (vendor/llama.cpp, ggml 0.25.3). It is fetched once into a cache outside the work tree
# (SSMGRAD_GGML_CACHE, default ${XDG_CACHE_HOME:-~/.cache}/ssmgrad-ggml), its sha256 checked, and only
# vendor/llama.cpp/ggml and vendor/llama.cpp/tests/test-backend-ops.cpp are extracted.
#
# Then: ggml/ssmgrad-ggml.patch is applied (edits to ggml's own files), ggml/overlay/ is copied over
# the tree (new files), and cmake + ninja build the CPU backend only (Release, GGML_NATIVE=OFF,
# GGML_OPENMP=OFF, static libraries). ssmgrad's kernels (csrc/ssm_*.c) are compiled into ggml-cpu
# by the patched ggml-cpu CMakeLists, from this checkout's csrc/ (SSMGRAD_CSRC).
#
# Incremental: the extracted tree is rebuilt only when the patch, the overlay, this script or the
# sdist changed (a stamp of their hashes), and even then only files whose bytes changed are
# rewritten, so ninja recompiles only what the change touched. csrc/ is compiled in place and
# tracked by ninja directly (a new csrc/ssm_*.c is picked up by cmake's CONFIGURE_DEPENDS glob).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SDIST=llama_cpp_python-$VERSION.tar.gz
CACHE="${SSMGRAD_GGML_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ssmgrad-ggml}"

PATCHED=1
if [ "${1:-}" = "--unpatched" ]; then
    PATCHED=0
    shift
fi
if [ $# -ne 0 ]; then
    echo "usage: bash ggml/build.sh [--unpatched]" >&2
    exit 2
fi

if [ $PATCHED = 1 ]; then
    BUILD="${SSMGRAD_GGML_BUILD:-$ROOT/build/ggml}"
else
    BUILD="${SSMGRAD_GGML_BUILD_UNPATCHED:-$ROOT/build/ggml-unpatched}"
fi
SRC="$BUILD/_src"          # extracted (and patched) llama.cpp subset: ggml/, tests/test-backend-ops.cpp

log() { echo "ggml/build.sh: $*" >&2; }

for tool in cmake ninja tar patch sha256sum; do
    command -v "$tool" >/dev/null || { log "missing tool: $tool (cmake and ninja: pip install cmake ninja)"; exit 1; }
done

# ---------------------------------------------------------------- fetch (cached) and verify
mkdir -p "$CACHE"
if [ ! -f "$CACHE/$SDIST" ]; then
    log "fetching $SDIST from PyPI into $CACHE"
    PY="${PYTHON:-python3}"
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" \
        -d "$CACHE/.download" >&2
    mv "$CACHE/.download/$SDIST" "$CACHE/$SDIST"
    rm -rf "$CACHE/.download"
fi
if ! echo "$SHA256  $CACHE/$SDIST" | sha256sum -c --status; then
    log "sha256 mismatch for $CACHE/$SDIST (expected $SHA256); delete it to fetch again"
    exit 1
fi

# ---------------------------------------------------------------- extract + patch (when the inputs changed)
# the parts of vendor/llama.cpp used (paths relative to it)
EXTRACT=(
    ggml tests/test-backend-ops.cpp
    CMakeLists.txt cmake LICENSE include src common vendor
    examples/training tools/tokenize
    convert_hf_to_gguf.py conversion gguf-py models/ggml-vocab-gpt-neox.gguf
)
hash_inputs() {
    {
        echo "sdist $SHA256 patched $PATCHED"
        if [ $PATCHED = 1 ]; then
            sha256sum "$HERE/ssmgrad-ggml.patch"
            (cd "$HERE" && find overlay -type f | LC_ALL=C sort | xargs sha256sum)
        fi
        sha256sum "$HERE/build.sh"
    } | sha256sum | cut -d' ' -f1
}
STAMP="$(hash_inputs)"

if [ ! -f "$SRC/.stamp" ] || [ "$(cat "$SRC/.stamp")" != "$STAMP" ]; then
    log "extracting ggml from $SDIST$([ $PATCHED = 1 ] && echo ' and applying ssmgrad-ggml.patch')"
    mkdir -p "$BUILD"
    NEW="$(mktemp -d "$BUILD/.src-new.XXXXXX")"
    trap 'rm -rf "$NEW"' EXIT
    top="llama_cpp_python-$VERSION/vendor/llama.cpp"
    tar -xzf "$CACHE/$SDIST" -C "$NEW" --strip-components=3 "${EXTRACT[@]/#/$top/}"
    if [ $PATCHED = 1 ]; then
        (cd "$NEW" && patch -p1 --forward --batch --quiet < "$HERE/ssmgrad-ggml.patch")
        cp -R "$HERE/overlay/." "$NEW/"
    fi
    # move into place, rewriting only files whose bytes differ (keeps ninja's incremental build)
    mkdir -p "$SRC"
    rm -f "$SRC/.stamp"
    (cd "$NEW" && find . -type f) | while IFS= read -r f; do
        if ! cmp -s "$NEW/$f" "$SRC/$f"; then
            mkdir -p "$(dirname "$SRC/$f")"
            cp "$NEW/$f" "$SRC/$f"
        fi
    done
    (cd "$SRC" && find . -type f ! -name .stamp) | while IFS= read -r f; do
        [ -e "$NEW/$f" ] || rm -f "$SRC/$f"
    done
    rm -rf "$NEW"
    trap - EXIT
    echo "$STAMP" > "$SRC/.stamp"
fi

# ---------------------------------------------------------------- configure + build
# GGML_NATIVE=OFF: no -march=native (the project never builds for the build machine only); ggml's
#   x86 default then is AVX2+FMA+F16C (x86-64-v3). ssmgrad's kernels keep their own flags and
#   runtime dispatch (they are an object library of their own, see the patched ggml-cpu CMakeLists).
# GGML_OPENMP=OFF: ggml's own thread pool (ggml_barrier on atomics); ssmgrad's kernels need no
#   OpenMP, they take (ith, nth) like every ggml op.
cmake -S "$HERE" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_SOURCE_DIR="$SRC/ggml" \
    -DTEST_BACKEND_OPS="$SRC/tests/test-backend-ops.cpp" \
    -DSSMGRAD_CSRC="$ROOT/csrc" \
    -DSSMGRAD_PATCHED=$([ $PATCHED = 1 ] && echo ON || echo OFF) \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF \
    -DGGML_OPENMP=OFF \
    -DGGML_CCACHE=OFF \
    -DGGML_BUILD_TESTS=OFF \
    -DGGML_BUILD_EXAMPLES=OFF \
    -DGGML_CPU=ON -DGGML_BLAS=OFF -DGGML_LLAMAFILE=OFF \
    -DLLAMA_SOURCE_DIR="$SRC" \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF -DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_BUILD_LIBRESSL=OFF \
    >"$BUILD/cmake-configure.log" 2>&1 || { cat "$BUILD/cmake-configure.log" >&2; exit 1; }

cmake --build "$BUILD" -j "${SSMGRAD_GGML_JOBS:-2}"

log "built $BUILD/bin/{test-backend-ops,llama-finetune,llama-tokenize}"
