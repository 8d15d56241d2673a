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
converter gives HF_DIR's config, after its class's own renames of checkpoint names), so the script runs the
converter copy ggml/convert.py extracts. A weight the converter reorders, splits or scales gets its adapter
transformed the same way (_Part: GGUF = row scale * W[rows] * column scale, so B' = row scale * B[rows],
A' = A * column scale; to-peft divides and joins): Granite-4.0-H's and Nemotron-H's q / k rows (the rotary
permutation), Granite's fused shared MLP input (gate and up halves, A copied to both), Falcon-H1's
multipliers (output ones on B's rows, input ones on A's columns), Qwen3.5's V heads (grouped by key head in
the checkpoint, tiled in the GGUF: in_proj_qkv's v rows, in_proj_z, in_proj_b, in_proj_a, out_proj's columns),
Qwen3-Next's in_proj_qkvz (split into attn_qkv and attn_gate, rows reordered). Module names that differ from
the checkpoint's are renamed (Kimi-Linear: _MODULE_RENAMES); its kv_b_proj is refused. Adapters on a
mixture's experts (PEFT's target_parameters on the 3-D experts.up_proj / down_proj / gate_proj, as
Nemotron-H has them, and the fused gate_up_proj of LFM2-MoE, Qwen3.5-MoE, Granite-4.0-H MoE, Jamba, Qwen3-Next and
Kimi-Linear) become llama.cpp's per-expert adapters of blk.N.ffn_*_exps and back (_expert_parts). With
``--base BASE.gguf`` (the converted HF_DIR) it checks that each adapted weight of HF_DIR, so transformed, is
that GGUF's tensor (element for element; within float32 rounding where the converter multiplied), and refuses
otherwise.
A rank_pattern / alpha_pattern gives each module its rank and scale as PEFT sets them (_peft_scales): a
split weight of rank n r whose B is block-diagonal by part (what to-peft writes for parts trained apart)
gives each part its own rank-r block back, any other module keeps its rank in every part, B multiplied by
the ratio of PEFT's scale to llama.cpp's alpha over that rank. Embedding adapters (lora_embedding_A/B), DoRA
and biases are refused.

to-peft is the way back (a trained adapter of llama-finetune -> adapter_config.json +
adapter_model.safetensors, which ``peft.PeftModel.from_pretrained`` loads on HF_DIR's model): each GGUF
name is found among HF_DIR's weights through the same name map, target_modules lists the adapted modules
by their full names, lora_alpha is the GGUF's (an adapter without alpha, which llama.cpp scales by 1,
gets lora_alpha = r). One rank for all weights, but a split weight whose parts have different A (llama-finetune
trains them apart): it becomes one adapter of rank n r (A stacked, B block-diagonal, alpha n alpha, the same
product) through rank_pattern / alpha_pattern. PEFT itself refuses some modules (out_proj and conv1d of the
models it calls Mamba-based: Mamba, Mamba-2, Falcon-H1, Nemotron-H): to-peft asks PEFT (on the model built on
the meta device) and refuses such an adapter, nothing written; and one PEFT would load in part (Qwen3-Next's
dense MLP, whose gate / up / down_proj PEFT takes for fused experts).
"""

import argparse
import functools
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


@functools.lru_cache(maxsize=1)
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
    return cfg, st


def _hf_config(hf_dir):
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise LoraConvertError(f"hf_dir: {hf_dir} has no config.json")
    return json.loads(path.read_text())


def _base_tensors(base_gguf, gguf):
    st = os.stat(base_gguf)
    return _read_tensors(str(base_gguf), st.st_size, st.st_mtime_ns)


class _GGUFTensor:
    """A tensor of a GGUF file as _read_tensors gives it: name, tensor_type, shape (ggml's ne), data (flat)."""

    def __init__(self, name, tensor_type, shape, data):
        self.name, self.tensor_type, self.shape, self.data = name, tensor_type, shape, data


@functools.lru_cache(maxsize=4)
def _read_tensors(path, size, mtime_ns):
    """{name: _GGUFTensor} of a GGUF (kept for the next call on the same unchanged file). Reads the header's
    tensor infos itself and skips the key-value section: gguf-py's GGUFReader builds a NumPy view of every
    field, seconds for a model's vocabulary. Only F32 data is read (the --base check needs no other)."""
    import struct
    gguf, _ = _converter()
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    mv = memoryview(buf)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, mv, pos)
        pos += struct.calcsize("<" + fmt)
        return v if len(v) > 1 else v[0]

    def string():
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(mv[pos - n:pos]).decode()

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(vtype):
        nonlocal pos
        if vtype == 8:
            return string()
        if vtype == 9:
            etype, count = take("I"), take("Q")
            if etype in scalar:                     # skip a numeric array whole
                pos += count * struct.calcsize(scalar[etype])
                return None
            for _ in range(count):
                value(etype)
            return None
        return take(scalar[vtype])

    if bytes(mv[:4]) != b"GGUF":
        raise LoraConvertError(f"--base: {path} is not a GGUF file")
    pos = 4
    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    if version < 2:
        raise LoraConvertError(f"--base: {path} is GGUF version {version}, expected >= 2")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = string(), take("I")
        v = value(vtype)
        if key == "general.alignment":
            alignment = int(v)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("I")
        ne = [take("Q") for _ in range(n_dims)]
        infos.append((name, ne, take("I"), take("Q")))
    start = (pos + alignment - 1) // alignment * alignment
    out = {}
    for name, ne, ttype, offset in infos:
        ttype = gguf.GGMLQuantizationType(ttype)
        data = None
        if ttype == gguf.GGMLQuantizationType.F32:
            data = np.frombuffer(buf, dtype=np.float32, count=int(np.prod(ne)), offset=start + offset)
        out[name] = _GGUFTensor(name, ttype, ne, data)
    return out


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
    # adapters of the experts' 3-D parameters (PEFT's target_parameters: ParamWrapper modules)
    patterns = bool(cfg.get("rank_pattern") or cfg.get("alpha_pattern"))
    # PEFT's own model of this adapter (on the meta device), where its modules or scales are needed
    pm = _meta_peft(hf_dir, hf_cfg, _lora_config(cfg)) if cfg.get("target_parameters") or patterns else None
    wrappers = _param_wrappers(pm) if cfg.get("target_parameters") else {}
    expert_pairs = {mod: pairs.pop(mod) for mod in list(pairs) if mod in wrappers}

    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    # llama.cpp scales by alpha / r: rsLoRA's alpha / sqrt(r) is alpha * sqrt(r) / r
    gguf_alpha = alpha * math.sqrt(r) if cfg.get("use_rslora") else alpha
    # a rank_pattern / alpha_pattern: each adapted module's rank and scale as PEFT itself sets them
    scales = _peft_scales(pm) if patterns else {}
    base = _base_tensors(base_gguf, gguf) if base_gguf else None
    hf_w = (_hf_weights_by_key(hf_dir, hf_cfg, {_converter_key(hf_cfg, m + ".weight") for m in pairs})
            if base_gguf else None)

    out = {}
    for mod in sorted(pairs):
        ab = pairs[mod]
        if set(ab) != {"A", "B"}:
            raise LoraConvertError(f"peft_dir: {mod} has only lora_{''.join(ab)}")
        a, b = ab["A"], ab["B"]
        r_m, scale = scales.get(mod, (r, None))
        if a.shape[0] != r_m or b.shape[1] != r_m:
            raise LoraConvertError(f"peft_dir: {mod}: lora_A {a.shape}, lora_B {b.shape}, but r = {r_m}")
        if a.shape[1] * b.shape[0] == 0:
            raise LoraConvertError(f"peft_dir: {mod}: empty adapter")
        parts = _weight_parts(model_arch, hf_cfg, name_map, mod + ".weight", b.shape[0])
        if not parts:
            raise LoraConvertError(f"{mod}.weight: the converter's name map has no GGUF name for it")
        per_part = _ranked_parts(a, b, [p.rows for p in parts], r, r_m, scale, gguf_alpha)
        for part, (a, b) in zip(parts, per_part):
            name = part.name
            if name == "token_embd.weight":
                raise LoraConvertError(f"{mod}: an embedding adapter is not supported")
            if name in out:
                raise LoraConvertError(f"{mod}.weight -> {name}: another module of the adapter maps to it too")
            if base is not None:
                if name not in base:
                    raise LoraConvertError(f"{mod}.weight -> {name}: not a tensor of {base_gguf}")
                _check_part(part, hf_w.get(_converter_key(hf_cfg, mod + ".weight")), _base_array(base[name], gguf), mod)
            out[name] = part.adapter(a, b)
    for mod in sorted(expert_pairs):
        ab = expert_pairs[mod]
        if set(ab) != {"A", "B"}:
            raise LoraConvertError(f"peft_dir: {mod} has only lora_{''.join(ab)}")
        param, n_exp = wrappers[mod]
        a, b = ab["A"], ab["B"]
        r_m, scale = scales.get(mod, (r, None))
        if a.shape[0] != r_m * n_exp or b.shape[1] != r_m * n_exp:
            raise LoraConvertError(f"peft_dir: {param}: lora_A {a.shape}, lora_B {b.shape}, but r = {r_m} and "
                                   f"{n_exp} experts")
        # PEFT's ParamWrapper (peft/tuners/lora/layer.py, get_delta_weight): expert e's update is
        # B.reshape(out, r, E)[:, :, e] @ A.reshape(E, r, in)[e]; llama's lora_a (E, r, in), lora_b (E, out, r)
        la = a.reshape(n_exp, r_m, a.shape[1])
        lb = b.reshape(b.shape[0], r_m, n_exp).transpose(2, 0, 1)
        names = _expert_parts(model_arch, param, b.shape[0])
        per_part = _ranked_parts(la, lb, [rows for _, rows in names], r, r_m, scale, gguf_alpha, experts=True)
        for (name, rows), (la_p, lb_p) in zip(names, per_part):
            if name in out:
                raise LoraConvertError(f"{param} -> {name}: another module of the adapter maps to it too")
            if base is not None:
                if name not in base:
                    raise LoraConvertError(f"{param} -> {name}: not a tensor of {base_gguf}")
                _check_experts(hf_dir, param, rows, _base_array(base[name], gguf), name)
            out[name] = (np.ascontiguousarray(la_p, dtype=np.float32), np.ascontiguousarray(lb_p, dtype=np.float32))
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


def _lora_config(cfg):
    """PEFT's LoraConfig of an adapter_config.json's CFG: what sets the adapted modules, their ranks and scales."""
    import peft
    keys = ("r", "lora_alpha", "target_modules", "target_parameters", "rank_pattern", "alpha_pattern",
            "use_rslora", "layers_to_transform", "layers_pattern", "exclude_modules")
    return peft.LoraConfig(**{k: cfg[k] for k in keys if cfg.get(k) is not None})


def _meta_peft(hf_dir, hf_cfg, lcfg):
    """PEFT's model of the LoraConfig LCFG on HF_DIR's model built on the meta device (PEFT's refusals raise
    ValueError)."""
    import peft
    return peft.get_peft_model(_meta_model(hf_dir, hf_cfg), lcfg)


def _peft_scales(pm):
    """{PEFT module of the adapter (its keys' prefix): (rank, scale)} as PEFT sets them (rank_pattern,
    alpha_pattern, use_rslora), read from the layers of PM (_meta_peft)."""
    out = {}
    for n, mod in pm.named_modules():
        if isinstance(getattr(mod, "r", None), dict) and "default" in mod.r:
            out[n[len(PEFT_PREFIX):]] = (int(mod.r["default"]), float(mod.scaling["default"]))
    return out


def _ranked_parts(a, b, part_rows, r, r_m, scale, gguf_alpha, experts=False):
    """Each part's (A, B) of one module's (A, B) of rank R_M whose parts take PART_ROWS of B (None: all):
    llama.cpp scales a tensor by the adapter's alpha over that tensor's rank, PEFT this module by SCALE (None:
    the adapter's own alpha / r, nothing to change). A module of rank n r over n parts whose B is
    block-diagonal by part (to-peft's join of parts trained apart) gives each part its own block back, rank r;
    any other keeps rank R_M in every part, and B takes the factor between the two scales (exact for a power
    of two: to-peft's rank 2r, alpha 2 alpha). EXPERTS: A (E, rank, in), B (E, out, rank), else A (rank, in),
    B (out, rank)."""
    take = (lambda x, rows: x if rows is None else x[:, rows]) if experts else \
        (lambda x, rows: x if rows is None else x[rows])
    rows_of = take if experts else (lambda x, rows: x)   # (a 2-D part's own adapter() takes its rows)
    if scale is None:
        return [(a, rows_of(b, rows)) for rows in part_rows]
    cols = [np.arange(r_m)] * len(part_rows)
    rank_t = r_m
    if r_m == r * len(part_rows) and len(part_rows) > 1:
        blocks = []
        for rows in part_rows:
            used = np.flatnonzero(np.any(take(b, rows) != 0, axis=tuple(range(b.ndim - 1))))
            blocks.append(None if used.size == 0 or used[-1] // r != used[0] // r else int(used[0] // r))
        if None not in blocks and len(set(blocks)) == len(blocks):
            cols = [np.arange(k * r, (k + 1) * r) for k in blocks]
            rank_t = r
    f = scale * rank_t / gguf_alpha
    f = 1.0 if abs(f - 1.0) < 1e-12 else f
    out = []
    for rows, c in zip(part_rows, cols):
        a_p = a[..., c, :] if experts else a[c]
        b_p = rows_of(b, rows)[..., c]
        out.append((a_p, b_p if f == 1.0 else b_p * np.float32(f)))
    return out


def _name_map(hf_dir):
    gguf, conversion = _converter()
    hf_cfg = _hf_config(hf_dir)
    archs = hf_cfg.get("architectures") or []
    if len(archs) != 1:
        raise LoraConvertError(f"hf_dir: config.json names architectures {archs}, expected one")
    try:
        model_arch = _nemotron_h_arch(conversion.get_model_class(archs[0]).model_arch, hf_cfg)
    except (NotImplementedError, KeyError) as e:
        raise LoraConvertError(f"hf_dir: architecture {archs[0]!r} is not one the converter knows") from e
    n_blocks = next((hf_cfg[k] for k in ("num_hidden_layers", "n_layer", "n_layers") if k in hf_cfg), None)
    if n_blocks is None and isinstance(hf_cfg.get("layers_block_type"), list):
        n_blocks = len(hf_cfg["layers_block_type"])     # Nemotron-H: one entry a layer, no count
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
    model_arch, name_map = _name_map(hf_dir)
    hf_cfg = _hf_config(hf_dir)
    hf_rows = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                if k.endswith(".weight") and len(shape) == 2:
                    hf_rows[k] = int(shape[0])
    inverse = {}
    for k, n_rows in hf_rows.items():
        try:
            parts = _weight_parts(model_arch, hf_cfg, name_map, k, n_rows)
        except LoraConvertError:
            continue            # a weight no adapter can be written for: an adapter on it finds no owner below
        for part in parts:
            inverse.setdefault(part.name, []).append((k, part))
    alpha, ad = read_gguf_adapter(adapter_gguf)
    ranks = {b.shape[-1] for _, b in ad.values()}
    if len(ranks) != 1:
        raise LoraConvertError(f"adapter: ranks {sorted(ranks)}; one rank for every weight is supported")
    r = ranks.pop()
    base = _base_tensors(base_gguf, gguf) if base_gguf else None
    # the experts' adapters (3-D): PEFT's target_parameters
    experts = {name: ad.pop(name) for name in list(ad) if ad[name][0].ndim == 3}
    by_param = {}               # experts' parameter -> [(rows, (lora_a, lora_b))], and its parts
    if experts:
        owners = {}
        for prm, n_out in _expert_params(hf_dir, hf_cfg).items():
            parts = _expert_parts(model_arch, prm, n_out)
            for name, rows in parts:
                owners[name] = (prm, rows, parts)
        for name, (la, lb) in experts.items():
            if name not in owners:
                raise LoraConvertError(f"{name}: no experts' parameter of {hf_dir} maps to it")
            prm, rows, parts = owners[name]
            if base is not None:
                t = base.get(name)
                if t is None:
                    raise LoraConvertError(f"{name} -> {prm}: not a tensor of {base_gguf}")
                _check_experts(hf_dir, prm, rows, _base_array(t, gguf), name)
            by_param.setdefault(prm, [parts, []])[1].append((rows, (la, lb)))
    if base is not None:
        hf_w = _hf_weights_by_key(hf_dir, hf_cfg, {_converter_key(hf_cfg, k) for k, _ in
                                                   (inverse[n][0] for n in ad if len(inverse.get(n, [])) == 1)})
    by_weight = {}
    for name in sorted(ad):
        hf = inverse.get(name, [])
        if len(hf) != 1:
            raise LoraConvertError(f"{name}: {'no' if not hf else len(hf)} weights of {hf_dir} map to it")
        key, part = hf[0]
        if base is not None:
            t = base.get(name)
            if t is None:
                raise LoraConvertError(f"{name} -> {key}: not a tensor of {base_gguf}")
            _check_part(part, hf_w.get(_converter_key(hf_cfg, key)), _base_array(t, gguf), key[:-len(".weight")])
        by_weight.setdefault(key, []).append((part, ad[name]))
    out, tensors = {}, {}
    lora_alpha = alpha if alpha > 0 else r
    rank_pattern, alpha_pattern = {}, {}
    modules = _module_names(hf_dir, hf_cfg)
    for key in sorted(by_weight):
        mod = modules.get(_converter_key(hf_cfg, key), key[:-len(".weight")])
        a, b = _join_parts(mod, hf_rows[key], r, by_weight[key],
                           [p for p in _weight_parts(model_arch, hf_cfg, name_map, key, hf_rows[key])])
        if a.shape[0] != r:
            # a split weight whose parts have their own A: one adapter of rank n r, alpha n alpha (the same scale)
            rank_pattern[mod] = a.shape[0]
            alpha_pattern[mod] = lora_alpha * a.shape[0] / r
        out[mod] = (a, b)
        tensors[PEFT_PREFIX + mod + ".lora_A.weight"] = np.ascontiguousarray(a)
        tensors[PEFT_PREFIX + mod + ".lora_B.weight"] = np.ascontiguousarray(b)
    why = _peft_refuses(hf_cfg, sorted(out))
    if why:
        raise LoraConvertError(f"PEFT would not load this adapter: {why}; train without them (llama-finetune "
                               "--lora-targets)")
    target_parameters = sorted(by_param)
    joined = {}
    if experts:
        n_rows = _expert_params(hf_dir, hf_cfg)
        joined = {prm: _join_experts(prm, n_rows[prm], r, parts, got) for prm, (parts, got) in by_param.items()}
        for prm, (a, b, rank) in joined.items():
            if rank != r:
                rank_pattern[prm] = rank
                alpha_pattern[prm] = lora_alpha * rank / r
            out[prm] = (a, b)
    # (rank / alpha patterns are regular expressions PEFT matches at the end of a module's name)
    modules_2d = sorted(m for m in out if m not in target_parameters)
    cfg = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=modules_2d,
                          target_parameters=target_parameters or None, lora_dropout=0.0,
                          bias="none", base_model_name_or_path=str(hf_dir),
                          rank_pattern={re.escape(m): n for m, n in rank_pattern.items()},
                          alpha_pattern={re.escape(m): v for m, v in alpha_pattern.items()})
    # PEFT's own refusals (out_proj and conv1d of the models it calls Mamba-based: Mamba, Mamba-2, Falcon-H1,
    # Nemotron-H), from PEFT itself on the model built on the meta device, before anything is written
    try:
        pm = _meta_peft(hf_dir, hf_cfg, cfg)
    except ValueError as e:
        raise LoraConvertError(f"PEFT would not load this adapter: {e} (llama-finetune --lora-targets leaves "
                               "a weight out)") from None
    # PEFT's keys of a ParamWrapper are those of its (nested) module: ask PEFT where it puts each
    wrappers = {prm: mod for mod, (prm, _) in _param_wrappers(pm).items()} if joined else {}
    for prm, (a, b, _) in joined.items():
        tensors[PEFT_PREFIX + wrappers[prm] + ".lora_A.weight"] = np.ascontiguousarray(a)
        tensors[PEFT_PREFIX + wrappers[prm] + ".lora_B.weight"] = np.ascontiguousarray(b)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return out


# ---------------------------------------------------------------- the experts' 3-D parameters
# transformers 5 keeps a mixture's experts as 3-D parameters (E, out, in) of one module (Nemotron-H's
# experts.up_proj / down_proj), PEFT adapts them through target_parameters (lora.ParamWrapper: lora_A (E r, in),
# lora_B (out, r E), expert e's update B.reshape(out, r, E)[:, :, e] @ A.reshape(E, r, in)[e]), the checkpoint
# holds one tensor per expert (experts.<e>.up_proj.weight), which the converter stacks into blk.N.ffn_up_exps.
# llama.cpp's adapter of such a tensor is lora_a [in, r, E], lora_b [r, out, E] (build_lora_mm_id).
_EXPERT_TENSORS = {"up_proj": ["FFN_UP_EXP"], "down_proj": ["FFN_DOWN_EXP"], "gate_proj": ["FFN_GATE_EXP"],
                   "gate_up_proj": ["FFN_GATE_EXP", "FFN_UP_EXP"]}


def _expert_parts(model_arch, param, n_rows):
    """The GGUF tensors of the experts' parameter PARAM (model.layers.N.<...>.experts.<proj>, N_ROWS output rows
    per expert), each with its rows of PARAM (None: all): a fused gate_up_proj (transformers 5's experts of
    LFM2-MoE, Qwen3.5-MoE, Granite, Jamba, Qwen3-Next, Kimi-Linear: the gate's rows then the up's, as their
    forward chunks it) is ffn_gate_exps + ffn_up_exps, as the converters split it."""
    gguf, _ = _converter()
    m = re.fullmatch(r"(?:.*\.)?layers\.(\d+)\..*\.experts\.(\w+)", param)
    if m is None or m[2] not in _EXPERT_TENSORS:
        raise LoraConvertError(f"{param}: not an experts' parameter lora_peft.py maps")
    kinds = _EXPERT_TENSORS[m[2]]
    if n_rows % len(kinds):
        raise LoraConvertError(f"{param}: {n_rows} rows do not split into {len(kinds)}")
    out = []
    for i, kind in enumerate(kinds):
        tensor = getattr(gguf.MODEL_TENSOR, kind)
        if tensor not in gguf.MODEL_TENSORS.get(model_arch, ()):
            raise LoraConvertError(f"{param}: the converter's architecture has no {gguf.TENSOR_NAMES[tensor]}")
        h = n_rows // len(kinds)
        out.append((gguf.TENSOR_NAMES[tensor].format(bid=int(m[1])) + ".weight",
                    None if len(kinds) == 1 else np.arange(i * h, (i + 1) * h)))
    return out


def _join_experts(param, n_rows, r, parts, got):
    """PEFT's (lora_A (E rank, in), lora_B (out, rank E), rank) of PARAM from its parts' llama adapters GOT
    [(rows, (lora_a (E, r, in), lora_b (E, rows, r)))]: rank r when the parts share lora_a (as to-gguf writes
    them), else n r (each expert's lora_a the parts' stacked, its lora_b block-diagonal: the same product)."""
    if len(got) != len(parts):
        have = {tuple(r_) if r_ is not None else None for r_, _ in got}
        missing = [n for n, rows in parts if (tuple(rows) if rows is not None else None) not in have]
        raise LoraConvertError(f"{param}: the adapter has no {', '.join(missing)}: PEFT adapts the parameter whole")
    las = [np.asarray(la, np.float64) for _, (la, _) in got]
    shared = all(np.array_equal(las[0], x) for x in las[1:])
    n = 1 if shared else len(got)
    n_exp, _, n_in = las[0].shape
    la = las[0] if shared else np.concatenate(las, axis=1)            # (E, n r, in)
    lb = np.zeros((n_exp, n_rows, n * r), dtype=np.float64)
    for i, (rows, (_, lb_p)) in enumerate(got):
        k = 0 if shared else i
        lb[:, slice(None) if rows is None else rows, k * r:(k + 1) * r] = lb_p
    a = la.reshape(n_exp * n * r, n_in)
    b = lb.transpose(1, 2, 0).reshape(n_rows, n * r * n_exp)
    return a.astype(np.float32), b.astype(np.float32), n * r


def _meta_model(hf_dir, hf_cfg):
    import torch
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(str(hf_dir))
    with torch.device("meta"):
        return getattr(transformers, hf_cfg["architectures"][0])(cfg)


def _expert_params(hf_dir, hf_cfg):
    """{the model's experts' 3-D parameter: its output rows per expert}."""
    return {n: int(w.shape[1]) for n, w in _meta_model(hf_dir, hf_cfg).named_parameters()
            if w.dim() == 3 and ".experts." in n}


def _param_wrappers(pm):
    """{PEFT module (the key's prefix) of a ParamWrapper: (the parameter's full name, experts)} in PM
    (_meta_peft), as PEFT itself nests them (several parameters of one module: ParamWrapper within
    ParamWrapper, the inner ones named <module>.base_layer...)."""
    out = {}
    for n, mod in pm.named_modules():
        if type(mod).__name__ == "ParamWrapper":
            prefix = n[len(PEFT_PREFIX):]
            unwrapped = re.sub(r"(\.base_layer)+$", "", prefix)
            out[prefix] = (f"{unwrapped}.{mod.parameter_name}", int(mod.num_experts))
            if not mod._did_swap_in_out_features:
                raise LoraConvertError(f"{unwrapped}.{mod.parameter_name}: stored (experts, in, out), not the "
                                       "(experts, out, in) lora_peft.py maps")
    return out


@functools.lru_cache(maxsize=2)
def _hf_params(hf_dir):
    """The experts' 3-D parameters of HF_DIR's model as transformers loads them (its conversion mapping stacks
    and fuses the checkpoint's per-expert tensors), float32 NumPy (for --base)."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    return {n: w.detach().numpy().copy() for n, w in model.named_parameters() if w.dim() == 3 and ".experts." in n}


def _check_experts(hf_dir, param, rows, g, name):
    """--base: the GGUF tensor G (E, rows, in) is PARAM's ROWS (None: all) as the model loads it."""
    w = _hf_params(str(hf_dir)).get(param)
    w = None if w is None else (w if rows is None else w[:, rows, :])
    if w is None or w.shape != g.shape or not np.array_equal(w, g):
        raise LoraConvertError(f"{param} -> {name}: the converter does not write these experts as lora_peft.py "
                               f"expects (HF {None if w is None else w.shape}, GGUF {g.shape}), so their adapter "
                               "cannot be mapped")


def _peft_refuses(hf_cfg, targets):
    """Why PEFT would not load an adapter on TARGETS as written, or None. PEFT's own config conversion for
    transformers 5 (peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers, run when
    an adapter is loaded) takes, for model types whose experts transformers 5 fuses (Qwen3-Next among them),
    every *.gate_proj / *.up_proj / *.down_proj for the experts' fused parameters: a dense MLP's or a shared
    expert's adapter is then dropped from target_modules without a word (or, gate without up, refused)."""
    import types
    import peft
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:             # a PEFT without that conversion loads target_modules as they are
        return None
    cfg = peft.LoraConfig(r=1, lora_alpha=1, target_modules=list(targets))
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type=hf_cfg.get("model_type")))
    why = (f"on a {hf_cfg.get('model_type')!r} model PEFT {peft.__version__} takes *.gate_proj / *.up_proj / "
           "*.down_proj for fused experts' parameters (transformers 5's MoE layout)")
    try:
        convert_peft_config_for_transformers(cfg, model, None)
    except ValueError as e:
        return f"{why}: {e}"
    except (AttributeError, TypeError):
        return None
    dropped = sorted(set(targets) - set(cfg.target_modules or ()))
    return f"{why} and would drop the adapters of {', '.join(dropped)}" if dropped else None


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



# ---------------------------------------------------------------- what the converter makes of a weight
# A weight W (PyTorch's (n_out, n_in)) becomes one or more GGUF tensors, each W' = row_scale * W[rows] *
# col_scale: rows picks (splits) or reorders W's rows, the scales are the converter's multipliers folded into
# the weight. B A x has the same form, so the part's adapter is B' = row_scale * B[rows], A' = A * col_scale:
# the same function of x, in llama.cpp as in PEFT (the way back divides). Most weights are one part, as they
# are; the families below are the exceptions, read from their converter classes (conversion/*.py of the sdist).

class _Part:
    """One GGUF tensor of an HF weight: name, rows (None: all, in order; else an index array), cols (None, or
    a permutation of the columns: Qwen3.5's out_proj), row_scale (None, or a factor per part row), col_scale
    (None or a scalar)."""

    def __init__(self, name, rows=None, row_scale=None, col_scale=None, cols=None):
        self.name, self.rows, self.row_scale, self.col_scale = name, rows, row_scale, col_scale
        self.cols = cols

    def weight(self, w):
        """W' of the HF weight W, as the converter writes it (in float64: the check allows its rounding)."""
        w = np.asarray(w, dtype=np.float64)
        w = w if self.rows is None else w[self.rows]
        w = w if self.cols is None else w[:, self.cols]
        if self.row_scale is not None:
            w = w * np.reshape(self.row_scale, (-1, 1))
        return w if self.col_scale is None else w * self.col_scale

    @property
    def scaled(self):
        return self.row_scale is not None or self.col_scale is not None

    def adapter(self, a, b):
        """(A', B') of PEFT's (A, B)."""
        b = b if self.rows is None else b[self.rows]
        if self.row_scale is not None:
            b = b * np.reshape(self.row_scale, (-1, 1))
        if self.col_scale is not None:
            a = a * self.col_scale
        if self.cols is not None:
            a = a[:, self.cols]
        return np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)

    def unscaled(self, a, b):
        """(A, B[rows]) of the part's (A', B')."""
        if self.row_scale is not None:
            b = b / np.reshape(self.row_scale, (-1, 1))
        if self.col_scale is not None:
            a = a / self.col_scale
        if self.cols is not None:
            full = np.empty_like(a)
            full[:, self.cols] = a
            a = full
        return a, b


def _converter_key(hf_cfg, key):
    """KEY (a checkpoint's tensor name, or a module's weight as PEFT names it) as the converter's name map
    reads it: its class's own renames (filter_tensors; Nemotron-H's checkpoints say backbone.layers.*, its
    modules model.layers.*); None if the converter drops it."""
    _, conversion = _converter()
    for pattern, ckpt in _MODULE_RENAMES.get(hf_cfg.get("model_type"), ()):
        key = re.sub(pattern, ckpt, key)
    cls = conversion.get_model_class(hf_cfg["architectures"][0])
    if hasattr(cls, "_original_block_count"):
        # Qwen3.5's filter_tensors numbers MTP layers after the model's: its index_tensors sets the count so
        hp = {**hf_cfg, **hf_cfg.get("text_config", {})}
        cls._original_block_count = next((hp[k] for k in ("n_layers", "num_hidden_layers", "n_layer", "num_layers")
                                          if k in hp), None)
    item = cls.filter_tensors((key, None))
    return None if item is None else item[0]


# PEFT names modules as the transformers model has them; the checkpoint (which the converter reads) names some
# weights otherwise (transformers 5's conversion mapping renames them on load and back on save): (module
# pattern, checkpoint name), applied by _converter_key (a checkpoint's own keys do not match them). Kimi-Linear
# (conversion_mapping.py, "kimi_linear"): the forget gate's projections sit in self_attn, every MLP (dense,
# shared experts) under block_sparse_moe.
_MODULE_RENAMES = {"kimi_linear": [(r"\.self_attn\.forget_gate\.(f_[ab]_proj)\.weight$", r".self_attn.\1.weight"),
                                   (r"\.mlp\.", ".block_sparse_moe.")]}


def _hf_weights_by_key(hf_dir, hf_cfg, keys):
    """The tensors of HF_DIR's safetensors files whose converter key is in KEYS, by converter key: (float32
    array, the rounding unit of the checkpoint's dtype: the converter multiplies in that dtype)."""
    import torch
    from safetensors import safe_open
    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                ck = _converter_key(hf_cfg, k)
                if ck in keys:
                    t = st.get_tensor(k)
                    eps = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
                    out[ck] = (t.float().numpy(), eps)
    return out


def _module_names(hf_dir, hf_cfg):
    """{converter key of a module's weight: the module's name in the transformers model} (the model built
    from the config on the meta device: PEFT names modules so, which a checkpoint's keys need not be)."""
    import torch
    import transformers
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(hf_dir))
        with torch.device("meta"):
            model = getattr(transformers, hf_cfg["architectures"][0])(cfg)
    except (AttributeError, TypeError, ValueError):
        return {}
    return {_converter_key(hf_cfg, n + ".weight"): n for n, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor)}


def _weight_parts(model_arch, hf_cfg, name_map, key, n_rows):
    """The GGUF tensors (_Part) the converter makes of HF_DIR's weight KEY (n_rows rows); [] if none."""
    key = _converter_key(hf_cfg, key)
    if key is None:
        return []
    name = name_map.get_name(key, try_suffixes=(".weight",))
    family = _family_parts().get(model_arch)
    if family is not None:
        parts = family(hf_cfg, key, name, n_rows, name_map)
        if parts is not None:
            return parts
    return [] if name is None else [_Part(name)]


def _check_part(part, w_eps, g, mod):
    """--base: the GGUF tensor G is what the converter makes of the HF weight (W_EPS: the weight and its dtype's
    rounding unit) through PART, or the adapter cannot be mapped: exact, or where the converter multiplied
    (in the checkpoint's dtype, twice at most) within 4 rounding units."""
    w, eps = (None, 0.0) if w_eps is None else w_eps
    want = None if w is None else part.weight(w)
    ok = want is not None and want.shape == g.shape
    if ok and part.scaled:
        ok = np.allclose(g, want, rtol=4 * eps, atol=0.0)
    elif ok:
        ok = np.array_equal(g, want)
    if not ok:
        raise LoraConvertError(f"{mod}.weight -> {part.name}: the converter does not write this weight as lora_peft.py "
                               f"expects (HF {None if w is None else w.shape}, GGUF {g.shape}), so its adapter "
                               "cannot be mapped")


def _join_parts(mod, n_rows, r, got, parts):
    """PEFT's (A, B) of MOD from the GGUF adapters of its parts: GOT [(part, (A', B'))], PARTS all of them. A
    split weight needs every part. Parts with the same A (as to-gguf writes them) give PEFT's adapter of rank
    r back; parts each with its own A (llama-finetune trains them so) give the same product as one adapter of
    rank n r: A the parts' A stacked, B block-diagonal (that rank, and alpha n alpha for the same scale)."""
    if len(got) != len(parts):
        missing = sorted({p.name for p in parts} - {p.name for p, _ in got})
        raise LoraConvertError(f"{mod}: the adapter has {', '.join(p.name for p, _ in got)} but not "
                               f"{', '.join(missing)}: "
                               "PEFT adapts the weight whole")
    rows, a_parts, b_parts = [], [], []
    seen = np.zeros(n_rows, dtype=bool)
    for part, (a_p, b_p) in got:
        a_p, b_p = part.unscaled(np.asarray(a_p, np.float64), np.asarray(b_p, np.float64))
        idx = np.arange(n_rows) if part.rows is None else np.arange(n_rows)[part.rows]
        if seen[idx].any():
            raise LoraConvertError(f"{mod}: its parts overlap")
        seen[idx] = True
        rows.append(idx)
        a_parts.append(a_p)
        b_parts.append(b_p)
    if not seen.all():
        raise LoraConvertError(f"{mod}: the parts cover {int(seen.sum())} of its {n_rows} rows")
    shared = all(np.array_equal(a_parts[0], a_p) for a_p in a_parts[1:])
    n = 1 if shared else len(got)
    a = a_parts[0] if shared else np.concatenate(a_parts, axis=0)
    b = np.zeros((n_rows, n * r), dtype=np.float64)
    for i, (idx, b_p) in enumerate(zip(rows, b_parts)):
        j = 0 if shared else i
        b[idx, j * r:(j + 1) * r] = b_p
    return a.astype(np.float32), b.astype(np.float32)


def _rope_rows(hf_cfg, key, n_rows):
    """The row order of q_proj / k_proj after LlamaModel.permute (the converter's undo of HF's rotary layout:
    GraniteHybridModel and NemotronHModel set undo_permute), as an index array; None for other weights."""
    import torch
    _, conversion = _converter()
    from conversion.llama import LlamaModel
    n_head = hf_cfg["num_attention_heads"]
    if key.endswith("q_proj.weight"):
        n_kv = n_head
    elif key.endswith("k_proj.weight"):
        n_kv = hf_cfg.get("num_key_value_heads") or n_head
    else:
        return None
    return LlamaModel.permute(torch.arange(n_rows)[:, None], n_head, n_kv)[:, 0].numpy()


def _granite_hybrid_parts(hf_cfg, key, name, n_rows, name_map):
    """Granite-4.0-H (GraniteHybridModel, GraniteMoeModel.modify_tensors): q / k rows permuted; the shared
    MLP's fused input_linear split into gate (first half of the rows) and up; its output_linear is ffn_down
    (ffn_*_shexp with experts). Granite's multipliers are hyperparameters, not folded."""
    m = re.match(r"model\.layers\.(\d+)\.shared_mlp\.(input|output)_linear\.weight$", key)
    if m:
        bid, sfx = m[1], "_shexp" if hf_cfg.get("num_local_experts") else ""
        if m[2] == "output":
            return [_Part(f"blk.{bid}.ffn_down{sfx}.weight")]
        ffn = hf_cfg["shared_intermediate_size"]
        return [_Part(f"blk.{bid}.ffn_gate{sfx}.weight", rows=np.arange(ffn)),
                _Part(f"blk.{bid}.ffn_up{sfx}.weight", rows=np.arange(ffn, 2 * ffn))]
    rows = _rope_rows(hf_cfg, key, n_rows)
    return None if rows is None or name is None else [_Part(name, rows=rows)]


def _nemotron_h_parts(hf_cfg, key, name, n_rows, name_map):
    """Nemotron-H (NemotronHModel, a GraniteHybridModel): q / k rows permuted, everything else as it is."""
    rows = _rope_rows(hf_cfg, key, n_rows)
    return None if rows is None or name is None else [_Part(name, rows=rows)]


def _nemotron_h_arch(model_arch, hf_cfg):
    """NemotronHModel.__init__ picks NEMOTRON_H_MOE when a layer of the pattern is a mixture of experts."""
    gguf, _ = _converter()
    pattern = hf_cfg.get("hybrid_override_pattern") or hf_cfg.get("layers_block_type") or []
    if model_arch == gguf.MODEL_ARCH.NEMOTRON_H and any(t in ("E", "moe") for t in pattern):
        return gguf.MODEL_ARCH.NEMOTRON_H_MOE
    return model_arch


def _falcon_h1_parts(hf_cfg, key, name, n_rows, name_map):
    """Falcon-H1 (FalconH1Model.modify_tensors) folds its multipliers into the weights; transformers applies
    attention_in_multiplier and ssm_in_multiplier to a projection's input (A's columns here), the others to its
    output (B's rows): key_multiplier on k_proj, attention_out on o_proj, ssm_out on the mixer's out_proj,
    mlp_multipliers on gate_proj / down_proj, ssm_multipliers (the mup vector) on in_proj's z, x, B, C, dt rows."""
    if name is None:
        return None
    def mult(k, default=1.0):
        v = hf_cfg.get(k)
        return default if v is None else v
    attn_in = mult("attention_in_multiplier")
    mlp = mult("mlp_multipliers", [1.0, 1.0])
    if key.endswith("self_attn.k_proj.weight"):
        return [_Part(name, row_scale=np.full(n_rows, mult("key_multiplier")), col_scale=attn_in)]
    if key.endswith(("self_attn.q_proj.weight", "self_attn.v_proj.weight")):
        return [_Part(name, col_scale=attn_in)]
    for suffix, scale in (("self_attn.o_proj.weight", mult("attention_out_multiplier")),
                          ("mamba.out_proj.weight", mult("ssm_out_multiplier")),
                          ("feed_forward.gate_proj.weight", mlp[0]), ("feed_forward.down_proj.weight", mlp[1])):
        if key.endswith(suffix):
            return [_Part(name, row_scale=np.full(n_rows, scale))]
    if key.endswith("mamba.in_proj.weight"):
        d_ssm = hf_cfg["mamba_d_ssm"]
        gs = hf_cfg["mamba_n_groups"] * hf_cfg["mamba_d_state"]
        zxbcdt = mult("ssm_multipliers", [1.0] * 5)
        sizes = [d_ssm, d_ssm, gs, gs, n_rows - 2 * d_ssm - 2 * gs]
        if sizes[-1] < 0:
            raise LoraConvertError(f"{key}: {n_rows} rows, fewer than z, x, B, C take ({2 * d_ssm + 2 * gs})")
        return [_Part(name, row_scale=np.repeat(np.asarray(zxbcdt, np.float64), sizes),
                      col_scale=mult("ssm_in_multiplier"))]
    return None


def _layer(key):
    m = re.search(r"\.layers\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def _qwen3next_parts(hf_cfg, key, name, n_rows, name_map):
    """Qwen3-Next: linear_attn.in_proj_qkvz holds, per key head, [q (d_k), k (d_k), v (n_v / n_k d_v),
    z (n_v / n_k d_v)] rows; the converter (Qwen3NextModel.modify_tensors) writes attn_qkv = every head's q,
    then every head's k, then v, and attn_gate = every head's z. in_proj_ba, out_proj and the rest are
    written as they are."""
    if not key.endswith(".linear_attn.in_proj_qkvz.weight"):
        return None
    gguf, _ = _converter()
    cfg = hf_cfg.get("text_config", hf_cfg)
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    d_k, d_v = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    sizes = [d_k, d_k, n_v // n_k * d_v, n_v // n_k * d_v]
    if n_k * sum(sizes) != n_rows:
        raise LoraConvertError(f"{key}: {n_rows} rows, not the {n_k} x {sum(sizes)} of the config")
    q, k, v, z = np.split(np.arange(n_rows).reshape(n_k, sum(sizes)), np.cumsum(sizes)[:-1], axis=1)
    bid = _layer(key)
    fmt = lambda t: gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight"
    return [_Part(fmt(gguf.MODEL_TENSOR.ATTN_QKV), rows=np.concatenate([q.ravel(), k.ravel(), v.ravel()])),
            _Part(fmt(gguf.MODEL_TENSOR.ATTN_GATE), rows=z.ravel())]


def _v_head_order(cfg, head_dim):
    """Qwen3.5's V heads (n_v > n_k): the checkpoint groups them by key head (g0 v0, g0 v1, ..., g1 v0, ...),
    the converter (_LinearAttentionVReorderBase._reorder_v_heads) tiles them (g0 v0, g1 v0, ..., g0 v1, ...):
    the index of each GGUF row (of head_dim rows per head) among the checkpoint's."""
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    return np.arange(n_v * head_dim).reshape(n_k, n_v // n_k, head_dim).transpose(1, 0, 2).ravel()


def _qwen35_parts(hf_cfg, key, name, n_rows, name_map):
    """Qwen3.5 (dense, MoE): the Gated DeltaNet's V heads reordered (_v_head_order) in the rows of
    in_proj_qkv (its v rows only), in_proj_z, in_proj_b, in_proj_a and in the columns of out_proj; names as
    the name map gives them. Nothing reordered when n_v = n_k."""
    cfg = hf_cfg.get("text_config", hf_cfg)
    m = re.search(r"\.linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight$", key)
    n_k, n_v = cfg.get("linear_num_key_heads", 0), cfg.get("linear_num_value_heads", 0)
    if m is None or n_k == n_v or name is None:
        return None
    proj, d_v = m.group(1), cfg["linear_value_head_dim"]
    if proj == "in_proj_qkv":
        n_qk = 2 * n_k * cfg["linear_key_head_dim"]
        return [_Part(name, rows=np.concatenate([np.arange(n_qk), n_qk + _v_head_order(cfg, d_v)]))]
    if proj == "in_proj_z":
        return [_Part(name, rows=_v_head_order(cfg, d_v))]
    if proj == "out_proj":
        return [_Part(name, cols=_v_head_order(cfg, d_v))]
    return [_Part(name, rows=_v_head_order(cfg, 1))]         # in_proj_b, in_proj_a: a row per V head


def _kimi_linear_parts(hf_cfg, key, name, n_rows, name_map):
    """Kimi-Linear: the MLA's kv_b_proj is split per head into k_b (transposed) and v_b, 3-D tensors the graph
    multiplies head by head, not through build_lora_mm: refused. A dense layer's MLP, saved under
    block_sparse_moe, is the GGUF's ffn_* (KimiLinearModel.modify_tensors renames it). The rest as it is."""
    if key.endswith(".self_attn.kv_b_proj.weight"):
        raise LoraConvertError(f"{key}: the converter splits kv_b_proj per head into k_b (transposed) and v_b, "
                               "which llama.cpp multiplies head by head: an adapter there is not supported")
    if name is None and re.search(r"\.block_sparse_moe\.(gate|up|down)_proj\.weight$", key):
        name = name_map.get_name(key.replace(".block_sparse_moe.", ".mlp."), try_suffixes=(".weight",))
        return None if name is None else [_Part(name)]
    return None


def _family_parts():
    """{model arch: its family's function (hf_cfg, converter key, GGUF name, n_rows, name map) -> [_Part] or
    None (as the name map says)}."""
    gguf, _ = _converter()
    A = gguf.MODEL_ARCH
    return {A.GRANITE_HYBRID: _granite_hybrid_parts, A.NEMOTRON_H: _nemotron_h_parts,
            A.NEMOTRON_H_MOE: _nemotron_h_parts, A.FALCON_H1: _falcon_h1_parts, A.QWEN3NEXT: _qwen3next_parts,
            A.QWEN35: _qwen35_parts, A.QWEN35MOE: _qwen35_parts, A.KIMI_LINEAR: _kimi_linear_parts}


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
