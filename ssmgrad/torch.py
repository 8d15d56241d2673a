"""PyTorch autograd adapter for ssmgrad's CPU kernels.

    import torch, ssmgrad.torch as st
    yc  = st.ssm_conv(sx, c)                              # (n_s, n_t, d_inner)
    out = st.ssm_scan(s, x, dt, A, B, C, ids, K=K)        # 1-D packed [y | K state slots]
    y, states = st.split(out, x.shape, (K, n_seqs) + s.shape[1:])
    (y.square().sum() + states.sum()).backward()          # gradients for every float input that asks

This is the only ssmgrad module that imports torch; ``import ssmgrad`` never does.

Shapes are those of ``ssmgrad.ssm_conv`` / ``ssmgrad.ssm_scan`` (NumPy order, ggml's ``ne`` reversed):
    sx  (n_s, d_inner, d_conv-1+n_t)        c  (d_inner, d_conv)
    s   (n_rs, n_head, head_dim, d_state)   x  (n_seqs, n_t, n_head, head_dim)
    dt  (n_seqs, n_t, n_head)               A  (n_head, d_state) Mamba-1 | (n_head, 1) Mamba-2
    B,C (n_seqs, n_t, n_group, d_state)     ids (n_seqs,) integer tensor or sequence, no gradient

Tensors must live on the CPU and be float32 or float64 (all float arguments of one call the same).
They are handed to the kernels without a copy (``tensor.detach().numpy()`` keeps any strides), so
views such as llama.cpp's ``xBC`` slices cost nothing; autograd sees the views and adds their
gradients into the base tensor. Backward computes only what is asked for: the conv's two gradients
are separate kernels, and the scan's ``d_A`` is requested only when ``A`` requires a gradient.
Double backward is not supported.
"""

import math

import numpy as np
import torch
from torch.autograd.function import once_differentiable

import ssmgrad

__all__ = ["ssm_conv", "ssm_scan", "split"]

_FLOAT_DTYPES = (torch.float32, torch.float64)


def _check_tensor(t, name):
    """Raise a clear error unless ``t`` is a CPU float32/float64 tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ssmgrad.torch: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"ssmgrad.torch: {name} is on device '{t.device}'; ssmgrad's kernels run on the CPU "
            f"only: move it with {name}.cpu()")
    if t.layout != torch.strided:
        raise TypeError(f"ssmgrad.torch: {name} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"ssmgrad.torch: {name} has dtype {t.dtype}; expected torch.float32 or torch.float64")


def _check_same_dtype(named):
    dtypes = {t.dtype for t in named.values()}
    if len(dtypes) > 1:
        got = ", ".join(f"{k}={str(t.dtype).replace('torch.', '')}" for k, t in named.items())
        raise TypeError(f"ssmgrad.torch: all float arguments must have the same dtype, got {got}")


def _np(t):
    """Zero-copy NumPy view of a CPU tensor (strides kept, stride-0 expansions included)."""
    t = t.detach()
    if t.is_conj():          # lazy conjugate / negative bits cannot be exported as plain memory
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.numpy()


def _ids_tensor(ids):
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(np.asarray(ids))
    if ids.device.type != "cpu":
        raise ValueError(f"ssmgrad.torch: ids is on device '{ids.device}'; move it with ids.cpu()")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"ssmgrad.torch: ids must be an integer tensor, got dtype {ids.dtype}")
    return ids


class SSMConv(torch.autograd.Function):
    """y = ssm_conv(sx, c): sx (n_s, d_inner, d_conv-1+n_t), c (d_inner, d_conv) -> y (n_s, n_t, d_inner)."""

    @staticmethod
    def forward(ctx, sx, c):
        y = ssmgrad.ssm_conv(_np(sx), _np(c))
        ctx.save_for_backward(sx, c)
        return torch.from_numpy(y)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        sx, c = ctx.saved_tensors
        g = _np(grad)                       # may be non-contiguous or expanded: kernels take any strides
        d_sx = d_c = None
        if ctx.needs_input_grad[0]:
            d_sx = torch.from_numpy(ssmgrad.ssm_conv_back(_np(sx), _np(c), g))
        if ctx.needs_input_grad[1]:
            d_c = torch.from_numpy(ssmgrad.ssm_conv_back_weight(_np(sx), _np(c), g))
        return d_sx, d_c


class SSMScan(torch.autograd.Function):
    """out = ssm_scan(s, x, dt, A, B, C, ids, K): 1-D packed [y | K state slots]."""

    @staticmethod
    def forward(ctx, s, x, dt, A, B, C, ids, K):
        out = ssmgrad.ssm_scan(_np(s), _np(x), _np(dt), _np(A), _np(B), _np(C), _np(ids), K=K)
        ctx.save_for_backward(s, x, dt, A, B, C, ids)
        ctx.K = K
        return torch.from_numpy(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        s, x, dt, A, B, C, ids = ctx.saved_tensors
        need = ctx.needs_input_grad                  # (s, x, dt, A, B, C, ids, K)
        if not any(need[:6]):
            return (None,) * 8
        args = [_np(t) for t in (s, x, dt, A, B, C, ids)]
        # One reverse pass yields d_s, d_x, d_dt, d_B, d_C together; d_A costs extra, so only on request.
        res = ssmgrad.ssm_scan_back(*args, _np(grad), K=ctx.K, return_dA=bool(need[3]))
        gin, d_A = res if need[3] else (res, None)
        d_s, d_x, d_dt, d_B, d_C = ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)
        grads = [d_s, d_x, d_dt, d_A, d_B, d_C]
        grads = [torch.from_numpy(np.asarray(g)) if n else None for g, n in zip(grads, need[:6])]
        return (*grads, None, None)


def ssm_conv(sx, c):
    """Differentiable ``ssmgrad.ssm_conv`` over CPU tensors: y (n_s, n_t, d_inner)."""
    _check_tensor(sx, "sx")
    _check_tensor(c, "c")
    _check_same_dtype({"sx": sx, "c": c})
    return SSMConv.apply(sx, c)


def ssm_scan(s, x, dt, A, B, C, ids, *, K=1):
    """Differentiable ``ssmgrad.ssm_scan`` over CPU tensors: the 1-D packed [y | K state slots].

    ``ids`` is an integer tensor (or sequence) and gets no gradient. See ``split`` to unpack."""
    K = ssmgrad._K_arg("ssmgrad.torch.ssm_scan", K)             # the NumPy API's rules for K
    named = {"s": s, "x": x, "dt": dt, "A": A, "B": B, "C": C}
    for name, t in named.items():
        _check_tensor(t, name)
    _check_same_dtype(named)
    return SSMScan.apply(s, x, dt, A, B, C, _ids_tensor(ids), K)


def split(packed, *shapes):
    """Differentiable views of consecutive regions of a 1-D tensor, like ``ssmgrad.split``.

        y, states = split(out, x.shape, (K, n_seqs) + s.shape[1:])
    """
    if packed.dim() != 1:
        raise ValueError(f"ssmgrad.torch.split: packed must be 1-D, got shape {tuple(packed.shape)}")
    shapes = [ssmgrad._shape_arg(sh) for sh in shapes]      # the same shape rules as ssmgrad.split
    sizes = [math.prod(sh) for sh in shapes]
    if sum(sizes) != packed.numel():
        raise ValueError(
            f"ssmgrad.torch.split: shapes {shapes} hold {sum(sizes)} elements, packed has {packed.numel()}")
    parts, start = [], 0
    for sh, n in zip(shapes, sizes):
        parts.append(packed[start:start + n].view(sh))
        start += n
    return tuple(parts)
