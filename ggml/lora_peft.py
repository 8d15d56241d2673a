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
converter gives HF_DIR's config), so the script runs the converter copy ggml/convert.py extracts. A weight
the converter reorders or splits by rows or columns is described per family by _weight_parts (Qwen3.5's V
heads, Qwen3-Next's in_proj_qkvz split into attn_qkv + attn_gate), its adapter taken the same way (lora_B's
rows, lora_A's columns); module names that differ from the checkpoint's are renamed (Kimi-Linear). With
``--base BASE.gguf`` (the converted HF_DIR) it checks that each adapted weight of HF_DIR, so taken, is that
GGUF's tensor, element for element, and refuses otherwise (a weight the converter scales, or splits into
tensors that are not a build_lora_mm, needs more: not done here).
Embedding adapters (lora_embedding_A/B), DoRA, biases, and a rank_pattern / alpha_pattern that matches an
adapted module are refused.

to-peft is the way back (a trained adapter of llama-finetune -> adapter_config.json +
adapter_model.safetensors, which ``peft.PeftModel.from_pretrained`` loads on HF_DIR's model): each GGUF
name is found among HF_DIR's weights through the same name map and _weight_parts (a split weight's parts
joined back: see to_peft), target_modules lists the adapted modules by their full names, lora_alpha is the
GGUF's (an adapter without alpha, which llama.cpp scales by 1, gets lora_alpha = r). One rank for all GGUF
tensors. PEFT itself refuses some modules (out_proj and conv1d of
the Mamba models): such an adapter is written but does not load there.
"""

import argparse
import json
import math
import os
import re
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
    if cfg.get("use_dora"):
        raise LoraConvertError("peft_dir: DoRA is not supported")
    st = load_file(str(st_path))
    # a pattern that matches no module of the adapter does not matter (PEFT 0.21 writes '.*\.gate_up_proj' for
    # Qwen3-Next, for fused experts a dense model does not have); PEFT matches a pattern at a name's end
    mods = {k[len(PEFT_PREFIX):].rpartition(".lora_")[0] for k in st}
    for key in ("rank_pattern", "alpha_pattern"):
        for pattern in cfg.get(key) or {}:
            hit = sorted(m for m in mods if re.match(rf"(.*\.)?({pattern})$", m))
            if hit:
                raise LoraConvertError(f"peft_dir: {key} {pattern!r} (matching {hit[0]}) is not supported "
                                       "(one rank and alpha for every weight)")
    return cfg, st


def _hf_config(hf_dir):
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise LoraConvertError(f"hf_dir: {hf_dir} has no config.json")
    return json.loads(path.read_text())


def _base_tensors(base_gguf, gguf):
    st = os.stat(base_gguf)
    key = (os.path.realpath(base_gguf), st.st_size, st.st_mtime_ns)
    if key not in _BASE_CACHE:         # (GGUFReader takes ~2 s on a tiny model: it parses the whole vocab)
        _BASE_CACHE.clear()
        _BASE_CACHE[key] = {t.name: t for t in gguf.GGUFReader(str(base_gguf)).tensors}
    return _BASE_CACHE[key]


_BASE_CACHE = {}


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
    hf_cfg = _hf_config(hf_dir)

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
    hf_w = _hf_weights(hf_dir, {_checkpoint_key(model_arch, m) + ".weight" for m in pairs}) if base_gguf else None

    out = {}
    for mod in sorted(pairs):
        ab = pairs[mod]
        if set(ab) != {"A", "B"}:
            raise LoraConvertError(f"peft_dir: {mod} has only lora_{''.join(ab)}")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise LoraConvertError(f"peft_dir: {mod}: lora_A {a.shape}, lora_B {b.shape}, but r = {r}")
        if a.shape[1] * b.shape[0] == 0:
            raise LoraConvertError(f"{mod}: empty adapter")
        key = _checkpoint_key(model_arch, mod) + ".weight"
        for name, rows, cols in _weight_parts(model_arch, hf_cfg, key, name_map):
            if name == "token_embd.weight":
                raise LoraConvertError(f"{mod}: an embedding adapter is not supported")
            if name in out:
                raise LoraConvertError(f"{mod}.weight -> {name}: another module of the adapter maps to it too")
            if base is not None:
                if name not in base:
                    raise LoraConvertError(f"{mod}.weight -> {name}: not a tensor of {base_gguf}")
                g = _base_array(base[name], gguf)
                w = hf_w.get(key)
                w = None if w is None else _take(w, rows, cols)
                if w is None or w.shape != g.shape or not np.array_equal(w, g):
                    raise LoraConvertError(f"{mod}.weight -> {name}: the converter does not write this weight as "
                                           f"it is (HF {None if w is None else w.shape}, GGUF {g.shape}), so its "
                                           "adapter cannot be copied")
            # W[rows][:, cols] = B[rows] A[:, cols]
            out[name] = (_take(a, None, cols), _take(b, rows, None))

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


# ---------------------------------------------------------------- weights the converter rewrites
# _weight_parts(arch, hf_cfg, key, name_map) -> [(gguf name, rows, cols)]: the GGUF tensors the converter makes
# of the checkpoint weight KEY (PyTorch's (n_out, n_in)), each W[rows][:, cols] (rows, cols: index arrays, None
# = all, in order). An adapter B A of W is then B[rows] A[:, cols] on each of them, exactly. A weight written as
# it is: [(its name_map name, None, None)]. Read from the converter copy ggml/convert.py extracts
# (conversion/qwen.py, conversion/kimi_linear.py); the --base check compares W[rows][:, cols] with the GGUF's
# tensor element for element, so a table that is wrong for a converted model is refused, not written.

def _weight_parts(model_arch, hf_cfg, key, name_map):
    gguf, _ = _converter()
    special = _FAMILY_PARTS.get(gguf.MODEL_ARCH_NAMES[model_arch])
    parts = special(gguf, hf_cfg.get("text_config", hf_cfg), key, name_map) if special else None
    if parts is not None:
        return parts
    name = name_map.get_name(key, try_suffixes=(".weight",))
    if name is None:
        raise LoraConvertError(f"{key}: the converter's name map has no GGUF name for it")
    return [(name, None, None)]


def _layer(key):
    m = re.search(r"\.layers\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def _tensor_name(gguf, tensor, bid):
    return gguf.TENSOR_NAMES[tensor].format(bid=bid) + ".weight"


def _qwen3next_parts(gguf, cfg, key, name_map):
    """Qwen3-Next: linear_attn.in_proj_qkvz holds, per key head, [q (d_k), k (d_k), v (n_v / n_k d_v),
    z (n_v / n_k d_v)] rows; the converter (Qwen3NextModel.modify_tensors) writes attn_qkv = every head's q,
    then every head's k, then v, and attn_gate = every head's z. in_proj_ba, out_proj and the rest are
    written as they are."""
    if not key.endswith(".linear_attn.in_proj_qkvz.weight"):
        return None
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    d_k, d_v = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    sizes = [d_k, d_k, n_v // n_k * d_v, n_v // n_k * d_v]
    per_head = np.arange(n_k * sum(sizes)).reshape(n_k, sum(sizes))
    q, k, v, z = np.split(per_head, np.cumsum(sizes)[:-1], axis=1)
    bid = _layer(key)
    return [(_tensor_name(gguf, gguf.MODEL_TENSOR.ATTN_QKV, bid), np.concatenate([q.ravel(), k.ravel(), v.ravel()]),
             None),
            (_tensor_name(gguf, gguf.MODEL_TENSOR.ATTN_GATE, bid), z.ravel(), None)]


def _v_head_order(cfg, head_dim):
    """Qwen3.5's V heads (n_v > n_k): the checkpoint groups them by key head (g0 v0, g0 v1, ..., g1 v0, ...),
    the converter (_LinearAttentionVReorderBase._reorder_v_heads) tiles them (g0 v0, g1 v0, ..., g0 v1, ...):
    the index of each GGUF row (of head_dim rows per head) among the checkpoint's."""
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    idx = np.arange(n_v * head_dim).reshape(n_k, n_v // n_k, head_dim)
    return idx.transpose(1, 0, 2).ravel()


def _qwen35_parts(gguf, cfg, key, name_map):
    """Qwen3.5 (dense, MoE): the Gated DeltaNet's V heads reordered (_v_head_order) in the rows of
    in_proj_qkv (its v rows only), in_proj_z, in_proj_b, in_proj_a and in the columns of out_proj; names as
    the name map gives them. Nothing reordered when n_v = n_k."""
    m = re.search(r"\.linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight$", key)
    n_k, n_v = cfg.get("linear_num_key_heads", 0), cfg.get("linear_num_value_heads", 0)
    if m is None or n_k == n_v:
        return None
    proj, d_v = m.group(1), cfg["linear_value_head_dim"]
    name = name_map.get_name(key, try_suffixes=(".weight",))
    if proj == "in_proj_qkv":
        n_qk = 2 * n_k * cfg["linear_key_head_dim"]
        return [(name, np.concatenate([np.arange(n_qk), n_qk + _v_head_order(cfg, d_v)]), None)]
    if proj == "in_proj_z":
        return [(name, _v_head_order(cfg, d_v), None)]
    if proj == "out_proj":
        return [(name, None, _v_head_order(cfg, d_v))]
    return [(name, _v_head_order(cfg, 1), None)]            # in_proj_b, in_proj_a: a row per V head


def _kimi_linear_parts(gguf, cfg, key, name_map):
    """Kimi-Linear: the MLA's kv_b_proj is split per head into k_b (transposed) and v_b, 3-D tensors the graph
    multiplies head by head, not through build_lora_mm: refused. A dense layer's MLP is renamed as the converter
    renames it (KimiLinearModel.modify_tensors). The rest is written as it is."""
    if key.endswith(".self_attn.kv_b_proj.weight"):
        raise LoraConvertError(f"{key}: the converter splits kv_b_proj per head into k_b (transposed) and v_b, "
                               "which llama.cpp multiplies head by head: an adapter there is not supported")
    # the converter's own rename: a dense layer's MLP, saved under block_sparse_moe, is the GGUF's ffn_*
    if re.search(r"\.block_sparse_moe\.(gate|up|down)_proj\.weight$", key):
        name = name_map.get_name(key.replace(".block_sparse_moe.", ".mlp."), try_suffixes=(".weight",))
        return None if name is None else [(name, None, None)]
    return None


# by the GGUF architecture name (gguf.MODEL_ARCH_NAMES)
_FAMILY_PARTS = {"qwen3next": _qwen3next_parts, "qwen35": _qwen35_parts, "qwen35moe": _qwen35_parts,
                 "kimi-linear": _kimi_linear_parts}


# PEFT names modules as the transformers model has them; the checkpoint (and the converter) names some weights
# otherwise (transformers 5's conversion mapping renames them on load): (module pattern, checkpoint pattern).
# Kimi-Linear (conversion_mapping.py, "kimi_linear"): the forget gate's projections sit in self_attn, every MLP
# (dense, shared experts) under block_sparse_moe.
_KIMI_LINEAR_RENAMES = [(r"\.self_attn\.forget_gate\.(f_[ab]_proj)$", r".self_attn.\1", r"\.self_attn\.(f_[ab]_proj)$",
                         r".self_attn.forget_gate.\1"),
                        (r"\.mlp\.", ".block_sparse_moe.", r"\.block_sparse_moe\.", ".mlp.")]
_MODULE_RENAMES = {"kimi-linear": _KIMI_LINEAR_RENAMES}


def _checkpoint_key(model_arch, mod):
    """The checkpoint's name of the PEFT module MOD's weight (without .weight)."""
    gguf, _ = _converter()
    for to_ckpt, ckpt, _, _ in _MODULE_RENAMES.get(gguf.MODEL_ARCH_NAMES[model_arch], ()):
        mod = re.sub(to_ckpt, ckpt, mod)
    return mod


def _module_name(model_arch, key):
    """The transformers module of the checkpoint weight KEY (without .weight): _checkpoint_key's inverse."""
    gguf, _ = _converter()
    for _, _, from_ckpt, module in _MODULE_RENAMES.get(gguf.MODEL_ARCH_NAMES[model_arch], ()):
        key = re.sub(from_ckpt, module, key)
    return key


def to_peft(adapter_gguf, hf_dir, out_dir, base_gguf=None):
    """Writes the GGUF LoRA adapter ADAPTER_GGUF of HF_DIR's converted model as a PEFT adapter in OUT_DIR;
    returns {PEFT module name: (lora_A, lora_B)}. A module the converter split into several GGUF tensors
    (_weight_parts) gets its parts' adapters back in one: rank r with the parts' lora_B rows in place when
    the parts' lora_A are equal (as to-gguf writes them), else rank r * parts, lora_A the parts' stacked and
    lora_B block by block (the same product, exactly), written as that module's rank_pattern / alpha_pattern
    (alpha scaled with the rank, so that PEFT's alpha / r stays llama.cpp's)."""
    import peft
    from safetensors import safe_open
    from safetensors.numpy import save_file
    gguf, _ = _converter()
    model_arch, name_map = _name_map(hf_dir)
    hf_cfg = _hf_config(hf_dir)
    shapes = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.endswith(".weight"):
                    shapes[k] = tuple(st.get_slice(k).get_shape())
    owner = {}                  # gguf name -> [(HF weight, rows, cols)]
    for k in shapes:
        try:
            parts = _weight_parts(model_arch, hf_cfg, k, name_map)
        except LoraConvertError:
            continue            # a weight no adapter can be written for; an adapter on it finds no owner below
        for g, rows, cols in parts:
            if g is not None:
                owner.setdefault(g, []).append((k, rows, cols))
    alpha, ad = read_gguf_adapter(adapter_gguf)
    ranks = {b.shape[1] for _, b in ad.values()}
    if len(ranks) != 1:
        raise LoraConvertError(f"adapter: ranks {sorted(ranks)}; one rank for every weight is supported")
    r = ranks.pop()
    base = _base_tensors(base_gguf, gguf) if base_gguf else None
    by_weight = {}
    for name in sorted(ad):
        hf = owner.get(name, [])
        if len(hf) != 1:
            raise LoraConvertError(f"{name}: {'no' if not hf else len(hf)} weights of {hf_dir} map to it")
        k, rows, cols = hf[0]
        if base is not None:
            w = _take(_hf_weights(hf_dir, {k})[k], rows, cols)
            t = base.get(name)
            g = None if t is None else _base_array(t, gguf)
            if g is None or g.shape != w.shape or not np.array_equal(g, w):
                raise LoraConvertError(f"{name} -> {k}: the converter does not write this weight as it is")
        by_weight.setdefault(k, []).append((rows, cols, *ad[name]))
    out, tensors, rank_pattern = {}, {}, {}
    for k, parts in by_weight.items():
        mod = _module_name(model_arch, k[:-len(".weight")])
        a, b = _join_parts(parts, shapes[k], r)
        out[mod] = (a, b)
        if a.shape[0] != r:
            rank_pattern[mod] = a.shape[0]
        tensors[PEFT_PREFIX + mod + ".lora_A.weight"] = np.ascontiguousarray(a)
        tensors[PEFT_PREFIX + mod + ".lora_B.weight"] = np.ascontiguousarray(b)
    why = _peft_refuses(hf_cfg, sorted(out))
    if why:
        raise LoraConvertError(f"PEFT would not load this adapter: {why}; train without them (llama-finetune "
                               "--lora-targets)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lora_alpha = alpha if alpha > 0 else r
    cfg = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=sorted(out), lora_dropout=0.0,
                          bias="none", base_model_name_or_path=str(hf_dir), rank_pattern=rank_pattern,
                          alpha_pattern={m: lora_alpha * n / r for m, n in rank_pattern.items()})
    cfg.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out


def _peft_refuses(hf_cfg, targets):
    """Why PEFT would not load an adapter on TARGETS as written, or None. PEFT's own config conversion for
    transformers 5 (peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers, run when
    an adapter is loaded) takes, for model types whose experts transformers 5 fuses (Qwen3-Next among them),
    every *.gate_proj / *.up_proj / *.down_proj for the experts' fused parameters: a dense MLP's or a shared
    expert's adapter is then dropped from target_modules without a word (or, gate without up, refused)."""
    import types
    try:
        import peft
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return None
    cfg = peft.LoraConfig(r=1, lora_alpha=1, target_modules=list(targets))
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type=hf_cfg.get("model_type")))
    why = f"on a {hf_cfg.get('model_type')!r} model PEFT {peft.__version__} takes *.gate_proj / *.up_proj / " \
          "*.down_proj for fused experts' parameters (transformers 5's MoE layout)"
    try:
        convert_peft_config_for_transformers(cfg, model, None)
    except ValueError as e:
        return f"{why}: {e}"
    except (AttributeError, TypeError):
        return None
    dropped = sorted(set(targets) - set(cfg.target_modules or ()))
    return f"{why} and would drop the adapters of {', '.join(dropped)}" if dropped else None


def _take(x, rows, cols):
    """x[rows][:, cols] (None: all, in order)."""
    if rows is not None:
        x = x[rows]
    if cols is not None:
        x = x[:, cols]
    return x


def _join_parts(parts, shape, r):
    """One (lora_A, lora_B) of a weight of SHAPE (n_out, n_in) from its parts' [(rows, cols, lora_a, lora_b)]
    (the weight's rows and columns each part's tensor takes): see to_peft."""
    n_out, n_in = shape
    a_parts = []
    for rows, cols, a, _ in parts:
        if cols is not None:
            full = np.empty((a.shape[0], n_in), dtype=a.dtype)
            full[:, cols] = a               # cols: a permutation of the weight's columns
            a = full
        a_parts.append(a)
    shared = all(np.array_equal(a, a_parts[0]) for a in a_parts[1:])
    rank = r if shared else r * len(parts)
    b_full = np.zeros((n_out, rank), dtype=np.float32)
    for i, (rows, _, _, b) in enumerate(parts):
        block = slice(0, r) if shared else slice(i * r, (i + 1) * r)
        b_full[slice(None) if rows is None else rows, block] = b
    return (a_parts[0] if shared else np.concatenate(a_parts)), b_full


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
