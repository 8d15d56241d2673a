"""llama.cpp fine-tunes the hybrid SSM families: llama-finetune against STOCK transformers, step by step.

For each family (Falcon-H1, Granite-4.0-H, Nemotron-H, Jamba, LFM2, and the MoE configurations of
Granite-4.0-H, Nemotron-H, Jamba and LFM2-MoE) a random tiny transformers 5.24 model with at least one SSM or short-conv layer
and one attention layer (ggml/finetune_hybrid.py's FAMILIES; the Mamba mixers drawn with Mamba's own
init, SSM in_proj scaled 5x, so that the states are large; Nemotron-H's mixer without transformers'
time-step floor, which llama.cpp does not have: test_nemotron_h_gradients) is saved, converted by ggml/convert.py (llama.cpp's converter with the series' patch, no
tokenizer: the bundled vocab) and fine-tuned by the patched llama-finetune (AdamW, 2 epochs of 4
windows, -c = -b = -ub = 256). The oracle is the same fine-tuning by stock transformers (not patched
by ssmgrad, whose kernels llama.cpp's SSM backward runs) with torch.optim.AdamW, training the GGUF's
form (A = -exp(A_log) as the parameter). Every step's loss must agree within 1.5e-5 relative (the
5-decimal print's bound; finetune_hybrid.TOL), and the loss must fall. The MoE models route tokens to every expert (checked on transformers' router).

AdamW divides a gradient's constant factor out, so a second check does not: one plain SGD step
(lr 1, no weight decay) of llama-finetune on a one-window text, whose per-tensor weight changes are
llama's gradients, against the per-tensor norms of stock transformers' gradients of that window.

What fails without the series' parts (each broken on purpose, see ggml/README.md): without the hybrid
memory input fix every family aborts at the first ubatch (GGML_ASSERT(buffer)); without the recurrent
start-state copy the losses of Falcon-H1, Granite-4.0-H (dense, MoE) and Jamba (dense, MoE) differ by
6.0e-5 to 1.1e-3 (LFM2's conv state is a copy anyway; docs/ggml.md); without the converter
patch no family but Granite converts (and Granite converts without its attention layer).

Needs `bash ggml/build.sh` (the fixture runs it: seconds when up to date). Without ggml/build.sh or a
compiler the module skips, except under CI=true, where that is an error.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_common import (  # noqa: E402
    check_every_expert_used, check_losses_match, finetune_hybrid, first_window_by_ubatch, sgd_step,
)
from ggml_build import ROOT, once_per_key  # noqa: E402

pytestmark = pytest.mark.integration

# the families of ggml/finetune_hybrid.py's FAMILIES, every one training and matching stock transformers,
# the MoE configurations among them. What they needed of the series beyond the dense families: GET_ROWS'
# batched backward (the gather of the chosen experts' router weights), SUB / DIV backward with a
# broadcast divisor (the weights divided by their sum per token: Granite, Nemotron-H, LFM2-MoE), and
# SOFT_MAX_BACK correct in place of its forward result (the softmax routers of Jamba and Granite: without
# it their routers get almost no gradient, one SGD step moving Jamba's by 1.5e-7 against transformers'
# gradient norm 9.0e-4; test_sgd_step_is_the_gradient sees it in the total norm, 1.2e-4 relative).
MOE = {"granitemoehybrid_moe", "nemotron_h_moe", "jamba_moe", "lfm2_moe"}
FAMILIES = ["falcon_h1", "granitemoehybrid", "nemotron_h", "jamba", "lfm2"] + sorted(MOE)
# one SGD step, llama's weight changes / lr vs stock transformers' gradients, relative: the norm over all
# tensors (measured <= 2.6e-8 on the dense families) and tensor by tensor (measured <= 6.4e-5, jamba's
# smallest tensors: float32 rounding of w - w' where the step is small against w)
SGD_TOL_TOTAL = 1e-5
SGD_TOL_TENSOR = 1e-3


@pytest.fixture(scope="module")
def fh():
    """ggml/finetune_hybrid.py as a module, with the patched llama-finetune and llama-tokenize built."""
    fh = finetune_hybrid()
    # the delta-rule families are tests/ggml/test_llama_finetune_gdn.py's
    assert sorted(set(fh.FAMILIES) - set(fh.GDN_FAMILIES)) == sorted(FAMILIES)
    return fh


@pytest.fixture(scope="module")
def prepared(fh, tmp_path_factory):
    """family -> the converted model, text and tokens (each converted once per module)."""
    return once_per_key(fh.prepare, tmp_path_factory.mktemp("llama_finetune_hybrid"))


@pytest.mark.parametrize("family", FAMILIES)
def test_finetune_matches_stock_transformers(fh, prepared, family):
    p = prepared(family)
    # the GGUF has both kinds of layer (a converter that drops the attention layers fails here)
    names = set(fh.gguf_tensors(p["gguf"]))
    assert any(".attn_q." in n for n in names), sorted(names)
    assert any(".ssm_" in n or ".shortconv." in n for n in names), sorted(names)
    if family in MOE:
        assert any("_exps." in n for n in names), sorted(names)
        check_every_expert_used(fh, family, p)
    check_losses_match(fh, family, p)


@pytest.mark.parametrize("family", FAMILIES)
def test_sgd_step_is_the_gradient(fh, prepared, family, tmp_path):
    """One SGD step of llama-finetune moves each tensor by lr times its gradient: the per-tensor norms
    equal stock transformers' gradients' (sorted: the layouts differ), no constant factor left over."""
    p = prepared(family)
    _, llama, torch_n, n_gguf, n_torch = sgd_step(fh, p, tmp_path)
    # the GGUF may split a tensor (Granite's fused expert input into gate and up; Mamba-2's in_proj stays
    # whole): compare the total, and tensor by tensor where the counts agree
    assert np.sqrt((llama ** 2).sum()) == pytest.approx(np.sqrt((torch_n ** 2).sum()), rel=SGD_TOL_TOTAL)
    if n_gguf == n_torch:
        big = torch_n > 1e-3 * torch_n.max()
        rel = np.abs(llama[big] - torch_n[big]) / torch_n[big]
        assert rel.max() <= SGD_TOL_TENSOR, f"{family}: per-tensor gradient norms differ by {rel.max():.2e}:\n{np.c_[llama, torch_n]}"


def test_convert_rejection_names_the_reason(fh, tmp_path):
    """A checkpoint llama.cpp's converter rejects (Mamba-1 with expand 3: a bare assert in the converter)
    is an error naming the condition, not a traceback."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=512, hidden_size=16, state_size=8, num_hidden_layers=1, expand=3)
    transformers.MambaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    with pytest.raises(fh.convert.ConvertError, match=r"requires `d_inner == 2 \* d_model`"):
        fh.convert.convert(tmp_path / "m", tmp_path / "m.gguf")
    proc = subprocess.run([sys.executable, str(ROOT / "ggml" / "convert.py"), str(tmp_path / "m"), str(tmp_path / "o.gguf")],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "convert.py: error: llama.cpp's convert_hf_to_gguf.py rejected" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # the dense configurations as transformers 5 writes them (the converter's patch reads these)
    for family, key, value in (("granitemoehybrid", "layer_types", ["linear_attention", "full_attention"]),
                               ("nemotron_h", "layers_block_type", ["linear_attention", "full_attention", "mlp"])):
        fh.make_model(family).save_pretrained(tmp_path / family)
        cfg = json.loads((tmp_path / family / "config.json").read_text())
        assert cfg[key] == value and "num_experts_per_tok" in cfg, cfg


@pytest.mark.parametrize("family", ["falcon_h1", "jamba", "lfm2"])
def test_ubatch_smaller_than_ctx(fh, prepared, family):
    """-ub 64 with -c = -b 256: attention stores K and V in the KV cache and reads them back, so the
    forward is the whole window's (the first window's four ubatch losses are stock transformers' loss of
    the window, split; the recurrent states flow on too), but no gradient reaches the K and V projections
    through the cache: with no weight decay they stay exactly as they were, while Q and the SSM / conv
    weights train."""
    p = prepared(family)
    r = first_window_by_ubatch(fh, family, p, n_ub=64)
    assert "the K and V projections will not receive gradients" in r["ft"]["proc"].stderr
    before, after = fh.gguf_tensors(p["gguf"]), fh.gguf_tensors(r["out"])
    kv = [n for n in before if ".attn_k." in n or ".attn_v." in n]
    moved = [n for n in before if not np.array_equal(before[n], after[n])]
    assert kv and not set(kv) & set(moved), f"K/V projections moved: {sorted(set(kv) & set(moved))}"
    assert any(".attn_q." in n for n in moved), sorted(moved)
    assert any(".ssm_" in n or ".shortconv." in n for n in moved), sorted(moved)


# Nemotron-H's gradients element by element, with the family's init and with Mamba's (large SSM states; the
# dt_bias of both drawn in Mamba's range, softplus(dt_bias) in [1e-3, 1e-1]). The oracle is stock transformers
# computing llama.cpp's model: transformers' Nemotron-H mixer clamps softplus(dt + dt_bias) from below at
# time_step_min (1e-3), llama.cpp's Mamba-2 layer does not (finetune_hybrid.drop_time_step_limits; docs/ggml.md).
# The test also holds what transformers' own model (the floor kept) does, so that the difference stays explained.
@pytest.mark.parametrize("mamba_init", [False, True])
def test_nemotron_h_gradients(fh, tmp_path, mamba_init):
    """One SGD step's gradients of Nemotron-H, element by element (ggml/grad_check.py), against stock
    transformers' (the converter's q/k row permutation undone), relative L2 over all tensors."""
    sys.path.insert(0, str(ROOT / "ggml"))
    try:
        import grad_check
    finally:
        sys.path.remove(str(ROOT / "ggml"))
    model = fh.make_model("nemotron_h", mamba_init=mamba_init)
    model.save_pretrained(tmp_path / "hf")
    gguf = fh.convert.convert(tmp_path / "hf", tmp_path / "m.gguf")
    text = tmp_path / "one-window.txt"
    text.write_bytes(fh.fc.make_text(fh.SGD_WORDS, seed=1).encode())
    inputs, labels = fh.fc.windows(fh.fc.tokenize(gguf, text))
    got, _, _ = grad_check.llama_grads(gguf, text, tmp_path / "sgd.gguf")
    want, loss = grad_check.torch_grads_by_gguf_name(fh.make_model("nemotron_h", mamba_init=mamba_init), inputs[0],
                                                     labels[0], "nemotron_h", qk_permuted=True)
    rows, total = grad_check.compare(got, want)
    # measured 3.8e-7 with the family's init, 9.0e-7 with Mamba's (its ssm_a and dt bias gradients, norms near
    # 1e-7 with the family's init, alone differ by up to 4e-3: float32 noise of near-zero sums, too small to
    # weigh in the total)
    assert total <= 1e-5, "\n".join(f"{n}: {r[0]:.2e}" for n, r in rows.items())

    # transformers' own Nemotron-H, the floor kept: it clamps 82 (family's init) and 327 (Mamba's) of the
    # 2048 time steps (256 tokens x 8 heads). With Mamba's init that moves every gradient by 5.6e-3 (the
    # forward's logits by 5.8e-3; output.weight 4.9e-3, token_embd 5.7e-3) while the loss moves by 2.0e-6
    # only: near-uniform softmax of a random model, whose loss is first-order blind to a logit change that
    # is not aligned with the labels; with the family's init x is ~0.01 and the clamp moves nothing (5.0e-7)
    floored = fh.make_model("nemotron_h", mamba_init=mamba_init, time_step_floor=True)
    clamped, n_dt = fh.clamped_time_steps(floored, inputs[0])
    assert n_dt == 2048 and clamped > 50, (clamped, n_dt)
    want_f, loss_f = grad_check.torch_grads_by_gguf_name(floored, inputs[0], labels[0], "nemotron_h",
                                                         qk_permuted=True)
    _, total_f = grad_check.compare(got, want_f)
    assert abs(loss_f - loss) <= 1e-5 * loss, (loss_f, loss)
    if mamba_init:
        assert total_f >= 1e-3, f"transformers' floor no longer shows: {total_f:.2e}"
    else:
        assert total_f <= 1e-5, f"{total_f:.2e}"
