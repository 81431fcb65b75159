"""Rank functions for the checkpoint tests: one spawn at 2 ranks, one at 4, many checks in each.

Every check returns a small record; the test asserts on it, so a failing check
names itself.  Oracles: torch FSDP1 (its full state dict and its
``FSDP.optim_state_dict``, bitwise: our training is bitwise torch FSDP1's), torch
FSDP2 with torch.distributed.checkpoint, the plain model, and the run that never stopped.
"""

from __future__ import annotations

import functools
import os
import shutil
import time

import torch
import torch.distributed as dist

import minifsdp
from minifsdp import checkpoint
from minifsdp.checkpoint import resume
from minifsdp.checkpoint.dcp import load_dcp, save_dcp
from minifsdp.checkpoint.files import rank_file
from minifsdp.fsdp import FSDP, ShardingStrategy
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy
from minifsdp.fsdp.torch_options import hybrid_groups
from minifsdp.models import Block, CharCorpus, TinyGPT
from tests._workers_fsdp import bitwise_differences, to_numpy

_CORPUS = []


def gpt_batch(step, rank, world):
    if not _CORPUS:
        _CORPUS.append(CharCorpus())
    return _CORPUS[0].batch(step, 2, 16, rank, world)


def ours(seed=0, group=None, strategy=ShardingStrategy.FULL_SHARD, use_orig_params=False):
    return FSDP(TinyGPT(seed=seed), process_group=group, sharding_strategy=strategy, use_orig_params=use_orig_params,
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))


def theirs(seed=0):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

    policy = functools.partial(torch_policy, transformer_layer_cls={Block})
    return TorchFSDP(TinyGPT(seed=seed), auto_wrap_policy=policy, device_id=torch.device("cpu"))


def make_opt(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model, opt, i, noise=False):
    """One training step on batch i; with noise, the input also depends on the global torch RNG."""
    rank, world = dist.get_rank(model_group(model)), dist.get_world_size(model_group(model))
    x, y = gpt_batch(i, rank, world)
    if noise:  # the RNG decides which positions are masked: a resume must restore it
        x = torch.where(torch.rand(x.shape) < 0.1, torch.zeros_like(x), x)
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def model_group(model):
    groups = getattr(model, "groups", None)
    return groups.shard if groups is not None and groups.replicate is None else None


def same_optim(a: dict, b: dict) -> list[str]:
    """``fqn.key`` of the optimizer-state entries that differ (``bitwise_differences``), or are on one side only;
    each entry is compared as an fp32 tensor, so a ``step`` kept as a number on one side and as a tensor on the
    other compares by value."""
    def entries(osd):
        return {f"{fqn}.{k}": torch.as_tensor(v).float() for fqn, st in osd["state"].items() for k, v in st.items()}

    return bitwise_differences(entries(a), entries(b))


def two_rank_worker(tmp: str) -> dict:
    """State dicts vs torch FSDP1, save/load, resume, errors, DCP vs torch FSDP2, timings."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, out = dist.get_rank(), {}
    # --- 1. full state dicts and full optimizer state vs torch FSDP1 (AdamW and SGD momentum)
    for opt_name in ("adamw", "sgd"):
        a, b = ours(), theirs()
        oa, ob = make_opt(opt_name, a), make_opt(opt_name, b)
        for i in range(2):
            step(a, oa, i), step(b, ob, i)
        ours_sd, torch_sd = checkpoint.full_state_dict(a), b.state_dict()
        out[f"{opt_name} full sd vs torch"] = bitwise_differences(ours_sd, torch_sd)
        ours_osd = checkpoint.full_optim_state_dict(a, oa, rank0_only=False)
        torch_osd = TorchFSDP.optim_state_dict(b, ob)
        out[f"{opt_name} full optim vs torch"] = same_optim(ours_osd, torch_osd)
        out[f"{opt_name} optim keys"] = sorted(next(iter(ours_osd["state"].values())))
        # torch's full state (model + optimizer) into a fresh ours; ours into a fresh torch FSDP1 and the plain model
        c = ours(seed=5)
        oc = make_opt(opt_name, c)
        c.load_state_dict(torch_sd)
        checkpoint.load_full_optim_state_dict(c, oc, torch_osd)
        d = theirs(seed=5)
        d.load_state_dict(ours_sd)
        plain = TinyGPT(seed=5)
        plain.load_state_dict(ours_sd)
        out[f"{opt_name} ours -> torch FSDP1 -> back"] = bitwise_differences(ours_sd, d.state_dict())
        out[f"{opt_name} ours -> plain"] = bitwise_differences(ours_sd, plain.state_dict())
        # continue: the loaded copy must take the same next step as the original (optimizer state included)
        step(a, oa, 2), step(c, oc, 2)
        out[f"{opt_name} torch state -> ours, next step"] = bitwise_differences(checkpoint.full_state_dict(a),
                                                                 checkpoint.full_state_dict(c))
    # --- 2. sharded and full checkpoints: save, load into a fresh model, continue bitwise; sizes and times
    a = ours()
    oa = make_opt("adamw", a)
    for i in range(2):
        step(a, oa, i)
    for kind in ("sharded", "full"):
        path = os.path.join(tmp, kind)
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.save(path, a, oa, extra={"rank": rank}, full=kind == "full")
        t_save = time.perf_counter() - t0
        c = ours(seed=7)
        oc = make_opt("adamw", c)
        oc.param_groups[0]["lr"] = 123.0  # hyperparameters come back from the checkpoint
        t0 = time.perf_counter()
        extra = checkpoint.load(path, c, oc)
        t_load = time.perf_counter() - t0
        mine = rank_file(rank) if kind == "sharded" else checkpoint.FULL_FILE
        files = checkpoint.read_manifest(path)["files"]
        out[f"{kind} numbers"] = dict(save_s=t_save, load_s=t_load, extra=extra,
                                      file_bytes={n: f["bytes"] for n, f in files.items()},
                                      my_file_bytes=files[mine]["bytes"] if mine in files and (
                                          kind == "sharded" or rank == 0) else 0)
        out[f"{kind} lr restored"] = oc.param_groups[0]["lr"]
        out[f"{kind} load equal"] = bitwise_differences(checkpoint.full_state_dict(a),
                                                        checkpoint.full_state_dict(c))
        e = ours(seed=9)
        oe = make_opt("adamw", e)
        checkpoint.load(path, e, oe)
        step(e, oe, 2), step(c, oc, 2)
        out[f"{kind} two loads continue equal"] = bitwise_differences(checkpoint.full_state_dict(e),
                                                                      checkpoint.full_state_dict(c))
    # --- 3. resume: stop at step 3, load into fresh objects, finish: bitwise the run that never stopped
    out["resume"] = resume_check(os.path.join(tmp, "resume"))
    # --- 4. errors on 2 ranks: a missing rank file, a world size without reshard
    out["errors"] = error_checks(os.path.join(tmp, "sharded"), tmp)
    # --- 5. DCP: torch FSDP2 writes, we read; we write, torch FSDP2 reads
    out["dcp"] = dcp_check(os.path.join(tmp, "dcp"))
    return out


def resume_check(root: str) -> dict:
    torch.manual_seed(100 + dist.get_rank())
    a = ours()
    oa = make_opt("adamw", a)
    straight = [step(a, oa, i, noise=True) for i in range(6)]
    final = checkpoint.full_state_dict(a)

    torch.manual_seed(100 + dist.get_rank())
    b = ours()
    ob = make_opt("adamw", b)
    mgr = checkpoint.CheckpointManager(root, keep=2)
    first = []
    for i in range(3):
        first.append(step(b, ob, i, noise=True))
        mgr.save(i + 1, b, ob, extra={"step": i + 1, "rng": resume.capture_rng()})
    kept = mgr.steps()
    torch.manual_seed(999)  # the "new process": different RNG, different init
    c = ours(seed=3)
    oc = make_opt("adamw", c)
    extra = mgr.load_latest(c, oc)
    resume.restore_rng(extra["rng"])
    second = [step(c, oc, i, noise=True) for i in range(extra["step"], 6)]
    return dict(kept=kept, losses_equal=straight == first + second,
                params_diff=bitwise_differences(final, checkpoint.full_state_dict(c)))


def error_checks(good: str, tmp: str) -> dict:
    res = {}
    model = ours()
    bad = os.path.join(tmp, "missing_rank")
    if dist.get_rank() == 0:
        shutil.copytree(good, bad)
        os.remove(os.path.join(bad, "rank00001.pt"))
    dist.barrier()
    try:
        checkpoint.load(bad, model)
        res["missing"] = "no error"
    except checkpoint.CheckpointError as e:
        res["missing"] = str(e)
    return res


def dcp_check(root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def fsdp2(seed):
        m = TinyGPT(seed=seed)
        for blk in m.blocks:
            fully_shard(blk)
        fully_shard(m)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    def full_of(m):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in m.state_dict().items()}

    rank, world = dist.get_rank(), dist.get_world_size()
    m, o = fsdp2(0)
    for i in range(2):
        x, y = gpt_batch(i, rank, world)
        m(x, y).backward()
        o.step()
        o.zero_grad()
    msd, osd = get_state_dict(m, o)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "torch"))
    a = ours(seed=4)
    oa = make_opt("adamw", a)
    load_dcp(os.path.join(root, "torch"), a, oa)
    res = {"fsdp2 -> ours": bitwise_differences(full_of(m), checkpoint.full_state_dict(a))}
    # the next step from the same state: FSDP2 shards rows, we shard flat numbers, yet each gradient number is
    # the same two-term sum and AdamW is elementwise, so the step is bitwise the same (measured)
    x, y = gpt_batch(2, rank, world)
    m(x, y).backward()
    o.step()
    step(a, oa, 2)
    res["next step"] = bitwise_differences(full_of(m), checkpoint.full_state_dict(a))
    save_dcp(os.path.join(root, "ours"), a, oa)
    m2, o2 = fsdp2(8)
    msd2, osd2 = get_state_dict(m2, o2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=os.path.join(root, "ours"))
    set_state_dict(m2, o2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    res["ours -> fsdp2"] = bitwise_differences(checkpoint.full_state_dict(a), full_of(m2))
    x, y = gpt_batch(3, rank, world)  # and AdamW's state came along: the next step is the same
    m2(x, y).backward()
    o2.step()
    step(a, oa, 3)
    res["ours -> fsdp2, next step"] = bitwise_differences(checkpoint.full_state_dict(a), full_of(m2))
    return res


# ---------------------------------------------------------------- 4 ranks: save once, load in every other layout


def pieces_match(model, opt, full: dict, full_osd: dict | None) -> list[str]:
    """Local check, no communication: every number this rank holds equals the saved whole tensor's."""
    from minifsdp.checkpoint.pieces import holders

    bad = []
    for h in holders(model):
        flat = h.tensor.detach().reshape(-1)
        state = opt.state.get(h.tensor, {}) if opt is not None else {}
        for p in h.pieces:
            if not torch.equal(flat[p.src_lo : p.src_hi], full[p.fqn].reshape(-1)[p.lo : p.hi]):
                bad.append(p.fqn)
            if full_osd is None:
                continue
            for k, v in full_osd["state"][p.fqn].items():
                mine = state.get(k)
                if mine is None:
                    bad.append(f"{p.fqn}.{k} missing")
                elif v.dim() > 0 and not torch.equal(mine.reshape(-1)[p.src_lo : p.src_hi], v.reshape(-1)[p.lo : p.hi]):
                    bad.append(f"{p.fqn}.{k}")
                elif v.dim() == 0 and not torch.equal(mine, v):
                    bad.append(f"{p.fqn}.{k} (scalar)")
    return bad


def first_loss_vs_plain(model, opt, full, i, group=None) -> bool:
    """The first step after loading: our loss is bitwise the plain model's (loaded with the same numbers)."""
    plain = TinyGPT(seed=11)
    plain.load_state_dict(full)
    x, y = gpt_batch(i, dist.get_rank(group), dist.get_world_size(group))
    return step(model, opt, i) == plain(x, y).item()


def reshard_worker(tmp: str) -> dict:
    rank, out = dist.get_rank(), {}
    solo = dist.new_group([0])
    a = ours()
    oa = make_opt("adamw", a)
    for i in range(2):
        step(a, oa, i)
    path = os.path.join(tmp, "r4")
    checkpoint.save(path, a, oa, extra={"step": 2})
    full, full_osd = checkpoint.full_state_dict(a), checkpoint.full_optim_state_dict(a, oa, rank0_only=False)
    step(a, oa, 2)
    a_next = checkpoint.full_state_dict(a)
    # fewer ranks: 1, 2, 3 (a subgroup; the ranks outside it wait at the barrier)
    for n in (1, 2, 3):
        group = dist.new_group(list(range(n)))  # every rank calls new_group
        if rank < n:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # 1 rank: "nothing to shard, using NO_SHARD"
                b = ours(seed=n, group=group)
            ob = make_opt("adamw", b)
            extra = checkpoint.load(path, b, ob, group=group)
            out[f"{n} ranks"] = dict(pieces=pieces_match(b, ob, full, full_osd), extra=extra,
                                     summon=bitwise_differences(full, checkpoint.full_state_dict(b)),
                                     continues=first_loss_vs_plain(b, ob, full, 2, group))
        dist.barrier()
    if rank == 0:  # and the plain nn.Module, no FSDP at all
        plain = TinyGPT(seed=12)
        op = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
        checkpoint.load(path, plain, op, group=solo)
        out["plain"] = pieces_match(plain, op, full, full_osd)
    dist.barrier()
    # 4 ranks, other layouts: each loads, takes the same step 2 as `a`, and is compared with `a`'s step
    variants = {"SHARD_GRAD_OP": dict(strategy=ShardingStrategy.SHARD_GRAD_OP),
                "NO_SHARD": dict(strategy=ShardingStrategy.NO_SHARD),
                "HYBRID_SHARD": dict(strategy=ShardingStrategy.HYBRID_SHARD, group=hybrid_groups(2)),
                "use_orig_params": dict(use_orig_params=True)}
    for name, kw in variants.items():
        b = ours(seed=4, **kw)
        ob = make_opt("adamw", b)
        checkpoint.load(path, b, ob)
        pieces = pieces_match(b, ob, full, full_osd)
        step(b, ob, 2)
        nxt = checkpoint.full_state_dict(b)
        # and back: this layout's own sharded save (replicas write once) loads into FULL_SHARD
        again = os.path.join(tmp, f"r4_{name}")
        checkpoint.save(again, b, ob)
        c = ours(seed=5)
        oc = make_opt("adamw", c)
        checkpoint.load(again, c, oc)
        out[name] = dict(pieces=pieces, next_step=bitwise_differences(a_next, nxt), max_diff=max(
            (a_next[k].double() - nxt[k].double()).abs().max().item() for k in a_next),
            round_trip=bitwise_differences(nxt, checkpoint.full_state_dict(c)),
            files=sorted(checkpoint.read_manifest(again)["files"]),
            written=sorted(f for f, info in checkpoint.read_manifest(again)["files"].items() if info["pieces"]))
    return out



def measure_worker(tmp: str, config: str = "small") -> dict:
    """Size and time per rank, full vs sharded, for TinyGPT(GPTConfig.<config>()) + AdamW (a command, not a test):

        minifsdp.spawn(measure_worker, args=(tmpdir, "bench"), world_size=4)
    """
    from minifsdp.models import GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = getattr(GPTConfig, config)()
    model = FSDP(TinyGPT(cfg, seed=0),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    model(x, x).backward()
    opt.step()
    out = {}
    for kind in ("sharded", "full"):
        path = os.path.join(tmp, f"{kind}_{world}")
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.save(path, model, opt, full=kind == "full")
        t_save = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.load(path, model, opt)
        t_load = time.perf_counter() - t0
        files = checkpoint.read_manifest(path)["files"]
        mine = rank_file(rank) if kind == "sharded" else (checkpoint.FULL_FILE if rank == 0 else None)
        out[kind] = dict(save_s=round(t_save, 3), load_s=round(t_load, 3),
                         written_bytes=files[mine]["bytes"] if mine in files else 0)
    return out


# ---------------------------------------------------------------- 4 ranks: a sharded save at a HYBRID layout


def _sorted(d: dict) -> dict:
    return {k: d[k] for k in sorted(d)}


def _sorted_optim_state(osd: dict) -> dict:
    """The ``state`` of a full optimizer state dict, names and keys sorted (for a bitwise comparison)."""
    return {fqn: {k: osd["state"][fqn][k] for k in sorted(osd["state"][fqn])} for fqn in sorted(osd["state"])}


def hybrid_save_worker(tmp: str) -> dict:
    """HYBRID_SHARD over shard groups {0, 1}, {2, 3} (replicas {0, 2}, {1, 3}): global ranks 2 and 3 hold shard
    ranks 0 and 1, so a piece keyed by the global rank lands elsewhere than one keyed by the shard rank.

    Ours trains 2 AdamW steps, saves sharded, trains a 3rd (the run that never stopped); torch FSDP1 trains
    the same 3 steps on the same groups.  The checkpoint is loaded (1) at the same layout into a fresh model
    that takes the 3rd step, (2) at 3 ranks (FULL_SHARD) and at 2 ranks (SHARD_GRAD_OP, ``use_orig_params=True``),
    (3) into the plain TinyGPT on rank 0.  Returns what the test
    compares bitwise (numpy)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

    rank, out = dist.get_rank(), {}
    pair = minifsdp.hybrid_groups(2)  # (shard group, replicate group) of this rank
    theirs_ = TorchFSDP(TinyGPT(seed=0), process_group=pair, sharding_strategy=TorchStrategy.HYBRID_SHARD,
                        auto_wrap_policy=functools.partial(torch_policy, transformer_layer_cls={Block}),
                        device_id=torch.device("cpu"))
    ot = make_opt("adamw", theirs_)
    torch_losses = [step(theirs_, ot, i) for i in range(3)]
    with TorchFSDP.summon_full_params(theirs_):
        torch_full = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in theirs_.named_parameters()}
    out["torch"] = dict(losses=torch_losses, full=torch_full)
    out["shard rank"] = dist.get_rank(pair[0])

    a = ours(group=pair, strategy=ShardingStrategy.HYBRID_SHARD)
    oa = make_opt("adamw", a)
    losses = [step(a, oa, i) for i in range(2)]
    path = os.path.join(tmp, "hybrid")
    checkpoint.save(path, a, oa, extra={"step": 2, "rank": rank})
    saved, saved_osd = checkpoint.full_state_dict(a), checkpoint.full_optim_state_dict(a, oa, rank0_only=False)
    losses.append(step(a, oa, 2))
    out["never stopped"] = dict(losses=losses, full=_sorted(checkpoint.full_state_dict(a)))
    out["saved"] = dict(model=_sorted(saved), optim=_sorted_optim_state(saved_osd))
    out["written"] = sorted(f for f, info in checkpoint.read_manifest(path)["files"].items() if info["pieces"])

    # (1) the same layout, a fresh model: load, take the 3rd step
    b = ours(seed=1, group=pair, strategy=ShardingStrategy.HYBRID_SHARD)
    ob = make_opt("adamw", b)
    extra = checkpoint.load(path, b, ob)
    loaded = dict(model=_sorted(checkpoint.full_state_dict(b)),
                  optim=_sorted_optim_state(checkpoint.full_optim_state_dict(b, ob, rank0_only=False)))
    losses_b = losses[:2] + [step(b, ob, 2)]
    out["resumed"] = dict(extra=extra, loaded=loaded, losses=losses_b, full=_sorted(checkpoint.full_state_dict(b)))

    # (2) other world sizes and holders: 3 ranks, FULL_SHARD (flat parameters; its last shard ends in padding),
    # and 2 ranks, SHARD_GRAD_OP, use_orig_params=True (each original parameter a holder; no padding at 2 ranks,
    # so the last rank's range ends on a real number).  The ranks outside a group wait at the barrier.
    for n, kw in ((3, {}), (2, dict(strategy=ShardingStrategy.SHARD_GRAD_OP, use_orig_params=True))):
        group = dist.new_group(list(range(n)))  # every rank calls new_group
        if rank < n:
            c = ours(seed=n, group=group, **kw)
            oc = make_opt("adamw", c)
            checkpoint.load(path, c, oc, group=group)
            out[f"{n} ranks"] = dict(model=_sorted(checkpoint.full_state_dict(c)), optim=_sorted_optim_state(
                checkpoint.full_optim_state_dict(c, oc, rank0_only=False, group=group)))
        dist.barrier()
    # (3) the plain model, rank 0 alone
    solo = dist.new_group([0])
    if rank == 0:
        plain = TinyGPT(seed=3)
        op = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
        checkpoint.load(path, plain, op, group=solo)
        out["plain"] = dict(model=_sorted(checkpoint.full_state_dict(plain)),
                            pieces=pieces_match(plain, op, saved, saved_osd))
    dist.barrier()
    return to_numpy(out)
