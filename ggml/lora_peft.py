"""PEFT LoRA adapters as llama.cpp's GGUF LoRA adapters.

    python ggml/lora_peft.py to-gguf PEFT_DIR HF_DIR OUT.gguf [--base BASE.gguf]
    python ggml/lora_peft.py to-peft ADAPTER.gguf HF_DIR OUT_DIR [--base BASE.gguf]

PEFT_DIR is what ``PeftModel.save_pretrained`` writes (adapter_config.json, adapter_model.safetensors) for
the transformers checkpoint HF_DIR; OUT.gguf is the same adapter for the GGUF that ggml/convert.py makes of
HF_DIR, as llama.cpp loads it (``--lora``, llama-finetune's ``--lora-init``): general.type = adapter,
adapter.type = lora, adapter.lora.alpha, and for each adapted weight ``<gguf name>.lora_a`` / ``.lora_b``.

The layouts (read from llama_adapter_lora_init_impl and build_lora_mm of the sdist ggml/build.sh fetches):
a weight W of a matrix product is ggml [n_in, n_out] (ne order), PyTorch's (n_out, n_in); lora_a is
[n_in, r], which is PEFT's lora_A.weight (r, n_in) as it is, and lora_b [r, n_out] is lora_B.weight
(n_out, r) as it is: no transpose. llama.cpp scales B A x by alpha / r, r read from lora_b; PEFT by
lora_alpha / r (alpha / sqrt(r) with use_rslora, written as alpha * sqrt(r)).

The GGUF names come from the converter's own name map (gguf-py's TensorNameMap for the architecture the
converter gives HF_DIR's config), so the script runs the converter copy ggml/convert.py extracts. It maps
only weights the converter writes unchanged; with ``--base BASE.gguf`` (the converted HF_DIR) it checks
that each adapted weight of HF_DIR is that GGUF's tensor, element for element, and refuses otherwise (a
weight the converter reorders, splits or scales needs its adapter transformed too: not done here).
Embedding adapters (lora_embedding_A/B), DoRA, biases, rank_pattern / alpha_pattern are refused.

to-peft is the way back (a trained adapter of llama-finetune -> adapter_config.json +
adapter_model.safetensors, which ``peft.PeftModel.from_pretrained`` loads on HF_DIR's model): each GGUF
name is found among HF_DIR's weights through the same name map, target_modules lists the adapted modules
by their full names, lora_alpha is the GGUF's (an adapter without alpha, which llama.cpp scales by 1,
gets lora_alpha = r). One rank for all weights. PEFT itself refuses some modules (out_proj and conv1d of
the Mamba models): such an adapter is written but does not load there.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import convert  # noqa: E402  (ggml/convert.py: the converter copy)

PEFT_PREFIX = "base_model.model."


class LoraConvertError(ValueError):
    """The adapter cannot be written for that base."""


def _converter():
    """(gguf, conversion) modules of the converter copy ggml/convert.py extracts."""
    d = convert.converter_dir()
    for p in (str(d / "gguf-py"), str(d)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import gguf
    import conversion
    return gguf, conversion


def _read_peft(peft_dir):
    from safetensors.numpy import load_file
    peft_dir = Path(peft_dir)
    cfg_path, st_path = peft_dir / "adapter_config.json", peft_dir / "adapter_model.safetensors"
    if not cfg_path.is_file() or not st_path.is_file():
        raise LoraConvertError(f"peft_dir: {peft_dir} has no adapter_config.json / adapter_model.safetensors")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraConvertError(f"peft_dir: a {cfg.get('peft_type')} adapter, not LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoraConvertError(f"peft_dir: {key} is not supported (one rank and alpha for every weight)")
    if cfg.get("use_dora"):
        raise LoraConvertError("peft_dir: DoRA is not supported")
    return cfg, load_file(str(st_path))


def _hf_config(hf_dir):
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise LoraConvertError(f"hf_dir: {hf_dir} has no config.json")
    return json.loads(path.read_text())


def _base_tensors(base_gguf, gguf):
    r = gguf.GGUFReader(str(base_gguf))
    return {t.name: t for t in r.tensors}


def _base_array(t, gguf):
    """A tensor of the --base GGUF as NumPy in PyTorch's order; F32 only (the check compares exact values)."""
    if t.tensor_type != gguf.GGMLQuantizationType.F32:
        raise LoraConvertError(f"--base: {t.name} is {t.tensor_type.name}: give the F32 conversion of hf_dir "
                               "(the check compares exact values)")
    return np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))


def _hf_weights(hf_dir, names):
    """The named tensors of HF_DIR's safetensors files, float32."""
    from safetensors import safe_open
    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k in names:
                    out[k] = st.get_tensor(k).float().numpy()
    return out


def to_gguf(peft_dir, hf_dir, out_path, base_gguf=None):
    """Writes PEFT_DIR's adapter as a GGUF LoRA adapter of HF_DIR's converted model; returns
    {gguf name: (lora_a, lora_b)} as written (NumPy, PyTorch's order)."""
    gguf, _ = _converter()
    cfg, st = _read_peft(peft_dir)
    model_arch, name_map = _name_map(hf_dir)

    # PEFT's keys: base_model.model.<module>.lora_A.weight / .lora_B.weight
    pairs = {}
    for key, value in st.items():
        if not key.startswith(PEFT_PREFIX):
            raise LoraConvertError(f"peft_dir: unexpected tensor {key!r}")
        mod, _, part = key[len(PEFT_PREFIX):].rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise LoraConvertError(f"peft_dir: {key!r} is not a lora_A / lora_B weight (embedding adapters, "
                                   "biases and magnitudes are not supported)")
        pairs.setdefault(mod, {})[part[0]] = value.astype(np.float32)
    if not pairs:
        raise LoraConvertError("peft_dir: no LoRA tensors")

    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    # llama.cpp scales by alpha / r: rsLoRA's alpha / sqrt(r) is alpha * sqrt(r) / r
    gguf_alpha = alpha * math.sqrt(r) if cfg.get("use_rslora") else alpha
    base = _base_tensors(base_gguf, gguf) if base_gguf else None
    hf_w = _hf_weights(hf_dir, {m + ".weight" for m in pairs}) if base_gguf else None

    out = {}
    for mod in sorted(pairs):
        ab = pairs[mod]
        if set(ab) != {"A", "B"}:
            raise LoraConvertError(f"peft_dir: {mod} has only lora_{''.join(ab)}")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise LoraConvertError(f"peft_dir: {mod}: lora_A {a.shape}, lora_B {b.shape}, but r = {r}")
        name = name_map.get_name(mod + ".weight", try_suffixes=(".weight",))
        if name is None:
            raise LoraConvertError(f"{mod}.weight: the converter's name map has no GGUF name for it")
        if name == "token_embd.weight":
            raise LoraConvertError(f"{mod}: an embedding adapter is not supported")
        if base is not None:
            if name not in base:
                raise LoraConvertError(f"{mod}.weight -> {name}: not a tensor of {base_gguf}")
            g = _base_array(base[name], gguf)
            w = hf_w.get(mod + ".weight")
            if w is None or w.shape != g.shape or not np.array_equal(w, g):
                raise LoraConvertError(f"{mod}.weight -> {name}: the converter does not write this weight as it is "
                                       f"(HF {None if w is None else w.shape}, GGUF {g.shape}), so its adapter "
                                       "cannot be copied")
        if a.shape[1] * b.shape[0] == 0:
            raise LoraConvertError(f"{mod}: empty adapter")
        out[name] = (a, b)

    writer = gguf.GGUFWriter(str(out_path), arch=gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, gguf_alpha)
    for name, (a, b) in out.items():
        writer.add_tensor(name + ".lora_a", np.ascontiguousarray(a))
        writer.add_tensor(name + ".lora_b", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _name_map(hf_dir):
    gguf, conversion = _converter()
    hf_cfg = _hf_config(hf_dir)
    archs = hf_cfg.get("architectures") or []
    if len(archs) != 1:
        raise LoraConvertError(f"hf_dir: config.json names architectures {archs}, expected one")
    try:
        model_arch = conversion.get_model_class(archs[0]).model_arch
    except (NotImplementedError, KeyError) as e:
        raise LoraConvertError(f"hf_dir: architecture {archs[0]!r} is not one the converter knows") from e
    n_blocks = next((hf_cfg[k] for k in ("num_hidden_layers", "n_layer", "n_layers") if k in hf_cfg), None)
    if n_blocks is None:
        raise LoraConvertError("hf_dir: config.json has no layer count")
    return model_arch, gguf.get_tensor_name_map(model_arch, n_blocks)


def to_peft(adapter_gguf, hf_dir, out_dir, base_gguf=None):
    """Writes the GGUF LoRA adapter ADAPTER_GGUF of HF_DIR's converted model as a PEFT adapter in OUT_DIR;
    returns {PEFT module name: (lora_A, lora_B)}."""
    import peft
    from safetensors import safe_open
    from safetensors.numpy import save_file
    gguf, _ = _converter()
    _, name_map = _name_map(hf_dir)
    hf_names = []
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            hf_names += [k for k in st.keys() if k.endswith(".weight")]
    inverse = {}
    for k in hf_names:
        g = name_map.get_name(k, try_suffixes=(".weight",))
        if g is not None:
            inverse.setdefault(g, []).append(k)
    alpha, ad = read_gguf_adapter(adapter_gguf)
    ranks = {b.shape[1] for _, b in ad.values()}
    if len(ranks) != 1:
        raise LoraConvertError(f"adapter: ranks {sorted(ranks)}; one rank for every weight is supported")
    r = ranks.pop()
    base = _base_tensors(base_gguf, gguf) if base_gguf else None
    out, tensors = {}, {}
    for name in sorted(ad):
        hf = inverse.get(name, [])
        if len(hf) != 1:
            raise LoraConvertError(f"{name}: {'no' if not hf else len(hf)} weights of {hf_dir} map to it")
        mod = hf[0][:-len(".weight")]
        if base is not None:
            w = _hf_weights(hf_dir, {hf[0]})[hf[0]]
            t = base.get(name)
            g = None if t is None else _base_array(t, gguf)
            if g is None or g.shape != w.shape or not np.array_equal(g, w):
                raise LoraConvertError(f"{name} -> {hf[0]}: the converter does not write this weight as it is")
        a, b = ad[name]
        out[mod] = (a, b)
        tensors[PEFT_PREFIX + mod + ".lora_A.weight"] = np.ascontiguousarray(a)
        tensors[PEFT_PREFIX + mod + ".lora_B.weight"] = np.ascontiguousarray(b)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha if alpha > 0 else r, target_modules=sorted(out), lora_dropout=0.0,
                          bias="none", base_model_name_or_path=str(hf_dir))
    cfg.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out


def read_gguf_adapter(path):
    """(alpha, {gguf name: (lora_a, lora_b)}) of a GGUF LoRA adapter, NumPy in PyTorch's order."""
    gguf, _ = _converter()
    r = gguf.GGUFReader(str(path))
    alpha = float(r.fields["adapter.lora.alpha"].contents())
    out = {}
    for t in r.tensors:
        a = np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))
        base, _, part = t.name.rpartition(".lora_")
        out.setdefault(base, [None, None])["ab".index(part)] = a
    return alpha, {k: tuple(v) for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("to-gguf", help="a PEFT adapter -> a GGUF LoRA adapter of the converted base")
    p.add_argument("peft_dir", type=Path)
    p.add_argument("hf_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--base", type=Path, help="the converted HF_DIR: check that each adapted weight is its tensor")
    p = sub.add_parser("to-peft", help="a GGUF LoRA adapter -> a PEFT adapter (adapter_config.json, "
                                        "adapter_model.safetensors)")
    p.add_argument("adapter", type=Path)
    p.add_argument("hf_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--base", type=Path, help="the converted HF_DIR: check that each adapted weight is its tensor")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "to-gguf":
            out = to_gguf(args.peft_dir, args.hf_dir, args.out, args.base)
        else:
            out = to_peft(args.adapter, args.hf_dir, args.out, args.base)
    except LoraConvertError as e:
        print(f"lora_peft.py: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {2 * len(out)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
