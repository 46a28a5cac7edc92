"""``ByteLM``: a small byte-level GPT-style language model as an ordinary LightningModule.

The model is ``embed -> body -> head`` where ``body`` is an ``nn.Sequential`` of transformer
blocks that each take and return one tensor. Nothing here knows about pipelining: under
``PipeStrategy`` the body is found automatically and split across stages, ``embed`` runs on the
first stage, ``head`` and the loss on the last. It is trained on the Python standard library's own
sources (see :mod:`examples.stdlib_lm.data`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import lightning.pytorch as pl

VOCAB_SIZE = 256  # bytes


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding: ``(B, T)`` bytes to ``(B, T, d_model)``."""

    def __init__(self, d_model: int, max_len: int, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token(tokens) + self.position(positions)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln_attention = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.projection = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.fc_in = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc_out = nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_attention(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.projection(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class Head(nn.Module):
    """Final LayerNorm and the projection to byte logits."""

    def __init__(self, d_model: int, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.linear = nn.Linear(d_model, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ByteLM(pl.LightningModule):
    """Byte-level causal language model.

    Args:
        d_model: width of the residual stream.
        n_layers: transformer blocks in ``self.body`` (the part a pipeline splits).
        n_heads: attention heads per block.
        max_len: longest sequence (size of the position embedding); at least the data's ``seq_len``.
        dropout: attention dropout.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to matrices only.
        warmup_steps: linear warmup steps before the cosine decay.
        min_lr_ratio: the learning rate at the end, as a fraction of ``lr``.
    """

    def __init__(
        self,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        max_len: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = Embedding(d_model, max_len)
        self.body = nn.Sequential(*[Block(d_model, n_heads, dropout=dropout) for _ in range(n_layers)])
        self.head = Head(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))

    def _loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_bpb", loss / math.log(2), sync_dist=True)  # bits per byte

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr, betas=(0.9, 0.95),
        )
        total = int(min(self.trainer.estimated_stepping_batches, 10**9))
        hp = self.hparams
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, total, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
