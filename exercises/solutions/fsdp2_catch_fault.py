"""Task 5.3, the instructor's answer: a test that sees FSDP2 keep full parameters it should have freed.

Why a parity test cannot catch the planted fault: a group that never frees its full parameters computes with
the very numbers a correct one gathers again (the next all-gather refills the same buffer), so losses, shards
and collectives stay bitwise torch's.  What changes is memory, so the test measures memory, against the same
oracle: torch's ``fully_shard``, applied the same way (every block, then the root) on the same seed and data.

What is measured: the bytes of every live tensor in the rank's process (``minifsdp.memory.census``: every
storage Python can reach, each once; a freed all-gather buffer has 0 bytes), before the model is built, after
its first forward (each block resharded, the root kept, as ``fully_shard``'s defaults say) and at rest after
one AdamW step and ``zero_grad()``.  The census sees every tensor, not only what the module registers, so a
full buffer kept anywhere shows.  Exact: whole bytes, ours must equal torch's on both ranks (2 ranks on gloo).

One trap on torch's side: gloo's worker thread marks a collective done (``wait()`` returns) and only then drops
it, with its tensors; a census taken in between counts an all-gather's input that torch no longer uses, and the
test fails once in a while on correct code.  Ours waits for that release; torch's side is measured inside
``torch_lets_go()``, which gives torch's collectives the same wait (chapter 2.2, ``minifsdp/comm/collectives.py``).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from minifsdp import CharCorpus, TinyGPT, fully_shard, spawn
from minifsdp.comm.collectives import torch_lets_go
from minifsdp.memory.census import live_tensor_bytes


def _bytes_over_one_step(shard, mesh) -> dict[str, int]:
    """Live tensor bytes this model adds: after its first forward, and at rest after one step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    before = live_tensor_bytes()
    model = TinyGPT(seed=0)
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = CharCorpus(vocab_size=model.cfg.vocab_size).batch(0, batch_size=2, block_size=model.cfg.block_size,
                                                             rank=rank, world_size=world)
    loss = model(x, y)
    after_forward = live_tensor_bytes() - before
    loss.backward()
    del loss
    optim.step()
    optim.zero_grad()
    at_rest = live_tensor_bytes() - before
    del model, optim
    gc.collect()
    return {"after forward": after_forward, "at rest": at_rest}


def _rank() -> dict[str, dict[str, int]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch_lets_go():  # torch's wait() returns once gloo's thread has let go of the tensors, as ours does
        torch_bytes = _bytes_over_one_step(torch_fully_shard, mesh)
    return {"torch": torch_bytes, "ours": _bytes_over_one_step(fully_shard, mesh)}


def test_catches_the_planted_fault() -> None:
    results = spawn(_rank, world_size=2)
    assert len(results) == 2
    for rank, got in enumerate(results):
        assert got["torch"]["after forward"] > 0 and got["torch"]["at rest"] > 0, got  # the census saw the model
        assert got["ours"] == got["torch"], (
            f"rank {rank}: live tensor bytes, ours {got['ours']} vs torch's fully_shard {got['torch']}: "
            f"ours holds {got['ours']['at rest'] - got['torch']['at rest']:,} more bytes at rest")
