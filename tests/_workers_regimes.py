"""Rank functions for tests/test_fsdp_regimes.py: regimes a user hits, ours against torch FSDP1.

Each runs ours and torch FSDP1 (``device_id=cpu``) on the same seed, data and wrapping, and
returns what a user would look at (losses, full parameters, state dicts) plus what the
case is about (a handle's state at a given moment, how many all-gathers ran).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy as torch_lambda_policy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy

from minifsdp.fsdp import FSDP, BackwardPrefetch, MixedPrecision, ShardingStrategy
from minifsdp.fsdp.core.units import clean_name
from minifsdp.fsdp.full_state_dict import full_state_dict
from minifsdp.fsdp.torch_options import size_based_auto_wrap_policy
from minifsdp.models import Block as GPTBlock
from minifsdp.models import GPTConfig, TinyGPT

STEPS = 3
SIDES = ("ours", "torch")


def mlp_model(seed: int = 0) -> nn.Module:
    """Sizes no world size in {2, 3} divides (padding); Linear(5, 13) and (13, 11) are their own units."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 13), nn.ReLU(), nn.Linear(13, 11), nn.ReLU(), nn.Linear(11, 3))


def _batch(step: int, rank: int, rows: int = 4, dim: int = 5):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, dim, generator=g), torch.randn(rows, 3, generator=g)


def _wrap(side: str, model: nn.Module, strategy: str = "FULL_SHARD", mp: dict | None = None,
          use_orig_params: bool = False, policy=None, **kwargs):
    """Wrap ``model`` with ours or torch's FSDP1, the same arguments (``policy``: a predicate on modules)."""
    if side == "ours":
        wrap_policy = (functools.partial(size_based_auto_wrap_policy, min_num_params=40) if policy is None
                       else functools.partial(_lambda_policy, fn=policy))
        return FSDP(model, sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=wrap_policy,
                    mixed_precision=MixedPrecision(**mp) if mp else None, use_orig_params=use_orig_params,
                    **kwargs)
    wrap_policy = (functools.partial(torch_size_policy, min_num_params=40) if policy is None
                   else functools.partial(torch_lambda_policy, lambda_fn=policy))
    return TorchFSDP(model, sharding_strategy=TorchStrategy[strategy], auto_wrap_policy=wrap_policy,
                     mixed_precision=TorchMixedPrecision(**mp) if mp else None, use_orig_params=use_orig_params,
                     device_id=torch.device("cpu"), **kwargs)


def _lambda_policy(module, recurse, nonwrapped_numel, fn):
    """Ours, with torch's ``lambda_auto_wrap_policy`` semantics: always recurse, wrap where ``fn`` says."""
    return True if recurse else bool(fn(module))


def _full_named(model) -> list[tuple[str, torch.Tensor]]:
    """Inside summon_full_params, as torch users read it: named_parameters() of the wrapped model."""
    with type(model).summon_full_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


# ---------------------------------------------------------------------- 1. NO_SHARD + MixedPrecision
def mixed_precision_no_shard_worker(strategy: str, mp: dict, use_orig_params: bool, no_sync: bool) -> dict:
    """3 SGD steps under ``MixedPrecision(**mp)``; with ``no_sync`` a kept no_sync micro-batch before each."""
    rank = dist.get_rank()
    out = {}
    for side in SIDES:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = _wrap(side, mlp_model(), strategy, mp, use_orig_params)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses, grad_dtypes = [], []
        for step in range(STEPS):
            if no_sync:
                with model.no_sync():
                    x, y = _batch(100 + step, rank)
                    F.mse_loss(model(x).float(), y).backward()
            x, y = _batch(step, rank)
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            grad_dtypes.append(sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[side] = dict(losses=losses, full=_full_named(model), grad_dtypes=grad_dtypes,
                         strategy=model.sharding_strategy.name,
                         warnings=[str(w.message) for w in caught if "NO_SHARD" in str(w.message)])
    return out


# ---------------------------------------------------------------------- 2. frozen units
class _ProbeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.probe.record(ctx.probe.tag)  # autograd has computed the gradient of this point's output
        return grad, None


class Probe(nn.Module):
    """Identity; in the backward, calls ``self.record(self.tag)`` when autograd gets there."""

    def __init__(self, tag: str):
        super().__init__()
        self.tag = tag
        self.record = lambda tag: None

    def forward(self, x):
        return _ProbeFn.apply(x, self)


class Block(nn.Module):
    """A residual Linear(8, 8): 72 parameters, its own unit; a probe inside it (in its backward)."""

    def __init__(self, i: int):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.probe = Probe(f"in {i}")

    def forward(self, x):
        return torch.relu(self.probe(self.fc(x))) + x


FROZEN = (1, 2, 3)  # blocks 1..3 of 0..4 are frozen (a LoRA-style run freezes most of a model)


def frozen_model(seed: int = 0) -> nn.Sequential:
    """Linear(5, 8), then 5 x (Block, Probe), then Linear(8, 3); blocks 1, 2, 3 frozen.

    In the backward, probe ``"in i"`` runs inside block i's backward, ``"after i"`` once
    autograd is past block i + 1 (it computed the gradient of block i + 1's input).
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(5, 8)]
    for i in range(5):
        block = Block(i)
        block.requires_grad_(i not in FROZEN)
        layers += [block, Probe(f"after {i}")]
    layers.append(nn.Linear(8, 3))
    return nn.Sequential(*layers)


def _live(model) -> dict[str, int]:
    """{unit name: numel} of every non-root unit whose full (unsharded) parameters exist now."""
    out = {}
    for name, m in model.named_modules():
        h = getattr(m, "_handle", None)
        if m is model or h is None or not isinstance(m, (FSDP, TorchFSDP)):
            continue
        if isinstance(m, TorchFSDP):  # the padded all-gather buffer: its storage is 0 bytes while freed
            flat = h.flat_param
            alive, numel = flat._full_param_padded.untyped_storage().size() > 0, flat._unpadded_unsharded_size.numel()
        else:
            alive, numel = h.padded.untyped_storage().size() > 0, h.layout.numel
        if alive:
            out[clean_name(name)] = numel
    return out


def frozen_units_worker(backward_prefetch: str | None, use_orig_params: bool) -> dict:
    """3 SGD steps; at every probe in each backward, which units' full parameters are alive."""
    rank = dist.get_rank()
    out = {}
    for side in SIDES:
        model = frozen_model()
        prefetch = (BackwardPrefetch if side == "ours" else TorchBackwardPrefetch)[backward_prefetch] \
            if backward_prefetch else None
        model = _wrap(side, model, policy=lambda m: isinstance(m, Block), use_orig_params=use_orig_params,
                      backward_prefetch=prefetch)
        snapshots: list = []
        for probe in (m for m in model.modules() if isinstance(m, Probe)):
            probe.record = functools.partial(lambda snaps, m, tag: snaps.append((tag, _live(m))), snapshots, model)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        losses, per_step = [], []
        for step in range(STEPS):
            x, y = _batch(step, rank, dim=5)
            loss = F.mse_loss(model(x), y)
            snapshots.clear()
            loss.backward()
            per_step.append([(tag, sorted(alive)) for tag, alive in snapshots])
            peak = max(sum(alive.values()) for _, alive in snapshots)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[side] = dict(losses=losses, full=_full_named(model), live=per_step, peak=peak,
                         after_backward=sorted(_live(model)))
    return out


# ---------------------------------------------------------------------- 3. a weight tied across units
def _gpt_with_head_unit(own: str = "lm_head"):
    """TinyGPT (tok_emb.weight tied to lm_head.weight); the policy makes each Block and ``own`` (``lm_head``,
    ``tok_emb``, or both: ``tok_emb+lm_head``) a unit."""
    model = TinyGPT(GPTConfig.tiny(), seed=0)
    for name in own.split("+"):
        getattr(model, name)._own_unit = True
    return model, (lambda m: isinstance(m, GPTBlock) or getattr(m, "_own_unit", False))


def _tokens(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    vocab = GPTConfig.tiny().vocab_size
    return torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g)


def tied_across_units_worker(use_orig_params: bool, strategy: str = "FULL_SHARD", own: str = "lm_head") -> dict:
    """3 AdamW steps with ``own`` its own unit; losses, full parameters, state dict, warnings or the error."""
    rank = dist.get_rank()
    out = {}
    for side in SIDES:
        model, policy = _gpt_with_head_unit(own)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model = _wrap(side, model, strategy, policy=policy, use_orig_params=use_orig_params)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                losses = []
                for step in range(STEPS):
                    loss = model(*_tokens(step, rank))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
            except Exception as e:  # noqa: BLE001 - the message is the result
                out[side] = dict(error=f"{type(e).__name__}: {e}")
                continue
        sd = model.state_dict()
        out[side] = dict(losses=losses, full=_full_named(model), state_dict={k: v.clone() for k, v in sd.items()},
                         warnings=[str(w.message) for w in caught if "tied" in str(w.message)])
    return out


def tied_across_units_cases(cases) -> list[dict]:
    """:func:`tied_across_units_worker` for each (use_orig_params, strategy, own) in ``cases``, one spawn."""
    return [tied_across_units_worker(*case) for case in cases]


# ---------------------------------------------------------------------- 4. all-gathers under no_sync
ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")  # torch FSDP1 on CPU: all_gather


@contextlib.contextmanager
def _on_each_all_gather(callback):
    """Call ``callback()`` at every all-gather issued inside (outermost calls only: one may call another)."""
    saved = {name: getattr(dist, name) for name in ALL_GATHERS if hasattr(dist, name)}
    depth = [0]

    def spied(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                callback()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name, fn in saved.items():
        setattr(dist, name, spied(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def counting_all_gathers():
    """Count the all-gathers issued inside, ours and torch's alike."""
    calls = [0]
    with _on_each_all_gather(lambda: calls.__setitem__(0, calls[0] + 1)):
        yield calls


def no_sync_all_gathers_worker(strategy: str) -> dict:
    """2 steps of 3 micro-batches (2 under no_sync, then a synced one); all-gathers in each forward and backward."""
    rank = dist.get_rank()
    out = {}
    for side in SIDES:
        model = _wrap(side, mlp_model(), strategy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        counts, losses = [], []
        for step in range(2):
            for micro in range(3):
                with model.no_sync() if micro < 2 else contextlib.nullcontext():
                    x, y = _batch(10 * step + micro, rank)
                    with counting_all_gathers() as forward:
                        loss = F.mse_loss(model(x), y)
                    with counting_all_gathers() as backward:
                        loss.backward()
                counts.append((forward[0], backward[0]))
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[side] = dict(counts=counts, losses=losses, full=_full_named(model))
    return out


def stepped_after_no_grad_forward_worker(strategy: str) -> dict:
    """Ours: 3 steps, with and without a no-grad forward between the backward and the optimizer step."""
    rank = dist.get_rank()
    out = {}
    for eval_between in (False, True):
        model = _wrap("ours", mlp_model(), strategy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(STEPS):
            x, y = _batch(step, rank)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if eval_between:
                with torch.no_grad():
                    model(x)  # the root (and SHARD_GRAD_OP's units) keep their full parameters after it
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[eval_between] = dict(losses=losses, full=_full_named(model))
    return out


# ---------------------------------------------------------------------- 5. state dicts
def _gpt_blocks(side: str, use_orig_params: bool, seed: int = 0):
    """TinyGPT with each Block its own unit (the tie stays inside the root)."""
    return _wrap(side, TinyGPT(GPTConfig.tiny(), seed=seed), policy=lambda m: isinstance(m, GPTBlock),
                 use_orig_params=use_orig_params)


@contextlib.contextmanager
def recording_live_at_all_gathers(model, record: list):
    """At every all-gather issued inside: which non-root units' full parameters exist already."""
    with _on_each_all_gather(lambda: record.append(sorted(_live(model)))):
        yield record


def _state_dict(side: str, model, rank0_only: bool):
    if side == "ours":
        return full_state_dict(model, rank0_only=rank0_only)
    config = FullStateDictConfig(rank0_only=rank0_only)
    with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return model.state_dict()


def state_dict_worker(use_orig_params: bool, rank0_only: bool) -> dict:
    """One AdamW step, then the full state dict (what each rank gets, which units are alive at each
    all-gather); then load it into a fresh model, strict and not, with a key missing and one extra."""
    rank = dist.get_rank()
    out = {}
    for side in SIDES:
        model = _gpt_blocks(side, use_orig_params)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(*_tokens(0, rank)).backward()
        opt.step()
        opt.zero_grad()
        live: list = []
        with recording_live_at_all_gathers(model, live):
            sd = _state_dict(side, model, rank0_only)
        res = dict(keys=list(sd), values=[v.clone() for v in sd.values()], live=live, after=sorted(_live(model)))
        if not rank0_only:
            fresh = _gpt_blocks(side, use_orig_params, seed=1)
            res["loaded"] = repr(fresh.load_state_dict(sd))
            res["after_load"] = _full_named(fresh)
            partial = {k: v for k, v in sd.items() if k != "ln_f.bias"}
            partial["head.extra"] = torch.zeros(2)
            res["non_strict"] = repr(fresh.load_state_dict(partial, strict=False))
            try:
                fresh.load_state_dict(partial)
            except RuntimeError as e:
                res["strict"] = str(e)
            res["refused_left_alone"] = all(torch.equal(a, b) for (_, a), (_, b) in zip(res["after_load"],
                                                                                      _full_named(fresh)))
        out[side] = res
    return out
