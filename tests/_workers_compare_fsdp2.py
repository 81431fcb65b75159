"""Workers for tests/test_compare_fsdp2.py: DCP checkpoints between our ``fully_shard`` and torch's FSDP2.

One rank set does both directions on a TinyGPT whose token and position tables have an odd number of rows
(97 and 31: the last rank's chunk is one row short), so the chunks DCP records are uneven, as torch.chunk's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from minifsdp.checkpoint.dcp_fsdp2 import fsdp2_state_dict, load_fsdp2_dcp, save_fsdp2_dcp
from minifsdp.fsdp2 import fully_shard
from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from tests._workers_fsdp import bitwise_differences

CFG = dict(vocab_size=97, block_size=31, n_layer=2, n_head=2, n_embd=16)


def _build(impl: str, seed: int, mesh):
    model = TinyGPT(GPTConfig(**CFG), seed=seed)
    shard = fully_shard if impl == "ours" else torch_fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    return shard(model, mesh=mesh)


def _train_one_step(model) -> None:
    """One AdamW step, so a checkpoint holds trained values, not a seed's."""
    cfg = model.cfg
    x, y = CharCorpus(vocab_size=cfg.vocab_size).batch(0, 2, cfg.block_size, dist.get_rank(), dist.get_world_size())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(x, y).backward()
    opt.step()


def _full(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _same(a: dict, b: dict) -> dict:
    """name -> bit for bit equal (``bitwise_differences``); the names must match."""
    if list(a) != list(b):
        raise AssertionError(f"parameter names differ: {list(a)} vs {list(b)}")
    differ = set(bitwise_differences(a, b))
    return {name: name not in differ for name in a}


def dcp_both_ways(directory: str) -> dict:
    """Ours saved -> torch FSDP2 loads; torch FSDP2 saved -> ours loads.  Full tensors before and after."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}

    ours = _build("ours", seed=0, mesh=mesh)
    _train_one_step(ours)
    save_fsdp2_dcp(f"{directory}/ours", ours)
    theirs = _build("torch", seed=1, mesh=mesh)
    out["to_torch_before"] = _same(_full(ours), _full(theirs))
    dcp.load({"model": theirs.state_dict()}, checkpoint_id=f"{directory}/ours")
    out["to_torch_after"] = _same(_full(ours), _full(theirs))

    _train_one_step(theirs)  # now torch's model holds values ours never had
    dcp.save({"model": theirs.state_dict()}, checkpoint_id=f"{directory}/torch")
    fresh = _build("ours", seed=2, mesh=mesh)
    out["from_torch_before"] = _same(_full(theirs), _full(fresh))
    load_fsdp2_dcp(f"{directory}/torch", fresh)
    out["from_torch_after"] = _same(_full(theirs), _full(fresh))
    # the local rows too: rank r holds the same rows in both (torch.chunk's rule)
    out["from_torch_locals"] = _same({n: p.to_local() for n, p in theirs.named_parameters()},
                                     {n: p.to_local() for n, p in fresh.named_parameters()})
    sd = fsdp2_state_dict(fresh)
    out["chunk_of_tok_emb"] = (tuple(sd["tok_emb.weight"].to_local().shape), tuple(sd["tok_emb.weight"].shape))
    return out
