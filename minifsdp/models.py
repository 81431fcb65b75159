"""The models every chapter trains: a tiny GPT and an MLP, plus a character corpus.

Both models are built from a seed alone, so every rank (and torch's FSDP/DDP
in the same test) starts from exactly the same numbers:

    model = TinyGPT(GPTConfig.tiny(), seed=0)     # ~30k parameters, for tests
    model = TinyGPT(GPTConfig.mini(), seed=0)     # ~0.2M parameters, the README's first training run
    model = TinyGPT(GPTConfig.bench(), seed=0)    # ~20M parameters, for benchmarks

The GPT has the parts that make sharding interesting:

    tokens ──> tok_emb ─┐                         ┌─> lm_head (weight TIED to tok_emb)
    positions > pos_emb ┴─> [Block] x n_layer ─> ln_f ┘
                         Block = x + attn(ln1(x)); x + mlp(ln2(x))   (pre-LN)

* a tied weight (``lm_head.weight is tok_emb.weight``): one tensor, two users;
* a registered buffer (the causal mask): state that is never trained or sharded;
* a stack of identical blocks, the natural unit to wrap for FSDP.

The corpus is the book's own text (chapter 1, shipped in ``data/``), read as
characters; :func:`batches` cuts it into (input, target) pairs deterministically
by step and rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "TinyGPT", "Block", "MLP", "CharCorpus", "load_corpus"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32

    @classmethod
    def tiny(cls) -> "GPTConfig":
        """About 30 thousand parameters: fast enough for many tests on 2 cores."""
        return cls()

    @classmethod
    def mini(cls) -> "GPTConfig":
        """About 0.2 million parameters: the README's first training job, which learns words in about a minute."""
        return cls(block_size=64, n_layer=4, n_head=4, n_embd=64)

    @classmethod
    def small(cls) -> "GPTConfig":
        """About 0.8 million parameters: the notebooks' demos."""
        return cls(block_size=64, n_layer=4, n_head=4, n_embd=128)

    @classmethod
    def bench(cls) -> "GPTConfig":
        """About 20 million parameters: the benchmarks."""
        return cls(block_size=128, n_layer=6, n_head=8, n_embd=512)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        B, T, C = x.shape
        # chunk and -1, not C and n_head: under tensor parallelism qkv yields only this rank's heads (3C/N wide)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, -1, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, H, T, T)
        att = att.masked_fill(~self.causal_mask[:, :, :T, :T], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)


class Block(nn.Module):
    """One pre-LN transformer block: the unit FSDP wraps."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A character-level GPT whose output is the loss when targets are given."""

    def __init__(self, cfg: GPTConfig | None = None, seed: int = 0):
        super().__init__()
        cfg = cfg or GPTConfig.tiny()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.tok_emb.weight  # weight tying
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx, targets: (B, T) int64. Returns the mean cross-entropy if targets, else logits (B, T, V)."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class MLP(nn.Module):
    """A plain multi-layer perceptron, ``dims=(in, hidden..., out)``; returns outputs, not a loss."""

    def __init__(self, dims: tuple[int, ...] = (16, 32, 32, 8), seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers: list[nn.Module] = []
            for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
                layers.append(nn.Linear(a, b))
                if i < len(dims) - 2:
                    layers.append(nn.ReLU())
            self.net = nn.Sequential(*layers)
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def batch(self, step: int, batch_size: int = 8, rank: int = 0, world_size: int = 1):
        """A deterministic regression batch (x, y) for (step, rank): rank r gets rows r::world_size."""
        g = torch.Generator().manual_seed(10_000 + step)
        x = torch.randn(batch_size * world_size, self.dims[0], generator=g)
        y = torch.randn(batch_size * world_size, self.dims[-1], generator=g)
        return x[rank::world_size].contiguous(), y[rank::world_size].contiguous()


DATA_DIR = Path(__file__).resolve().parent / "data"


def load_corpus() -> str:
    """The shipped character corpus (the book's chapter 1 text)."""
    return (DATA_DIR / "corpus.txt").read_text(encoding="utf-8")


class CharCorpus:
    """Characters -> token ids; the vocabulary is capped at ``vocab_size`` (rare chars map to 0)."""

    def __init__(self, text: str | None = None, vocab_size: int = 96):
        text = text if text is not None else load_corpus()
        counts: dict[str, int] = {}
        for ch in text:
            counts[ch] = counts.get(ch, 0) + 1
        common = sorted(counts, key=lambda c: (-counts[c], c))[: vocab_size - 1]
        self.stoi = {ch: i + 1 for i, ch in enumerate(common)}  # 0 = unknown
        self.itos = {i: ch for ch, i in self.stoi.items()}
        self.vocab_size = vocab_size
        self.data = torch.tensor([self.stoi.get(ch, 0) for ch in text], dtype=torch.long)

    def batch(self, step: int, batch_size: int, block_size: int, rank: int = 0, world_size: int = 1):
        """The (x, y) pair rank ``rank`` trains on at ``step``: shape (batch_size, block_size) each.

        The global batch (batch_size * world_size rows) depends only on ``step``,
        so 1 rank with a global batch and N ranks with 1/N each see the same data.
        """
        g = torch.Generator().manual_seed(step)
        n_rows = batch_size * world_size
        starts = torch.randint(0, len(self.data) - block_size - 1, (n_rows,), generator=g)
        starts = starts[rank * batch_size : (rank + 1) * batch_size]
        x = torch.stack([self.data[s : s + block_size] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1 : s + 1 + block_size] for s in starts.tolist()])
        return x, y
