"""Convert a transformers checkpoint to GGUF with llama.cpp's own converter, offline.

    python ggml/convert.py HF_DIR OUT.gguf [--outtype f32]

HF_DIR is a directory written by ``save_pretrained`` (config.json + safetensors). The converter is
``convert_hf_to_gguf.py`` of the same llama.cpp that ggml/build.sh builds: the sdist of
llama-cpp-python (version and sha256 read from ggml/build.sh, which fetches it into the cache
``${SSMGRAD_GGML_CACHE:-${XDG_CACHE_HOME:-~/.cache}/ssmgrad-ggml}``). Its converter, its ``conversion``
package, its ``gguf-py`` and the bundled vocab ``models/ggml-vocab-gpt-neox.gguf`` are extracted once
into ``<cache>/convert-<version>-<hash>/`` and the script runs from there, so it imports that gguf-py
(not any installed ``gguf``) and finds the vocab where it looks for it (``sys.path[0]/models``). The
patches of the series (ggml/patches/) that change the converter are applied to that copy (the hash
covers the sdist and those patches), so this runs the converter ggml/build.sh's tree has.

No tokenizer needed: for checkpoints without tokenizer.json / tokenizer.model (Mamba, Mamba-2, and
with the series Falcon-H1, Granite-4.0-H, Nemotron-H, Jamba, LFM2, LFM2-MoE,
Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi-Linear) the converter falls back
to the bundled GPT-NeoX vocab, truncated to the model's vocab_size (Mamba rounds it up to a multiple
of 8, Mamba-2 to 16). Offline: HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 for the converter (it reads
config.json through transformers' AutoConfig). A checkpoint the converter rejects is a ConvertError
naming the reason (the converter's last error line, and for a bare assert its condition), not its
traceback.

What the converter needs besides the standard library: torch, numpy, transformers (AutoConfig),
safetensors, and for gguf-py PyYAML, tqdm and requests (pinned by the project's test extra).
"""

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

# what is taken from the sdist's vendor/llama.cpp/ (directories whole)
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "models/ggml-vocab-gpt-neox.gguf")


class ConvertError(RuntimeError):
    """The converter is unavailable or refused the checkpoint."""


def sdist_pin():
    """(version, sha256) of the llama-cpp-python sdist, as ggml/build.sh pins them."""
    text = (HERE / "build.sh").read_text()
    version = re.search(r"^VERSION=([0-9.]+)$", text, re.M)
    sha = re.search(r"^SHA256=([0-9a-f]{64})$", text, re.M)
    if not (version and sha):
        raise ConvertError("ggml/build.sh: no VERSION= / SHA256= lines to read the sdist pin from")
    return version.group(1), sha.group(1)


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("SSMGRAD_GGML_CACHE") or os.path.join(base, "ssmgrad-ggml"))


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def converter_patches():
    """The patches of the series (ggml/patches/*.patch, in order) that change the converter's files.
    A patch must change either only converter files or none (build.sh applies all of them to its tree)."""
    out = []
    for path in sorted((HERE / "patches").glob("*.patch")):
        files = re.findall(r"^\+\+\+ b/(\S+)", path.read_text(), re.M)
        conv = [f for f in files if any(f == c or f.startswith(c + "/") for c in CONVERTER_FILES)]
        if conv and len(conv) != len(files):
            raise ConvertError(f"{path.name}: changes converter files ({', '.join(conv)}) and others; "
                               "a patch of the converter must change only its files")
        if conv:
            out.append(path)
    return out


def converter_dir():
    """The extracted, patched converter tree (<cache>/convert-<version>-<hash>/), made on first use."""
    version, sha = sdist_pin()
    cache = cache_dir()
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    patches = converter_patches()
    key = hashlib.sha256("\n".join([sha] + [_sha256(p) for p in patches]).encode()).hexdigest()
    dest = cache / f"convert-{version}-{key[:12]}"
    stamp = dest / ".sha256"
    if stamp.is_file() and stamp.read_text().strip() == key:
        return dest
    if not sdist.is_file():
        raise ConvertError(f"{sdist} not found: run `bash ggml/build.sh` first (it fetches the llama-cpp-python "
                           f"{version} sdist into the cache), or set SSMGRAD_GGML_CACHE")
    if _sha256(sdist) != sha:
        raise ConvertError(f"{sdist}: sha256 mismatch (expected {sha}); delete it and run `bash ggml/build.sh`")
    top = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    wanted = tuple(top + f for f in CONVERTER_FILES)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-new.", dir=cache))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                if not (m.isfile() or m.isdir()) or not any(m.name == w or m.name.startswith(w + "/") for w in wanted):
                    continue
                m.name = m.name[len(top):]
                members.append(m)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, members=members, filter="data")
            else:   # Pythons without extraction filters (members are regular files/dirs under top)
                tar.extractall(tmp, members=members)
        missing = [f for f in CONVERTER_FILES if not (tmp / f).exists()]
        if missing:
            raise ConvertError(f"{sdist}: no {', '.join(top + f for f in missing)}")
        for p in patches:
            if shutil.which("patch") is None:
                raise ConvertError("the `patch` tool is needed to apply the converter's patches of ggml/patches/")
            proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "--quiet", "-i", str(p)], cwd=tmp,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise ConvertError(f"{p.name} does not apply to the converter of {sdist.name}:\n{proc.stdout}{proc.stderr}")
        (tmp / ".sha256").write_text(key + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def supported_architectures(conv):
    """The text-model architectures convert_hf_to_gguf.py knows (its TEXT_MODEL_MAP), read without importing it."""
    tree = ast.parse((conv / "conversion" / "__init__.py").read_text())
    for node in tree.body:
        target = getattr(node, "target", None) or (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "TEXT_MODEL_MAP":
            return set(ast.literal_eval(node.value))
    raise ConvertError(f"{conv}/conversion/__init__.py: no TEXT_MODEL_MAP")


def checkpoint_architecture(hf_dir):
    """The architecture the converter will look up: config.json's architectures[0] (or text_config's)."""
    cfg_path = Path(hf_dir) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"hf_dir: {hf_dir} has no config.json (a directory written by save_pretrained)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"hf_dir: {cfg_path} is not valid JSON ({exc})") from None
    arches = (cfg.get("text_config") or {}).get("architectures") or cfg.get("architectures")
    if not arches:
        if "ssm_cfg" in cfg:   # non-HF mamba_ssm checkpoints, as the converter names them
            return cfg["ssm_cfg"].get("layer", "Mamba") + "ForCausalLM"
        raise ValueError(f"hf_dir: {cfg_path} names no architectures")
    return arches[0]


def convert(hf_dir, out_path, outtype="f32"):
    """Convert the checkpoint in hf_dir to the GGUF file out_path; returns out_path as a Path."""
    if not isinstance(hf_dir, (str, os.PathLike)):
        raise TypeError(f"hf_dir: expected a path, got {type(hf_dir).__name__}")
    if not isinstance(out_path, (str, os.PathLike)):
        raise TypeError(f"out_path: expected a path, got {type(out_path).__name__}")
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype: expected one of {', '.join(OUTTYPES)}, got {outtype!r}")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if not hf_dir.is_dir():
        raise ValueError(f"hf_dir: {hf_dir} is not a directory")
    arch = checkpoint_architecture(hf_dir)
    conv = converter_dir()
    known = supported_architectures(conv)
    if arch not in known:
        mamba = sorted(a for a in known if "mamba" in a.lower() or a.endswith(("H1ForCausalLM", "HybridForCausalLM")))
        raise ConvertError(f"architecture {arch!r} (in {hf_dir / 'config.json'}) is not supported by llama.cpp's "
                           f"convert_hf_to_gguf.py ({conv.name}); state-space ones it knows: {', '.join(mamba)}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("NO_LOCAL_GGUF", None)   # use the gguf-py beside the script, not an installed gguf
    cmd = [sys.executable, str(conv / "convert_hf_to_gguf.py"), str(hf_dir.resolve()),
           "--outfile", str(out_path.resolve()), "--outtype", outtype]
    proc = subprocess.run(cmd, cwd=conv, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out_path.is_file():
        raise ConvertError(f"llama.cpp's convert_hf_to_gguf.py rejected {hf_dir} ({arch}): "
                           + rejection_reason(proc.stdout + proc.stderr, proc.returncode))
    return out_path


# convert_many's driver: the converter once per job in one Python process (torch, transformers and the
# converter's own modules imported once), from the converter's directory as sys.path[0] (it finds the
# bundled vocab there); a job that fails is left to convert(), which names the reason
_MANY_DRIVER = """
import os, runpy, sys
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "gguf-py")]
for line in sys.stdin.read().splitlines():
    src, dst, outtype = line.split("\\t")
    sys.argv = ["convert_hf_to_gguf.py", src, "--outfile", dst, "--outtype", outtype]
    try:
        runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
    except BaseException as exc:   # SystemExit of a rejection included: the next job still runs
        print(f"convert.py: job {src} failed: {exc!r}", file=sys.stderr)
        if os.path.exists(dst):
            os.remove(dst)
"""


def convert_many(jobs, outtype="f32"):
    """convert() of each (hf_dir, out_path) of JOBS, in one converter process (a conversion of a tiny model
    is mostly the converter's imports: seconds each); the same files. Returns the out paths."""
    jobs = [(Path(h), Path(o)) for h, o in jobs]
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype: expected one of {', '.join(OUTTYPES)}, got {outtype!r}")
    for h, o in jobs:
        if not h.is_dir():
            raise ValueError(f"hf_dir: {h} is not a directory")
        if "\t" in str(h.resolve()) + str(o.resolve()):
            raise ValueError(f"jobs: a tab in {h} or {o}")
    conv = converter_dir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("NO_LOCAL_GGUF", None)
    stdin = "".join(f"{h.resolve()}\t{o.resolve()}\t{outtype}\n" for h, o in jobs)
    subprocess.run([sys.executable, "-c", _MANY_DRIVER], cwd=conv, env=env, input=stdin, capture_output=True, text=True)
    # what the batch did not write, convert() does again on its own, and raises its ConvertError
    return [o if o.is_file() else convert(h, o, outtype) for h, o in jobs]


def rejection_reason(output, returncode):
    """What the converter's output says went wrong, in one line: the last exception line of its
    traceback (for a bare `assert`, the asserted condition and where), or its last error log line."""
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip()]
    tb = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")), default=None)
    if tb is not None:
        frames = [(m.group(1), m.group(2), i) for i, ln in enumerate(lines[tb:], tb)
                  if (m := re.match(r'\s*File "([^"]+)", line (\d+)', ln))]
        exc = next((ln for ln in reversed(lines[tb:]) if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit)\b|AssertionError", ln)), lines[-1])
        if exc.strip() == "AssertionError" and frames:
            path, line, i = frames[-1]
            # the source line follows the frame line; ^^^ markers may follow it
            src = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = "/".join(Path(path).parts[-2:])
            return f"the converter requires `{src.removeprefix('assert ').strip()}` ({where}:{line}), which this checkpoint does not meet"
        return exc.strip()
    errors = [ln for ln in lines if "ERROR" in ln or "error" in ln.lower()]
    return (errors or lines or [f"exit status {returncode}, no output"])[-1].strip()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="The converter is llama.cpp's, from the sdist ggml/build.sh fetches.")
    ap.add_argument("hf_dir", help="directory written by save_pretrained")
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--outtype", default="f32", choices=OUTTYPES, help="tensor type (default f32, what training needs)")
    args = ap.parse_args(argv)
    try:
        out = convert(args.hf_dir, args.out, args.outtype)
    except (ValueError, ConvertError) as exc:
        ap.exit(1, f"convert.py: error: {exc}\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
