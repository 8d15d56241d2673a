"""llama-finetune's gradients, element by element, against transformers': one plain SGD step.

AdamW's first step moves every weight with a nonzero gradient by about lr whatever the gradient's size, so
a loss after it says little about the gradients (float32 rounding of a gradient near 0 flips a whole step).
Plain SGD does not divide: `ggml_opt_step_sgd` computes `w = w * (1 - lr wd) - lr g`, so with wd = 0 and lr
a power of two, `(w_before - w_after) / lr` is llama's gradient, up to one rounding of the subtraction
(at most half an ulp of `w_after`, which `llama_grads` also returns as a bound).

The torch side is transformers (stock, or with ssmgrad.transformers.patch()) in the GGUF's form of the
parameters (ggml/finetune_hybrid.py's train_gguf_form: A = -exp(A_log) as the parameter), each gradient
found under its GGUF name by gguf-py's tensor name map (the converter's own), flattened: the converter
reshapes (conv1d's singleton axis, the grouped norm, A's and D's axes) but keeps the element order.

    from grad_check import llama_grads, torch_grads_by_gguf_name, compare
"""

import contextlib
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import convert                  # noqa: E402  (ggml/convert.py)
import finetune_check as fc     # noqa: E402
import finetune_hybrid as fh    # noqa: E402  (train_gguf_form)


@contextlib.contextmanager
def _gguf_py():
    sys.path.insert(0, str(convert.converter_dir() / "gguf-py"))
    try:
        import gguf
        yield gguf
    finally:
        sys.path.pop(0)


def _tensors(path):
    """{name: float32 array (a memory map of the file)}."""
    with _gguf_py() as gguf:
        return {t.name: t.data for t in gguf.GGUFReader(path).tensors}


def llama_grads(gguf_path, text_path, out_path, lr=1024.0, threads=fc.THREADS, bin_dir=fc.BIN):
    """One SGD step of llama-finetune (-opt sgd -wd 0, one epoch) on a text of exactly one window:
    ({name: gradient}, {name: bound of its rounding error}, the step's printed loss), float64."""
    if lr <= 0 or 2.0 ** np.round(np.log2(lr)) != lr:
        raise ValueError(f"lr: expected a power of two (so that lr g is exact), got {lr}")
    ft = fc.run_finetune(gguf_path, text_path, out_path, epochs=1, lr=lr, wd=0.0, threads=threads,
                         bin_dir=bin_dir, opt="sgd")
    if ft["proc"].returncode != 0:
        raise RuntimeError(f"llama-finetune -opt sgd failed ({ft['proc'].returncode}):\n{ft['proc'].stderr[-3000:]}")
    if [len(e) for e in ft["losses"]] != [1]:
        raise ValueError(f"text_path: expected exactly one window, llama-finetune ran {ft['losses']}")
    before, after = _tensors(gguf_path), _tensors(out_path)
    grads, bound = {}, {}
    for name, w0 in before.items():
        w1 = np.asarray(after[name], dtype=np.float32)
        grads[name] = (np.asarray(w0, dtype=np.float64) - w1.astype(np.float64)) / lr
        bound[name] = np.spacing(np.abs(w1)).astype(np.float64) / (2 * lr)
    return grads, bound, ft["losses"][0][0]


def gguf_name_map(arch, n_blocks):
    """HF parameter name -> GGUF tensor name (gguf-py's TensorNameMap of `arch`, e.g. "mamba2")."""
    with _gguf_py() as gguf:
        tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_blocks)

    def name(hf):
        hf = hf.replace("parametrizations.", "").replace(".original", "")
        names = [hf]
        if hf.endswith(".dt_bias"):          # the Mamba-2 converters rename it (dt_proj.bias, or dt.bias)
            names += [hf[:-len(".dt_bias")] + ".dt_proj.bias", hf[:-len(".dt_bias")] + ".dt.bias"]
        # (transformers 5 saves Nemotron-H under model., which its converter reads as backbone.)
        names += ["backbone." + n[len("model."):] for n in names if n.startswith("model.")]
        for n in names:
            g = tmap.get_name(n, try_suffixes=(".weight", ".bias"))
            if g is not None:
                return g
        return None
    return name


def permute_qk(w, n_head, n_head_kv=None):
    """The rows of a q (k: n_head_kv given) projection as llama.cpp's converters permute them for ggml's
    RoPE (LlamaModel.permute; the Granite and Nemotron-H converters inherit it): w's first axis."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def torch_grads_by_gguf_name(model, x, y, arch, patch=False, qk_permuted=False):
    """{GGUF name: float64 gradient, flattened} of one window's mean cross-entropy, in the GGUF's form;
    stock transformers unless patch (ssmgrad.transformers). Also the loss. qk_permuted: the converter
    permuted attention's q and k rows (permute_qk), so their gradients are permuted alike."""
    import torch
    import torch.nn.functional as F
    fh.train_gguf_form(model)
    model.train()
    model.zero_grad(set_to_none=True)
    if patch:
        import ssmgrad.transformers as st
        ctx = st.patched()
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        loss = F.cross_entropy(model(input_ids=x[None], use_cache=False).logits[0].float(), y)
        loss.backward()
    to_gguf = gguf_name_map(arch, model.config.num_hidden_layers)
    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = to_gguf(n)
        if g is None:
            raise KeyError(f"{n}: no GGUF name in gguf-py's map of {arch}")
        grad = p.grad.detach().double().numpy()
        if qk_permuted and (g.endswith(".attn_q.weight") or g.endswith(".attn_k.weight")):
            cfg = model.config
            grad = permute_qk(grad, cfg.num_attention_heads,
                              cfg.num_key_value_heads if g.endswith(".attn_k.weight") else None)
        out[g] = grad.ravel()
    return out, float(loss.detach())


def compare(a, b):
    """Per tensor of b (the reference): relative L2 error ||a - b|| / ||b|| and max |a - b| / max |b|;
    and over all tensors together. Tensors only in a must be all zero (e.g. untrained); raises otherwise."""
    rows, num, den = {}, 0.0, 0.0
    for name, ref in b.items():
        got = np.asarray(a[name], dtype=np.float64).ravel()
        if got.size != ref.size:
            raise ValueError(f"{name}: {got.size} elements against {ref.size}")
        d = got - ref
        nb = float(np.linalg.norm(ref))
        rows[name] = (float(np.linalg.norm(d)) / nb if nb else float(np.linalg.norm(d)),
                      float(np.abs(d).max() / np.abs(ref).max()) if nb else float(np.abs(d).max()), nb)
        num += float(d @ d)
        den += nb * nb
    extra = [n for n in a if n not in b and np.any(np.asarray(a[n]) != 0)]
    if extra:
        raise ValueError(f"tensors with a gradient only in the first: {extra[:5]}")
    return rows, float(np.sqrt(num / den))
