"""Small Mamba-1 and Mamba-2 blocks written on ssmgrad.torch, for the compile, export and DDP tests.

Each block: in_proj -> depthwise causal conv (ssm_conv, from a zero conv state) + bias + SiLU ->
selective scan (ssm_scan, from a zero state) -> D skip, SiLU(z) gate -> out_proj. ``ref=True`` runs the
same block on the torch reference of the two ops (tests/reference.py), the oracle for its values.
"""

import torch
import torch.nn.functional as F
from torch import nn

import ssmgrad.torch as st
from reference import ref_ssm_conv, ref_ssm_scan


def _ops(ref):
    if ref:
        return ref_ssm_conv, lambda s, x, dt, A, B, C, ids: ref_ssm_scan(s, x, dt, A, B, C, ids)
    return st.ssm_conv, lambda s, x, dt, A, B, C, ids: st.ssm_scan(s, x, dt, A, B, C, ids)


def _conv(conv, u, weight, bias):
    """u (batch, L, channels) -> SiLU(causal depthwise conv + bias), (batch, L, channels)."""
    sx = F.pad(u.transpose(1, 2), (weight.shape[1] - 1, 0))       # (batch, channels, d_conv-1+L), a view
    return F.silu(conv(sx, weight) + bias)


class Mamba2Block(nn.Module):
    """h (batch, L, d_model) -> (batch, L, d_model); x, B, C are views of one conv output (xBC)."""

    def __init__(self, d_model=8, n_head=2, head_dim=4, d_state=4, n_group=1, d_conv=4, ref=False):
        super().__init__()
        self.n_head, self.head_dim, self.d_state, self.n_group = n_head, head_dim, d_state, n_group
        self.d_inner = n_head * head_dim
        conv_dim = self.d_inner + 2 * n_group * d_state
        self.in_proj = nn.Linear(d_model, self.d_inner + conv_dim + n_head)
        self.conv_w = nn.Parameter(torch.randn(conv_dim, d_conv) * 0.5)
        self.conv_b = nn.Parameter(torch.randn(conv_dim) * 0.1)
        self.dt_bias = nn.Parameter(torch.rand(n_head) - 1.0)
        self.A_log = nn.Parameter(torch.rand(n_head))
        self.D = nn.Parameter(torch.randn(n_head))
        self.out_proj = nn.Linear(self.d_inner, d_model)
        self.conv, self.scan = _ops(ref)

    def forward(self, h):
        b, L, _ = h.shape
        G = self.n_group * self.d_state
        z, xbc, dt = self.in_proj(h).split([self.d_inner, self.d_inner + 2 * G, self.n_head], dim=-1)
        xbc = _conv(self.conv, xbc, self.conv_w, self.conv_b)
        x = xbc[..., :self.d_inner].unflatten(-1, (self.n_head, self.head_dim))
        B = xbc[..., self.d_inner:self.d_inner + G].unflatten(-1, (self.n_group, self.d_state))
        C = xbc[..., self.d_inner + G:].unflatten(-1, (self.n_group, self.d_state))
        s0 = h.new_zeros((b, self.n_head, self.head_dim, self.d_state))
        A = -torch.exp(self.A_log).unsqueeze(-1)                          # (n_head, 1): Mamba-2
        out = self.scan(s0, x, dt + self.dt_bias, A, B, C, torch.arange(b))
        y = out[:x.numel()].view(x.shape) + x * self.D.unsqueeze(-1)
        return self.out_proj(y.flatten(2) * F.silu(z))


class Mamba1Block(nn.Module):
    """h (batch, L, d_model) -> (batch, L, d_model); head_dim 1, A (d_inner, d_state), B, C views of x_proj's output."""

    def __init__(self, d_model=8, d_inner=8, d_state=4, dt_rank=2, d_conv=4, ref=False):
        super().__init__()
        self.d_inner, self.d_state, self.dt_rank = d_inner, d_state, dt_rank
        self.in_proj = nn.Linear(d_model, 2 * d_inner)
        self.conv_w = nn.Parameter(torch.randn(d_inner, d_conv) * 0.5)
        self.conv_b = nn.Parameter(torch.randn(d_inner) * 0.1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner)
        self.A_log = nn.Parameter(torch.rand(d_inner, d_state))
        self.D = nn.Parameter(torch.randn(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model)
        self.conv, self.scan = _ops(ref)

    def forward(self, h):
        b, L, _ = h.shape
        x, z = self.in_proj(h).chunk(2, dim=-1)
        x = _conv(self.conv, x, self.conv_w, self.conv_b)                 # (b, L, d_inner)
        x_db = self.x_proj(x)
        dt = self.dt_proj(x_db[..., :self.dt_rank])                        # (b, L, d_inner), bias inside softplus
        B = x_db[..., self.dt_rank:self.dt_rank + self.d_state].unsqueeze(2)
        C = x_db[..., self.dt_rank + self.d_state:].unsqueeze(2)
        s0 = h.new_zeros((b, self.d_inner, 1, self.d_state))
        out = self.scan(s0, x.unsqueeze(-1), dt, -torch.exp(self.A_log), B, C, torch.arange(b))
        y = out[:x.numel()].view(x.shape) + x * self.D
        return self.out_proj(y * F.silu(z))


class TinyLM(nn.Module):
    """Embedding -> Mamba-2 block -> Mamba-1 block -> vocabulary head: a small model for the DDP test."""

    def __init__(self, vocab=16, d_model=8, ref=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList([Mamba2Block(d_model, ref=ref), Mamba1Block(d_model, ref=ref)])
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(h)
