"""``ByteLM``: a small byte-level GPT-style language model as an ordinary LightningModule.

Written the way model libraries write decoder-only transformers: the blocks sit in an
``nn.ModuleList`` that ``forward`` calls in a loop, with rotary position tables and a causal mask
computed once before the loop and passed to every block. Nothing here knows about pipelining:
under ``PipeStrategy`` the list is found automatically and split across stages, ``embed`` runs on
the first stage, ``norm``, ``head`` and the loss on the last, and the rotary tables and the mask
travel with the hidden state. It is trained on the Python standard library's own sources (see
:mod:`examples.stdlib_lm.data`).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import lightning.pytorch as pl

VOCAB_SIZE = 256  # bytes


def rotary_tables(length: int, head_dim: int, device=None, base: float = 10000.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of rotary position embeddings, shape ``(1, 1, length, head_dim)``: no batch dimension."""
    inverse = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inverse)
    angles = torch.cat((angles, angles), dim=-1)[None, None]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then an MLP, each with a residual.

    ``block(x, cos, sin, mask=mask)`` applies rotary tables and an explicit mask; ``block(x)``
    alone is a plain causal block (what ``examples/plain_pipeline.py`` stacks in a Sequential).
    """

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

    def forward(self, x: torch.Tensor, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_attention(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if cos is not None:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.projection(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_mlp(x))))


class Embedding(nn.Module):
    """Token embedding plus a learned position embedding: ``(B, T)`` bytes to ``(B, T, d_model)``."""

    def __init__(self, d_model: int, max_len: int, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_len, d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token(tokens) + self.position(positions)


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
        n_layers: transformer blocks in ``self.layers`` (the part a pipeline splits).
        n_heads: attention heads per block.
        max_len: longest sequence; at least the data's ``seq_len``.
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
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.layers = nn.ModuleList([Block(d_model, n_heads, dropout=dropout) for _ in range(n_layers)])
        self.head = Head(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.hparams.max_len:
            raise ValueError(f"sequences of {length} bytes are longer than max_len={self.hparams.max_len}")
        cos, sin = rotary_tables(length, self.hparams.d_model // self.hparams.n_heads, tokens.device)
        mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, cos, sin, mask=mask)
        return self.head(x)

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
