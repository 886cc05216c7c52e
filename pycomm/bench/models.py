"""The benchmark's models and their synthetic data: an MLP stack and a small GPT-style
transformer (pre-LayerNorm blocks of causal self-attention and a 4x MLP, tied embeddings).

Both are sized by flags, from about 1M to 100M+ parameters; :func:`count_params` builds the
model on the meta device, so the parent can check the size before any rank starts.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

MODELS = ("mlp", "transformer")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What to build and feed it.

    ``mlp``: ``layers`` Linear(width, width) with ReLU between, input and target
    ``batch x width`` Gaussian, MSE loss. ``transformer``: ``layers`` GPT blocks of ``d_model``
    with ``heads`` heads over ``seq_len`` tokens of a ``vocab``-token vocabulary, random token
    ids in and as targets, cross-entropy; ``batch`` is sequences.

    Example:
        >>> spec = ModelSpec("transformer", layers=2, batch=4, d_model=64, heads=4)
        >>> count_params(spec)
        628480
    """

    kind: str = "mlp"
    layers: int = 8
    batch: int = 64
    width: int = 1024
    d_model: int = 256
    heads: int = 4
    seq_len: int = 64
    vocab: int = 8192

    def config(self) -> dict[str, object]:
        """The fields that matter for this kind of model (``ModelSpec(**config)`` rebuilds it)."""
        keys = ["kind", "layers", "batch"]
        keys += ["width"] if self.kind == "mlp" else ["d_model", "heads", "seq_len", "vocab"]
        return {k: getattr(self, k) for k in keys}

    def describe(self, params: Optional[int] = None) -> str:
        """One line for the report, e.g. ``MLP 8x1024 = 8.4M params, batch 64/rank``."""
        size = f" = {format_count(params)} params" if params else ""
        if self.kind == "mlp":
            return f"MLP {self.layers}x{self.width}{size}, batch {self.batch}/rank"
        return (
            f"GPT {self.layers} blocks x d_model {self.d_model} ({self.heads} heads), "
            f"vocab {self.vocab}{size}, batch {self.batch}x{self.seq_len} tokens/rank"
        )


def format_count(n: int) -> str:
    """``8396800`` -> ``8.4M``, ``1152`` -> ``1152``.

    Example:
        >>> format_count(109_225_984)
        '109.2M'
    """
    return f"{n / 1e6:.1f}M" if n >= 10**5 else str(n)


class Block(torch.nn.Module):
    """A pre-LayerNorm GPT block: x + attn(ln(x)), then x + mlp(ln(x)); causal attention."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.fc1 = torch.nn.Linear(d_model, 4 * d_model)
        self.fc2 = torch.nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm, and a language-model
    head that shares the token embedding's weight."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(spec.vocab, spec.d_model)
        self.pos = torch.nn.Embedding(spec.seq_len, spec.d_model)
        self.blocks = torch.nn.Sequential(
            *(Block(spec.d_model, spec.heads) for _ in range(spec.layers))
        )
        self.ln = torch.nn.LayerNorm(spec.d_model)
        self.head = torch.nn.Linear(spec.d_model, spec.vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def build(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    """The model, initialized from ``seed`` (every rank and every hook gets the same weights).

    Example:
        >>> model = build(ModelSpec("mlp", layers=2, width=16))
    """
    torch.manual_seed(seed)
    if spec.kind == "mlp":
        mods: list[torch.nn.Module] = []
        for _ in range(spec.layers):
            mods += [torch.nn.Linear(spec.width, spec.width), torch.nn.ReLU()]
        return torch.nn.Sequential(*mods[:-1])
    if spec.kind == "transformer":
        return GPT(spec)
    raise ValueError(f"model {spec.kind!r} is not one of {', '.join(MODELS)}")


def count_params(spec: ModelSpec) -> int:
    """Trainable parameters (a shared tensor once), counted on the meta device: no memory.

    Example:
        >>> count_params(ModelSpec("mlp", layers=8, width=1024))
        8396800
    """
    with torch.device("meta"):
        model = build(spec)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


Batch = tuple[torch.Tensor, torch.Tensor]


def batches(spec: ModelSpec, count: int, generator: torch.Generator) -> list[Batch]:
    """``count`` synthetic (input, target) micro-batches for one rank.

    Example:
        >>> xs = batches(ModelSpec("mlp", width=16, batch=2), 1, torch.Generator())
    """
    out = []
    for _ in range(count):
        if spec.kind == "mlp":
            x = torch.randn(spec.batch, spec.width, generator=generator)
            y = torch.randn(spec.batch, spec.width, generator=generator)
        else:
            shape = (spec.batch, spec.seq_len)
            x = torch.randint(spec.vocab, shape, generator=generator)
            y = torch.randint(spec.vocab, shape, generator=generator)
        out.append((x, y))
    return out


def loss_fn(spec: ModelSpec, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The scalar loss of one micro-batch: MSE for the MLP, cross-entropy for the transformer."""
    x, y = batch
    out = model(x)
    if spec.kind == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
