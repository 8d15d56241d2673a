"""What the golden hash files share (scan_hashes.py and scan_hashes.txt, gdn_hashes.py and
gdn_hashes.txt): the SIMD passes this machine has, the compiler of the imported build, the command
line of a hash script, the reading of a golden file and the check the tests make with it. Not a
script itself.

A hash script calls run_from_this_tree() when it runs as a script, defines case_hashes() -> (one line
per case, the hash of all cases), computed at the SIMD pass selected when it is called, and ends with
`hash_golden.main(__file__, case_hashes)`:

    python benchmarks/<op>_hashes.py OUT.txt          # the pass the environment selects
    python benchmarks/<op>_hashes.py --all OUT.txt    # one section per pass, headed by the compiler

--all runs the script once per pass this machine has (plain, SSMGRAD_NO_AVX512=1,
SSMGRAD_SIMD=x86-64-v3, SSMGRAD_SIMD=x86-64) and writes one file: a line `# compiler: ...`, then per
pass a line `# <label>` and its case lines, in benchmarks/<op>_hashes.txt for the golden file. Its
test, tests/kernels/test_<op>_hashes.py, is `golden_test(<op>_hashes, number of cases)`: one test per
pass, each reproducing its section in-process, the pass selected through _ssmgrad._set_simd (check()).
"""
import contextlib
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_from_this_tree():
    """For a hash script run as a script (not imported by the tests, whose conftest sets the path):
    import ssmgrad's in-place build and tests/reference.py from this tree."""
    for p in (os.path.join(ROOT, "tests"), ROOT):
        if p not in sys.path:
            sys.path.insert(1, p)


def passes():
    """(label, environment changes) of every SIMD pass this machine runs"""
    out = [("plain", {})]
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx512f" in flags:
        out.append(("no_avx512", {"SSMGRAD_NO_AVX512": "1"}))
    if " avx2" in flags:
        out.append(("x86-64-v3", {"SSMGRAD_SIMD": "x86-64-v3"}))
    out.append(("x86-64", {"SSMGRAD_SIMD": "x86-64"}))
    return out


# the cap under which _set_simd selects in-process what each pass of passes() selects through the
# environment (SSMGRAD_SIMD / SSMGRAD_NO_AVX512)
CAPS = {"plain": "auto", "no_avx512": "v4-no-vec64", "x86-64-v3": "x86-64-v3", "x86-64": "x86-64"}


def compiler():
    """The compiler the imported build says it was made with (the hashes depend on it)."""
    import ssmgrad as sg
    info = sg._ext.build_info()["simd_compiled"]
    return info.split("compiler: ", 1)[1].split(";")[0] if "compiler: " in info else info


def one_pass(case_hashes, path):
    lines, h_all = case_hashes()
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(lines)} cases, all: {h_all} (compiler: {compiler()})")


def all_passes(script, path):
    text = [f"# compiler: {compiler()}\n"]
    for label, env in passes():
        tmp = f"{path}.{label}"
        e = dict(os.environ, **env)
        r = subprocess.run([sys.executable, os.path.abspath(script), tmp], env=e, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{label}: {r.stderr}")
        print(f"{label}: {r.stdout.strip()}")
        text.append(f"# {label}\n" + open(tmp).read())
        os.remove(tmp)
    with open(path, "w") as f:
        f.write("".join(text))


def main(script, case_hashes):
    """The command line of a hash script: [--all] OUT.txt."""
    args = sys.argv[1:]
    if not args or args[0].startswith("-") and args[0] != "--all" or args[0] == "--all" and len(args) != 2 \
            or args[0] != "--all" and len(args) != 1:
        sys.exit(f"usage: python benchmarks/{os.path.basename(script)} [--all] OUT.txt   (see the module docstring)")
    if args[0] == "--all":
        all_passes(script, args[1])
    else:
        one_pass(case_hashes, args[0])


def golden(path):
    """({section: [case lines]}, the compiler line) of a golden file."""
    sections, name, comp = {}, None, None
    with open(path, encoding="utf-8") as f:
        for line in f.read().splitlines():
            if line.startswith("# compiler: "):
                comp = line[len("# compiler: "):]
            elif line.startswith("# "):
                name = line[2:]
                sections[name] = []
            elif line:
                sections[name].append(line)
    return sections, comp


def section(cap):
    """The golden section for what this CPU runs under cap, or None where it runs no such pass."""
    import _ssmgrad
    info = _ssmgrad.build_info()
    selected = info["simd_selected"].split(" ")[0]
    if cap in ("auto", "v4-no-vec64"):
        if selected != "x86-64-v4":
            return None                      # no AVX-512: the other caps cover its pass
        return "plain" if info["avx512_kernels"] else "no_avx512"
    return selected if selected == cap else None


@contextlib.contextmanager
def simd_cap(cap):
    """The SIMD pass capped at cap (a value of CAPS) inside the block."""
    import _ssmgrad
    old = _ssmgrad._set_simd(cap)
    try:
        yield
    finally:
        _ssmgrad._set_simd(old)


def check(script, n_cases, cap):
    """Check that script's case_hashes(), run under cap, reproduces its section of script's golden
    file (the script's path with .txt), which must hold every pass of CAPS with n_cases lines each and
    name this build's compiler. Raises AssertionError where it does not; returns None where checked,
    or the reason this CPU runs no pass under cap (the caller skips)."""
    path = os.path.splitext(script.__file__)[0] + ".txt"
    sections, comp = golden(path)
    if set(sections) != set(CAPS) or any(len(v) != n_cases for v in sections.values()):
        raise AssertionError(f"{path}: want {n_cases} cases in each of {sorted(CAPS)}, got "
                             f"{ {k: len(v) for k, v in sections.items()} }")
    if comp != compiler():
        raise AssertionError(f"{path} was recorded with {comp}; this build: {compiler()} "
                             "(results round differently: record it again with CI's default compiler)")
    with simd_cap(cap):
        name = section(cap)
        if name is None:
            import _ssmgrad
            return f"this CPU does not run the {cap} pass ({_ssmgrad.build_info()['simd_selected']})"
        lines, _ = script.case_hashes()
    want = sections[name]
    diff = [f"{w}  !=  {g}" for w, g in zip(want, lines) if w != g]
    if len(lines) != len(want) or diff:
        raise AssertionError(f"{len(diff)} of {len(want)} cases ({len(lines)} computed) differ from the golden "
                             f"section {name!r} of {path}:\n" + "\n".join(diff[:20]))
    return None


def golden_test(script, n_cases):
    """The pytest test of script's golden file (check()): one per cap of CAPS, skipped with its
    reason where this CPU runs no such pass. A test module assigns it to a test_ name."""
    import pytest

    @pytest.mark.parametrize("cap", list(CAPS.values()), ids=list(CAPS))
    def test_build_reproduces_the_golden_hashes(cap):
        reason = check(script, n_cases, cap)
        if reason:
            pytest.skip(reason)
    return test_build_reproduces_the_golden_hashes
