#!/usr/bin/env bash
# Build ggml with ssmgrad's SSM_CONV_BACK / SSM_SCAN_BACK, and ggml's test-backend-ops, into build/ggml/.
#
#   bash ggml/build.sh              patched build:   build/ggml/bin/{test-backend-ops,ssm-back-check,gdn-check[,train_mamba],
#                                                    llama-finetune,llama-tokenize,llama-perplexity,
#                                                    llama-quantize,llama-completion}
#   bash ggml/build.sh --unpatched  reference build: build/ggml-unpatched/bin/{llama-finetune,opt-rebuilt-graphs}
#   bash ggml/build.sh --export DIR the change as git-format patches against the pristine llama.cpp tree, one
#                                   concern each, with every new file in them (nothing is built)
#
# Where ggml comes from: the sdist of llama-cpp-python==0.3.36 on PyPI carries the full llama.cpp
# tree (vendor/llama.cpp, ggml 0.25.3). It is fetched once into a cache outside the work tree
# (SSMGRAD_GGML_CACHE, default ${XDG_CACHE_HOME:-~/.cache}/ssmgrad-ggml), its sha256 checked, and only
# vendor/llama.cpp/ggml and vendor/llama.cpp/tests/test-backend-ops.cpp are extracted.
#
# Then: the series ggml/patches/*.patch is applied in order (edits to llama.cpp's own files, one concern
# each), ggml/overlay/ is copied over the tree (new files), ssmgrad's kernels (csrc/*.c, csrc/*.h, csrc/inst/*.c; not
# csrc/glue/, the Python glue) are copied into ggml/src/ggml-cpu/ssmgrad/, and cmake + ninja build the CPU backend
# only (Release, GGML_NATIVE=OFF, GGML_OPENMP=OFF, static libraries). The patched tree builds on its own:
# its ggml-cpu CMakeLists compiles ggml-cpu/ssmgrad/*.c and inst/*.c, nothing points back into this checkout.
#
# Incremental: the extracted tree is rebuilt only when the patches, the overlay, this script or the
# sdist changed (a stamp of their hashes), and even then only files whose bytes changed are
# rewritten, so ninja recompiles only what the change touched. The kernels are synced on every run the
# same way (a changed csrc/ file is copied, so ninja recompiles it; a new one is picked up by cmake's
# CONFIGURE_DEPENDS glob; a removed one is removed).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SDIST=llama_cpp_python-$VERSION.tar.gz
CACHE="${SSMGRAD_GGML_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ssmgrad-ggml}"

PATCHED=1
EXPORT=
usage() { echo "usage: bash ggml/build.sh [--unpatched | --export DIR]" >&2; exit 2; }
case "${1:-}" in
    --unpatched) PATCHED=0; shift ;;
    --export) [ $# -eq 2 ] || usage; EXPORT="$2"; shift 2 ;;
esac
[ $# -eq 0 ] || usage
PATCHES=("$HERE"/patches/*.patch)

if [ $PATCHED = 1 ]; then
    BUILD="${SSMGRAD_GGML_BUILD:-$ROOT/build/ggml}"
else
    BUILD="${SSMGRAD_GGML_BUILD_UNPATCHED:-$ROOT/build/ggml-unpatched}"
fi
# a relative build directory is the caller's (cmake's add_subdirectory needs it absolute: it failed with
# "not an existing directory" for every tool)
case "$BUILD" in /*) ;; *) BUILD="$PWD/$BUILD" ;; esac
SRC="$BUILD/_src"          # extracted (and patched) llama.cpp subset (EXTRACT below)

log() { echo "ggml/build.sh: $*" >&2; }

TOOLS="cmake ninja tar patch sha256sum"
[ -z "$EXPORT" ] || TOOLS="tar git sha256sum"
for tool in $TOOLS; do
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
# one build.sh at a time per build directory (tests of several modules call it)
if [ -z "$EXPORT" ] && command -v flock >/dev/null; then
    mkdir -p "$BUILD"
    exec 9>"$BUILD/.lock"
    flock 9
fi
# the parts of vendor/llama.cpp used (paths relative to it)
EXTRACT=(
    ggml tests/test-backend-ops.cpp
    CMakeLists.txt cmake LICENSE include src common vendor
    examples/training tools/tokenize tools/perplexity tools/quantize tools/completion
    convert_hf_to_gguf.py conversion gguf-py models/ggml-vocab-gpt-neox.gguf
)
extract() {  # extract DIR: the pristine subset of vendor/llama.cpp
    tar -xzf "$CACHE/$SDIST" -C "$1" --strip-components=3 "${EXTRACT[@]/#/llama_cpp_python-$VERSION/vendor/llama.cpp/}"
}
new_files() {  # new_files DIR: what the series adds as new files (ssm-back.* and the kernels)
    cp -R "$HERE/overlay/." "$1/"
    sync_kernels "$1/ggml/src/ggml-cpu/ssmgrad"
}
sync_kernels() {  # sync_kernels DIR: csrc's kernel sources into DIR, rewriting only files that changed
    local dst="$1" f
    mkdir -p "$dst"
    mkdir -p "$dst/inst"
    # not csrc/glue/: the CPython glue (Python.h) is no part of ggml
    for f in "$ROOT"/csrc/*.c "$ROOT"/csrc/*.h "$ROOT"/csrc/inst/*.c; do
        local rel="${f#"$ROOT"/csrc/}"
        cmp -s "$f" "$dst/$rel" || cp "$f" "$dst/$rel"
    done
    for f in "$dst"/* "$dst"/inst/*; do
        [ -f "$f" ] || continue
        [ -e "$ROOT/csrc/${f#"$dst"/}" ] || rm -f "$f"
    done
}

# ---------------------------------------------------------------- --export DIR: the series as git commits
if [ -n "$EXPORT" ]; then
    mkdir -p "$EXPORT"
    EXPORT="$(cd "$EXPORT" && pwd)"
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    extract "$WORK"
    export GIT_AUTHOR_NAME=ssmgrad GIT_AUTHOR_EMAIL=ssmgrad@invalid GIT_COMMITTER_NAME=ssmgrad \
        GIT_COMMITTER_EMAIL=ssmgrad@invalid GIT_AUTHOR_DATE="2026-12-01T00:00:00Z" GIT_COMMITTER_DATE="2026-12-01T00:00:00Z"
    (cd "$WORK" && git init -q && git add -A && git commit -q -m "llama.cpp as vendored by llama-cpp-python $VERSION")
    first=1
    for p in "${PATCHES[@]}"; do
        (cd "$WORK" && git apply --whitespace=nowarn "$p")
        if [ $first = 1 ]; then new_files "$WORK"; first=0; fi
        # the commit message: the patch file's text before its "---" line
        (cd "$WORK" && git add -A && sed '/^---$/,$d' "$p" | git commit -q -F -)
    done
    rm -f "$EXPORT"/*.patch
    (cd "$WORK" && git format-patch -q -o "$EXPORT" HEAD~${#PATCHES[@]})
    # named as in ggml/patches/ (format-patch names them after their subjects)
    i=0
    for f in $(cd "$EXPORT" && ls -1 [0-9][0-9][0-9][0-9]-*.patch | LC_ALL=C sort); do
        [ "$f" = "$(basename "${PATCHES[$i]}")" ] || mv "$EXPORT/$f" "$EXPORT/$(basename "${PATCHES[$i]}")"
        i=$((i + 1))
    done
    log "wrote ${#PATCHES[@]} patches to $EXPORT"
    exit 0
fi

hash_inputs() {
    {
        echo "sdist $SHA256 patched $PATCHED"
        if [ $PATCHED = 1 ]; then
            sha256sum "${PATCHES[@]}"
            (cd "$HERE" && find overlay -type f | LC_ALL=C sort | xargs sha256sum)
        fi
        sha256sum "$HERE/build.sh"
    } | sha256sum | cut -d' ' -f1
}
STAMP="$(hash_inputs)"

if [ ! -f "$SRC/.stamp" ] || [ "$(cat "$SRC/.stamp")" != "$STAMP" ]; then
    log "extracting llama.cpp from $SDIST$([ $PATCHED = 1 ] && echo ' and applying ggml/patches')"
    mkdir -p "$BUILD"
    NEW="$(mktemp -d "$BUILD/.src-new.XXXXXX")"
    trap 'rm -rf "$NEW"' EXIT
    extract "$NEW"
    if [ $PATCHED = 1 ]; then
        for p in "${PATCHES[@]}"; do
            (cd "$NEW" && patch -p1 --forward --batch --quiet < "$p") || { log "failed to apply $p"; exit 1; }
        done
        new_files "$NEW"
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
[ $PATCHED = 0 ] || sync_kernels "$SRC/ggml/src/ggml-cpu/ssmgrad"

# ---------------------------------------------------------------- configure + build
# GGML_NATIVE=OFF: no -march=native (the project never builds for the build machine only); ggml's
#   x86 default then is AVX2+FMA+F16C (x86-64-v3). ssmgrad's kernels keep their own flags and
#   runtime dispatch (they are an object library of their own, see the patched ggml-cpu CMakeLists).
# GGML_OPENMP=OFF: ggml's own thread pool (ggml_barrier on atomics); ssmgrad's kernels need no
#   OpenMP, they take (ith, nth) like every ggml op.
# The stock build (--unpatched) only has to show what the series fixes: llama-finetune aborts while it
#   builds the backward graph, and opt-rebuilt-graphs runs a few steps of a 4x3 linear model. It is
#   compiled with -O0 instead of Release's -O3 (the same abort message and the same ggml-opt steps
#   to well within the tests' 2e-5; what the programs run takes well under a second either way).
OPT_FLAGS=()
[ $PATCHED = 1 ] || OPT_FLAGS=(-DCMAKE_C_FLAGS_RELEASE="-O0 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELEASE="-O0 -DNDEBUG")
# ccache, when installed (SSMGRAD_GGML_CCACHE=0 turns it off): the sources live in $BUILD/_src, so
#   with CCACHE_BASEDIR=$BUILD every compile command names them by the same relative paths in every
#   build directory, and a build of the same file with the same flags elsewhere (the fresh extraction
#   tests/ggml/test_ggml_series.py builds with the same layout, a rebuild after `rm -rf build`) reuses the
#   object. No -g in these builds, so the directory itself is not hashed.
LAUNCHER=()
if [ "${SSMGRAD_GGML_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then
    LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    export CCACHE_BASEDIR="$BUILD" CCACHE_NOHASHDIR=1
fi
# Build options (environment, default off; a build directory per set of options, SSMGRAD_GGML_BUILD):
#   SSMGRAD_GGML_NATIVE=1     GGML_NATIVE=ON: ggml for this machine's CPU (-march=native: AVX-512 where
#                             there is one); the binaries may not run on another machine
#   SSMGRAD_GGML_LLAMAFILE=1  GGML_LLAMAFILE=ON: llamafile's sgemm (tinyBLAS) for the F32 matrix
#                             products (MUL_MAT) of the forward; the backward's OUT_PROD does not use it
#   e.g. SSMGRAD_GGML_BUILD=build/ggml-fast SSMGRAD_GGML_NATIVE=1 SSMGRAD_GGML_LLAMAFILE=1 bash ggml/build.sh
#   What each costs and gains in llama-finetune's step: docs/performance.md.
onoff() { case "${1:-0}" in 1|ON|on|yes) echo ON ;; 0|OFF|off|no|'') echo OFF ;; *) log "expected 0 or 1, got '$1'"; exit 2 ;; esac; }
NATIVE="$(onoff "${SSMGRAD_GGML_NATIVE:-0}")"
LLAMAFILE="$(onoff "${SSMGRAD_GGML_LLAMAFILE:-0}")"
CONFIGURE=(cmake -S "$HERE" -B "$BUILD" -G Ninja
    -DCMAKE_BUILD_TYPE=Release "${OPT_FLAGS[@]}" "${LAUNCHER[@]}"
    -DGGML_SOURCE_DIR="$SRC/ggml"
    -DTEST_BACKEND_OPS="$SRC/tests/test-backend-ops.cpp"
    -DSSMGRAD_PATCHED=$([ $PATCHED = 1 ] && echo ON || echo OFF)
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=$NATIVE
    -DGGML_OPENMP=OFF
    -DGGML_CCACHE=OFF
    -DGGML_BUILD_TESTS=OFF
    -DGGML_BUILD_EXAMPLES=OFF
    -DGGML_CPU=ON -DGGML_BLAS=OFF -DGGML_LLAMAFILE=$LLAMAFILE
    -DLLAMA_SOURCE_DIR="$SRC"
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF -DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_BUILD_LIBRESSL=OFF)
# configured once per set of arguments and inputs (llama.cpp's configure takes ~20 s here); after
# that ninja re-runs cmake by itself when a CMakeLists or a globbed directory changes
CONF_HASH="$(echo "$STAMP ${CONFIGURE[*]}" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$BUILD/build.ninja" ] || [ "$(cat "$BUILD/.configured" 2>/dev/null)" != "$CONF_HASH" ]; then
    rm -f "$BUILD/.configured"
    "${CONFIGURE[@]}" >"$BUILD/cmake-configure.log" 2>&1 || { cat "$BUILD/cmake-configure.log" >&2; exit 1; }
    echo "$CONF_HASH" > "$BUILD/.configured"
fi

# the stock build serves only the tests that show what the series fixes (llama-finetune aborts,
# ggml-opt never zeroes the gradients): only those two programs, not the whole tree
TARGETS=()
[ $PATCHED = 1 ] || TARGETS=(--target llama-finetune opt-rebuilt-graphs)
cmake --build "$BUILD" -j "${SSMGRAD_GGML_JOBS:-2}" "${TARGETS[@]}"

log "built $BUILD/bin/{test-backend-ops,llama-finetune,llama-tokenize,llama-perplexity,llama-quantize,llama-completion}"
