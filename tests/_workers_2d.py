"""Rank functions for tests/test_parallel_2d.py: FSDP x TP on a (dp, tp) = 2 x 2 mesh, and FSDP x PP counts.

``two_d_worker`` runs on 4 ranks (gloo, CPU).  Rank r sits at ``(dp, tp) = (r // 2, r % 2)`` of
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``:

    tp ->      0        1
    dp 0:  rank 0   rank 1      rows 0..1 of the batch  (both tp ranks the same rows)
    dp 1:  rank 2   rank 3      rows 2..3
           dp group {0, 2}: slice 0 of every TP weight, sharded again by FSDP over the two dp ranks
                   {1, 3}: slice 1

Cases returned per rank (plain tensors and counts, the test compares them):

* ``gpt``: TinyGPT with every block's attention (qkv colwise by heads, proj rowwise) and MLP split by our
  ``parallelize_module`` on ``mesh["tp"]``, then our ``FullyShardedDataParallel`` on ``mesh["dp"]`` with one
  unit per ``Block``; three AdamW steps; the losses and the full parameters after them (TP slices gathered
  with ``full_tensor`` inside ``summon_full_params``).  Rank 0 also trains the plain TinyGPT on all 4 rows.
* ``gpt_same_rows``: the fault: both dp groups get rows 0..1 (the single process still trains on 0..3).
* ``mlp_torch``: ``MLP((16, 32, 32, 8))`` with net.2 colwise / net.4 rowwise, ours (our TP + our FSDP) and
  torch's (``torch.distributed.tensor.parallel.parallelize_module`` + ``fully_shard(mesh=mesh["dp"])``).
* ``counts``: the collectives our FSDP issues per optimizer step when one stage of a pipeline runs M
  micro-batches in GPipe order (all forwards, then all backwards), per sharding strategy.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as ttp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import minifsdp.parallel.tensor_parallel as tp
from minifsdp import fsdp2
from minifsdp.comm import get_collectives
from minifsdp.fsdp import FullyShardedDataParallel as FSDP
from minifsdp.fsdp import ShardingStrategy
from minifsdp.fsdp.core.units import clean_name
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.models import MLP, Block, GPTConfig, TinyGPT
from minifsdp.parallel.pipelining import PipelineStage, ScheduleGPipe

GPT_PLAN = {"blocks.*.attn.qkv": tp.ColwiseParallel(chunks=3), "blocks.*.attn.proj": tp.RowwiseParallel(),
            "blocks.*.mlp.0": tp.ColwiseParallel(), "blocks.*.mlp.2": tp.RowwiseParallel()}
MLP_DIMS = (16, 32, 32, 8)
STEPS, ROWS, T, LR = 3, 4, 16, 1e-2
GPT_OPT = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)  # see test_parallel_2d: why not AdamW here
CPU = torch.device("cpu")
TORCH_COLLECTIVES = type(get_collectives("torch"))  # the class behind FSDP(collectives="torch")


class _Done:
    def wait(self):
        return True


def _batches(vocab: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole batch of every step (ROWS rows), the same on every rank."""
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, vocab, (ROWS, T), generator=g), torch.randint(0, vocab, (ROWS, T), generator=g))
            for _ in range(steps)]


def _my_rows(dp_rank: int, dp_size: int, same_rows: bool, rows: int = ROWS) -> slice:
    per = rows // dp_size
    start = 0 if same_rows else dp_rank * per  # the fault: every dp group reads the first rows
    return slice(start, start + per)


def _dp_mean(loss: torch.Tensor, dp_group) -> torch.Tensor:
    """The whole batch's loss: the mean of the dp groups' losses (equal row counts)."""
    if dp_group is None:
        return loss.detach().clone()
    out = loss.detach().clone()
    dist.all_reduce(out, group=dp_group)
    return out / dist.get_world_size(dp_group)


def _full_params(model: FSDP, shards: dict) -> dict[str, torch.Tensor]:
    """Every parameter whole: FSDP's shards all-gathered over dp, then TP's slices over tp (both collectives)."""
    with FSDP.summon_full_params(model, writeback=False):
        return {clean_name(n): tp.full_tensor(p, shards.get(clean_name(n))).clone()
                for n, p in model.named_parameters()}


def _tp_shards(model) -> dict:
    return {n: p.tp_shard for n, p in model.named_parameters() if hasattr(p, "tp_shard")}


@contextlib.contextmanager
def skip_dp_reduction():
    """The fault: our FSDP's reduce-scatter keeps this rank's own rows of its own gradient, summing nothing."""
    saved = TORCH_COLLECTIVES.reduce_scatter

    def own_rows_only(self, out, inp, op="sum", group=None, async_op=False):
        r = dist.get_rank(group)
        out.copy_(inp.reshape(-1)[r * out.numel():(r + 1) * out.numel()].view_as(out))
        return _Done()

    TORCH_COLLECTIVES.reduce_scatter = own_rows_only
    try:
        yield
    finally:
        TORCH_COLLECTIVES.reduce_scatter = saved


def _gpt_case(mesh, same_rows: bool = False, fault=contextlib.nullcontext) -> dict:
    dp, tp_mesh = mesh["dp"], mesh["tp"]
    base = TinyGPT(GPTConfig.tiny(), seed=0)
    data = _batches(base.cfg.vocab_size)
    model = tp.parallelize_module(copy.deepcopy(base), tp_mesh, GPT_PLAN)
    shards = _tp_shards(model)
    model = FSDP(model, process_group=dp.get_group(), device_id=CPU,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    opt = GPT_OPT(model.parameters())
    rows = _my_rows(dp.get_local_rank(), dp.size(), same_rows)
    losses = []
    for x, y in data:
        loss = model(x[rows], y[rows])
        with fault():
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(loss, dp.get_group()))
    res = {"losses": torch.stack(losses), "params": _full_params(model, shards),
           "local_shapes": {n: tuple(p.shape) for n, p in tp.parallelize_module(
               copy.deepcopy(base), tp_mesh, GPT_PLAN).named_parameters()},
           "flat_numel": [p.numel() for p in model.parameters()]}
    if dist.get_rank() == 0 and fault is contextlib.nullcontext and not same_rows:  # the oracle: one process,
        ref = copy.deepcopy(base)                                           # the plain model, the whole batch
        ropt = GPT_OPT(ref.parameters())
        ref_losses = []
        for x, y in data:
            loss = ref(x, y)
            loss.backward()
            ropt.step()
            ropt.zero_grad()
            ref_losses.append(loss.detach())
        res["ref_losses"] = torch.stack(ref_losses)
        res["ref_params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return res


def _gpt_fsdp2_case(mesh) -> dict:
    """The same TP plan, then our per-parameter ``fully_shard(mesh=mesh["dp"])`` on each Block and the root."""
    dp, tp_mesh = mesh["dp"], mesh["tp"]
    base = TinyGPT(GPTConfig.tiny(), seed=0)
    model = tp.parallelize_module(copy.deepcopy(base), tp_mesh, GPT_PLAN)
    shards = _tp_shards(model)
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=dp)
    fsdp2.fully_shard(model, mesh=dp)
    opt = GPT_OPT(model.parameters())
    rows = _my_rows(dp.get_local_rank(), dp.size(), False)
    losses = []
    for x, y in _batches(base.cfg.vocab_size):
        loss = model(x[rows], y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(loss, dp.get_group()))
    params = {n: tp.full_tensor(p.full_tensor(), shards.get(n)).clone() for n, p in model.named_parameters()}
    return {"losses": torch.stack(losses), "params": params}


def _mlp_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(ROWS, MLP_DIMS[0], generator=g), torch.randn(ROWS, MLP_DIMS[-1], generator=g))
            for _ in range(STEPS)]


def _train_mlp(model, params, rows, data, gather, dp_group=None) -> dict:
    opt = torch.optim.AdamW(params, lr=LR)
    losses = []
    for x, y in data:
        loss = F.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_dp_mean(loss, dp_group))
    return {"losses": torch.stack(losses), "params": gather()}


def _mlp_case(mesh) -> dict:
    """Ours (TP + FSDP1-style) and torch's (DTensor TP + FSDP2) on the same MLP, rows and steps."""
    dp, tp_mesh = mesh["dp"], mesh["tp"]
    base, data = MLP(MLP_DIMS, seed=0), _mlp_data()
    rows = _my_rows(dp.get_local_rank(), dp.size(), False)
    ours = tp.parallelize_module(copy.deepcopy(base), tp_mesh, {"net.2": tp.ColwiseParallel(),
                                                                 "net.4": tp.RowwiseParallel()})
    shards = _tp_shards(ours)
    ours = FSDP(ours, process_group=dp.get_group(), device_id=CPU)
    res = {"ours": _train_mlp(ours, ours.parameters(), rows, data, lambda: _full_params(ours, shards),
                                dp.get_group())}
    theirs = ttp.parallelize_module(copy.deepcopy(base), tp_mesh, {"net.2": ttp.ColwiseParallel(),
                                                                    "net.4": ttp.RowwiseParallel()})
    fully_shard(theirs, mesh=dp)
    res["torch"] = _train_mlp(theirs, theirs.parameters(), rows, data,
                              lambda: {n: p.full_tensor().detach().clone() for n, p in theirs.named_parameters()},
                              dp.get_group())
    if dist.get_rank() == 0:
        ref = copy.deepcopy(base)
        res["ref"] = _train_mlp(ref, ref.parameters(), slice(None), data,
                                lambda: {n: p.detach().clone() for n, p in ref.named_parameters()})
    return res


# ----------------------------------------------------------------------------- FSDP x PP: count the collectives
PP_DIMS = ((16, 32, 32), (32, 32, 8))  # stage 0: MLP(16 -> 32 -> 32), stage 1: MLP(32 -> 32 -> 8)
PP_ROWS = 8  # per dp group per step; M micro-batches of PP_ROWS / M rows
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
MICROBATCHES = (1, 2, 4)


@contextlib.contextmanager
def count_fsdp_collectives():
    """Count every collective our FSDP issues (through ``get_collectives("torch")``), by kind; TP's and the
    pipeline's are not FSDP's."""
    counts: Counter = Counter()
    saved = {k: getattr(TORCH_COLLECTIVES, k) for k in ("all_gather", "reduce_scatter", "all_reduce")}

    def counting(kind, fn):
        def call(self, *args, **kwargs):
            counts[kind] += 1
            return fn(self, *args, **kwargs)
        return call

    for kind, fn in saved.items():
        setattr(TORCH_COLLECTIVES, kind, counting(kind, fn))
    try:
        yield counts
    finally:
        for kind, fn in saved.items():
            setattr(TORCH_COLLECTIVES, kind, fn)


def _pp_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(2 * PP_ROWS, PP_DIMS[0][0], generator=g), torch.randn(2 * PP_ROWS, PP_DIMS[1][-1], generator=g)


def _trace_actions(stage, stage_mod, counts: Counter, m: int, accumulate: bool) -> list:
    """Wrap this stage's forward/backward of one micro-batch: log the FSDP collectives each one issued.

    ``accumulate``: every backward but the last micro-batch's runs under ``no_sync()`` (gradients
    accumulate unreduced, as DDP and ZeRO-1 do under a pipeline).
    """
    log = []
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

    def traced(name, fn, chunk_id, *args, **kwargs):
        before = Counter(counts)
        sync = not (accumulate and name == "B" and chunk_id < m - 1)
        with contextlib.nullcontext() if sync else stage_mod.no_sync():
            out = fn(chunk_id, *args, **kwargs)
        log.append((f"{name}{chunk_id}", dict(Counter(counts) - before)))
        return out

    stage.forward_one_chunk = functools.partial(traced, "F", fwd)
    stage.backward_one_chunk = functools.partial(traced, "B", bwd)
    return log


def _pp_case(mesh, strategy: str, m: int, accumulate: bool = False) -> dict:
    """One GPipe step over 2 stages, each stage our FSDP (one unit per Linear) over its dp group; SGD."""
    pp, dp = mesh["pp"], mesh["dp"]
    s = pp.get_local_rank()
    per_linear = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    stage_mod = FSDP(MLP(PP_DIMS[s], seed=s), process_group=dp.get_group(), device_id=CPU,
                     sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=per_linear)
    stage = PipelineStage(stage_mod, s, 2, CPU, group=pp.get_group())
    sched = ScheduleGPipe(stage, m, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=0.1)
    x, y = _pp_data()
    rows = _my_rows(dp.get_local_rank(), dp.size(), False, PP_ROWS * 2)
    losses: list = []
    with count_fsdp_collectives() as counts:
        log = _trace_actions(stage, stage_mod, counts, m, accumulate)
        sched.step(x[rows]) if s == 0 else sched.step(target=y[rows], losses=losses)
    opt.step()
    with FSDP.summon_full_params(stage_mod, writeback=False):
        params = {f"{s}.{clean_name(n)}": p.detach().clone() for n, p in stage_mod.named_parameters()}
    return {"counts": dict(counts), "params": params, "actions": list(stage.actions), "log": log,
            "units": sum(1 for u in FSDP.fsdp_modules(stage_mod) if u._handle is not None)}


def _pp_reference() -> dict:
    """The oracle: one process, both stages in a row, the whole batch (both dp groups' rows), one SGD step."""
    mods = [MLP(d, seed=i) for i, d in enumerate(PP_DIMS)]
    x, y = _pp_data()
    F.mse_loss(mods[1](mods[0](x)), y).backward()
    out = {}
    for i, mod in enumerate(mods):
        torch.optim.SGD(mod.parameters(), lr=0.1).step()
        out.update({f"{i}.{n}": p.detach().clone() for n, p in mod.named_parameters()})
    return out


def pp_counts(mesh) -> dict:
    out = {(st, acc, m): _pp_case(mesh, st, m, acc) for st in STRATEGIES for acc in (False, True)
           for m in MICROBATCHES}
    if dist.get_rank() == 0:
        out["ref"] = _pp_reference()
    return out


def two_d_worker(with_torch: bool = True) -> dict:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {"coord": (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()),
           "gpt": _gpt_case(mesh), "gpt_same_rows": _gpt_case(mesh, same_rows=True),
           "gpt_no_dp_reduction": _gpt_case(mesh, fault=skip_dp_reduction), "gpt_fsdp2": _gpt_fsdp2_case(mesh)}
    if with_torch:
        out["mlp_torch"] = _mlp_case(mesh)
    out["pp"] = pp_counts(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    return out
