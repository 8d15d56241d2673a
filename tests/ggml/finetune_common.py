"""The checks tests/ggml/test_llama_finetune_hybrid.py and test_llama_finetune_gdn.py share: llama-finetune
of a converted hybrid model (ggml/finetune_hybrid.py) against stock transformers' fine-tuning of it."""

import numpy as np

from ggml_build import built_script


def finetune_hybrid():
    """ggml/finetune_hybrid.py as a module, with the patched llama-finetune and llama-tokenize built."""
    return built_script("finetune_hybrid", lambda fh: [fh.fc.BIN / n for n in ("llama-finetune", "llama-tokenize")])


def check_every_expert_used(fh, family, p):
    """The MoE model's router (transformers') sends tokens of the windows to every expert."""
    inputs, _ = fh.fc.windows(p["tokens"])
    use = fh.expert_use(fh.make_model(family), inputs)
    assert use and all(min(c) > 0 for c in use.values()), f"{family}: an expert no token picks: {use}"


def check_losses_match(fh, family, p):
    """Every step's loss of llama-finetune is stock transformers' within fh.TOL, and the loss falls."""
    r = fh.compare(p)
    assert len(r["llama"]) == fh.EPOCHS * r["steps_per_epoch"] and r["steps_per_epoch"] >= 3
    worst = r["worst_step"]
    assert r["max_rel"] <= fh.TOL, (
        f"{family}: step {worst + 1}: llama-finetune {r['llama'][worst]:.6f} vs stock transformers "
        f"{r['torch'][worst]:.6f} (relative {r['max_rel']:.2e} > {fh.TOL}); all steps:\n{np.c_[r['llama'], r['torch']]}")
    n = r["steps_per_epoch"]
    assert r["torch"][-n:].mean() < r["torch"][:n].mean() - 0.05, f"the loss did not fall: {r['torch']}"


def sgd_step(fh, p, tmp_path):
    """One plain SGD step of llama-finetune on a one-window text: (that text, llama's per-tensor weight
    changes / lr, stock transformers' per-tensor gradient norms, the two tensor counts)."""
    text = tmp_path / "one-window.txt"
    text.write_bytes(fh.fc.make_text(fh.SGD_WORDS, seed=1).encode())
    return (text, *fh.sgd_step_norms(p, text))


def first_window_by_ubatch(fh, family, p, n_ub):
    """llama-finetune with -ub N_UB, -c = -b 256, one epoch, no weight decay: the first window's
    per-ubatch losses must be stock transformers' loss of that whole window, split into the same
    ubatches. Returns the run, its output GGUF, both losses, the model, the first window's inputs and labels."""
    import torch
    out = p["workdir"] / f"{family}-ub.gguf"
    ft = fh.fc.run_finetune(p["gguf"], p["text"], out, n_batch=256, n_ubatch=n_ub, epochs=1, wd=0.0)
    assert ft["proc"].returncode == 0, f"llama-finetune -ub {n_ub} failed:\n{ft['proc'].stderr[-3000:]}"
    inputs, labels = fh.fc.windows(p["tokens"])
    per_window = fh.fc.N_CTX // n_ub
    model = fh.make_model(family)
    with torch.no_grad():
        logits = model(input_ids=inputs[:1], use_cache=False).logits[0]
        ce = torch.nn.functional.cross_entropy(logits, labels[0], reduction="none")
    expect = ce.view(per_window, n_ub).mean(1).numpy()
    llama = np.asarray(ft["losses"][0][:per_window])
    assert np.all(fh.fc.rel_diff(llama, expect) <= fh.TOL), (
        f"first window per ubatch: {llama} vs stock transformers {expect}")
    return dict(ft=ft, out=out, llama=llama, expect=expect, model=model, inputs=inputs[:1], labels=labels[0])

