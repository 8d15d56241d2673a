"""llama.cpp fine-tunes the delta-rule families: llama-finetune against STOCK transformers, step by step.

For Qwen3.5 (dense), Qwen3.5-MoE, Qwen3-Next (dense, MoE, and a dense layer among MoE ones) a random tiny transformers 5.24 model with a
Gated DeltaNet layer (4 value heads of 16 reading 2 key heads) and a gated attention layer, and for
Kimi-Linear one with a KDA layer (per-channel gate, 4 heads of 16) and an MLA attention layer with experts
(ggml/finetune_hybrid.py's GDN_FAMILIES; the DeltaNet's v projection scaled 5x and its decay rate A
drawn in [0.02, 0.2] so that the states are large and remembered) is saved, converted by ggml/convert.py
(llama.cpp's converter with the series' patches, no tokenizer: the bundled vocab) and fine-tuned by the
patched llama-finetune (AdamW, 2 epochs of 4 windows, -c = -b = -ub = 256), whose backward runs
GATED_DELTA_NET_BACK (ssmgrad's kernel) for the fused GATED_DELTA_NET op llama.cpp builds. The oracle is
the same fine-tuning by stock transformers (not patched by ssmgrad: its torch_chunk_gated_delta_rule)
with torch.optim.AdamW, training the GGUF's form: A = -exp(A_log) and, for the (1 + weight) RMSNorms,
1 + weight as the parameters. Every step's loss must agree within 1.5e-5 relative (the 5-decimal print's
bound; finetune_hybrid.TOL), and the loss must fall. The MoE models route tokens to every expert (checked
on transformers' router). One plain SGD step checks the gradients' scale (AdamW divides it out).

What fails without the series' parts (each broken on purpose, see ggml/README.md): without the
converter patch none converts; without the qwen3next loader patch the dense Qwen3-Next does not load;
without the MLA patch Kimi-Linear's KV down projection gets no gradient (the losses drift to 1.2e-3, the
SGD step's total norm is off); without the KDA eps patch Kimi-Linear's first loss is already off.

Needs `bash ggml/build.sh` (the fixture runs it: seconds when up to date). Without ggml/build.sh or a
compiler the module skips, except under CI=true, where that is an error.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_common import (  # noqa: E402
    check_every_expert_used, check_losses_match, finetune_hybrid, first_window_by_ubatch, sgd_step,
)
from ggml_build import once_per_key  # noqa: E402

pytestmark = pytest.mark.integration

MOE = {"qwen3_5_moe", "qwen3_next_moe", "qwen3_next_mixed", "kimi_linear"}
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_next_moe", "qwen3_next_mixed", "kimi_linear"]
# one SGD step, llama's weight changes / lr vs stock transformers' gradients, relative (the hybrid test's
# bounds): the norm over all tensors and, where the tensor counts agree, tensor by tensor
SGD_TOL_TOTAL = 1e-5
SGD_TOL_TENSOR = 1e-3
# transformers parameters the converter writes as two GGUF tensors
SPLIT = ("in_proj_qkvz", "gate_up_proj", "kv_b_proj", "self_attn.conv1d")   # the last: Kimi's q, k, v convs


@pytest.fixture(scope="module")
def fh():
    """ggml/finetune_hybrid.py as a module, with the patched llama-finetune and llama-tokenize built."""
    fh = finetune_hybrid()
    assert sorted(fh.GDN_FAMILIES) == sorted(FAMILIES)
    return fh


@pytest.fixture(scope="module")
def prepared(fh, tmp_path_factory):
    """family -> the converted model, text and tokens (each converted once per module)."""
    return once_per_key(fh.prepare, tmp_path_factory.mktemp("llama_finetune_gdn"))


@pytest.mark.parametrize("family", FAMILIES)
def test_finetune_matches_stock_transformers(fh, prepared, family):
    p = prepared(family)
    # the GGUF has both kinds of layer: a Gated DeltaNet (ssm_* tensors) and attention
    names = set(fh.gguf_tensors(p["gguf"]))
    assert any(".attn_q." in n for n in names), sorted(names)
    assert any(".ssm_a" in n for n in names) and any(".ssm_conv1d" in n for n in names), sorted(names)
    if family in MOE:
        assert any("_exps." in n for n in names), sorted(names)
        check_every_expert_used(fh, family, p)
    check_losses_match(fh, family, p)


@pytest.mark.parametrize("family", FAMILIES)
def test_sgd_step_is_the_gradient(fh, prepared, family, tmp_path):
    """One SGD step of llama-finetune moves each tensor by lr times its gradient: the per-tensor norms
    equal stock transformers' gradients' (sorted: the layouts differ), no constant factor left over."""
    p = prepared(family)
    text, llama, torch_n, n_gguf, n_torch = sgd_step(fh, p, tmp_path)
    # tensor by tensor: the GGUF splits some tensors (Qwen3-Next's qkvz into qkv and the gate, the experts'
    # fused gate_up, Kimi's kv_b into k_b and v_b and its fused conv into q, k, v), so the counts differ; every tensor the converter keeps
    # whole must find its gradient norm among llama's weight changes. The total alone hardly sees small
    # tensors: with the gate's gradient (d_g) dropped from GATED_DELTA_NET_BACK on purpose, Kimi-Linear's
    # total moved by 1.4e-5 only, while its gate projections, dt bias and A did not move at all
    inputs, labels = fh.fc.windows(fh.fc.tokenize(p["gguf"], text, fh.fc.BIN))
    grads = fh.torch_grads(fh.make_model(family), inputs[0], labels[0])
    norms = {n: float(g.double().norm()) for n, g in grads.items()}
    top = max(norms.values())
    bad = {}
    for name, n in norms.items():
        # (the gate projections' gradients are ~1e-3 of the embedding's: a cut at 1e-3 of the largest, as for
        # the total's tensor-by-tensor check in the hybrid test, would leave them out)
        if any(k in name for k in SPLIT) or n < 1e-5 * top:
            continue
        rel = float(np.min(np.abs(llama - n))) / n
        if rel > SGD_TOL_TENSOR:
            bad[name] = (n, rel)
    assert not bad, f"{family}: no llama weight change of these gradient norms (norm, nearest relative): {bad}"
    assert np.sqrt((llama ** 2).sum()) == pytest.approx(np.sqrt((torch_n ** 2).sum()), rel=SGD_TOL_TOTAL)


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_ubatch_state_carries_over(fh, prepared, family):
    """-ub 64 with -c = -b 256: the Gated DeltaNet's state (and the conv state) at the end of one ubatch is
    the start state of the next, so the first window's four ubatch losses are stock transformers' loss of
    the whole window, split (a start state read wrong, e.g. zero, changes ubatches 2-4)."""
    import torch
    p = prepared(family)
    n_ub = 64
    r = first_window_by_ubatch(fh, family, p, n_ub)
    with torch.no_grad():
        # the same ubatches, each from a zero state: what a backend that drops the carried state would give
        cut = torch.cat([torch.nn.functional.cross_entropy(r["model"](input_ids=r["inputs"][:, i:i + n_ub],
                                                                      use_cache=False).logits[0],
                                                           r["labels"][i:i + n_ub], reduction="none")
                         for i in range(0, fh.fc.N_CTX, n_ub)])
    wrong = cut.view(-1, n_ub).mean(1).numpy()
    expect = r["expect"]
    # the check can tell the two apart: a zero start state moves ubatches 2-4 by far more than TOL
    assert fh.fc.rel_diff(wrong[1:], expect[1:]).min() > 10 * fh.TOL, (wrong, expect)
