"""A tiny GPT with tied input/output embeddings, run as a script by tests/test_scaling.py.

``python tests/gpt_app.py --strategy pipe --devices 3 --root DIR --out result.pt`` trains it on
synthetic tokens and, on global rank 0, saves the final weights, the CSV log, the last checkpoint's
path and ``global_step`` to ``--out``. The embedding (first stage) and the head (last stage) share
one weight, so the pipeline must keep their gradients in sync across stages.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
from torch import nn

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightning_pipe  # noqa: E402  (registers the strategy names)

VOCAB = 24
LENGTH = 12


class Block(nn.Module):
    """Pre-norm causal self-attention (one head) and an MLP, each with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        # No bias: a key bias has zero true gradient (softmax ignores a constant per query), and Adam
        # would turn its rounding noise into full-size steps that differ between runs.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.norm2(x))


class TinyGPT(pl.LightningModule):
    """embed (+ positions) -> body of blocks (pipelined) -> norm -> head, head.weight tied to embed.weight."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, depth: int = 4, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.02 * torch.randn(LENGTH, width))
        self.body = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.body(x)))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, self.hparams.vocab), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def tokens(num_sequences: int = 64) -> torch.Tensor:
    """Sequences that mostly follow ``t -> 3t + 1 (mod VOCAB)``, with some random tokens."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (num_sequences, 1), generator=g)
    steps = [start]
    for _ in range(LENGTH - 1):
        steps.append((steps[-1] * 3 + 1) % VOCAB)
    sequences = torch.cat(steps, dim=1)
    noise = torch.rand(sequences.shape, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, sequences.shape, generator=g), sequences)


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="pipe")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    pl.seed_everything(0)
    model = TinyGPT()
    strategy = lightning_pipe.PipeStrategy(num_microbatches=args.microbatches) if args.strategy == "pipe" else args.strategy
    checkpoint = ModelCheckpoint(dirpath=os.path.join(args.root, "ckpt"), save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.max_epochs,
        gradient_clip_val=0.5, logger=CSVLogger(args.root, name="logs", version=0), log_every_n_steps=1,
        callbacks=[checkpoint], enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.root,
    )
    data = torch.utils.data.TensorDataset(tokens())
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    if trainer.is_global_zero:
        with open(os.path.join(args.root, "logs", "version_0", "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        torch.save({
            "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "tied": model.head.weight is model.embed.weight,
            "csv": rows,
            "last_model_path": checkpoint.last_model_path,
            "global_step": trainer.global_step,
        }, args.out)


if __name__ == "__main__":
    main()
