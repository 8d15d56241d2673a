"""End-to-end training check: Mamba blocks whose conv and scan run through ssmgrad.torch.

Two copies of the same small model (embedding -> Mamba block (residual) -> layer norm -> LM head)
start from the same weights and see the same batches of a toy selective-copying task; one copy's
block calls ``ssmgrad.torch.ssm_conv`` / ``ssm_scan``, the other the pure-torch reference ops
(tests/reference.py ref_ssm_conv / ref_ssm_scan, the test suite's oracle, loaded by path).
Their losses must agree step by step (tolerance 1e-8 in float64, where 300 steps agree to ~1e-13
on the LoRA path and ~1e-11 with --full; 1e-3 in float32, measured ~2e-5), the loss must fall
(last 10% of steps below 0.9x the first 10%), and the script reports how long each copy took.

    Mamba-2 block: in_proj -> [z | xBC | dt];  xBC -> ssm_conv (+bias) -> SiLU -> x, B, C views
                   -> ssm_scan (A (n_head, 1)) -> + D*x -> * SiLU(z) -> out_proj
    Mamba-1 block: in_proj -> [x | z];  x -> ssm_conv (+bias) -> SiLU -> x_proj -> [dt_low | B | C]
                   dt = dt_proj(dt_low) -> ssm_scan (head_dim 1, A (d_inner, d_state)) -> + D*x
                   -> * SiLU(z) -> out_proj

A learning rate at the edge of stability turns last-bit differences (two correct implementations
never sum in the same order) into exponentially diverging trajectories: Mamba-1 at lr 1e-2 went
from 1e-15 to 2e-7 in 300 steps. The default rates (Mamba-2 1e-2, Mamba-1 3e-3) stay below that;
``--lr`` overrides both. Per-op agreement itself is tested in tests/torch/test_torch_adapter.py.

Default (the LoRA path): the projections' base weights, the conv weight and A are frozen; low-rank
adapters on every projection train, with the embedding, head, biases, dt bias and D. ``--full``
trains everything, so the conv-weight gradient and d_A are exercised too.

    python examples/train.py                      # 300 steps, float64, writes examples/train.png
    python examples/train.py --quick              # small and short: a few seconds
    python examples/train.py --full --dtype float32 --steps 500 --out /tmp/train.png
"""

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tests")):   # the in-place build of ssmgrad; tests/reference.py
    if _p not in sys.path:
        sys.path.insert(0, _p)

import ssmgrad                 # noqa: E402
import ssmgrad.torch as st     # noqa: E402
from reference import ref_ssm_conv, ref_ssm_scan  # noqa: E402  (the tests' torch reference)

OPS = {"ssmgrad": (st.ssm_conv, st.ssm_scan), "torch": (ref_ssm_conv, ref_ssm_scan)}

# ----------------------------------------------------------------------------------------------
# Model


class LoRALinear(nn.Module):
    """y = x W^T (+ b) + scale * (x A^T) B^T; W frozen on the LoRA path, B starts at zero."""

    def __init__(self, d_in, d_out, rank, bias=False, alpha=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / math.sqrt(d_in))
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank))
        self.scale = (alpha if alpha is not None else 2 * rank) / rank

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def _inv_softplus(v):
    return v + torch.log(-torch.expm1(-v))


def _causal_conv_input(xs, d_conv):
    """(b, n_t, ch) tokens -> sx (b, ch, d_conv-1+n_t): zero conv state prepended, as a transposed view."""
    state = xs.new_zeros(xs.shape[0], d_conv - 1, xs.shape[2])
    return torch.cat([state, xs], dim=1).transpose(1, 2)


class Mamba2Block(nn.Module):
    def __init__(self, d_model, d_state=16, head_dim=16, expand=2, n_group=1, d_conv=4, rank=4):
        super().__init__()
        self.d_inner = d_inner = expand * d_model
        self.n_head, self.head_dim, self.d_state, self.n_group, self.d_conv = (
            d_inner // head_dim, head_dim, d_state, n_group, d_conv)
        self.conv_dim = d_inner + 2 * n_group * d_state
        self.in_proj = LoRALinear(d_model, 2 * d_inner + 2 * n_group * d_state + self.n_head, rank)
        self.conv_weight = nn.Parameter(torch.randn(self.conv_dim, d_conv) / math.sqrt(d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim))
        dt = torch.exp(torch.rand(self.n_head) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(_inv_softplus(dt))
        self.A_log = nn.Parameter(torch.log(torch.rand(self.n_head, 1) * 15 + 1))
        self.D = nn.Parameter(torch.ones(self.n_head))
        self.out_proj = LoRALinear(d_inner, d_model, rank)

    def frozen(self):
        return [self.in_proj.weight, self.out_proj.weight, self.conv_weight, self.A_log]

    def forward(self, u, ops):
        conv, scan = ops
        b, n_t, _ = u.shape
        G = self.n_group * self.d_state
        z, xBC, dt = self.in_proj(u).split([self.d_inner, self.conv_dim, self.n_head], dim=-1)
        xBC = F.silu(conv(_causal_conv_input(xBC, self.d_conv), self.conv_weight) + self.conv_bias)
        # x, B, C are views of xBC, as in llama.cpp: autograd adds their gradients into xBC's.
        x = xBC[..., :self.d_inner].reshape(b, n_t, self.n_head, self.head_dim)
        B = xBC[..., self.d_inner:self.d_inner + G].reshape(b, n_t, self.n_group, self.d_state)
        C = xBC[..., self.d_inner + G:].reshape(b, n_t, self.n_group, self.d_state)
        s = u.new_zeros(b, self.n_head, self.head_dim, self.d_state)
        out = scan(s, x, dt + self.dt_bias, -torch.exp(self.A_log), B, C, torch.arange(b))
        y = out[:x.numel()].view(x.shape) + x * self.D[:, None]
        return self.out_proj(y.reshape(b, n_t, self.d_inner) * F.silu(z))


class Mamba1Block(nn.Module):
    def __init__(self, d_model, d_state=8, expand=2, dt_rank=None, d_conv=4, rank=4):
        super().__init__()
        self.d_inner = d_inner = expand * d_model
        self.d_state, self.d_conv = d_state, d_conv
        self.dt_rank = dt_rank = dt_rank or max(1, math.ceil(d_model / 16))
        self.in_proj = LoRALinear(d_model, 2 * d_inner, rank)
        self.conv_weight = nn.Parameter(torch.randn(d_inner, d_conv) / math.sqrt(d_conv))
        self.conv_bias = nn.Parameter(torch.zeros(d_inner))
        self.x_proj = LoRALinear(d_inner, dt_rank + 2 * d_state, rank)
        self.dt_proj = LoRALinear(dt_rank, d_inner, rank, bias=True)
        dt = torch.exp(torch.rand(d_inner) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        with torch.no_grad():
            self.dt_proj.bias.copy_(_inv_softplus(dt))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = LoRALinear(d_inner, d_model, rank)

    def frozen(self):
        return [self.in_proj.weight, self.x_proj.weight, self.dt_proj.weight, self.out_proj.weight,
                self.conv_weight, self.A_log]

    def forward(self, u, ops):
        conv, scan = ops
        b, n_t, _ = u.shape
        x, z = self.in_proj(u).split([self.d_inner, self.d_inner], dim=-1)
        x = F.silu(conv(_causal_conv_input(x, self.d_conv), self.conv_weight) + self.conv_bias)
        x_db = self.x_proj(x)                                   # (b, n_t, dt_rank + 2*d_state)
        dt = self.dt_proj(x_db[..., :self.dt_rank])             # (b, n_t, d_inner)
        B = x_db[..., self.dt_rank:self.dt_rank + self.d_state].unsqueeze(2)   # views, n_group 1
        C = x_db[..., self.dt_rank + self.d_state:].unsqueeze(2)
        s = u.new_zeros(b, self.d_inner, 1, self.d_state)
        out = scan(s, x.unsqueeze(-1), dt, -torch.exp(self.A_log), B, C, torch.arange(b))
        y = out[:x.numel()].view(x.shape) + x * self.D
        return self.out_proj(y * F.silu(z))


class Model(nn.Module):
    def __init__(self, block, vocab, d_model):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.block = block
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens, ops):
        h = self.emb(tokens)
        h = h + self.block(h, ops)
        return self.head(F.layer_norm(h, h.shape[-1:]))


# ----------------------------------------------------------------------------------------------
# Task: selective copying. n_mem data tokens (1..n_colors) sit at random places among blanks (0);
# after them come n_mem markers; at the markers the model must emit the data tokens in order.


def make_batch(gen, batch, body, n_mem, n_colors):
    marker = n_colors + 1
    tokens = torch.zeros(batch, body + n_mem, dtype=torch.long)
    data = torch.randint(1, n_colors + 1, (batch, n_mem), generator=gen)
    pos = torch.rand(batch, body, generator=gen).argsort(dim=1)[:, :n_mem].sort(dim=1).values
    tokens.scatter_(1, pos, data)
    tokens[:, body:] = marker
    return tokens, data


def make_model(kind, cfg, dtype, full, seed):
    """The seeded initial model of one block kind; on the LoRA path (full False) its frozen weights
    have requires_grad False. Also used by ggml/train_check.py, which trains the same model in ggml."""
    vocab = cfg["n_colors"] + 2
    with torch.random.fork_rng(devices=[]):           # seeded init, caller's RNG state untouched
        torch.manual_seed(seed)
        if kind == "mamba2":
            block = Mamba2Block(cfg["d_model"], d_state=cfg["d_state"], head_dim=cfg["head_dim"],
                                n_group=cfg["n_group"], rank=cfg["rank"])
        else:
            block = Mamba1Block(cfg["d_model"], d_state=cfg["d_state"], rank=cfg["rank"])
        model = Model(block, vocab, cfg["d_model"]).to(dtype)
    if not full:
        for p in model.block.frozen():
            p.requires_grad_(False)
    return model


def batches(cfg, seed):
    """The endless stream of (tokens, target) batches that train_pair feeds, in its order."""
    gen = torch.Generator().manual_seed(seed + 1)
    while True:
        yield make_batch(gen, cfg["batch"], cfg["body"], cfg["n_mem"], cfg["n_colors"])


def train_pair(kind, cfg, dtype, full, steps, seed, log_every=0):
    """Train the ssmgrad copy and the torch copy of one model side by side; return their histories."""
    vocab = cfg["n_colors"] + 2
    model = make_model(kind, cfg, dtype, full, seed)
    models = {"ssmgrad": model, "torch": copy.deepcopy(model)}
    lr = cfg["lr"][kind] if isinstance(cfg["lr"], dict) else cfg["lr"]
    opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
            for k, m in models.items()}
    hist = {k: [] for k in models}
    secs = {k: 0.0 for k in models}
    data = batches(cfg, seed)
    n_mem = cfg["n_mem"]
    for step in range(steps):
        tokens, target = next(data)
        for k, m in models.items():
            t0 = time.perf_counter()
            logits = m(tokens, OPS[k])[:, -n_mem:]
            loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            secs[k] += time.perf_counter() - t0
            hist[k].append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  {kind} step {step:4d}  loss ssmgrad {hist['ssmgrad'][-1]:.6f}  torch {hist['torch'][-1]:.6f}"
                  f"  |diff| {abs(hist['ssmgrad'][-1] - hist['torch'][-1]):.2e}", flush=True)
    tail = max(1, steps // 10)
    diffs = [abs(a - b) for a, b in zip(hist["ssmgrad"], hist["torch"])]
    return {
        "kind": kind, "losses": hist, "diffs": diffs, "max_diff": max(diffs),
        "initial": sum(hist["ssmgrad"][:tail]) / tail, "final": sum(hist["ssmgrad"][-tail:]) / tail,
        "seconds": secs, "speedup": secs["torch"] / secs["ssmgrad"], "lr": lr,
        "max_weight_diff": max((a - b).abs().max().item() for a, b in
                               zip(models["ssmgrad"].parameters(), models["torch"].parameters())),
        "grads": {"A": model.block.A_log.grad is not None, "conv_weight": model.block.conv_weight.grad is not None},
    }


CONFIGS = {
    # d_model 32, Mamba-2: d_inner 64, 4 heads of 16, d_state 16; sequences of 36 tokens, batch 16
    "default": dict(d_model=32, d_state=16, head_dim=16, n_group=1, rank=4, n_colors=8, n_mem=4,
                    body=32, batch=16, lr={"mamba2": 1e-2, "mamba1": 3e-3}),
    "quick": dict(d_model=16, d_state=8, head_dim=8, n_group=2, rank=2, n_colors=4, n_mem=2,
                  body=10, batch=8, lr={"mamba2": 2e-2, "mamba1": 1e-2}),
}
TOL = {torch.float64: 1e-8, torch.float32: 1e-3}


def run(steps=300, quick=False, dtype=torch.float64, full=False, seed=0, threads=1, log_every=0, cfg=None,
        blocks=("mamba2", "mamba1")):
    cfg = dict(CONFIGS["quick" if quick else "default"], **(cfg or {}))
    saved = torch.get_num_threads(), ssmgrad.get_num_threads()
    torch.set_num_threads(threads)
    ssmgrad.set_num_threads(threads)
    try:
        return [train_pair(kind, cfg, dtype, full, steps, seed, log_every) for kind in blocks]
    finally:
        torch.set_num_threads(saved[0])
        ssmgrad.set_num_threads(saved[1])


def plot_curves(panels, path, title):
    """One column per panel: two loss curves over the steps above, their difference (log scale) below.
    A panel is a dict: ref, new (loss lists), ref_label, new_label, title, diff (list), diff_label,
    floor (where a difference of 0 is drawn), and optionally tol (a dashed line)."""
    import matplotlib        # in the test and bench extras of pyproject.toml
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 6), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1.3]}, squeeze=False)
    for j, pn in enumerate(panels):
        ax, ax_d = axes[0, j], axes[1, j]
        ax.plot(pn["ref"], color="tab:orange", lw=3, alpha=0.5, label=pn["ref_label"])
        ax.plot(pn["new"], color="tab:blue", lw=1, label=pn["new_label"])
        ax.set_title(pn["title"], fontsize=10)
        ax.set_ylabel("cross-entropy (selective copying)")
        ax.legend()
        ax_d.semilogy([max(d, pn["floor"]) for d in pn["diff"]], color="tab:gray", lw=1)
        if pn.get("tol") is not None:
            ax_d.axhline(pn["tol"], color="tab:red", lw=1, ls="--", label=f"tolerance {pn['tol']:g}")
            ax_d.legend(fontsize=8)
        ax_d.set_ylabel(pn["diff_label"])
        ax_d.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def block_name(kind):
    return "Mamba-2" if kind == "mamba2" else "Mamba-1"


def plot(results, path, title):
    plot_curves([dict(ref=r["losses"]["torch"], ref_label="pure-torch reference ops",
                      new=r["losses"]["ssmgrad"], new_label="ssmgrad.torch ops",
                      title=f"{block_name(r['kind'])} block (lr {r['lr']:g})\ntraining time: ssmgrad "
                            f"{r['seconds']['ssmgrad']:.1f} s, pure torch {r['seconds']['torch']:.1f} s "
                            f"({r['speedup']:.2f}x)",
                      diff=r["diffs"], diff_label="|loss difference|\n(0 drawn at 1e-17)", floor=1e-17)
                 for r in results], path, title)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (default 300, --quick 60)")
    p.add_argument("--quick", action="store_true", help="tiny model and short sequences")
    p.add_argument("--full", action="store_true", help="train everything, incl. A and the conv weight")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--threads", type=int, default=1, help="torch and ssmgrad threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", default="mamba2,mamba1", help="comma-separated: mamba2, mamba1")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: per config)")
    p.add_argument("--out", default=str(ROOT / "examples" / "train.png"), help="figure path ('' for none)")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (60 if args.quick else 300)
    dtype = getattr(torch, args.dtype)
    mode = "full fine-tuning" if args.full else "LoRA (frozen base weights, conv weight and A)"
    print(f"ssmgrad {ssmgrad.__version__}, torch {torch.__version__}: {steps} steps, {args.dtype}, {mode}, "
          f"{args.threads} thread(s){', quick' if args.quick else ''}", flush=True)
    blocks = tuple(b.strip() for b in args.blocks.split(",") if b.strip())
    if not blocks or set(blocks) - {"mamba2", "mamba1"}:
        p.error(f"--blocks: expected a comma-separated subset of mamba2,mamba1, got {args.blocks!r}")
    results = run(steps, args.quick, dtype, args.full, args.seed, args.threads, log_every=max(1, steps // 10),
                  cfg={"lr": args.lr} if args.lr else None, blocks=blocks)
    tol = TOL[dtype]
    ok = True
    print(f"\n{'block':8} {'lr':>7} {'max|dloss|':>11} {'max|dW|':>9} {'loss start':>11} {'loss end':>9} "
          f"{'ssmgrad s':>10} {'torch s':>8} {'torch/ssmgrad':>14}")
    for r in results:
        print(f"{r['kind']:8} {r['lr']:7.0e} {r['max_diff']:11.2e} {r['max_weight_diff']:9.2e} {r['initial']:11.4f} "
              f"{r['final']:9.4f} {r['seconds']['ssmgrad']:10.2f} {r['seconds']['torch']:8.2f} {r['speedup']:13.2f}x")
        ok &= r["max_diff"] <= tol and r["final"] < 0.9 * r["initial"]
    print(f"(max|dloss|: over all steps, tolerance {tol:g}; max|dW|: largest weight difference after the "
          f"last step; losses: means over the first/last 10% of steps; time: forward + backward + "
          f"optimizer step of each copy)")
    if args.out:
        plot(results, args.out, f"ssmgrad vs pure-torch ops, {mode}, {args.dtype}, same weights and batches")
        print(f"wrote {os.path.relpath(args.out)}")
    print("OK" if ok else "FAILED: losses disagree or did not fall")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
