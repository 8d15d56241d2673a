"""ggml/README.md's LoRA walkthrough (the block between <!-- lora-walkthrough --> markers), run as it is.

The block is a newcomer's path from a transformers checkpoint to a trained adapter in llama.cpp and PEFT:
finetune_hybrid.py writes a tiny Falcon-H1, ggml/convert.py makes its F32 GGUF, llama-quantize a Q8_0 base,
llama-finetune --lora-rank trains an adapter on it, llama-completion and llama-perplexity use it with --lora,
lora_peft.py to-peft writes it for PEFT (which loads it on the transformers model), to-gguf brings it back and
llama-finetune --lora-init trains it further. It runs with `bash -e` in a fresh directory whose `ggml` and
`build` are this checkout's, and each step's result is checked here: the commands must work as written, and
what they write must be what the README says.

Needs `bash ggml/build.sh` and peft; without them the module skips, except under CI=true, where that is an
error.
"""

import hashlib
import os
import re
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ggml_build import built_script, import_lora_peft, import_peft  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "ggml", "README.md")


@pytest.fixture(scope="module")
def fc():
    return built_script("finetune_check", lambda fc: [fc.BIN / n for n in (
        "llama-finetune", "llama-tokenize", "llama-quantize", "llama-completion", "llama-perplexity")])


def walkthrough():
    text = open(README, encoding="utf-8").read()
    blocks = re.findall(r"<!-- lora-walkthrough -->\n```bash\n(.*?)```\n<!-- /lora-walkthrough -->", text, re.S)
    assert len(blocks) == 1, "ggml/README.md: expected one <!-- lora-walkthrough --> block"
    return blocks[0]


def test_readme_lora_walkthrough_runs_as_written(fc, tmp_path):
    import_peft()
    lp = import_lora_peft()
    os.symlink(os.path.join(ROOT, "ggml"), tmp_path / "ggml")
    os.symlink(os.path.join(ROOT, "build"), tmp_path / "build")
    script = walkthrough()
    # the quantized base must stay as llama-quantize wrote it: hash it right after that command
    marker = "build/ggml/bin/llama-quantize work/base-f32.gguf work/base-q8_0.gguf Q8_0\n"
    assert marker in script
    script = script.replace(marker, marker + "sha256sum work/base-q8_0.gguf > work/base.sha256\n")
    (tmp_path / "walk.sh").write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "walk.sh"], cwd=tmp_path, capture_output=True, env=env,
                          timeout=900)
    out, err = (proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"))  # a random model's bytes
    log = out + err
    assert proc.returncode == 0, log[-4000:]
    work = tmp_path / "work"

    want = (work / "base.sha256").read_text().split()[0]
    assert hashlib.sha256((work / "base-q8_0.gguf").read_bytes()).hexdigest() == want, "llama-finetune wrote the base"
    # the adapter: the targets asked for, on every layer, trained (lora_b moved from 0)
    alpha, ad = lp.read_gguf_adapter(work / "adapter.gguf")
    kinds = {re.sub(r"^blk\.\d+\.", "", n) for n in ad}
    assert kinds == {f"{k}.weight" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ssm_in", "ffn_gate",
                                             "ffn_up", "ffn_down")}, kinds
    assert alpha == 16 and {b.shape[-1] for _, b in ad.values()} == {8}
    assert all(np.abs(b).max() > 0 for _, b in ad.values())
    # llama-perplexity with it printed its estimate; PEFT loaded it (the printed target modules)
    assert re.search(r"Final estimate: PPL = [\d.]+", log), log[-3000:]
    assert "'model.layers.0.mamba.in_proj'" in out and "'model.layers.1.self_attn.q_proj'" in out, out[-3000:]
    assert "wrote work/peft: 32 tensors" in out and "wrote work/adapter-again.gguf: 32 tensors" in out
    # to-peft and back: the same adapter (Falcon-H1's multipliers divided out and in again: float32 rounding)
    _, again = lp.read_gguf_adapter(work / "adapter-again.gguf")
    assert sorted(again) == sorted(ad)
    for n, (a, b) in ad.items():
        np.testing.assert_allclose(again[n][0], a, rtol=1e-6, atol=0)
        np.testing.assert_allclose(again[n][1], b, rtol=1e-6, atol=0)
    assert (work / "adapter-2.gguf").is_file()
