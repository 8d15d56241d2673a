"""PyTorch operators for ssmgrad's CPU kernels: autograd, torch.compile and torch.export.

    import torch, ssmgrad.torch as st
    yc  = st.ssm_conv(sx, c)                              # (n_s, n_t, d_inner)
    out = st.ssm_scan(s, x, dt, A, B, C, ids, K=K)        # 1-D packed [y | K state slots]
    y, states = st.split(out, x.shape, (K, n_seqs) + s.shape[1:])
    (y.square().sum() + states.sum()).backward()          # gradients for every float input that asks
    with torch.no_grad():
        y = st.ssm_scan_update_(cache, x, dt, A, B, C)    # generation: the states written over cache
    out = st.gated_delta_net(q, k, v, g, beta, state, K=K, head_bcast="interleaved")  # 1-D [o | K slots]
    o, states = st.split(out, v.shape, (K,) + state.shape)

This is the only ssmgrad module that imports torch; ``import ssmgrad`` never does. Importing it
registers the custom operators ``torch.ops.ssmgrad.{ssm_conv, ssm_conv_back, ssm_conv_back_weight,
ssm_scan, ssm_scan_keep, ssm_scan_back, ssm_scan_update_, gated_delta_net, gated_delta_net_keep,
gated_delta_net_back}`` (``torch.library.custom_op``: fake implementations with
exact output shapes, registered autograd), which the functions here call; code using them compiles
with ``torch.compile(fullgraph=True)`` and exports with ``torch.export`` (docs/torch.md).

Shapes are those of ``ssmgrad.ssm_conv`` / ``ssmgrad.ssm_scan`` (NumPy order, ggml's ``ne`` reversed):
    sx  (n_s, d_inner, d_conv-1+n_t)        c  (d_inner, d_conv)
    s   (n_rs, n_head, head_dim, d_state)   x  (n_seqs, n_t, n_head, head_dim)
    dt  (n_seqs, n_t, n_head)               A  (n_head, d_state) Mamba-1 | (n_head, 1) Mamba-2
    B,C (n_seqs, n_t, n_group, d_state)     ids (n_seqs,) integer tensor or sequence, no gradient
and those of ``ssmgrad.gated_delta_net``:
    q,k (n_seqs_k, n_t, H_k, S)   v (n_seqs, n_t, H_v, S)   g (n_seqs, n_t, H_v, 1 or S)
    beta (n_seqs, n_t, H_v, 1)    state (n_seqs, H_v, S, S), transposed (state[n, h, j, i] = S[i][j])

Tensors must live on the CPU and be float32 or float64 (all float arguments of one call the same).
They are handed to the kernels without a copy (``tensor.detach().numpy()`` keeps any strides), so
views such as llama.cpp's ``xBC`` slices cost nothing; autograd sees the views and adds their
gradients into the base tensor. Backward computes only what is asked for: the conv's two gradients
are separate kernels, and the scan's ``d_A`` is requested only when ``A`` requires a gradient.
Double backward is not supported (the backward operators have no autograd formula and say so).
"""

import math
from typing import Optional

import numpy as np
import torch

import ssmgrad

__all__ = ["ssm_conv", "ssm_scan", "ssm_scan_update_", "gated_delta_net", "split"]

_FLOAT_DTYPES = (torch.float32, torch.float64)


def _check_tensor(t, name):
    """Raise a clear error unless ``t`` is a CPU float32/float64 tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ssmgrad.torch: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:            # (is_cpu, not device.type: no device object per check)
        raise ValueError(
            f"ssmgrad.torch: {name} is on device '{t.device}'; ssmgrad's kernels run on the CPU "
            f"only: move it with {name}.cpu()")
    if t.layout != torch.strided:
        raise TypeError(f"ssmgrad.torch: {name} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.dtype not in _FLOAT_DTYPES:
        hint = ""
        if t.dtype in (torch.bfloat16, torch.float16):     # half precision: the kernels compute in float32
            hint = f": convert it with {name}.float() (and the result back with .to({t.dtype}) if you need it)"
        raise TypeError(f"ssmgrad.torch: {name} has dtype {t.dtype}; expected torch.float32 or torch.float64{hint}")


def _check_same_dtype(named):
    dtypes = {t.dtype for t in named.values()}
    if len(dtypes) > 1:
        got = ", ".join(f"{k}={str(t.dtype).replace('torch.', '')}" for k, t in named.items())
        raise TypeError(f"ssmgrad.torch: all float arguments must have the same dtype, got {got}")


def _np(t):
    """Zero-copy NumPy view of a CPU tensor (strides kept, stride-0 expansions included)."""
    if t.requires_grad:
        t = t.detach()
    try:
        return t.numpy()
    except RuntimeError:     # lazy conjugate / negative bits cannot be exported as plain memory
        return t.resolve_conj().resolve_neg().numpy()


def _ids_tensor(ids):
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(np.asarray(ids))
    if ids.device.type != "cpu":
        raise ValueError(f"ssmgrad.torch: ids is on device '{ids.device}'; move it with ids.cpu()")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"ssmgrad.torch: ids must be an integer tensor, got dtype {ids.dtype}")
    return ids


# ---------------------------------------------------------------------------------------------------
# The operators. Each is a ``torch.library.custom_op`` in the namespace ``ssmgrad`` (``torch.ops.ssmgrad.*``):
# the schema is the contract torch.compile, torch.export, FakeTensor tracing and AOTAutograd rely on.
# The CPU implementation hands the tensors to the kernels without a copy; the fake implementation gives
# the exact output shape and dtype from the input shapes alone; the autograd formula calls the backward
# operators. Arguments are checked by the public functions below (and shapes again by the kernels).

# The implementations (NumPy-backed, zero-copy) are plain functions: the operators call them, and so does
# the eager path below (``_eager``), which skips the dispatcher's ~0.1 ms per call outside tracing.

def _conv_impl(sx, c):
    return torch.from_numpy(ssmgrad.ssm_conv(_np(sx), _np(c)))


def _conv_grad_impl(name):
    def impl(sx, c, grad):
        return torch.from_numpy(getattr(ssmgrad, name)(_np(sx), _np(c), _np(grad)))
    return impl


_conv_back_impl = _conv_grad_impl("ssm_conv_back")
_conv_back_weight_impl = _conv_grad_impl("ssm_conv_back_weight")


def _scan_impl(s, x, dt, A, B, C, ids, K):
    return torch.from_numpy(ssmgrad.ssm_scan(_np(s), _np(x), _np(dt), _np(A), _np(B), _np(C), _np(ids), K=K))


def _kept_shape(s, x, A, K):
    """The shape of ssm_scan_keep's chunk states: ssmgrad.ssm_scan(keep_states=True)'s where the two kernels take
    the chunked form, which only Mamba-2 with K = 1 can; a shape of the sizes alone (symbolic in a traced graph,
    where which form runs would be a guard on every size), so where the forms keep none it holds zeros, which
    ssmgrad.ssm_scan_back ignores."""
    if A.shape[1] == 1 and K == 1:
        return (x.shape[0], s.shape[1], (x.shape[1] + 63) // 64, s.shape[2], s.shape[3])
    return (0,)


def _scan_keep_impl(s, x, dt, A, B, C, ids, K):
    out, kept = ssmgrad.ssm_scan(_np(s), _np(x), _np(dt), _np(A), _np(B), _np(C), _np(ids), K=K, keep_states=True)
    shape = _kept_shape(s, x, A, K)
    kept = torch.from_numpy(kept) if kept.shape == shape else torch.zeros(shape, dtype=x.dtype)
    return torch.from_numpy(out), kept


def _scan_back_impl(s, x, dt, A, B, C, ids, grad, K, return_dA, chunk_states=None):
    res = ssmgrad.ssm_scan_back(*(_np(t) for t in (s, x, dt, A, B, C, ids, grad)), K=K, return_dA=bool(return_dA),
                                chunk_states=None if chunk_states is None else _np(chunk_states))
    gin, d_A = res if return_dA else (res, np.empty((0,), res.dtype))
    return torch.from_numpy(gin), torch.from_numpy(d_A)


def _scan_update_impl(s, x, dt, A, B, C):
    # s's NumPy view shares its memory: ssmgrad.ssm_scan_update writes the states through it
    return torch.from_numpy(ssmgrad.ssm_scan_update(_np(s), _np(x), _np(dt), _np(A), _np(B), _np(C)))


@torch.library.custom_op("ssmgrad::ssm_conv", mutates_args=(), device_types="cpu")
def _conv_op(sx: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """y = ssm_conv(sx, c): sx (n_s, d_inner, d_conv-1+n_t), c (d_inner, d_conv) -> y (n_s, n_t, d_inner)."""
    return _conv_impl(sx, c)


@_conv_op.register_fake
def _(sx, c):
    n_s, d_inner, n_cols = sx.shape
    return sx.new_empty((n_s, n_cols - c.shape[1] + 1, d_inner))


def _conv_grad_op(name, arg):
    """The operator ssmgrad::<name>(sx, c, grad) -> the gradient of ssm_conv w.r.t. its argument ``arg``
    (0: sx, 1: c), shaped like it (contiguous), from grad (n_s, n_t, d_inner): the NumPy API's ``name``."""
    impl = _conv_grad_impl(name)

    @torch.library.custom_op(f"ssmgrad::{name}", mutates_args=(), device_types="cpu")
    def op(sx: torch.Tensor, c: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return impl(sx, c, grad)

    op.register_fake(lambda sx, c, grad: (sx, c)[arg].new_empty((sx, c)[arg].shape))
    return op


_conv_back_op = _conv_grad_op("ssm_conv_back", 0)
_conv_back_weight_op = _conv_grad_op("ssm_conv_back_weight", 1)


def _conv_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _conv_backward(ctx, grad):
    # grad may be non-contiguous or expanded (out.sum()): the kernels take any strides.
    # The two gradients are separate kernels, each run only when asked for.
    sx, c = ctx.saved_tensors
    eager = _eager_backward(sx, c, grad)
    back = _conv_back_impl if eager else torch.ops.ssmgrad.ssm_conv_back
    back_weight = _conv_back_weight_impl if eager else torch.ops.ssmgrad.ssm_conv_back_weight
    d_sx = back(sx, c, grad) if ctx.needs_input_grad[0] else None
    d_c = back_weight(sx, c, grad) if ctx.needs_input_grad[1] else None
    return d_sx, d_c


_conv_op.register_autograd(_conv_backward, setup_context=_conv_setup_context)


def _n_states(s, x, K):
    """Elements of the K state slots of ssm_scan's packed output: K * n_seqs * n_head * head_dim * d_state."""
    return K * x.shape[0] * s.shape[1] * s.shape[2] * s.shape[3]


@torch.library.custom_op("ssmgrad::ssm_scan", mutates_args=(), device_types="cpu")
def _scan_op(s: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, ids: torch.Tensor, K: int) -> torch.Tensor:
    """The 1-D packed [y | K state slots]: x.numel() + K * n_seqs * n_head * head_dim * d_state elements."""
    return _scan_impl(s, x, dt, A, B, C, ids, K)


@_scan_op.register_fake
def _(s, x, dt, A, B, C, ids, K):
    return x.new_empty((x.numel() + _n_states(s, x, K),))


@torch.library.custom_op("ssmgrad::ssm_scan_keep", mutates_args=(), device_types="cpu")
def _scan_keep_op(s: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, ids: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, chunk_states): ssm_scan's packed output, and the states its backward reads instead of recomputing
    them (_kept_shape). What ssmgrad.torch.ssm_scan runs when a gradient is wanted."""
    return _scan_keep_impl(s, x, dt, A, B, C, ids, K)


@_scan_keep_op.register_fake
def _(s, x, dt, A, B, C, ids, K):
    return x.new_empty((x.numel() + _n_states(s, x, K),)), x.new_empty(_kept_shape(s, x, A, K))


@torch.library.custom_op("ssmgrad::ssm_scan_back", mutates_args=(), device_types="cpu")
def _scan_back_op(s: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, K: int,
                  return_dA: bool, chunk_states: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gin, d_A): gin the 1-D packed [d_s | d_x | d_dt | d_B | d_C] from the whole packed gradient of
    ssm_scan's output; d_A shaped like A when return_dA, else empty (0,) (d_A costs an extra reduction).
    chunk_states: ssm_scan_keep's, read instead of recomputed (the same bits), or None."""
    return _scan_back_impl(s, x, dt, A, B, C, ids, grad, K, return_dA, chunk_states)


@_scan_back_op.register_fake
def _(s, x, dt, A, B, C, ids, grad, K, return_dA, chunk_states=None):
    n_gin = s.numel() + x.numel() + dt.numel() + B.numel() + C.numel()
    return x.new_empty((n_gin,)), x.new_empty(A.shape if return_dA else (0,))


def _scan_setup_context(ctx, inputs, output):
    *tensors, K = inputs                       # s, x, dt, A, B, C, ids
    if isinstance(output, tuple):              # ssm_scan_keep: the chunk states too
        ctx.mark_non_differentiable(output[1])
        tensors.append(output[1])
    ctx.save_for_backward(*tensors)
    ctx.K = K


def _scan_backward(ctx, grad, grad_states=None):
    s, x, dt, A, B, C, ids, *kept = ctx.saved_tensors
    need = ctx.needs_input_grad                  # (s, x, dt, A, B, C, ids, K)
    if not any(need[:6]):
        return (None,) * 8
    # One reverse pass yields d_s, d_x, d_dt, d_B, d_C together; d_A costs extra, so only on request.
    back = _scan_back_impl if _eager_backward(s, x, dt, A, B, C, ids, grad) else torch.ops.ssmgrad.ssm_scan_back
    gin, d_A = back(s, x, dt, A, B, C, ids, grad, ctx.K, bool(need[3]), *kept)
    grads = [*_views(gin, (s.shape, x.shape, dt.shape, B.shape, C.shape))]
    grads.insert(3, d_A)
    return (*(g if n else None for g, n in zip(grads, need[:6])), None, None)


_scan_op.register_autograd(_scan_backward, setup_context=_scan_setup_context)
_scan_keep_op.register_autograd(_scan_backward, setup_context=_scan_setup_context)


@torch.library.custom_op("ssmgrad::ssm_scan_update_", mutates_args=("s",), device_types="cpu")
def _scan_update_op(s: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor) -> torch.Tensor:
    """y (n_seqs, n_t, n_head, head_dim) of ssm_scan with ids = arange(n_seqs), K = 1; the final states are
    written over s (n_seqs, n_head, head_dim, d_state). For the one-token updates of a generation cache."""
    return _scan_update_impl(s, x, dt, A, B, C)


@_scan_update_op.register_fake
def _(s, x, dt, A, B, C):
    return x.new_empty(x.shape)


# Gated DeltaNet (ggml's GATED_DELTA_NET). ``head_bcast`` is the key head broadcast: "tiled" is ggml's
# (value head h reads key head h % H_k), "interleaved" transformers' (h // (H_v / H_k)); no copy either way.

def _gdn_impl(q, k, v, g, beta, state, K, head_bcast, form):
    return torch.from_numpy(ssmgrad.gated_delta_net(*(_np(t) for t in (q, k, v, g, beta, state)), K=K,
                                                    head_bcast=head_bcast, form=form))


def _gdn_kept_shape(v, g, K, form):
    """The shape of gated_delta_net_keep's chunk states: ssmgrad.gated_delta_net(keep_states=True)'s where the
    call takes a chunked form, which needs K = 1 and a form other than "recurrence"; a shape of the sizes alone
    (symbolic in a traced graph, where which form runs would be a guard on n_t), so where the call keeps none
    it holds zeros, which ssmgrad.gated_delta_net_back ignores."""
    if K == 1 and form != "recurrence":
        n_seqs, n_t, H_v, S = v.shape
        Sp = (S + 15) // 16 * 16
        E = Sp * Sp + 128 * Sp + (2 if g.shape[-1] != 1 else 3) * 64 * 64   # csrc/gdn_common.h, gdn_kda_chunked.h
        return (n_seqs, H_v, (n_t + 63) // 64, E)
    return (0,)


def _gdn_keep_impl(q, k, v, g, beta, state, K, head_bcast, form):
    out, kept = ssmgrad.gated_delta_net(*(_np(t) for t in (q, k, v, g, beta, state)), K=K, head_bcast=head_bcast,
                                        form=form, keep_states=True)
    shape = _gdn_kept_shape(v, g, K, form)
    kept = torch.from_numpy(kept) if kept.shape == shape else torch.zeros(shape, dtype=v.dtype)
    return torch.from_numpy(out), kept


def _gdn_back_impl(q, k, v, g, beta, state, grad, K, head_bcast, form, chunk_states=None):
    return torch.from_numpy(ssmgrad.gated_delta_net_back(*(_np(t) for t in (q, k, v, g, beta, state, grad)), K=K,
                                                         head_bcast=head_bcast, form=form,
                                                         chunk_states=None if chunk_states is None
                                                         else _np(chunk_states)))


def _gdn_keeps(g, K, form):
    """Whether a training call runs gated_delta_net_keep: where it may take a chunked form, as the sizes alone
    say (the scalar gate unless form is "recurrence"; the per-channel gate with form "chunked", since "auto"
    takes its recurrence below 2048 tokens, where the kept zeros would be memory for nothing)."""
    return K == 1 and form != "recurrence" and (g.shape[-1] == 1 or form == "chunked")


def _gdn_n_out(v, K):
    """Elements of gated_delta_net's packed output: o (v's shape) and K state slots (n_seqs, H_v, S, S)."""
    n_seqs, _, H_v, S = v.shape
    return v.numel() + K * n_seqs * H_v * S * S


@torch.library.custom_op("ssmgrad::gated_delta_net", mutates_args=(), device_types="cpu")
def _gdn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, K: int, head_bcast: str, form: str) -> torch.Tensor:
    """The 1-D packed [o | K state slots]: v.numel() + K * n_seqs * H_v * S * S elements."""
    return _gdn_impl(q, k, v, g, beta, state, K, head_bcast, form)


@_gdn_op.register_fake
def _(q, k, v, g, beta, state, K, head_bcast, form):
    return v.new_empty((_gdn_n_out(v, K),))


@torch.library.custom_op("ssmgrad::gated_delta_net_back", mutates_args=(), device_types="cpu")
def _gdn_back_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, grad: torch.Tensor, K: int, head_bcast: str, form: str,
                 chunk_states: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The 1-D packed [d_q | d_k | d_v | d_g | d_beta | d_state] from the whole packed gradient of
    gated_delta_net's output, each region in its input's shape. chunk_states: gated_delta_net_keep's, read
    instead of recomputed (the same bits), or None."""
    return _gdn_back_impl(q, k, v, g, beta, state, grad, K, head_bcast, form, chunk_states)


@_gdn_back_op.register_fake
def _(q, k, v, g, beta, state, grad, K, head_bcast, form, chunk_states=None):
    return v.new_empty((q.numel() + k.numel() + v.numel() + g.numel() + beta.numel() + state.numel(),))


@torch.library.custom_op("ssmgrad::gated_delta_net_keep", mutates_args=(), device_types="cpu")
def _gdn_keep_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, K: int, head_bcast: str, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, chunk_states): gated_delta_net's packed output, and what its chunked backward reads instead of
    recomputing it (_gdn_kept_shape). What ssmgrad.torch.gated_delta_net runs when a gradient is wanted
    (_gdn_keeps)."""
    return _gdn_keep_impl(q, k, v, g, beta, state, K, head_bcast, form)


@_gdn_keep_op.register_fake
def _(q, k, v, g, beta, state, K, head_bcast, form):
    return v.new_empty((_gdn_n_out(v, K),)), v.new_empty(_gdn_kept_shape(v, g, K, form))


def _gdn_setup_context(ctx, inputs, output):
    *tensors, K, head_bcast, form = inputs       # q, k, v, g, beta, state
    if isinstance(output, tuple):                # gated_delta_net_keep: the chunk states too
        ctx.mark_non_differentiable(output[1])
        tensors.append(output[1])
    ctx.save_for_backward(*tensors)
    ctx.K, ctx.head_bcast, ctx.form = K, head_bcast, form


def _gdn_backward(ctx, grad, grad_states=None):
    *tensors, = ctx.saved_tensors
    kept = tensors[6:]                           # gated_delta_net_keep's chunk states, or nothing
    tensors = tensors[:6]
    need = ctx.needs_input_grad                  # (q, k, v, g, beta, state, K, head_bcast, form)
    if not any(need[:6]):
        return (None,) * 9
    # one reverse pass yields all six gradients
    back = _gdn_back_impl if _eager_backward(*tensors, grad) else torch.ops.ssmgrad.gated_delta_net_back
    gin = back(*tensors, grad, ctx.K, ctx.head_bcast, ctx.form, *kept)   # the forward's form: its bits' gradient
    grads = _views(gin, [t.shape for t in tensors])
    return (*(d if n else None for d, n in zip(grads, need[:6])), None, None, None)


_gdn_op.register_autograd(_gdn_backward, setup_context=_gdn_setup_context)
_gdn_keep_op.register_autograd(_gdn_backward, setup_context=_gdn_setup_context)


# ---------------------------------------------------------------------------------------------------
# The eager path. Outside tracing (no torch.compile / export, no FakeTensor, functionalization, proxy or
# other dispatch mode, no functorch transform, plain tensors) the public functions call the
# implementations above directly: under no_grad (generation) the kernel alone, with grad an
# autograd.Function whose forward and backward are the operators' own implementations and autograd
# formula. Same kernels, same bits, same gradients (tests/torch/test_torch_eager.py); the dispatcher's
# ~0.1 ms per call (the custom op's schema handling, its autograd and ADInplaceOrView kernels) is
# saved where a decode step spends it. Everything else takes the operators.

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_torch_function_mode = torch._C._is_torch_function_mode_enabled
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _eager(*tensors):
    """Whether the direct path applies: not tracing, and every argument a plain CPU tensor."""
    if _is_compiling() or _dispatch_stack_len() or _torch_function_mode():
        return False
    for t in tensors:
        if type(t) not in _TENSOR_TYPES or _functorch_wrapped(t):
            return False
    return True


def _eager_backward(*tensors):
    """The backward's implementations directly: eager, and no graph of the backward wanted (create_graph
    runs the backward operators, which say that they have no autograd formula)."""
    return not torch.is_grad_enabled() and _eager(*tensors)


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _ConvFn(torch.autograd.Function):
    """Eager ssm_conv with grad: _conv_op's implementation and autograd formula."""
    @staticmethod
    def forward(sx, c):
        return _conv_impl(sx, c)

    setup_context = staticmethod(_conv_setup_context)
    backward = staticmethod(_conv_backward)


class _ScanFn(torch.autograd.Function):
    """Eager ssm_scan with grad: _scan_keep_op's implementation and autograd formula."""
    @staticmethod
    def forward(s, x, dt, A, B, C, ids, K):
        return _scan_keep_impl(s, x, dt, A, B, C, ids, K)

    setup_context = staticmethod(_scan_setup_context)
    backward = staticmethod(_scan_backward)


class _GdnFn(torch.autograd.Function):
    """Eager gated_delta_net with grad: _gdn_op's implementation and autograd formula."""
    @staticmethod
    def forward(q, k, v, g, beta, state, K, head_bcast, form):
        return _gdn_impl(q, k, v, g, beta, state, K, head_bcast, form)

    setup_context = staticmethod(_gdn_setup_context)
    backward = staticmethod(_gdn_backward)


class _GdnKeepFn(torch.autograd.Function):
    """Eager gated_delta_net with grad where it may keep its chunks: _gdn_keep_op's implementation and autograd
    formula."""
    @staticmethod
    def forward(q, k, v, g, beta, state, K, head_bcast, form):
        return _gdn_keep_impl(q, k, v, g, beta, state, K, head_bcast, form)

    setup_context = staticmethod(_gdn_setup_context)
    backward = staticmethod(_gdn_backward)


def ssm_conv(sx, c):
    """Differentiable ``ssmgrad.ssm_conv`` over CPU tensors: y (n_s, n_t, d_inner)."""
    _check_tensor(sx, "sx")
    _check_tensor(c, "c")
    _check_same_dtype({"sx": sx, "c": c})
    if _eager(sx, c):
        return _ConvFn.apply(sx, c) if _needs_grad(sx, c) else _conv_impl(sx, c)
    return _conv_op(sx, c)


def ssm_scan(s, x, dt, A, B, C, ids, *, K=1):
    """Differentiable ``ssmgrad.ssm_scan`` over CPU tensors: the 1-D packed [y | K state slots].

    ``ids`` is an integer tensor (or sequence) and gets no gradient. See ``split`` to unpack."""
    K = ssmgrad._K_arg("ssmgrad.torch.ssm_scan", K)             # the NumPy API's rules for K
    named = {"s": s, "x": x, "dt": dt, "A": A, "B": B, "C": C}
    for name, t in named.items():
        _check_tensor(t, name)
    _check_same_dtype(named)
    ids = _ids_tensor(ids)
    # with a gradient wanted, the forward keeps the chunk states its backward would recompute (ssm_scan_keep)
    if _eager(s, x, dt, A, B, C, ids):
        if _needs_grad(s, x, dt, A, B, C):
            return _ScanFn.apply(s, x, dt, A, B, C, ids, K)[0]
        return _scan_impl(s, x, dt, A, B, C, ids, K)
    if _needs_grad(s, x, dt, A, B, C) and not torch.compiler.is_exporting():   # (export: an inference graph)
        return _scan_keep_op(s, x, dt, A, B, C, ids, K)[0]
    return _scan_op(s, x, dt, A, B, C, ids, K)


def ssm_scan_update_(s, x, dt, A, B, C):
    """In place: run ``ssm_scan`` (K = 1) from the states ``s`` (n_seqs, n_head, head_dim, d_state), one
    row per sequence (ids = arange(n_seqs)), write the final states over ``s`` and return y
    (n_seqs, n_t, n_head, head_dim). The values are those of ``ssm_scan``; for a generation cache (one
    token per call) the kernel writes the states straight into ``s``. Not differentiable: for inference
    (no input may require a gradient while grad mode is on); train with ``ssm_scan``. The tensor form of
    ``ssmgrad.ssm_scan_update``, which checks the shapes."""
    named = {"s": s, "x": x, "dt": dt, "A": A, "B": B, "C": C}
    for name, t in named.items():
        _check_tensor(t, name)
    _check_same_dtype(named)
    if torch.is_grad_enabled():
        for name, t in named.items():
            if t.requires_grad:
                raise ValueError(f"ssmgrad.torch.ssm_scan_update_: {name} requires grad; the in-place update "
                                 "is for inference: use ssm_scan to train, or torch.no_grad()")
    # a lazy negation reaches the operator as a copy (torch's fallback), and the update would be lost
    if not torch.compiler.is_compiling() and s.is_neg():
        raise ValueError("ssmgrad.torch.ssm_scan_update_: s is a lazily negated view; pass s.resolve_neg()")
    if _eager(s, x, dt, A, B, C):
        y = _scan_update_impl(s, x, dt, A, B, C)
        torch.autograd.graph.increment_version(s)   # as the mutating operator does: autograd sees the write
        return y
    return _scan_update_op(s, x, dt, A, B, C)


def gated_delta_net(q, k, v, g, beta, state, *, K=1, head_bcast="tiled", form="auto"):
    """Differentiable ``ssmgrad.gated_delta_net`` over CPU tensors: the 1-D packed [o | K state slots].

    ``o, states = split(out, v.shape, (K,) + state.shape)``; the states are transposed like ``state``
    (``state[n, h, j, i]`` is S[i][j], i the key channel). ``head_bcast="tiled"`` is ggml's head broadcast
    (value head h reads key/query head ``h % H_k``), ``"interleaved"`` transformers' (``h // (H_v // H_k)``);
    neither copies. ``form`` (``"auto"``, ``"recurrence"``, ``"chunked"``) as for ``ssmgrad.gated_delta_net``,
    the same for the forward and its backward. Gradients reach every float input that asks (one
    ``gated_delta_net_back`` call)."""
    fn = "ssmgrad.torch.gated_delta_net"
    K = ssmgrad._K_arg(fn, K)
    ssmgrad._head_bcast_arg(fn, head_bcast)                      # the NumPy API's rules: ValueError naming them
    ssmgrad._gdn_form_arg(fn, form)
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state}
    for name, t in named.items():
        _check_tensor(t, name)
    _check_same_dtype(named)
    # with a gradient wanted, the forward keeps what its chunked backward would recompute (gated_delta_net_keep)
    keeps = _needs_grad(q, k, v, g, beta, state) and _gdn_keeps(g, K, form)
    if _eager(q, k, v, g, beta, state):
        if _needs_grad(q, k, v, g, beta, state):
            if keeps:
                return _GdnKeepFn.apply(q, k, v, g, beta, state, K, head_bcast, form)[0]
            return _GdnFn.apply(q, k, v, g, beta, state, K, head_bcast, form)
        return _gdn_impl(q, k, v, g, beta, state, K, head_bcast, form)
    if keeps and not torch.compiler.is_exporting():   # (export: an inference graph)
        return _gdn_keep_op(q, k, v, g, beta, state, K, head_bcast, form)[0]
    return _gdn_op(q, k, v, g, beta, state, K, head_bcast, form)


def split(packed, *shapes):
    """Differentiable views of consecutive regions of a 1-D tensor, like ``ssmgrad.split``.

        y, states = split(out, x.shape, (K, n_seqs) + s.shape[1:])
    """
    if packed.dim() != 1:
        raise ValueError(f"ssmgrad.torch.split: packed must be 1-D, got shape {tuple(packed.shape)}")
    shapes = [ssmgrad._shape_arg(sh) for sh in shapes]      # the same shape rules as ssmgrad.split
    n = sum(math.prod(sh) for sh in shapes)
    if n != packed.numel():
        raise ValueError(f"ssmgrad.torch.split: shapes {shapes} hold {n} elements, packed has {packed.numel()}")
    return _views(packed, shapes)


def _views(packed, shapes):
    """Consecutive views of the 1-D ``packed`` with the given (checked) shapes; symbolic sizes welcome."""
    parts, start = [], 0
    for sh in shapes:
        n = math.prod(sh)
        parts.append(packed[start:start + n].view(sh))
        start += n
    return tuple(parts)
