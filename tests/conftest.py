"""Shared pytest set-up for the ssmgrad suite.

torch policy: the oracle comparisons need torch, and an oracle comparison is never skipped.
Without torch the run fails at collection, with or without CI=true (the `test` extra requires
torch>=2.4; .ci/constraints.txt pins torch==2.13.0).
"""

import os
import sys
import zlib

import numpy as np
import pytest

# The suite is grouped as the package is: kernels/ (the C kernels through the NumPy API, the C driver,
# threads, errors, fuzzing, leaks), torch/, transformers/, ggml/ (the patched ggml and llama.cpp) and
# package/ (CLI, README and docs, sdist). The shared helpers stay here: reference.py (the oracles),
# torch_blocks.py, ddp_worker.py, c_api/. The folders have no __init__.py on purpose (test modules
# import as their basename, which are unique), so tests/torch and tests/transformers can never shadow
# the torch and transformers packages.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import reference` in any import mode
# benchmarks/ last, so that it shadows nothing: the golden hash tests (tests/kernels/test_*_hashes.py)
# import the scripts that write their golden files and what those share (hash_golden.py)
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

# torch.compile's on-disk caches (/tmp/torchinductor_<user> by default) outlive a run, and a graph cached by an
# earlier build of ssmgrad can be replayed with that build's shapes for a custom op whose fake kernel changed
# since (seen: the kept chunks' size, a stride mismatch in the compiled training test). Each run gets caches
# of its own, shared by its subprocesses and removed at exit, unless the caller chose a directory.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ssmgrad-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

try:
    import torch  # noqa: F401
except ImportError as exc:  # never skip: a missing oracle is a failed run
    ci = os.environ.get("CI", "").lower() == "true"
    raise RuntimeError(
        "the ssmgrad tests need torch (the float64 autograd oracle); install the test extra, "
        "e.g. `pip install -c .ci/constraints.txt '.[test]'` (torch==2.13.0)" + (" — CI=true: refusing to skip" if ci else "")
    ) from exc

import ssmgrad  # noqa: E402  (a missing/stale build must fail collection, not skip)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id: deterministic per test, different across tests."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def restore_threads():
    """Yields ssmgrad; puts back the thread count that was set before the test."""
    before = ssmgrad.get_num_threads()
    try:
        yield ssmgrad
    finally:
        ssmgrad.set_num_threads(before)


@pytest.fixture
def force_threads():
    """Calls use every thread they are given, however small: the glue keeps calls below 2^18
    multiply-adds per thread on fewer threads (csrc/glue/threads.c, clamp_threads), which would run
    the small shapes of the thread tests serially."""
    import _ssmgrad
    old = _ssmgrad._set_min_work_per_thread(0)
    try:
        yield
    finally:
        _ssmgrad._set_min_work_per_thread(old)


@pytest.fixture
def one_thread(restore_threads):
    """Run the test on one thread. For finite-difference loops (thousands of tiny calls), where
    thread start-up would dominate on a busy machine; test_threads.py covers the thread counts."""
    ssmgrad.set_num_threads(1)
    yield ssmgrad


@pytest.fixture(params=["recurrence", "chunked"])
def scan_back_form(request):
    """Runs the test once with each form of the Mamba-2 scan backward's phase 1 forced (the
    checkpointed reverse recurrence, the chunked matrix-product form; SSMGRAD_SCAN_BACK), then
    puts back the mode that was set. Calls the chunked form does not cover (Mamba-1, K > 1)
    take the recurrence either way."""
    import _ssmgrad
    old = _ssmgrad._set_scan_back(request.param)
    try:
        yield request.param
    finally:
        _ssmgrad._set_scan_back(old)


@pytest.fixture(params=["recurrence", "chunked"])
def scan_fwd_form(request):
    """Runs the test once with each form of the Mamba-2 scan forward forced (the token recurrence,
    the chunked matrix-product form; SSMGRAD_SCAN_FWD), then puts back the mode that was set. Calls
    the chunked form does not cover (Mamba-1, K > 1, n_t <= 4) take the recurrence either way."""
    import _ssmgrad
    old = _ssmgrad._set_scan_fwd(request.param)
    try:
        yield request.param
    finally:
        _ssmgrad._set_scan_fwd(old)
