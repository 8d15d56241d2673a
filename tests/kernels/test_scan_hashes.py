"""The current build reproduces benchmarks/scan_hashes.txt bitwise: the scan's forward, backward,
d_A and in-place update over 248 cases (both dtypes, both branches, n_t 1-130, K 1 and 3, 1-3
threads, each forced form, dense and strided inputs; benchmarks/scan_hashes.py), at every SIMD pass
this CPU can run. The oracle tests say the results are right; this one says a change (such as a
restructuring of the kernels) left every bit where it was.

The golden file was recorded (`python benchmarks/scan_hashes.py --all`) with the default build's
compiler, which its first line names: other compilers round differently (contraction into FMA,
vectorisation), so .ci/compilers.sh deselects this file, and a build by another compiler fails here
(record the golden again with CI's default compiler when that changes). The sections are the SIMD
passes of an AVX-512 machine (plain, no_avx512, x86-64-v3, x86-64); a CPU without AVX-512 checks the
passes it has. A pass the file has no section for fails.
"""

import importlib.util
import os

import pytest

import _ssmgrad

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "benchmarks", "scan_hashes.txt")
_spec = importlib.util.spec_from_file_location("scan_hashes", os.path.join(ROOT, "benchmarks", "scan_hashes.py"))
scan_hashes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scan_hashes)


def golden():
    """({section: [case lines]}, the compiler line) of the golden file."""
    sections, name, compiler = {}, None, None
    with open(GOLDEN, encoding="utf-8") as f:
        for line in f.read().splitlines():
            if line.startswith("# compiler: "):
                compiler = line[len("# compiler: "):]
            elif line.startswith("# "):
                name = line[2:]
                sections[name] = []
            elif line:
                sections[name].append(line)
    return sections, compiler


# the cap each section was recorded under (benchmarks/scan_hashes.py, passes()): SSMGRAD_SIMD /
# SSMGRAD_NO_AVX512, set here in-process through _set_simd
CAPS = {"plain": "auto", "no_avx512": "v4-no-vec64", "x86-64-v3": "x86-64-v3", "x86-64": "x86-64"}


def _section(cap):
    """The golden section for what this CPU runs under cap, or None where it runs no such pass."""
    info = _ssmgrad.build_info()
    selected = info["simd_selected"].split(" ")[0]
    if cap in ("auto", "v4-no-vec64"):
        if selected != "x86-64-v4":
            return None                      # no AVX-512: the other parametrizations cover its pass
        return "plain" if info["avx512_kernels"] else "no_avx512"
    return selected if selected == cap else None


@pytest.fixture
def simd_cap(request):
    old = _ssmgrad._set_simd(request.param)
    try:
        yield request.param
    finally:
        _ssmgrad._set_simd(old)


@pytest.mark.parametrize("simd_cap", list(CAPS.values()), indirect=True, ids=list(CAPS))
def test_build_reproduces_the_golden_hashes(simd_cap):
    sections, compiler = golden()
    assert set(sections) == set(CAPS) and all(len(v) == 248 for v in sections.values()), \
        {k: len(v) for k, v in sections.items()}
    assert compiler == scan_hashes.compiler(), (
        f"{GOLDEN} was recorded with {compiler}; this build: {scan_hashes.compiler()} "
        "(results round differently: record it again with CI's default compiler)")
    name = _section(simd_cap)
    if name is None:
        pytest.skip(f"this CPU does not run the {simd_cap} pass ({_ssmgrad.build_info()['simd_selected']})")
    lines, _ = scan_hashes.case_hashes()
    want = sections[name]
    diff = [f"{w}  !=  {g}" for w, g in zip(want, lines) if w != g]
    assert len(lines) == len(want) and not diff, (
        f"{len(diff)} of {len(want)} cases differ from the golden section {name!r}:\n" + "\n".join(diff[:20]))
