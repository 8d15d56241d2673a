"""House rules of the C kernels that a reader relies on, checked on the sources (no build needed).

- No kernel function is longer than MAX_BODY_LINES lines (from the line of its opening brace to the
  line of its closing brace): the kernels are read one screen at a time, and a long function is
  split into named helpers. The files checked are every C source and header of csrc/, csrc/inst/
  (bodies, shared kernel headers, instantiation files, dispatchers) and csrc/glue/ (the Python
  bindings).
- No `__attribute__((unused))` left on a kernel function: each one is used, or deleted.
- No file of those is longer than MAX_FILE_LINES lines: a long body is split by phase, as the
  scan's forms are (ssm_scan_*_body.h) and the Gated DeltaNet's (gdn_*_body.h with gdn_step.h,
  gdn_vec.h, gdn_chunk.h).

The parser is small: it drops comments, string and character literals and preprocessor lines
(with their continuations), then takes each `{` at file scope whose preceding text has a `(`
and is not a struct, union, enum or an initializer (`=`) as the start of a function, and its
matching `}` as the end.
"""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_BODY_LINES = 80
MAX_FILE_LINES = 720


def kernel_sources():
    pats = ("csrc/*.c", "csrc/*.h", "csrc/inst/*.c", "csrc/glue/*.c", "csrc/glue/*.h")   # the glue too
    files = sorted({f for p in pats for f in glob.glob(os.path.join(ROOT, p))})
    assert files, f"no C sources under {ROOT}/csrc"
    return files


def _blank(text):
    """text with comments, literals and preprocessor lines replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if at_line_start and c == "#":          # a directive, with its backslash continuations
            j = i
            while j < n:
                k = text.find("\n", j)
                k = n if k < 0 else k
                if text[j:k].rstrip().endswith("\\"):
                    j = k + 1
                    continue
                j = k
                break
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
            continue
        at_line_start = False
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (j + 1 - i))
            i = j + 1
        else:
            out.append(c)
            if c == "\n":
                at_line_start = True
            i += 1
    return "".join(out)


def functions(path):
    """[(name, first line, number of lines from '{' to '}')] of the functions defined in path."""
    with open(path, encoding="utf-8") as f:
        text = _blank(f.read())
    found, depth, start, head_from = [], 0, None, 0
    for i, c in enumerate(text):
        if c == "{":
            if depth == 0:
                head = text[head_from:i]
                is_fn = "(" in head and "=" not in head and not re.search(r"\b(struct|union|enum)\b[^()]*$", head)
                m = re.search(r"(\w+)\s*\([^()]*(\([^()]*\)[^()]*)*\)\s*$", head) if is_fn else None
                start = (m.group(1), i) if m else None
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                if start is not None:
                    name, at = start
                    first, last = text.count("\n", 0, at) + 1, text.count("\n", 0, i) + 1
                    found.append((name, first, last - first + 1))
                start = None
                head_from = i + 1
        elif c == ";" and depth == 0:
            head_from = i + 1
    assert depth == 0, f"{path}: unbalanced braces after the parser's blanking"
    return found


def test_parser_finds_functions():
    """The parser sees the functions it should (a parser that finds nothing would pass everything)."""
    names = {n for f in kernel_sources() for n, _, _ in functions(f)}
    for want in ("ssm_conv", "ssm_conv_back_weight", "ssm_scan_back_f32_v4", "ssm_simd_level", "gdn_fwd_f32"):
        assert want in names, f"the parser missed {want}"


def test_parser_counts_lines(tmp_path):
    p = tmp_path / "x.c"
    body = "\n".join(f"    a += {i};" for i in range(90))
    p.write_text("#define M(x) \\\n  { x }\nstatic const int t[2] = { 1, 2 };\nstruct s { int a; };\n"
                 "/* f(void) { */\nstatic int f(int a, void (*cb)(int)) {\n" + body + "\n    return a;\n}\n"
                 "int g(void) { return \"}\"[0]; }\n")
    assert functions(str(p)) == [("f", 6, 93), ("g", 99, 1)]


@pytest.mark.parametrize("path", kernel_sources(), ids=lambda p: os.path.relpath(p, ROOT))
def test_no_long_function(path):
    long_ones = [f"{name} (line {line}): {n} lines" for name, line, n in functions(path) if n > MAX_BODY_LINES]
    assert not long_ones, (f"{os.path.relpath(path, ROOT)}: functions over {MAX_BODY_LINES} lines "
                           "(split them into named helpers):\n" + "\n".join(long_ones))


@pytest.mark.parametrize("path", kernel_sources(), ids=lambda p: os.path.relpath(p, ROOT))
def test_no_unused_attribute(path):
    with open(path, encoding="utf-8") as f:
        text = _blank(f.read())
    hits = [text.count("\n", 0, m.start()) + 1 for m in re.finditer(r"\bunused\b|SSM_MAYBE_UNUSED", text)]
    assert not hits, f"{os.path.relpath(path, ROOT)}: unused-function markers at lines {hits}"


@pytest.mark.parametrize("path", kernel_sources(), ids=lambda p: os.path.relpath(p, ROOT))
def test_no_long_file(path):
    with open(path, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= MAX_FILE_LINES, (f"{os.path.relpath(path, ROOT)}: {n} lines, over {MAX_FILE_LINES} "
                                 "(split it by phase into files of their own)")
