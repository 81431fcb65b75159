"""Grades tasks 2.5b and 3.1: ``exercises/config_tasks.py`` (``--impl=student``) or the instructor's answer, run in
the learner's process.  No spawned ranks.

Oracles: 2.5b torch FSDP1 itself, constructed with the returned kwargs on TinyGPT in a 1-rank gloo group in the
learner's process (:func:`probe_corrected_call` reports what torch made of them as plain data: its units, its
``mixed_precision``, ``backward_prefetch``, the dtype of every flat parameter inside forward, the checkpoint
wrappers), and torch rejecting the source's original call (here).  3.1 the unsharded TinyGPT: the consolidated
state dict must load with ``strict=True`` into a fresh TinyGPT and give bitwise its parameters, buffers and
logits (pure copies, so bitwise).
"""

import contextlib
import importlib
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

from minifsdp.classroom.course_remote import capture, raise_again
from minifsdp.models import Block, TinyGPT
from tests.exercises import module_name


def _fn(learner, name):
    return getattr(learner("config_tasks"), name)


@contextlib.contextmanager
def _one_rank_group():
    if dist.is_initialized():  # someone else's group: use it, leave it
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def probe_corrected_call(name: str) -> dict:
    """In the learner's process: torch FSDP1 built with the learner's kwargs on TinyGPT (one rank), the learner's
    checkpointing applied, one forward and backward; what torch made of it, as plain data."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    mod = importlib.import_module(name)
    got = capture(mod.corrected_fsdp_kwargs, Block)
    if "raised" in got:
        return got
    kwargs = got["value"]
    facts = {"keys": sorted(map(str, kwargs)),
             "full_shard": kwargs.get("sharding_strategy") == ShardingStrategy.FULL_SHARD}
    with _one_rank_group(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one rank: FSDP switches to NO_SHARD
        model = FSDP(TinyGPT(seed=0), **kwargs)
        mp = model.mixed_precision
        units = [m for m in model.modules() if isinstance(m, FSDP)]
        facts.update(backward_pre=model.backward_prefetch == BackwardPrefetch.BACKWARD_PRE,
                     mp=[str(mp.param_dtype), str(mp.reduce_dtype), str(mp.buffer_dtype)], units=len(units),
                     block_units=sum(isinstance(u.module, Block) for u in units), device=str(model.compute_device))
        seen = []  # inside forward every unit's flat parameter is bf16; outside, the sharded fp32 copy is kept
        hooks = [u.module.register_forward_pre_hook(lambda m, a, u=u: seen.extend(str(fp.dtype) for fp in u.params))
                 for u in units]
        applied = capture(mod.apply_checkpointing, model, Block)
        if "raised" in applied:
            return applied
        logits = model(torch.randint(0, 32, (2, 8)))
        logits.float().sum().backward()
        for h in hooks:
            h.remove()
        wrapped = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
        facts.update(seen=seen, logits=str(logits.dtype), params=sorted({str(p.dtype) for p in model.parameters()}),
                     blocks=sum(isinstance(m, Block) for m in model.modules()), wrapped=len(wrapped),
                     wrapped_blocks=all(isinstance(w._checkpoint_wrapped_module, Block) for w in wrapped))
    return {"value": facts}


def test_task2_5b_corrected_fsdp_call(impl, learner_process):
    got = learner_process.call("tests.exercises.test_config_exercises:probe_corrected_call", ("2.5b",),
                               (module_name("config_tasks", impl),))
    if "raised" in got:
        raise_again(got["raised"])
    facts = got["value"]
    assert "activation_checkpointing" not in facts["keys"]
    assert facts["full_shard"], "sharding_strategy is not ShardingStrategy.FULL_SHARD"
    assert facts["backward_pre"], "backward_prefetch is not BackwardPrefetch.BACKWARD_PRE"
    assert facts["mp"] == [str(torch.bfloat16)] * 3, f"MixedPrecision dtypes {facts['mp']}, want bfloat16 thrice"
    assert facts["units"] == 3 and facts["block_units"] == 2, "root + one unit per Block"
    assert facts["device"] == "cpu"
    # 3 unit forwards + 2 Block recomputations in backward: the checkpointing really runs
    assert len(facts["seen"]) == 5 and set(facts["seen"]) == {str(torch.bfloat16)}, facts["seen"]
    assert facts["logits"] == str(torch.bfloat16)
    assert facts["params"] == [str(torch.float32)]
    assert facts["blocks"] == 2 and facts["wrapped"] == 2 and facts["wrapped_blocks"], facts
    with _one_rank_group():
        _source_call_fails()


def _source_call_fails():
    """What the task fixes: torch refuses the source's call."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("torch.distributed.fsdp.sharding_strategy")
    with pytest.raises(TypeError, match="activation_checkpointing"):
        FSDP(TinyGPT(seed=0), activation_checkpointing=True, device_id=torch.device("cpu"))
    from torch.distributed.fsdp import BackwardPrefetch

    assert not hasattr(BackwardPrefetch, "BWD_PRE")
    with pytest.raises(AttributeError, match="param_dtype"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FSDP(TinyGPT(seed=0), mixed_precision=True, device_id=torch.device("cpu"))(torch.randint(0, 32, (1, 4)))


# ---- 3.1 -------------------------------------------------------------------------------------

def _shard_tinygpt(model, world_size):
    """Our own simulation of FSDP's flat shards: one unit per Block, the rest in the root unit."""
    groups = {}
    for name, p in model.named_parameters():  # named_parameters lists a tied weight once
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        groups.setdefault(key, []).append((name, p.detach()))
    units, shards = [], []
    for params in groups.values():
        flat = torch.cat([p.reshape(-1) for _, p in params])
        numel = flat.numel()
        padded = -(-numel // world_size) * world_size
        flat = torch.cat([flat, flat.new_zeros(padded - numel)])
        units.append({"names": [n for n, _ in params], "shapes": [tuple(p.shape) for _, p in params],
                      "numel": numel})
        shards.append([c.clone() for c in flat.chunk(world_size)])
    return units, shards


def test_task3_1_consolidate_for_serving(learner):
    f = _fn(learner, "consolidate_state_dict")
    model = TinyGPT(seed=3)
    params = dict(model.named_parameters())
    tied = {k: n for k, v in model.state_dict().items() if k not in params
            for n, p in params.items() if v.data_ptr() == p.data_ptr()}
    assert tied == {"lm_head.weight": "tok_emb.weight"}
    buffers = dict(model.named_buffers())
    x = torch.randint(0, 32, (2, 8))
    for world_size in (1, 3, 7):
        units, shards = _shard_tinygpt(model, world_size)
        padded = [sum(s.numel() for s in sh) > u["numel"] for u, sh in zip(units, shards, strict=True)]
        assert world_size == 1 or any(padded), "no padding"
        state = f(units, shards, buffers, tied)
        plain = TinyGPT(seed=99)
        plain.load_state_dict(state, strict=True)
        ref = model.state_dict()
        assert set(plain.state_dict()) == set(ref)
        for k, v in plain.state_dict().items():
            assert torch.equal(v, ref[k]), k
        assert plain.lm_head.weight is plain.tok_emb.weight
        with torch.no_grad():
            assert torch.equal(plain(x), model(x))
        # copies, not views of a shard: changing a shard afterwards must not change the state dict
        before = {k: v.clone() for k, v in state.items()}
        for sh in shards:
            for s in sh:
                s.add_(1.0)
        assert all(torch.equal(before[k], state[k]) for k in state)
