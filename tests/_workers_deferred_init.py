"""Rank functions for tests/test_deferred_init.py: a meta-device TinyGPT wrapped by ours and by torch FSDP1.

``cases(world_cases)`` runs every named case on this rank and returns a dict of small, picklable results
(the test reads them); an exception inside a case becomes ``("error", type, message)`` so one broken case does
not hide the others' results.  Every case is collective-safe: each rank raises at the same point or not at all.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_block_policy

from minifsdp.fsdp import FSDP
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.fsdp.deferred_init import tinygpt_param_init_fn
from minifsdp.fsdp.torch_options import size_based_auto_wrap_policy
from minifsdp.memory.tracker import MemoryTracker, without_resident
from minifsdp.models import Block, CharCorpus, GPTConfig, TinyGPT
from tests._workers_fsdp import _error_of  # (type name, message) of what fn raises, or None

STEPS, BATCH = 3, 4
CPU = torch.device("cpu")
_CORPUS: list = []


def meta_gpt(n_layer: int = 2) -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT(GPTConfig(n_layer=n_layer), seed=0)


def block_policy(ours: bool):
    fn = transformer_auto_wrap_policy if ours else torch_block_policy
    return functools.partial(fn, transformer_layer_cls={Block})


def recording(fn, log: list):
    """``fn``, with each module it is called on appended to ``log`` as (class name, its own meta tensors)."""
    def recorded(m):
        log.append((type(m).__name__, sum(t.is_meta for t in list(m._parameters.values()) + list(m._buffers.values())
                                          if t is not None)))
        fn(m)
    return recorded


def wrap(impl: str, model, fn, **kwargs):
    if impl == "ours":
        return FSDP(model, auto_wrap_policy=block_policy(True), param_init_fn=fn, device_id=CPU, **kwargs)
    return TorchFSDP(model, auto_wrap_policy=block_policy(False), param_init_fn=fn, device_id=CPU,
                     use_orig_params=False, **kwargs)


def full_state(impl: str, model) -> dict[str, torch.Tensor]:
    """Every full parameter and buffer under its plain name (summon_full_params, rank 0's view = everyone's)."""
    summon = FSDP.summon_full_params if impl == "ours" else TorchFSDP.summon_full_params
    with summon(model):
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
        return {_plain(n): t.detach().clone() for n, t in named}


def _plain(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_flat_param"))


def tie_kept(impl: str, model) -> bool:
    summon = FSDP.summon_full_params if impl == "ours" else TorchFSDP.summon_full_params
    with summon(model):
        inner = model.module
        return inner.lm_head.weight is inner.tok_emb.weight


def train_gpt(model, rank: int, world: int) -> list[float]:
    if not _CORPUS:
        _CORPUS.append(CharCorpus())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _CORPUS[0].batch(step, BATCH, 32, rank, world)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def case_parity(rank, world):
    """Meta TinyGPT + tinygpt_param_init_fn(seed 0): ours and torch FSDP1, then 3 AdamW steps each."""
    out = {}
    for impl in ("ours", "torch"):
        model, calls = meta_gpt(), []
        fsdp = wrap(impl, model, recording(tinygpt_param_init_fn(model, seed=0), calls))
        out[impl] = {
            "calls": calls,
            "shards": [p.detach().clone() for p in fsdp.parameters()],
            "full_at_wrap": full_state(impl, fsdp),
            "tied": tie_kept(impl, fsdp),
            "losses": train_gpt(fsdp, rank, world),
        }
        out[impl]["full_after"] = full_state(impl, fsdp)
        out[impl]["shards_after"] = [p.detach().clone() for p in fsdp.parameters()]
    model = meta_gpt()  # the planted fault: another seed in param_init_fn (the comparisons must see it)
    fault = wrap("ours", model, tinygpt_param_init_fn(model, seed=1))
    out["fault"] = {"shards": [p.detach().clone() for p in fault.parameters()], "full": full_state("ours", fault)}
    ref = TinyGPT(GPTConfig(n_layer=2), seed=0)
    out["reference"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return out


def reset_model() -> nn.Module:
    """Linear / LayerNorm / Embedding-free MLP whose every module defines reset_parameters (no ties)."""
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 8))


def case_reset(rank, world):
    """No param_init_fn: to_empty + reset_parameters() per module, same global seed on every rank."""
    out = {}
    for impl in ("ours", "torch"):
        with torch.device("meta"):
            model = reset_model()
        torch.manual_seed(123)  # reset_parameters draws from the global generator, unit by unit
        if impl == "ours":
            fsdp = FSDP(model, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=500),
                        device_id=CPU)
        else:
            fsdp = TorchFSDP(model, auto_wrap_policy=functools.partial(torch_size_policy, min_num_params=500),
                             device_id=CPU, use_orig_params=False)
        shards = [p.detach().clone() for p in fsdp.parameters()]
        opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(BATCH * world, 16, generator=g), torch.randn(BATCH * world, 8, generator=g)
            loss = F.mse_loss(fsdp(x[rank::world]), y[rank::world])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        after = [p.detach().clone() for p in fsdp.parameters()]
        out[impl] = {"shards": shards, "losses": losses, "shards_after": after}
    return out


def _materialize_all_first(model, fn):
    """The fault the memory check exists for: the first call materialises the whole model at once."""
    done = []

    def greedy(m):
        if not done:
            done.append(True)
            for sub in model.modules():
                fn(sub)
        fn(m)
    return greedy


def case_memory(rank, world, n_layer=6):
    """Peak live tensor bytes during the wrap (MemoryTracker, less what was alive before) vs the full model."""
    full_bytes = sum(p.numel() * p.element_size() for p in TinyGPT(GPTConfig(n_layer=n_layer)).parameters())
    full_bytes += sum(b.numel() * b.element_size() for b in TinyGPT(GPTConfig(n_layer=n_layer)).buffers())
    out = {"full_bytes": full_bytes}
    for label, impl, greedy in (("ours", "ours", False), ("torch", "torch", False), ("ours_greedy", "ours", True)):
        model = meta_gpt(n_layer)
        fn = tinygpt_param_init_fn(model, seed=0)
        if greedy:
            fn = _materialize_all_first(model, fn)
        with MemoryTracker() as mt:
            fsdp = wrap(impl, model, fn)
        out[label] = {"peak": without_resident(mt.breakdown_at_peak)["total"],
                      "at_rest": sum(p.numel() * p.element_size() for p in fsdp.parameters())
                      + sum(b.numel() * b.element_size() for b in fsdp.buffers())}
        del fsdp, model, fn
    return out


def case_sync(rank, world):
    """sync_module_states=True: ranks seeded differently end with rank 0's weights (TinyGPT(seed=0))."""
    out = {}
    model = meta_gpt()  # meta, each rank materialises seed=rank, then rank 0's win unit by unit
    fsdp = FSDP(model, auto_wrap_policy=block_policy(True), param_init_fn=tinygpt_param_init_fn(model, seed=rank),
                sync_module_states=True)
    out["meta"] = full_state("ours", fsdp)
    out["meta_tied"] = tie_kept("ours", fsdp)
    plain = FSDP(TinyGPT(GPTConfig(n_layer=2), seed=10 + rank), auto_wrap_policy=block_policy(True),
                 sync_module_states=True)
    out["plain"] = full_state("ours", plain)
    out["reference"] = {k: v.detach().clone() for k, v in TinyGPT(GPTConfig(n_layer=2), seed=0).state_dict().items()}
    out["reference10"] = {k: v.detach().clone() for k, v in
                          TinyGPT(GPTConfig(n_layer=2), seed=10).state_dict().items()}
    out["unsynced_differs"] = not torch.equal(TinyGPT(GPTConfig(n_layer=2), seed=10 + rank).tok_emb.weight,
                                              out["reference10"]["tok_emb.weight"])
    out["torch_cpu"] = _error_of(lambda: TorchFSDP(TinyGPT(GPTConfig(n_layer=2), seed=0), device_id=CPU,
                                                   sync_module_states=True))
    return out


def case_errors(rank, world):
    """Bad input: each (type, message) or None; every rank raises at the same point, so none waits."""
    out = {}

    def leaves_mask(m):  # materialises parameters only: the causal mask buffer stays meta
        for attr, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                m._parameters[attr] = nn.Parameter(torch.zeros(p.shape))

    out["meta_left"] = _error_of(lambda: FSDP(meta_gpt(), auto_wrap_policy=block_policy(True),
                                              param_init_fn=leaves_mask))
    out["no_reset"] = _error_of(lambda: FSDP(meta_gpt(), auto_wrap_policy=block_policy(True)))
    out["not_callable"] = _error_of(lambda: FSDP(meta_gpt(), param_init_fn=3))

    def tie_breaker(m):  # torch's to_empty on each module: lm_head gets its own tensor
        if any(t.is_meta for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None):
            m.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                for p in m._parameters.values():
                    if p is not None:
                        p.fill_(0.5)
                for name, b in m._buffers.items():
                    m._buffers[name] = torch.ones_like(b)

    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        broken = FSDP(meta_gpt(), auto_wrap_policy=block_policy(True), param_init_fn=tie_breaker)
    out["tie_warning"] = [str(w.message) for w in caught if "tied" in str(w.message)]
    out["tie_broken"] = not tie_kept("ours", broken)
    out["shape"] = _error_of(lambda: FSDP(nn.Linear(4, 4 + rank), sync_module_states=True))
    out["count"] = _error_of(lambda: FSDP(nn.Linear(4, 4, bias=rank == 0), sync_module_states=True))
    ok = FSDP(nn.Linear(4, 4), sync_module_states=True)  # the group still works after the refusals
    out["after"] = [p.numel() for p in ok.parameters()]
    return out


CASES = {"parity": case_parity, "reset": case_reset, "memory": case_memory, "sync": case_sync,
         "errors": case_errors}


def cases(names) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in names:
        try:
            out[name] = CASES[name](rank, world)
        except Exception as e:  # noqa: BLE001 - the test shows it
            import traceback
            out[name] = ("error", type(e).__name__, traceback.format_exc())
        dist.barrier()
    return out
