"""Train a tiny MoE language model on synthetic data, its experts spread over ranks with epkit.

    torchrun --nproc-per-node 2 examples/train_moe.py --steps 50      # expert parallel
    python examples/train_moe.py --dense --steps 50                    # the same model, one process
    torchrun --nproc-per-node 2 examples/train_moe.py --compare-dense  # both at once, side by side

gloo on CPU, NCCL on GPU (one GPU per rank). Every rank builds the same dense model from the
seed, ``epkit.nn.to_expert_parallel`` keeps each rank's experts, every rank trains on its share
of each global batch, and the replicated parameters' gradients are summed over the group
(``sync_replicated_grads``). Each rank's loss is its tokens' cross-entropy sum divided by the
global token count, so the group's summed loss and gradients are the dense model's on the whole
batch: the per-step losses of the two runs agree to float32 rounding. ``--compare-dense``
checks it in one run: rank 0 also trains the dense model (DenseMoE layers, its own optimizer)
on the whole global batch and prints both losses and their difference every step.

The data: sequences over a vocabulary of ``V`` tokens where the next token is ``(3 * t + 1) % V``
most of the time and random otherwise, so the loss falls from ``log V`` towards the noise floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import epkit.nn as enn


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then the MoE layer."""

    def __init__(self, hidden, heads, moe):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.moe = moe

    def forward(self, x):
        B, S, H = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, H // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, H))
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, vocab, seq, hidden, ffn, experts, top_k, layers, heads=2, shared=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, enn.DenseMoE(hidden, ffn, experts, top_k, shared_expert=shared))
            for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step, args):
    """The global batch of ``step``: ``[B, S+1]`` token ids, the same on every rank."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    V = args.vocab
    seqs = torch.empty(args.batch, args.seq + 1, dtype=torch.int64)
    seqs[:, 0] = torch.randint(V, (args.batch,), generator=g)
    noise = torch.rand(args.batch, args.seq, generator=g) < 0.1
    rand = torch.randint(V, (args.batch, args.seq), generator=g)
    for t in range(args.seq):
        seqs[:, t + 1] = torch.where(noise[:, t], rand[:, t], (3 * seqs[:, t] + 1) % V)
    return seqs


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    p.add_argument("--batch", type=int, default=16, help="global sequences per step (default 16)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--vocab", type=int, default=64,
                   help="vocabulary size V of the synthetic data (default 64)")
    p.add_argument("--hidden", type=int, default=32, help="model width H (default 32)")
    p.add_argument("--ffn", type=int, default=64, help="each expert's FFN width (default 64)")
    p.add_argument("--experts", type=int, default=8,
                   help="experts per MoE layer, a multiple of the rank count (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    p.add_argument("--layers", type=int, default=2,
                   help="transformer blocks, each attention + MoE (default 2)")
    p.add_argument("--shared-expert", action="store_true",
                   help="add a shared expert every token goes through (overlapped with the "
                        "token exchange in the expert-parallel run)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and of the synthetic data (default 0)")
    p.add_argument("--dense", action="store_true", help="one process, DenseMoE (the reference run)")
    p.add_argument("--losses", help="write the per-step losses here (JSON list), rank 0")
    p.add_argument("--compare-dense", action="store_true",
                   help="rank 0 also trains the dense model on the whole batch and reports the "
                        "difference of the losses every step")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar even on a terminal (there is none where stderr is not "
                        "a terminal, e.g. a log file); the per-step losses are printed either way")
    args = p.parse_args(argv)
    if args.compare_dense and args.dense:
        p.error("--compare-dense runs the dense model beside the expert-parallel one: drop --dense")
    return args


def setup_distributed():
    """Join the torchrun group (or a one-rank group without torchrun); returns the device."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="train_moe_"), "store"), 1)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def train(args) -> list[float]:
    """Run ``args.steps`` steps; returns the global mean loss of each step (every rank)."""
    if args.dense:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        rank, world = 0, 1
    else:
        device = setup_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = TinyMoELM(args.vocab, args.seq, args.hidden, args.ffn, args.experts, args.top_k,
                      args.layers, shared=args.shared_expert).to(device)
    dense = dense_opt = None
    if args.compare_dense and rank == 0:  # the dense twin: same weights, trained on it all
        import copy

        dense = copy.deepcopy(model)
        dense_opt = torch.optim.AdamW(dense.parameters(), lr=args.lr, weight_decay=0.01)
    if not args.dense:
        model = enn.to_expert_parallel(model)  # keeps this rank's experts, router replicated
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    tokens_per_step = args.batch * args.seq
    losses, gaps = [], []
    bar = None
    if rank == 0 and not args.no_progress and sys.stderr.isatty():  # a log gets plain lines
        from tqdm import tqdm

        mode = "dense" if args.dense else f"expert-parallel x{world}"
        bar = tqdm(total=args.steps, desc=f"train_moe ({mode})", file=sys.stderr)
    def loss_of(net, seqs):
        logits = net(seqs[:, :-1])
        return F.cross_entropy(logits.reshape(-1, args.vocab).float(), seqs[:, 1:].reshape(-1),
                               reduction="sum") / tokens_per_step

    for step in range(args.steps):
        seqs = torch.tensor_split(batch(step, args), world)[rank].to(device)  # this rank's share
        loss = loss_of(model, seqs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        total = loss.detach().clone()
        if not args.dense:
            enn.sync_replicated_grads(model)  # expert gradients are already complete
            dist.all_reduce(total)
        opt.step()
        losses.append(total.item())
        line = f"step {step:4d}  loss {losses[-1]:.6f}"
        if dense is not None:
            dense_loss = loss_of(dense, batch(step, args).to(device))
            dense_opt.zero_grad(set_to_none=True)
            dense_loss.backward()
            dense_opt.step()
            gaps.append(abs(losses[-1] - dense_loss.item()) / abs(dense_loss.item()))
            line += f"  dense {dense_loss.item():.6f}  relative difference {gaps[-1]:.1e}"
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.write(line, file=sys.stdout)
        elif rank == 0:
            print(line, flush=True)
    if bar is not None:
        bar.close()
    if gaps:
        print(f"expert-parallel x{world} against dense: largest relative loss difference "
              f"{max(gaps):.1e} over {len(gaps)} steps (float32 sums in another order)", flush=True)
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    if not args.dense:
        # Drop every reference to the group (the model's layers hold it, and the last step's
        # graph holds its pending exchanges) before destroying it, with every rank there:
        # gloo work or a group still alive at interpreter exit can abort the process.
        import gc

        dist.barrier()
        del model, opt, loss, total
        gc.collect()
        dist.destroy_process_group()
    return losses


def main(argv=None):
    args = parse(argv)
    t0 = time.time()
    losses = train(args)
    if args.dense or int(os.environ.get("RANK", 0)) == 0:
        print(f"final loss {losses[-1]:.4f} after {len(losses)} steps ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
