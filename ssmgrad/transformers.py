"""Run Hugging Face transformers' Mamba-family, delta-rule and conv-family models on ssmgrad's CPU kernels.

    import ssmgrad.transformers
    ssmgrad.transformers.patch()        # every covered family (or patch(["mamba2", "lfm2"])), from now on
    model(**batch).loss.backward()      # the scan / delta rule and the conv run on ssmgrad (forward and backward)

``unpatch()`` puts the stock functions back (the very same objects), ``patched()`` is a context manager
doing both, ``is_patched()`` / ``patched_families()`` tell. Each takes the families to act on (None: all).
transformers is imported by ``patch()``, never by ``import ssmgrad``. docs/transformers.md is the guide.

What is replaced. In transformers 5.24 each Mamba-family modeling file defines its CPU code as module
functions, wrapped by ``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`` (which picks
mamba_ssm / causal_conv1d when they import, else the pure-torch body), and the mixer's ``forward``
looks them up as module globals at call time. ``patch()`` rebinds four globals per modeling file:

    Mamba-1 style (mamba, falcon_mamba, jamba, zamba):
        mamba_selective_scan          full sequence: the token loop, from a zero state (as stock)
        mamba_selective_state_update  one token, updating the cached state in place
    Mamba-2 style (mamba2, bamba, falcon_h1, granitemoehybrid, nemotron_h, zamba2):
        mamba2_chunk_scan             full sequence: the chunked SSD form, from ``initial_states``
        mamba2_selective_state_update one token, updating the cached state in place
    Gated DeltaNet (qwen3_next, qwen3_5, qwen3_5_moe, qwen4_exp, olmo_hybrid, lara_mini):
        torch_chunk_gated_delta_rule      full sequence (and a multi-token continuation from a cached state)
        torch_recurrent_gated_delta_rule  one token from the cached state
    Kimi delta attention, the delta rule with a gate per key channel (kimi_linear, bailing_hybrid, glm5_next):
        chunk_kimi_delta_attention        as torch_chunk_gated_delta_rule
        recurrent_kimi_delta_attention    as torch_recurrent_gated_delta_rule
    all of the above, and alone in lfm2, lfm2_moe, lfm3, inkling, inkling2, inkling2_loop (a short-conv
    block after it, which stays stock):
        causal_conv1d_fn              depthwise causal conv (+ bias, activation)
        causal_conv1d_update          one token, rolling the cached conv state in place

The 25 files define these functions identically (the delta-rule files in two versions, GDN and KDA, each
calling its own file's ``l2norm``, which the replacements call too); the families differ only in their mixers' forward
(falcon_mamba and jamba normalise B, C and dt before the call, zamba calls the Mamba-1 functions once
per Mamba head, falcon_h1 may pass the z gate to the one-token update), which stay stock. The fused
training entry points (``mamba_inner_fn``, ``mamba2_split_conv1d_scan_combined``) return None on the
CPU while patched (as their stock torch bodies do; the mixer then takes the path above) without the
stock wrapper's log that they are "falling back to its reference PyTorch implementation ... much
slower"; ``patch()`` logs its own line at INFO instead.

torch.compile. While dynamo traces, the replacements call ssmgrad.torch's custom operators (never the
NumPy entry points) and change no Python state: ``call_counts`` / ``fallback_counts`` are not updated
inside compiled code, no cache or log is touched, so that dynamo has no changing Python value to guard
on and compiled models do not recompile.

Hub kernels. The object patch() replaces is whatever the decorator produced (it already chose
mamba_ssm / causal_conv1d over the torch body at import, and with the ``kernels`` package ``kernelize``
swaps implementations inside that same object, for CUDA devices). Each replacement keeps it and hands it
every call it does not take: tensors on another device go to it unchanged, so GPU kernels keep working.
On the CPU, where those packages have no kernels (mamba_ssm's are Triton/CUDA), ssmgrad takes the call.

The delta rule (``_delta_rule``) runs in ``ssmgrad.torch.gated_delta_net`` (ggml's GATED_DELTA_NET): q and
k L2-normalised in torch first when ``use_qk_l2norm_in_kernel`` (with the file's ``l2norm``), key heads
shared by value heads interleaved as transformers' ``repeat_interleave`` (the kernel's
``head_bcast="interleaved"``: no copy), transformers' state ``(batch, H_v, d_k, d_v)`` handed over and
back as a transposed view of ggml's; the scale 1/sqrt(d_k) is the kernel's. Key and value head dims
that differ (OLMo-hybrid's default) are zero-padded to ggml's square state. The output comes back in the
query's dtype, the state in float32 (float64 for float64 inputs), as stock.

In each Mamba replacement the softplus of ``dt + dt_bias`` (threshold 20), the decay, the state recurrence
and ``y = C . H`` run in ``ssmgrad.torch.ssm_scan`` (a scan of ``n_t = 1`` from the cached state for
the one-token updates), the conv in ``ssmgrad.torch.ssm_conv``; the D skip, the z gate, the conv bias
and activation are torch around them. bfloat16 / float16 inputs are cast to float32 around the kernels
(the stock Mamba-2 path computes in float32 too); float64 stays float64.

Two cases are decided in torch, not in Python, so that they run alike in eager mode and under
torch.compile (no branch on the data):
    - a ``dt_limit`` (``time_step_limit``) that can clamp (nemotron_h and zamba2 pass
      ``(time_step_min, inf)``): the kernel gets ``dt`` where ``clamp(softplus(dt), *dt_limit)`` keeps
      the value, and where it clamps the input whose softplus is the limit (``log(expm1(v))``, or v
      above 20), a constant: the stock values within rounding and the stock gradient (torch.clamp's,
      which passes on the edges and is zero beyond them);
    - a one-token Mamba-2 update whose ``dt`` / ``dt_bias`` / ``A`` are expanded per head (as the mixers
      pass them: seen from the strides) runs the scan's Mamba-2 form; otherwise its Mamba-1 form, each of
      the n_head * head_dim channels a head of its own (head_dim 1) with its own dt and decays, B and C by
      group. (In eager mode values that are constant over each head without being expanded also take the
      cheaper Mamba-2 form; both forms give the stock values within rounding.)

What falls back to the stock function (the object patch() replaced: hub kernel, mamba_ssm or the
torch body), counted in ``fallback_counts`` and logged once per reason; none of these depends on the
data, so each falls back alike in eager mode and under torch.compile:
    - ``seq_idx`` / ``cu_seqlens`` (packed sequences; for the delta rule also ``cu_seq_lens_q``)
    - tensors not on the CPU
    - a ``scale`` passed to a delta-rule function (flash-linear-attention's argument, which the stock
      torch body ignores; the 5.24 mixers never pass it)
    - ``dt_softplus`` / ``delta_softplus`` False (the kernel always applies softplus), a ``z`` passed to
      ``mamba2_chunk_scan`` (the torch body ignores it, mamba_ssm applies it), ``dt_limit=None`` (the
      stock torch body cannot take it either) or an upper limit <= 0 (no softplus value), and shapes
      other than the ones the mixers pass.
``call_counts`` counts the calls that did run on ssmgrad, per function name.
"""

import contextlib
import functools
import importlib
import logging
import math
import threading
from collections import Counter

import numpy as np
import torch
import torch.nn.functional as F

import ssmgrad
import ssmgrad.torch as st

__all__ = ["patch", "unpatch", "patched", "is_patched", "patched_families", "call_counts", "fallback_counts",
           "FAMILIES"]

logger = logging.getLogger(__name__)

TESTED_TRANSFORMERS = "5.24"   # the versions the test extra pins; other versions are checked by name only

MAMBA1_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba_selective_scan", "mamba_selective_state_update")
MAMBA2_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_chunk_scan", "mamba2_selective_state_update")
CONV_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update")
GDN_FUNCTIONS = CONV_FUNCTIONS + ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
KDA_FUNCTIONS = CONV_FUNCTIONS + ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")

# family (transformers.models.<family>.modeling_<family>) -> the module globals replaced in it
FAMILIES = {
    # Mamba-family models: the scan and the conv
    "mamba": MAMBA1_FUNCTIONS,
    "falcon_mamba": MAMBA1_FUNCTIONS,
    "jamba": MAMBA1_FUNCTIONS,
    "zamba": MAMBA1_FUNCTIONS,
    "mamba2": MAMBA2_FUNCTIONS,
    "bamba": MAMBA2_FUNCTIONS,
    "falcon_h1": MAMBA2_FUNCTIONS,
    "granitemoehybrid": MAMBA2_FUNCTIONS,
    "nemotron_h": MAMBA2_FUNCTIONS,
    "zamba2": MAMBA2_FUNCTIONS,
    # the conv ahead of a short-conv block (LFM, Inkling: it stays stock) or a delta-rule mixer: the gated
    # delta rule (GDN) or Kimi delta attention (KDA, a gate per key channel), chunked and one-token
    "lfm2": CONV_FUNCTIONS,
    "lfm2_moe": CONV_FUNCTIONS,
    "lfm3": CONV_FUNCTIONS,
    "qwen3_next": GDN_FUNCTIONS,
    "qwen3_5": GDN_FUNCTIONS,
    "qwen3_5_moe": GDN_FUNCTIONS,
    "qwen4_exp": GDN_FUNCTIONS,
    "kimi_linear": KDA_FUNCTIONS,
    "olmo_hybrid": GDN_FUNCTIONS,
    "bailing_hybrid": KDA_FUNCTIONS,
    "glm5_next": KDA_FUNCTIONS,
    "inkling": CONV_FUNCTIONS,
    "inkling2": CONV_FUNCTIONS,
    "inkling2_loop": CONV_FUNCTIONS,
    "lara_mini": GDN_FUNCTIONS,
}

# module globals a family's replacements use without replacing them
_HELPERS = {"torch_chunk_gated_delta_rule": ("l2norm",), "chunk_kimi_delta_attention": ("l2norm",)}

# The fused training entry points, replaced where a modeling file defines them: on the CPU the patched one
# returns None at once (what the stock torch body returns), so the mixer takes the path whose functions
# ssmgrad replaced, without transformers' warning that the call "is falling back to its reference PyTorch
# implementation ... much slower" (true of the stock body, not of the patched model); other devices call
# the stock object.
FUSED_FUNCTIONS = ("mamba_inner_fn", "mamba2_split_conv1d_scan_combined")

call_counts = Counter()       # function name -> calls that ran on ssmgrad
fallback_counts = Counter()   # "function: reason" -> calls handed to the stock function

_originals = {}               # family -> {global name: the stock object}, while patched
_lock = threading.Lock()


# ---------------------------------------------------------------------------------------------------
# helpers

def _compiling():
    """True while dynamo traces: the replacements then mutate no Python state (a counter dynamo saw change
    would be guarded on, and every later call would recompile) and call only ssmgrad.torch's operators."""
    return torch.compiler.is_compiling()


def _count(name):
    if not _compiling():
        call_counts[name] += 1


def _fallback(stock, name, reason, args, kwargs):
    if not _compiling():
        key = f"{name}: {reason}"
        if key not in fallback_counts:
            logger.warning("ssmgrad.transformers: %s falls back to the stock function (%s)", name, reason)
        fallback_counts[key] += 1
    return stock(*args, **kwargs)


def _common_reason(tensors, kwargs):
    """The reason a call cannot run on ssmgrad whatever the function, or None."""
    if kwargs.get("seq_idx") is not None or kwargs.get("cu_seqlens") is not None:
        return "seq_idx / cu_seqlens (packed sequences)"
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        return "tensors not on the CPU"
    return None


def _compute_dtype(*tensors):
    """float64 when any input is float64, else float32 (bfloat16/float16 are computed in float32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _to(t, dtype):
    """t.to(dtype), skipping the call when it would return t itself (one-token updates make many calls)."""
    return t if t.dtype == dtype else t.to(dtype)


def _needs_graph(tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _scan(s, x, dt, A, B, C, ids):
    """ssmgrad's scan: y (n_seqs, n_t, n_head, head_dim) and the final states (n_seqs, n_head, head_dim, d_state).
    ``ids`` from ``_ids``. With autograd, or while dynamo traces, through ssmgrad.torch's operator; otherwise
    (generation) the kernel is called on NumPy views directly: the same kernel without the operator and
    its checks, which at one token per call cost about as much as the kernel itself."""
    states_shape = (x.shape[0],) + tuple(s.shape[1:])
    if _compiling() or _needs_graph((s, x, dt, A, B, C)):
        out = st.ssm_scan(s, x, dt, A, B, C, ids if isinstance(ids, torch.Tensor) else torch.from_numpy(ids))
        return st.split(out, x.shape, states_shape)
    out = ssmgrad.ssm_scan(*(st._np(t) for t in (s, x, dt, A, B, C)), ids)
    n_y = x.numel()
    return torch.from_numpy(out[:n_y].reshape(x.shape)), torch.from_numpy(out[n_y:].reshape(states_shape))


_IDS = {}   # n_seqs -> np.arange(n_seqs), the ids of a cache update (never written)


def _ids(n, identity):
    """The ids of a scan over n sequences: 0..n-1 (each sequence its own state row) or all 0 (one shared zero
    state). NumPy (cached) in eager mode; a fresh tensor while dynamo traces (no Python state changes)."""
    if _compiling():
        return torch.arange(n) if identity else torch.zeros(n, dtype=torch.int64)
    if not identity:
        return np.zeros(n, dtype=np.int64)
    ids = _IDS.get(n)
    if ids is None:
        ids = _IDS[n] = np.arange(n, dtype=np.int64)
    return ids


def _scan_update(state, x, dt, A, B, C):
    """The update of a cache in place (``ssmgrad.ssm_scan_update``: the kernel writes the final states over
    ``state``, no fresh state and copy back), returning y (n_seqs, n_t, n_head, head_dim); or None with
    autograd, while dynamo traces, or for mixed dtypes: the caller then takes ``_scan`` and copies. The
    same kernel code as ``_scan``, so the same values. Without autograd only: the state changes behind
    torch's version counter."""
    if torch.is_grad_enabled() or _compiling() or any(t.dtype != state.dtype for t in (x, dt, A, B, C)):
        return None
    return torch.from_numpy(ssmgrad.ssm_scan_update(*(st._np(t) for t in (state, x, dt, A, B, C))))


def _conv(sx, c):
    """ssmgrad's conv: y (n_s, n_t, channels); without autograd on NumPy views, like _scan."""
    if _compiling() or _needs_graph((sx, c)):
        return st.ssm_conv(sx, c)
    return torch.from_numpy(ssmgrad.ssm_conv(st._np(sx), st._np(c)))


def _per_head(t, n_trailing):
    """``t`` reduced over its last ``n_trailing`` axes when it is constant along them (the mixers pass
    per-head values expanded over head_dim and d_state), else None: seen from the strides, and in eager
    mode also from the values (while dynamo traces no Python branch may depend on them; the caller then
    takes the per-channel form, exact as well)."""
    idx = (Ellipsis,) + (0,) * n_trailing
    if all(t.stride(-1 - k) == 0 for k in range(n_trailing)):
        return t[idx]
    if _compiling():
        return None
    head = t[idx]
    return head if torch.equal(t, head[(Ellipsis,) + (None,) * n_trailing].expand_as(t)) else None


def _broadcasts(t, shape):
    """Does ``t`` expand to ``shape`` (torch's broadcasting from the right)?"""
    return t.dim() <= len(shape) and all(a in (1, b) for a, b in zip(reversed(t.shape), reversed(shape)))


def _activation(y, activation):
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    from transformers.activations import ACT2FN
    return ACT2FN[activation](y)


# ---------------------------------------------------------------------------------------------------
# replacements; each factory binds the stock object of one modeling file (its fallback)

def _make_causal_conv1d_fn(stock):
    @functools.wraps(stock)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        """hidden_states (batch, channels, n_t), weight (channels, d_conv) -> (batch, channels, n_t)."""
        args, kw = (hidden_states, weight, bias, activation), kwargs
        reason = _common_reason((hidden_states, weight, bias), kwargs)
        if reason is None and (hidden_states.dim() != 3 or weight.dim() != 2):
            reason = "unexpected shapes"
        if reason is not None:
            return _fallback(stock, "causal_conv1d_fn", reason, args, kw)
        _count("causal_conv1d_fn")
        cdt = _compute_dtype(hidden_states, weight)
        d_conv = weight.shape[-1]
        sx = F.pad(_to(hidden_states, cdt), (d_conv - 1, 0))        # the zero left context of a causal conv
        y = _conv(sx, _to(weight, cdt)).transpose(1, 2)             # (batch, channels, n_t)
        if bias is not None:
            y = y + _to(bias, cdt)[:, None]
        return _activation(y, activation).to(hidden_states.dtype)
    return causal_conv1d_fn


def _make_causal_conv1d_update(stock):
    @functools.wraps(stock)
    def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None, **kwargs):
        """hidden_states (batch, channels, n_t) new tokens; conv_state (batch, channels, state_len) rolled in place."""
        args, kw = (hidden_states, conv_state, weight, bias, activation), kwargs
        reason = _common_reason((hidden_states, conv_state, weight, bias), kwargs)
        if reason is None and (hidden_states.dim() != 3 or weight.dim() != 2 or conv_state.dim() != 3
                               or conv_state.shape[-1] < weight.shape[-1] - 1):
            reason = "unexpected shapes"
        if reason is not None:
            return _fallback(stock, "causal_conv1d_update", reason, args, kw)
        _count("causal_conv1d_update")
        cdt = _compute_dtype(hidden_states, weight)
        n_t, state_len, d_conv = hidden_states.shape[-1], conv_state.shape[-1], weight.shape[-1]
        if (n_t == 1 and state_len == d_conv and conv_state.dtype == cdt and hidden_states.dtype == cdt
                and conv_state.is_contiguous() and not torch.is_grad_enabled() and not _compiling()):
            # one token (generation, without autograd: the state changes behind torch's version counter):
            # the window is the rolled state itself. Roll it in place (NumPy copies overlapping ranges
            # correctly; a strided per-row copy took 17 us at 1792 channels, the flat shift 1 us) and run
            # the conv on it: the same values as the general form below, without its concatenation,
            # strided copy and slice
            cs = conv_state.detach().numpy()
            flat = cs.reshape(-1)            # a view (contiguous): shifting it all by one rolls every row,
            flat[:-1] = flat[1:]             # and each row's last element, taken from the next row, is
            cs[:, :, -1] = st._np(hidden_states)[:, :, 0]     # overwritten by the new token
            y = torch.from_numpy(ssmgrad.ssm_conv(cs, st._np(_to(weight, cdt)))).transpose(1, 2)
            if bias is not None:
                y = y + _to(bias, cdt)[:, None]
            return _activation(y, activation)
        full = torch.cat([_to(conv_state, cdt), _to(hidden_states, cdt)], dim=-1)
        conv_state.copy_(full[:, :, -state_len:])
        y = _conv(full[:, :, full.shape[-1] - (d_conv - 1 + n_t):], _to(weight, cdt)).transpose(1, 2)
        if bias is not None:
            y = y + _to(bias, cdt)[:, None]
        return _activation(y, activation).to(hidden_states.dtype)
    return causal_conv1d_update


def _make_mamba_selective_scan(stock):
    @functools.wraps(stock)
    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
        """Mamba-1. hidden_states, dt, z (batch, d_inner, n_t); A (d_inner, d_state); B, C (batch, d_state, n_t);
        D, delta_bias (d_inner,). Starts from a zero state, as the stock torch body does."""
        args = (hidden_states, dt, A, B, C)
        kw = dict(kwargs, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                  return_last_state=return_last_state, use_mambapy=use_mambapy,
                  use_associative_scan=use_associative_scan)
        reason = _common_reason((hidden_states, dt, A, B, C, D, z, delta_bias), kwargs)
        if reason is None and not delta_softplus:
            reason = "delta_softplus=False (ssmgrad's scan always applies softplus)"
        if reason is None and (hidden_states.dim() != 3 or dt.shape != hidden_states.shape or A.dim() != 2
                               or B.dim() != 3 or C.dim() != 3):
            reason = "unexpected shapes"
        if reason is not None:
            return _fallback(stock, "mamba_selective_scan", reason, args, kw)
        _count("mamba_selective_scan")

        batch, d_inner, n_t = hidden_states.shape
        d_state = A.shape[-1]
        cdt = _compute_dtype(hidden_states, dt, A, B, C)
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]              # in dt's dtype, as stock; softplus in the kernel
        x = _to(hidden_states, cdt).transpose(1, 2)                  # (batch, n_t, d_inner): n_head = d_inner
        s0 = x.new_zeros(1, d_inner, 1, d_state)                      # one zero row shared by every sequence
        ids = _ids(batch, identity=False)
        y, last = _scan(s0, x.unsqueeze(-1), _to(dt, cdt).transpose(1, 2).contiguous(), _to(A, cdt),
                        _to(B, cdt).transpose(1, 2).unsqueeze(2), _to(C, cdt).transpose(1, 2).unsqueeze(2), ids)
        y = y.view(batch, n_t, d_inner).transpose(1, 2)               # (batch, d_inner, n_t)
        out_dtype = hidden_states.dtype
        if D is not None:
            y = y + _to(hidden_states, cdt) * _to(D, cdt)[None, :, None]
            out_dtype = torch.promote_types(out_dtype, D.dtype)
        if z is not None:
            y = y * F.silu(_to(z, cdt))
            out_dtype = torch.promote_types(out_dtype, z.dtype)
        y = y.to(out_dtype)
        if return_last_state:
            return y, last.view(batch, d_inner, d_state).to(torch.promote_types(hidden_states.dtype, A.dtype))
        return y
    return mamba_selective_scan


def _make_mamba_selective_state_update(stock):
    @functools.wraps(stock)
    def mamba_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                                     z=None, **kwargs):
        """Mamba-1, one token. state (batch, d_inner, d_state), updated in place; hidden_states, dt, z
        (batch, d_inner); A (d_inner, d_state); B, C (batch, d_state); D, dt_bias (d_inner,)."""
        args = (state, hidden_states, dt, A, B, C)
        kw = dict(kwargs, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z)
        reason = _common_reason((state, hidden_states, dt, A, B, C, D, dt_bias, z), kwargs)
        if reason is None and not dt_softplus:
            reason = "dt_softplus=False (ssmgrad's scan always applies softplus)"
        if reason is None and (state.dim() != 3 or hidden_states.dim() != 2 or dt.shape != hidden_states.shape
                               or A.dim() != 2 or B.dim() != 2 or C.dim() != 2):
            reason = "unexpected shapes"
        if reason is not None:
            return _fallback(stock, "mamba_selective_state_update", reason, args, kw)
        _count("mamba_selective_state_update")

        batch, d_inner, d_state = state.shape
        cdt = _compute_dtype(state, hidden_states, dt, A, B, C)
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        x = _to(hidden_states, cdt)
        args = (_to(state, cdt).unsqueeze(2), x.view(batch, 1, d_inner, 1), _to(dt, cdt).reshape(batch, 1, d_inner),
                _to(A, cdt), _to(B, cdt).view(batch, 1, 1, d_state), _to(C, cdt).view(batch, 1, 1, d_state))
        y = _scan_update(*args) if state.dtype == cdt else None
        if y is None:
            y, new_state = _scan(*args, _ids(batch, identity=True))
            state.copy_(new_state.view(batch, d_inner, d_state))
        y = y.view(batch, d_inner)
        if D is not None:
            y = y + x * _to(D, cdt)
        if z is not None:
            y = y * F.silu(_to(z, cdt))
        return y.to(hidden_states.dtype)
    return mamba_selective_state_update


def _make_mamba2_chunk_scan(stock):
    @functools.wraps(stock)
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        """Mamba-2. hidden_states (batch, n_t, n_head, head_dim); dt (batch, n_t, n_head); A, D, dt_bias (n_head,);
        B, C (batch, n_t, n_group, d_state); initial_states (batch, n_head, head_dim, d_state) or None.
        ``chunk_size`` only shapes the stock algorithm; the recurrence needs none."""
        args = (hidden_states, dt, A, B, C, chunk_size)
        kw = dict(kwargs, D=D, dt_bias=dt_bias, initial_states=initial_states, dt_softplus=dt_softplus,
                  dt_limit=dt_limit, return_final_states=return_final_states)
        reason = _common_reason((hidden_states, dt, A, B, C, D, dt_bias, initial_states), kwargs)
        if reason is None and not dt_softplus:
            reason = "dt_softplus=False (ssmgrad's scan always applies softplus)"
        if reason is None and kwargs.get("z") is not None:
            reason = "z passed (the stock torch body ignores it, mamba_ssm applies it)"
        if reason is None and dt_limit is None:
            reason = "dt_limit=None"
        if reason is None and (hidden_states.dim() != 4 or dt.dim() != 3 or A.dim() != 1 or B.dim() != 4
                               or C.dim() != 4):
            reason = "unexpected shapes"
        if reason is None and not dt_limit[1] > 0:
            reason = "dt_limit with an upper limit <= 0 (no softplus value)"
        if reason is not None:
            return _fallback(stock, "mamba2_chunk_scan", reason, args, kw)
        _count("mamba2_chunk_scan")

        batch, n_t, n_head, head_dim = hidden_states.shape
        d_state = B.shape[-1]
        cdt = _compute_dtype(hidden_states)                           # the stock body computes in float32
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)                            # in dt's dtype, as stock
        dt = _clamp_softplus_input(dt, dt_limit, cdt) if _limit_checked(dt_limit) else _to(dt, cdt).contiguous()
        x = _to(hidden_states, cdt)
        if initial_states is None:
            s, ids = x.new_zeros(1, n_head, head_dim, d_state), _ids(batch, identity=False)
        else:
            s, ids = _to(initial_states, cdt), _ids(batch, identity=True)
        y, final = _scan(s, x, dt, _to(A, cdt)[:, None], _to(B, cdt), _to(C, cdt), ids)
        if D is not None:
            y = y + x * _to(D, cdt)[:, None]
            out_dtype = torch.promote_types(cdt, D.dtype)
        else:
            out_dtype = cdt
        y = y.to(out_dtype)
        return (y, final) if return_final_states else y
    return mamba2_chunk_scan


def _limit_checked(dt_limit):
    """Can ``clamp(softplus(dt), *dt_limit)`` change a value at all? (softplus is >= 0, so a lower limit
    <= 0 never clamps.)"""
    lo, hi = dt_limit
    return lo > 0 or hi != math.inf


def _inverse_softplus(v):
    """The input whose softplus (ggml's, threshold 20: above 20 the input itself) is v > 0: v above 20,
    else log(expm1(v)) (which is <= 20 there, so the kernel takes its log1p(exp) branch)."""
    return torch.where(v > 20, v, torch.log(torch.expm1(v)))


def _clamp_softplus_input(dt, dt_limit, cdt):
    """The kernel's dt input (``cdt``, contiguous) for the stock ``clamp(softplus(dt), *dt_limit)``: dt itself
    where the clamp keeps softplus(dt) (the same values and gradient as without a limit), and where it clamps
    a constant whose softplus is the limit, within rounding (no gradient, as the clamp's). Whether an element
    clamps is decided in torch on the stock values (softplus and clamp in dt's dtype), so nothing depends on
    the data in Python: the same graph in eager mode and under torch.compile."""
    lo, hi = dt_limit
    with torch.no_grad():
        sp = F.softplus(dt)
        clamped = (sp < lo) | (sp > hi)                       # the complement of torch.clamp's gradient mask
        # the stock clamped value (in dt's dtype), inverted in float64 and rounded once to cdt
        limit = _inverse_softplus(torch.clamp(sp, lo, hi).to(torch.float64)).to(cdt)
    return torch.where(clamped, limit, _to(dt, cdt))


def _make_mamba2_selective_state_update(stock):
    @functools.wraps(stock)
    def mamba2_selective_state_update(state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                                      z=None, **kwargs):
        """Mamba-2, one token. state (batch, n_head, head_dim, d_state), updated in place; hidden_states, dt, z
        (batch, n_head, head_dim); A (n_head, head_dim, d_state); B, C (batch, n_group, d_state);
        D, dt_bias (n_head, head_dim). The mixers pass dt, dt_bias and A expanded from one value per head:
        then the scan runs in its Mamba-2 form (one decay per head). Otherwise, in the Mamba-1 form: each of
        the n_head * head_dim channels a head of its own (head_dim 1), with its own dt and decays A[h, p, :],
        B and C by group (channel h * head_dim + p falls in group h // (n_head // n_group), as head h does)."""
        args = (state, hidden_states, dt, A, B, C)
        kw = dict(kwargs, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z)
        reason = _common_reason((state, hidden_states, dt, A, B, C, D, dt_bias, z), kwargs)
        if reason is None and not dt_softplus:
            reason = "dt_softplus=False (ssmgrad's scan always applies softplus)"
        if reason is None and (state.dim() != 4 or hidden_states.dim() != 3 or dt.shape != hidden_states.shape
                               or state.shape[:3] != hidden_states.shape or not _broadcasts(A, state.shape[1:])
                               or B.dim() != 3 or C.dim() != 3
                               or (dt_bias is not None and not _broadcasts(dt_bias, dt.shape[1:]))):
            reason = "unexpected shapes"
        if reason is not None:
            return _fallback(stock, "mamba2_selective_state_update", reason, args, kw)
        _count("mamba2_selective_state_update")

        batch, n_head, head_dim, d_state = state.shape
        A = A.expand(n_head, head_dim, d_state)                       # size-1 axes become stride-0 ones
        if dt_bias is not None:
            dt_bias = dt_bias.expand(n_head, head_dim)
        n_group = B.shape[1]
        cdt = _compute_dtype(state, hidden_states, dt, A, B, C)
        x = _to(hidden_states, cdt)
        # one value per head: reduced before adding, so the mixers' expanded views need no comparison
        dt_head, A_head = _per_head(dt, 1), _per_head(A, 2)
        bias_head = _per_head(dt_bias, 1) if dt_bias is not None else None
        if dt_head is not None and A_head is not None and (dt_bias is None or bias_head is not None):
            if bias_head is not None:
                dt_head = dt_head + bias_head.to(dt_head.dtype)
            s = _to(state, cdt)
            args = (s, x.view(batch, 1, n_head, head_dim), _to(dt_head, cdt).reshape(batch, 1, n_head),
                    _to(A_head, cdt)[:, None], _to(B, cdt).view(batch, 1, n_group, d_state),
                    _to(C, cdt).view(batch, 1, n_group, d_state))
        else:
            if dt_bias is not None:
                dt = dt + dt_bias.to(dt.dtype)                        # in dt's dtype, as stock
            n_chan = n_head * head_dim
            s = _to(state, cdt).reshape(batch, n_chan, 1, d_state)    # a view of a contiguous state
            args = (s, x.reshape(batch, 1, n_chan, 1), _to(dt, cdt).reshape(batch, 1, n_chan),
                    _to(A, cdt).reshape(n_chan, d_state), _to(B, cdt).view(batch, 1, n_group, d_state),
                    _to(C, cdt).view(batch, 1, n_group, d_state))
        # in place when s is the cache's own memory (ssm_scan_update writes the final states over it)
        y = _scan_update(*args) if state.dtype == cdt and state.is_contiguous() else None
        if y is None:
            if _needs_graph(args):        # autograd keeps the scan's input state, which state.copy_ overwrites
                args = (args[0].clone(),) + args[1:]
            y, new_state = _scan(*args, _ids(batch, identity=True))
            state.copy_(new_state.view(state.shape))
        y = y.view(batch, n_head, head_dim)
        if D is not None:
            y = y + x * _to(D, cdt)
        if z is not None:
            y = y * F.silu(_to(z, cdt))
        return y.to(hidden_states.dtype)
    return mamba2_selective_state_update


def _make_fused(stock):
    @functools.wraps(stock)
    def fused(*args, **kwargs):
        """On the CPU: None (the stock torch body's answer; the mixer then takes the unfused path, on
        ssmgrad). Elsewhere the stock object (hub kernel or mamba_ssm)."""
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, torch.Tensor) and first.device.type == "cpu":
            return None
        return stock(*args, **kwargs)
    return fused


# ---------------------------------------------------------------------------------------------------
# the delta rule: the gated DeltaNet (scalar gate per head) and Kimi delta attention (a gate per key channel)

def _delta_rule_reason(query, key, value, g, beta, initial_state, kwargs, kda):
    """Why a call of a delta-rule function cannot run on ssmgrad, or None. None of it depends on the values."""
    reason = _common_reason((query, key, value, g, beta, initial_state), kwargs)
    if reason is None and kwargs.get("cu_seq_lens_q") is not None:
        reason = "cu_seq_lens_q (packed sequences)"
    if reason is None and kwargs.get("scale") is not None:
        reason = "scale passed (the stock torch body ignores it, flash-linear-attention applies it)"
    if reason is not None:
        return reason
    if query.dim() != 4 or key.shape != query.shape or value.dim() != 4 or value.shape[:2] != query.shape[:2]:
        return "unexpected shapes"
    batch, n_t, H_k, d_k = key.shape
    H_v, d_v = value.shape[2:]
    if H_v % H_k or (kda and H_v != H_k) or min(d_k, d_v) == 0:
        return "unexpected shapes"
    if g.shape != ((batch, n_t, H_v, d_k) if kda else (batch, n_t, H_v)) or beta.shape != (batch, n_t, H_v):
        return "unexpected shapes"
    if initial_state is not None and initial_state.shape != (batch, H_v, d_k, d_v):
        return "unexpected shapes"
    return None


def _delta_rule(module, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                kda):
    """The stock functions' values: (output (batch, n_t, H_v, d_v) in query's dtype, the final state
    (batch, H_v, d_k, d_v) in the compute dtype, or None). transformers' state is ggml's transposed
    (``state[b, h, i, j]`` = S[i][j], i the key channel): both directions are a transposed view, no copy.
    The L2 norm of q and k is the modeling file's own ``l2norm`` (the Qwen and Kimi files differ), in the
    compute dtype as stock (which computes in float32; float64 stays float64); key heads are shared
    interleaved, as stock's ``repeat_interleave``, by the kernel's broadcast mode instead of a copy.
    The scale 1/sqrt(d_k) is the kernel's 1/sqrt(S).

    ggml's state is square (S x S). Key and value head dims that differ (OLMo-hybrid's default value head
    is twice its key head) are padded with zeros to S = max(d_k, d_v): zero key channels address state
    rows that stay zero, zero value channels state columns that stay zero (the delta of a zero column is
    zero), so the output and the state are the stock values on the unpadded part, gradients included; q is
    scaled by sqrt(S / d_k) first so that the kernel's 1/sqrt(S) is stock's 1/sqrt(d_k). That costs copies
    of q, k (or v) and the state, and a state and a recurrence larger by S^2 / (d_k d_v)."""
    cdt = _compute_dtype(query, key, value, g, beta, initial_state)
    q, k = _to(query, cdt), _to(key, cdt)
    if use_qk_l2norm_in_kernel:
        q, k = module.l2norm(q, dim=-1, eps=1e-6), module.l2norm(k, dim=-1, eps=1e-6)
    v = _to(value, cdt)
    g = _to(g, cdt) if kda else _to(g, cdt).unsqueeze(-1)
    beta = _to(beta, cdt).unsqueeze(-1)
    batch, _, H_v, d_v = v.shape
    d_k = k.shape[-1]
    S = max(d_k, d_v)
    if d_k < S:
        q = F.pad(q * math.sqrt(S / d_k), (0, S - d_k))
        k = F.pad(k, (0, S - d_k))
        if kda:
            g = F.pad(g, (0, S - d_k))
    if d_v < S:
        v = F.pad(v, (0, S - d_v))
    if initial_state is None:
        state = v.new_zeros(batch, H_v, S, S)
    else:
        state = _to(initial_state, cdt).transpose(-1, -2)              # (batch, H_v, d_v, d_k)
        if d_k != d_v:
            state = F.pad(state, (0, S - d_k, 0, S - d_v))
    out = st.gated_delta_net(q, k, v, g, beta, state, head_bcast="interleaved")
    o, final = st.split(out, v.shape, state.shape)
    if d_k != d_v:
        o, final = o[..., :d_v].contiguous(), final[..., :d_v, :d_k]
    return o.to(query.dtype), (final.transpose(-1, -2) if output_final_state else None)


def _make_delta_rule(name, chunked, kda):
    """A factory of the replacement of the delta-rule function ``name`` of one modeling file (``module``)."""
    def factory(stock, module):
        def run(args, kw, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                kwargs):
            reason = _delta_rule_reason(query, key, value, g, beta, initial_state, kwargs, kda)
            if reason is not None:
                return _fallback(stock, name, reason, args, kw)
            _count(name)
            return _delta_rule(module, query, key, value, g, beta, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, kda)

        if chunked:
            @functools.wraps(stock)
            def replacement(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, **kwargs):
                """query, key (batch, n_t, H_k, S); value (batch, n_t, H_v, S); g (batch, n_t, H_v) or, KDA,
                (batch, n_t, H_v, S); beta (batch, n_t, H_v); initial_state (batch, H_v, S, S) or None.
                ``chunk_size`` only shapes the stock algorithm."""
                kw = dict(kwargs, chunk_size=chunk_size, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
                return run((query, key, value, g, beta), kw, query, key, value, g, beta, initial_state,
                           output_final_state, use_qk_l2norm_in_kernel, kwargs)
        else:
            @functools.wraps(stock)
            def replacement(query, key, value, g, beta, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, **kwargs):
                """As the chunked function, one token per call in the mixers (any n_t is computed)."""
                kw = dict(kwargs, initial_state=initial_state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
                return run((query, key, value, g, beta), kw, query, key, value, g, beta, initial_state,
                           output_final_state, use_qk_l2norm_in_kernel, kwargs)
        return replacement
    return factory


# the delta-rule functions: their replacements also need the modeling file (its l2norm)
_DELTA_FACTORIES = {
    "torch_chunk_gated_delta_rule": _make_delta_rule("torch_chunk_gated_delta_rule", chunked=True, kda=False),
    "torch_recurrent_gated_delta_rule": _make_delta_rule("torch_recurrent_gated_delta_rule", chunked=False, kda=False),
    "chunk_kimi_delta_attention": _make_delta_rule("chunk_kimi_delta_attention", chunked=True, kda=True),
    "recurrent_kimi_delta_attention": _make_delta_rule("recurrent_kimi_delta_attention", chunked=False, kda=True),
}


_FACTORIES = {
    "causal_conv1d_fn": _make_causal_conv1d_fn,
    "causal_conv1d_update": _make_causal_conv1d_update,
    "mamba_selective_scan": _make_mamba_selective_scan,
    "mamba_selective_state_update": _make_mamba_selective_state_update,
    "mamba2_chunk_scan": _make_mamba2_chunk_scan,
    "mamba2_selective_state_update": _make_mamba2_selective_state_update,
    "mamba_inner_fn": _make_fused,
    "mamba2_split_conv1d_scan_combined": _make_fused,
}


# ---------------------------------------------------------------------------------------------------
# patch / unpatch

def _family_names(fn, families):
    """``families`` as a list of known family names (None: all of them); TypeError / ValueError otherwise."""
    if families is None:
        return list(FAMILIES)
    if isinstance(families, str):
        families = [families]
    try:
        names = list(families)
    except TypeError:
        raise TypeError(f"ssmgrad.transformers.{fn}: families must be None, a family name or an iterable of "
                        f"names, got {type(families).__name__}") from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"ssmgrad.transformers.{fn}: families must hold family names (str), got "
                            f"{type(name).__name__} {name!r}")
        if name not in FAMILIES:
            raise ValueError(f"ssmgrad.transformers.{fn}: unknown family {name!r} in families; known: "
                             f"{', '.join(FAMILIES)}")
    return names


def _plan(family):
    """[(module, global name, stock object)] for one family, or a string saying why it cannot be patched."""
    import transformers
    name = f"transformers.models.{family}.modeling_{family}"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return (f"cannot import {name} ({exc}); ssmgrad.transformers is tested with transformers "
                f"{TESTED_TRANSFORMERS}.x")
    plan = []
    for fn_name in FAMILIES[family]:
        stock = getattr(module, fn_name, None)
        if not callable(stock):
            return (f"{name} has no function `{fn_name}` (transformers {transformers.__version__}; "
                    f"ssmgrad.transformers is tested with {TESTED_TRANSFORMERS}.x, where the {family} mixer calls "
                    f"`{fn_name}` as a module global)")
        plan.append((module, fn_name, stock))
        for helper in _HELPERS.get(fn_name, ()):
            if not callable(getattr(module, helper, None)):
                return (f"{name} has no function `{helper}` (transformers {transformers.__version__}; "
                        f"ssmgrad.transformers is tested with {TESTED_TRANSFORMERS}.x, where `{fn_name}` uses it)")
    for fn_name in FUSED_FUNCTIONS:
        stock = getattr(module, fn_name, None)
        if callable(stock):
            plan.append((module, fn_name, stock))
    return plan


def patch(families=None):
    """Run the models of transformers' Mamba and conv families on ssmgrad's CPU kernels (all models of those
    families in the process, from now on). ``families``: None for every family in ``FAMILIES``, or the
    names of some (``patch(["mamba2", "lfm2"])``); ValueError names an unknown one.

    Each family is checked on its own: its modeling file must import and define every function patch()
    replaces in it. With ``families=None`` a family that fails the check is left stock (a warning names it
    and why) and the others are patched; a family named explicitly that fails raises RuntimeError, and then
    none of the named families is patched. Calling it again patches what is not patched yet (idempotent).
    Returns the families patched now."""
    names = _family_names("patch", families)
    with _lock:
        todo = [f for f in names if f not in _originals]
        plans, failed = {}, {}
        for family in todo:
            plan = _plan(family)
            (failed if isinstance(plan, str) else plans)[family] = plan
        if failed and families is not None:
            raise RuntimeError("ssmgrad.transformers.patch: " + "; ".join(failed.values()) + ". Nothing was patched.")
        for family, why in failed.items():
            logger.warning("ssmgrad.transformers: %s left stock: %s", family, why)
        for family, plan in plans.items():
            _originals[family] = {fn_name: stock for _, fn_name, stock in plan}
            for module, fn_name, stock in plan:
                if fn_name in _DELTA_FACTORIES:
                    setattr(module, fn_name, _DELTA_FACTORIES[fn_name](stock, module))
                else:
                    setattr(module, fn_name, _FACTORIES[fn_name](stock))
        if plans:
            logger.info("ssmgrad.transformers: patched %s (the Mamba scan, the delta rule and the causal conv of "
                        "these models run on ssmgrad's CPU kernels)", ", ".join(plans))
        return list(plans)


def unpatch(families=None):
    """Put back the stock functions patch() replaced (the same objects), in every patched family or in the
    named ones. Does nothing for a family that is not patched."""
    import sys
    names = _family_names("unpatch", families)
    with _lock:
        for family in names:
            stock = _originals.pop(family, None)
            if stock is None:
                continue
            module = sys.modules[f"transformers.models.{family}.modeling_{family}"]
            for fn_name, obj in stock.items():
                setattr(module, fn_name, obj)


def is_patched(family=None):
    """True while any family is patched (or, given a family name, while that family is)."""
    if family is None:
        return bool(_originals)
    return _family_names("is_patched", [family])[0] in _originals


def patched_families():
    """The families patched now, in FAMILIES' order."""
    return [f for f in FAMILIES if f in _originals]


@contextlib.contextmanager
def patched(families=None):
    """``with ssmgrad.transformers.patched(): ...`` runs the block with ``patch(families)``, then unpatches
    the families that block patched (those patched before stay patched)."""
    new = patch(families)
    try:
        yield
    finally:
        unpatch(new)
