"""The models the fuzzer draws: small trees of blocks, built from a plain description (a dict), as users write them.

A program's model is a root :class:`Net` over a container of :class:`Block` s::

    Net
      inp      Linear(d_in, d)            or  Embedding(vocab, d) for token inputs
      blocks   Sequential | ModuleList | ModuleDict of Block (the same Block twice: a module called twice)
      head     Linear(d, d_out)           its weight tied to the embedding's where asked

    Block (kind)   linear: Linear+ReLU     mlp: Linear-GELU-Linear, residual    norm: LayerNorm, Linear
                   bn: BatchNorm1d, Linear (a 0-dim buffer)     conv: Conv1d over the features
                   twice: one Linear called twice                unused: a Linear that never runs
                   nested: Blocks inside a Block that has its own Linear

Every block returns its result as users do, in one of seven containers (``ret``): a tensor, a tuple, a dict,
a dict subclass, an ``OrderedDict``, a namedtuple or a dataclass, each holding the hidden state and an
``aux`` tensor that reaches the loss.  FSDP finds the tensors in a unit's output to hook its backward, so
the container a wrapped block returns is where ours and torch can part (``tests/test_fuzz.py``).

Sizes are drawn so that no world size from 2 to 4 divides them (padding everywhere).  Everything here is
plain torch: the same description builds the same numbers for torch's FSDP and ours.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "Net", "build_model", "RETURNS", "KINDS", "main_and_aux", "loss_of"]

RETURNS = ("tensor", "tuple", "dict", "dict_subclass", "ordered_dict", "namedtuple", "dataclass")
KINDS = ("linear", "mlp", "norm", "bn", "conv", "twice", "unused", "nested")


class Out(dict):
    """A dict subclass, as Hugging Face's ``ModelOutput`` is one."""


HiddenAux = collections.namedtuple("HiddenAux", ["hidden", "aux"])


@dataclasses.dataclass
class BlockOutput:
    hidden: torch.Tensor
    aux: torch.Tensor


def pack(hidden: torch.Tensor, aux: torch.Tensor, ret: str):
    """``hidden`` and ``aux`` in the container ``ret`` names (a bare tensor drops ``aux``)."""
    return {"tensor": lambda: hidden, "tuple": lambda: (hidden, aux), "dict": lambda: {"hidden": hidden, "aux": aux},
            "dict_subclass": lambda: Out(hidden=hidden, aux=aux),
            "ordered_dict": lambda: collections.OrderedDict(hidden=hidden, aux=aux),
            "namedtuple": lambda: HiddenAux(hidden, aux), "dataclass": lambda: BlockOutput(hidden, aux)}[ret]()


def main_and_aux(out) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The hidden state and the aux tensors (if any) out of whatever :func:`pack` made."""
    if isinstance(out, torch.Tensor):
        return out, []
    if isinstance(out, BlockOutput):
        return out.hidden, [out.aux]
    if isinstance(out, dict):
        return out["hidden"], [out["aux"]]
    return out[0], [out[1]]


class Block(nn.Module):
    """One block of ``kind`` on width ``d``; returns ``(hidden, aux)`` packed as ``ret``."""

    def __init__(self, kind: str, d: int, hidden: int = 5, ret: str = "tensor", children=()):
        super().__init__()
        self.kind, self.ret = kind, ret
        if kind == "linear":
            self.fc = nn.Linear(d, d)
        elif kind == "mlp":
            self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)
        elif kind == "norm":
            self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)
        elif kind == "bn":
            self.bn, self.fc = nn.BatchNorm1d(d), nn.Linear(d, d)
        elif kind == "conv":
            self.conv = nn.Conv1d(1, 2, kernel_size=3, padding=1)
            self.fc = nn.Linear(2 * d, d)
        elif kind == "twice":
            self.fc = nn.Linear(d, d)
        elif kind == "unused":
            self.fc, self.spare = nn.Linear(d, d), nn.Linear(d, hidden)
        elif kind == "nested":
            self.fc = nn.Linear(d, d)
            self.inner = nn.ModuleList(children)
        else:
            raise ValueError(f"unknown block kind {kind!r}; one of {KINDS}")

    def forward(self, x):
        aux = []
        if self.kind in ("linear", "unused"):
            h = torch.relu(self.fc(x))
        elif self.kind == "mlp":
            h = x + self.down(F.gelu(self.up(x)))
        elif self.kind == "norm":
            h = self.fc(self.norm(x))
        elif self.kind == "bn":
            h = self.fc(self.bn(x))
        elif self.kind == "conv":
            h = self.fc(torch.tanh(self.conv(x.unsqueeze(1))).flatten(1))
        elif self.kind == "twice":
            h = self.fc(torch.tanh(self.fc(x)))
        else:  # nested
            h = torch.tanh(self.fc(x))
            for child in self.inner:
                h, more = main_and_aux(child(h))
                aux += more
        aux_total = h.pow(2).mean(dim=-1)
        for a in aux:
            aux_total = aux_total + a
        return pack(h, aux_total, self.ret)


class Net(nn.Module):
    """The root: input layer, a container of blocks, a head; returns ``(prediction, aux)`` packed as ``ret``."""

    def __init__(self, spec: dict):
        super().__init__()
        d = spec["d"]
        self.tokens, self.ret = spec["input"] == "tokens", spec["out"]
        self.inp = nn.Embedding(spec["vocab"], d) if self.tokens else nn.Linear(spec["d_in"], d)
        blocks = [_block(b, d) for b in spec["blocks"]]
        self.order = list(range(len(blocks))) + ([spec["repeat"]] if spec.get("repeat") is not None else [])
        container = spec["container"]
        if container == "sequential":
            self.blocks = nn.Sequential(*blocks)
        elif container == "modulelist":
            self.blocks = nn.ModuleList(blocks)
        else:
            self.blocks = nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
        self.head = nn.Linear(d, spec["d_out"], bias=not spec.get("tie", False))
        if spec.get("tie", False):
            self.head.weight = self.inp.weight  # (vocab, d) both: a weight used twice

    def forward(self, x):
        h = self.inp(x)
        blocks = list(self.blocks.values()) if isinstance(self.blocks, nn.ModuleDict) else list(self.blocks)
        aux = []
        for i in self.order:  # spec["repeat"]: that block runs again at the end
            h, more = main_and_aux(blocks[i](h))
            aux += more
        total = torch.zeros((), dtype=h.dtype, device=h.device)
        for a in aux:
            total = total + a.float().mean().to(h.dtype)
        return pack(self.head(h), total, self.ret)


def _block(spec: dict, d: int) -> Block:
    children = [_block(c, d) for c in spec.get("children", ())]
    return Block(spec["kind"], d, spec.get("hidden", 5), spec.get("ret", "tensor"), children)


def build_model(spec: dict, seed: int) -> Net:
    """The model ``spec`` describes, initialised from ``seed``, with the parameters ``spec`` freezes frozen."""
    torch.manual_seed(seed)
    model = Net(spec)
    for name, p in model.named_parameters():
        if any(name.startswith(prefix) for prefix in spec.get("frozen", ())):
            p.requires_grad_(False)
    return model


def batch(spec: dict, step: int, rank: int, dtype=torch.float32):
    """(input, target) of one step on one rank: each rank its own data, as data parallelism has it."""
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 3)
    rows = spec["batch"]
    if spec["input"] == "tokens":
        x = torch.randint(0, spec["vocab"], (rows,), generator=g)
    else:
        x = torch.randn(rows, spec["d_in"], generator=g).to(dtype)
    return x, torch.randn(rows, spec["d_out"], generator=g)


def loss_of(out, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the prediction, in fp32, plus a tenth of the aux terms."""
    pred, aux = main_and_aux(out)
    loss = F.mse_loss(pred.float(), target)
    for a in aux:
        loss = loss + 0.1 * a.float()
    return loss
