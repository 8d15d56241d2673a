"""One rank of the data-parallel test (tests/torch/test_ddp.py), and the models and data both sides share.

    python tests/ddp_worker.py RANK WORLD_SIZE PORT OUT_DIR

joins a gloo process group on 127.0.0.1:PORT, trains each model for STEPS SGD steps wrapped in
DistributedDataParallel on its slice of the combined batch, and saves every step's gradients to
OUT_DIR/rank{RANK}.pt. ``train`` without a process group is the single-process oracle on the whole batch.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_blocks import TinyLM  # noqa: E402

STEPS = 2
BATCH, SEQ_LEN, VOCAB = 4, 6, 16
MODELS = ("ssmgrad_blocks", "transformers_mamba2")


def build(name):
    """The model ``name`` in float64, with the same parameters in every process."""
    torch.manual_seed(0)
    if name == "ssmgrad_blocks":
        return TinyLM(VOCAB).double()
    import transformers
    config = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=16, state_size=8, num_hidden_layers=2,
                                       expand=2, num_heads=4, head_dim=8, n_groups=2, chunk_size=8,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Mamba2ForCausalLM(config).double()


def batches():
    """STEPS combined batches of token ids (BATCH, SEQ_LEN)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (BATCH, SEQ_LEN), generator=gen) for _ in range(STEPS)]


def loss_of(name, model, ids):
    """Mean next-token cross-entropy over the rows of ids (rows of equal length: the mean over the
    combined batch is the mean of the ranks' means, which DDP's gradient averaging computes)."""
    if name == "ssmgrad_blocks":
        logits = model(ids)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return model(input_ids=ids, labels=ids).loss


def train(name, model, rows=slice(None)):
    """STEPS SGD steps on ``rows`` of each batch; returns each step's gradients {parameter: tensor}.
    ``model`` may be DDP-wrapped (then the gradients are those averaged over the ranks)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.named_parameters())
    grads = []
    for ids in batches():
        opt.zero_grad()
        loss_of(name, model, ids[rows]).backward()
        grads.append({k.removeprefix("module."): p.grad.detach().clone() for k, p in params.items()})
        opt.step()
    return grads


def main(rank, world, port, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ssmgrad
    import ssmgrad.transformers as sht

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        per_rank = BATCH // world
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        result = {"threads": (ssmgrad.get_num_threads(), torch.get_num_threads())}
        sht.patch()
        try:
            for name in MODELS:
                result[name] = train(name, DDP(build(name)), rows)
        finally:
            sht.unpatch()
        result["call_counts"] = dict(sht.call_counts)
        result["fallback_counts"] = dict(sht.fallback_counts)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
