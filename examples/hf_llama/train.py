"""A Hugging Face ``LlamaForCausalLM`` trained as a transformers + Lightning project writes it, pipelined.

Everything here is what such a project already has: a fast tokenizer, a dataset of tokenized
snippets, Hugging Face's ``DataCollatorForLanguageModeling`` (its batches are ``BatchEncoding``
objects with ``input_ids``, ``attention_mask`` and ``labels``, padding marked -100), and a
``LightningModule`` whose step is ``self.model(**batch).loss``. The one pipelining line is the
Trainer's ``strategy="pipe"``: PipeStrategy finds the model's decoder layers (an ``nn.ModuleList``
the model calls in its own loop), splits them over the processes, splits each ``BatchEncoding`` into
microbatches, and weights the microbatches' losses by the tokens Hugging Face's loss averaged over
(no ``num_items`` needed), so the run trains what one process would.

The data needs no download: the Python standard library's own ``.py`` sources (see
``examples/stdlib_lm/data.py``), cut into snippets at blank lines. The tokenizer is a byte-level BPE
trained on the same text when the script starts (a few seconds); the model is built from a small
config (random weights). Needs transformers: ``pip install -e ".[hf]"``.

    python examples/hf_llama/train.py                        # 2 processes, 2 pipeline stages
    python examples/hf_llama/train.py --strategy ddp --devices 1   # the same run in one process

Each run prints its per-step training losses, so the two can be compared line by line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning_pipe  # noqa: E402,F401  (registers strategy="pipe")
from examples.stdlib_lm.data import read_stdlib_bytes  # noqa: E402


def snippets(max_bytes: int) -> List[str]:
    """The first ``max_bytes`` of the sorted stdlib sources, cut at blank lines into snippets of 3+ lines."""
    text = bytes(read_stdlib_bytes(max_bytes).tolist()).decode("utf-8", errors="replace")
    return [part.strip("\n") for part in text.split("\n\n") if part.count("\n") >= 2]


def train_tokenizer(texts: List[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts`` (deterministic: every process trains the same one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")


class Snippets(Dataset):
    """Each snippet tokenized, cut at ``max_len`` tokens (what a ``datasets.map(tokenize)`` step gives)."""

    def __init__(self, tokenizer, texts: List[str], max_len: int) -> None:
        self.items = [tokenizer(text, truncation=True, max_length=max_len) for text in texts]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        return {k: list(v) for k, v in self.items[index].items()}


class LlamaLM(pl.LightningModule):
    """A LightningModule around ``LlamaForCausalLM``; nothing in it knows about pipelining."""

    def __init__(self, vocab_size: int, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, lr: float = 3e-3,
                 pad_token_id: int = 0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab_size, hidden_size=d_model, intermediate_size=4 * d_model, num_hidden_layers=n_layers,
            num_attention_heads=n_heads, num_key_value_heads=n_heads, max_position_embeddings=512,
            pad_token_id=pad_token_id, tie_word_embeddings=True, attn_implementation="sdpa"))

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss  # Hugging Face's mean over the labels that are not -100
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class StepLosses(pl.Callback):
    """Collects the training loss of every step (what ``on_train_batch_end`` receives: the whole batch's)."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="pipe", help="'pipe' (default), or 'ddp' to compare")
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=96, help="tokens per snippet at most")
    parser.add_argument("--max-bytes", type=int, default=1_000_000, help="bytes of stdlib sources read")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--root", default="lightning_logs/hf_llama", help="where logs go")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    texts = snippets(args.max_bytes)
    tokenizer = train_tokenizer(texts, args.vocab_size)
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # pads; labels -100 on the padding
    held_out = len(texts) // 20
    train = DataLoader(Snippets(tokenizer, texts[:-held_out], args.max_len), batch_size=args.batch_size, shuffle=True,
                       drop_last=True, collate_fn=collator)
    val = DataLoader(Snippets(tokenizer, texts[-held_out:], args.max_len), batch_size=args.batch_size,
                     collate_fn=collator)
    model = LlamaLM(len(tokenizer), args.d_model, args.layers, pad_token_id=tokenizer.pad_token_id)
    losses = StepLosses()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=args.strategy, max_steps=args.steps,
                         val_check_interval=max(args.steps // 2, 1), limit_val_batches=8, log_every_n_steps=10,
                         default_root_dir=args.root, callbacks=[losses], enable_progress_bar=False)
    trainer.fit(model, train, val)
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        print(f"{len(train.dataset)} snippets, vocabulary {len(tokenizer)}, {sum(p.numel() for p in model.parameters()):,} "
              f"parameters, strategy {args.strategy} on {args.devices} process(es)")
        print("step losses: " + " ".join(f"{loss:.6f}" for loss in losses.losses))
        print(f"trained {trainer.global_step} steps: train_loss {metrics['train_loss']:.3f}, "
              f"val_loss {metrics['val_loss']:.3f}")


if __name__ == "__main__":
    main()
