"""Reference solution of project-zero1 (left out of the student edition): ZeRO stage 1 on a flat layout.

Every trainable parameter, flattened and concatenated in order, is one flat vector of P numbers,
padded to a multiple of N and cut into N equal slices; rank r owns slice r::

    flat (P numbers, padded)   |  wte ....... | wpe . | blocks.0 ...... | ... | pad |
    owner                      |<-- rank 0 ---------->|<-- rank 1 ----------->|<-- rank 2 -->|

The local optimizer is built over *pieces*: for each parameter that overlaps this rank's slice, a view
of exactly the overlapping numbers of that parameter (``p.data.view(-1)[a:b]``, no copy).  So the
optimizer updates the parameters in place and keeps state (Adam's m and v, SGD's momentum) for 1/N
of the numbers only; no copy of the weights is kept.

One step::

    grads   -> one flat buffer -> all-reduce (sum), / N       every rank: the averaged gradient
    pieces' .grad = their slice of that buffer                 the local optimizer's view of it
    local optimizer.step()                                     rank r's slice of the weights is new
    all-gather the slices -> copy into every parameter         every rank: every new weight

Frozen parameters (``requires_grad=False``) stay out of the flat vector: a weight decay would otherwise
move a weight no one trains.  Tied parameters are one tensor and appear once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Zero1"]


class Zero1:
    """ZeRO-1: each rank keeps optimizer state for 1/N of the parameters; every rank keeps all weights."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        params = list(params)
        seen, self.params = set(), []
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"Zero1 takes tensors (one parameter group), got {type(p).__name__}")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError("Zero1 got no parameter that requires grad: nothing to optimize")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.shard = -(-self.numel // self.world)  # numbers per rank, padding included
        lo, hi = self.rank * self.shard, min((self.rank + 1) * self.shard, self.numel)
        self.pieces = []  # (param, start in the flat vector, start in the param, length) owned by this rank
        offset = 0
        for p in self.params:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                self.pieces.append((p, a, a - offset, b - a))
            offset += p.numel()
        self.views = [p.detach().view(-1).narrow(0, start, n) for p, _, start, n in self.pieces]
        self.optimizer = optimizer_class(self.views, **defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def step(self) -> None:
        padded = self.shard * self.world
        flat = torch.zeros(padded, dtype=self.params[0].dtype)  # first the gradients, then the weights
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat[offset : offset + p.numel()].copy_(p.grad.view(-1))
            offset += p.numel()
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)
        for view, (_, at, _, n) in zip(self.views, self.pieces, strict=True):
            view.grad = flat[at : at + n]
        self.optimizer.step()
        for view, (_, at, _, n) in zip(self.views, self.pieces, strict=True):
            view.grad = None
            flat[at : at + n].copy_(view)  # the gradient's place now holds the new weights we own
        mine = flat[self.rank * self.shard : (self.rank + 1) * self.shard].clone()
        dist.all_gather_into_tensor(flat, mine, group=self.group)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.view(-1).copy_(flat[offset : offset + p.numel()])
                offset += p.numel()
