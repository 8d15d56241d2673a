"""The figures README.md and docs/performance.md quote from benchmarks/results.md agree with it, to
the digits they quote: a new benchmark run that changes a figure fails this test until the docs
say the new one (benchmarks/README.md quotes none). Each check names the row of results.md's
"Scan targets" table it reads. And every file of this repository that the docs name exists."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.integration   # the docs, not the C code: the main pass runs it


def read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return " ".join(f.read().split())          # one line: quoted figures may wrap


RESULTS = read("benchmarks", "results.md")


def row(prefix):
    """The cells of the results.md table row whose first cell starts with prefix."""
    for line in open(os.path.join(ROOT, "benchmarks", "results.md"), encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(prefix):
            return cells
    raise AssertionError(f"benchmarks/results.md has no row starting with {prefix!r}")


def numbers(text):
    return [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", text)]


def quoted(doc, pattern):
    m = re.search(pattern, doc)
    assert m, f"the docs no longer quote /{pattern}/"
    return m.groups()


def assert_same(doc_values, measured, what):
    """Each quoted value is the measured one rounded to the quoted digits."""
    assert len(doc_values) == len(measured), (what, doc_values, measured)
    for d, v in zip(doc_values, measured):
        digits = len(d.split(".")[1]) if "." in d else 0
        assert abs(float(d) - v) <= 0.5 * 10 ** -digits + 1e-9, \
            f"{what}: the docs say {d}, benchmarks/results.md {v}"


README = read("README.md")
PERF = read("docs", "performance.md")
COMPILED = "Mamba-2 fwd+bwd, compiled SSD / ssmgrad, 1 thread"


def test_readme_speed_figures():
    assert_same(quoted(README, r"Mamba-2 ([\d.]+)–([\d.]+)x `torch.compile`d SSD"),
                numbers(row(COMPILED)[1]), COMPILED)
    assert_same(quoted(README, r"Mamba-1 ([\d.]+)x the torch token loop"),
                numbers(row("Mamba-1 fwd+bwd, torch loop / ssmgrad")[1]), "Mamba-1 vs the torch loop")


def test_performance_md_figures():
    assert_same(quoted(PERF, r"\*\*Mamba-2 fwd\+bwd >= 3x `torch.compile`d SSD\*\* \(measured ([\d.]+)-([\d.]+)x\)"),
                numbers(row(COMPILED)[1]), COMPILED)
    peak = row("Mamba-2 forward, % of one core's FMA peak")[0]
    assert_same(quoted(PERF, r"FMA peak measured in that run: ([\d.]+) GFLOP/s"),
                [float(re.search(r"\(([\d.]+) GFLOP/s\)", peak).group(1))], "the FMA peak")
    for d, label in (("fwd", "forward"), ("bwd", "backward")):
        cells = row(f"Mamba-1 ns per state update per thread, {label}")
        pattern = (r"forward ([\d.]+)-([\d.]+) \(medians; fastest runs ([\d.]+)-([\d.]+)\)" if d == "fwd"
                   else r"backward ([\d.]+)-([\d.]+) \(([\d.]+)-([\d.]+)\)")
        assert_same(quoted(PERF, pattern), numbers(cells[1]) + numbers(cells[2]), f"Mamba-1 {label}")
    m1 = numbers(row("decode step (ssm_scan_update) / state copy, m1_130m")[1])
    m2 = numbers(row("decode step (ssm_scan_update) / state copy, m2_130m")[1])
    decode = quoted(PERF, r"Mamba-1 layer\*\* \(measured ([\d.]+)x; the Mamba-2 layer's ([\d.]+)x")
    assert_same(decode, [m1[1], m2[1]], "decode / copy, 1 thread")
    shares = [numbers(row(f"conv {c}: share of the copy's bandwidth")[1]) for c in ("conv1536", "conv1792")]
    conv = quoted(PERF, r"measured forward (\d+)-(\d+)%, backward (\d+)-(\d+)%")
    fwd, bwd = sorted(s[0] for s in shares), sorted(s[1] for s in shares)
    assert_same(conv, [fwd[0], fwd[-1], bwd[0], bwd[-1]], "conv share of the copy")


def test_ggml_readme_counts_match_the_baseline():
    """ggml/README.md's counts of the unpatched sweep are those of ggml/grad_baseline_unpatched.txt."""
    rows = [ln.split("\t") for ln in open(os.path.join(ROOT, "ggml", "grad_baseline_unpatched.txt"), encoding="utf-8")
            if ln.strip() and not ln.startswith("#")]
    aborts = sum(r[1].startswith("signal") for r in rows)
    doc = read("ggml", "README.md")
    n_abort, n_ops = (int(v) for v in quoted(doc, r"a bug of that version; (\d+) of the baseline's (\d+) ops abort"))
    assert (n_abort, n_ops) == (aborts, len(rows)), ((n_abort, n_ops), (aborts, len(rows)))
    cpy = next(r for r in rows if r[0] == "CPY")
    ok, checked = (int(v) for v in re.search(r"OK=(\d+) FAIL=(\d+)", cpy[3]).groups())
    lo, hi, of = (int(v) for v in quoted(doc, r"CPY: (\d+) to (\d+) of (\d+) checked cases OK"))
    assert of == ok + checked and lo <= ok <= hi, ((lo, hi, of), (ok, ok + checked))


# Repository paths the docs name: a renamed or deleted file fails here until the docs follow. A path
# is a token starting with one of the project's top-level folders; `<...>` / `{...}` templates are
# left out, `*` patterns must match something. ggml/README.md also names files of the llama.cpp tree
# (ggml/src/..., tests/test-backend-ops.cpp, examples/training/...), so there only this project's own
# folders are checked: csrc/, benchmarks/, ssmgrad/, .ci/, the suite's folders, and ggml/'s own files.
PATH_TOKEN = r"(?<![\w/.-])((?:csrc|tests|benchmarks|examples|ssmgrad|docs|\.ci|ggml)/[\w./*<>{},-]*[\w*>}])"
OWN_IN_GGML_README = r"^(csrc|benchmarks|ssmgrad|\.ci)/|^tests/(reference\.py|c_api/|(kernels|torch|transformers|ggml|package)/)|^ggml/[\w.-]+$"


def _named_paths(doc, only=None):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = f.read()
    for p in sorted(set(re.findall(PATH_TOKEN, text))):
        if re.search(r"[<>{},]", p) or (only and not re.search(only, p)):
            continue
        yield p


DOCS = ["README.md", "benchmarks/README.md", "ggml/README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_only_files_that_exist(doc):
    import glob
    only = OWN_IN_GGML_README if doc == "ggml/README.md" else None
    names = list(_named_paths(doc, only))
    if doc in ("README.md", "benchmarks/README.md", "ggml/README.md"):
        assert names, f"{doc} names no repository path (the pattern no longer matches?)"
    missing = [p for p in names if not glob.glob(os.path.join(ROOT, p))]
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_gated_delta_net_figures():
    """docs/gated-delta-net.md's speed figures are benchmarks/results_gdn.md's (benchmarks/gdn_bench.py)."""
    res = read("benchmarks", "results_gdn.md")
    doc = read("docs", "gated-delta-net.md")
    for H_v, H_k in ((32, 16), (16, 8)):
        for n_t in (512, 2048):
            m = re.search(rf"- H_v {H_v}, H_k {H_k}, n_t {n_t}: fwd\+bwd, fastest peer / ssmgrad ([\d.]+)x .*?"
                          rf"eager / ssmgrad ([\d.]+)x .*?forward into out= [\d.]+ GFLOP/s = (\d+)% of the FMA peak", res)
            assert m, f"benchmarks/results_gdn.md has no target line for H_v {H_v}, H_k {H_k}, n_t {n_t}"
            quote = quoted(doc, rf"\| {H_v}, {H_k} \| {n_t} \| ([\d.]+)x \| ([\d.]+)x \| (\d+)% \|")
            assert_same(quote, [float(v) for v in m.groups()], f"H_v {H_v}, n_t {n_t}")
    dec = re.search(r"- H_v 32, H_k 16: .*?ssmgrad \d+ us \(([\d.]+)x the copy\); with out= \d+ us \(([\d.]+)x", res)
    assert dec, "benchmarks/results_gdn.md has no decode line for H_v 32"
    assert_same(quoted(doc, r"decode step ([\d.]+)x a copy of the state \(([\d.]+)x with `out=`\)"),
                [float(v) for v in dec.groups()], "decode / copy")
