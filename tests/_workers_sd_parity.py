"""Rank functions for tests/test_state_dict_parity.py: torch-FSDP1 user code that saves and resumes, run on
torch FSDP1 and on ours in the same ranks.

Every case goes through :class:`tests._workers_torch_api.Side` (torch's ``FullyShardedDataParallel`` or
ours, torch's enums and configs on both sides) on the same models, seeds and data, and returns what a user
sees: state dicts (keys in order, dtypes, values, copied when taken), losses, full parameters, the scaler's
scale after each step.  :func:`run_cases` runs a list of them in one spawn; a case that raises reports its
traceback for that side and the others still run.

* :func:`case_save_and_resume`: a model with an ignored module (``Net.ign``), trained; its FULL model state
  dict with ``rank0_only`` (``offload_to_cpu`` both ways) and without; its FULL optimizer state dict with
  ``rank0_only`` both ways; each loaded into a fresh model and optimizer (``optim_state_dict_to_load``)
  and trained on, against the run that never stopped.  With ``use_orig_params=True`` and AdamW, also the
  optimizer state dict at torch's default ``offload_to_cpu=True`` and a resume from it.
* :func:`case_rank0_only`: which keys each rank gets under ``rank0_only`` where the rank test is not
  simply "global rank 0": NO_SHARD (torch ignores the config), a root with no parameters of its own.
* :func:`case_scaler_resume`: a ``ShardedGradScaler`` saved between two growth steps and after a
  backoff, loaded into a fresh scaler, trained on.
"""

from __future__ import annotations

import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

import minifsdp
import minifsdp.checkpoint
from tests._workers_torch_api import Side

STEPS = 2  # steps before a save, and again after it
SIDES = ("torch", "ours")


class Net(nn.Module):
    """a, b, c: units (>= 40 parameters, ``Side``'s wrap policy); bn stays in the root unit; ign: the module the
    cases ignore (each rank trains its own copy); scale: a root buffer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.bn, self.b = nn.Linear(5, 13), nn.BatchNorm1d(13), nn.Linear(13, 11)
        self.ign, self.c = nn.Linear(11, 7), nn.Linear(7, 3)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x):
        return self.c(torch.relu(self.ign(torch.relu(self.b(self.bn(self.a(x))))))) * self.scale


class BareRoot(Net):
    """As :class:`Net` without ``bn``, ``c`` large enough to be a unit: the root unit has no parameters."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        del self.bn
        self.c = nn.Linear(7, 13)

    def forward(self, x):
        return self.c(torch.relu(self.ign(torch.relu(self.b(self.a(x))))))[:, :3] * self.scale


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


_HYBRID: dict = {}


def wrap(api, model, strategy: str, orig: bool, ignored: bool):
    kw = dict(use_orig_params=orig, sharding_strategy=getattr(api.ShardingStrategy, strategy))
    if ignored:
        kw["ignored_modules"] = [model.ign]
    if strategy == "HYBRID_SHARD":  # 2 replicas of 2 ranks; the groups made once per side
        if api.ours not in _HYBRID:
            from torch.distributed.device_mesh import init_device_mesh

            _HYBRID[api.ours] = ({"device_mesh": init_device_mesh("cpu", (2, 2))} if api.ours
                                 else {"process_group": minifsdp.hybrid_groups(2)})
        kw.update(_HYBRID[api.ours])
    return api.wrap(model, **kw)


def train(model, opt, first: int, steps: int = STEPS, scaler=None, inf_at=None) -> dict:
    """``steps`` steps from step ``first``; with a scaler, rank 1 writes inf into a gradient at step ``inf_at``."""
    rank, losses, scales = dist.get_rank(), [], []
    for step in range(first, first + steps):
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            if step == inf_at and rank == 1:
                next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = \
                    float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "scales": scales}


def copied(obj):
    """A deep copy of a state dict (torch's may share tensors with the live model or optimizer)."""
    if isinstance(obj, dict):
        return type(obj)((k, copied(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [copied(v) for v in obj]
    return obj.detach().clone() if torch.is_tensor(obj) else obj


def full_params(api, model) -> list:
    with api.FSDP.summon_full_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def state_dicts(api, model, opt, rank0_only: bool, offload: bool = False, optim_offload: bool = False):
    """(model state dict, optimizer state dict), FULL, copied."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's NO_SHARD and offload warnings
        with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
                                      FullOptimStateDictConfig(offload_to_cpu=optim_offload, rank0_only=rank0_only)):
            return copied(model.state_dict()), copied(api.FSDP.optim_state_dict(model, opt))


def resume(api, make, msd, osd, rank0_only: bool, first: int, **train_kw) -> tuple:
    """A fresh model and optimizer (``make(seed=1)``), ``msd`` and ``osd`` loaded (``osd`` through
    ``optim_state_dict_to_load`` under ``rank0_only``), trained on from step ``first``."""
    model, opt = make(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with api.FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                      FullOptimStateDictConfig(rank0_only=rank0_only)):
            model.load_state_dict(msd)
            # a copy: torch's optimizer takes an ignored parameter's "step" tensor from the dict itself and
            # counts on in it (ours copies it), which would change the saved dict this case returns
            opt.load_state_dict(api.FSDP.optim_state_dict_to_load(model, opt, copied(osd)))
    return model, opt, train(model, opt, first, **train_kw)


def after(api, model, opt, trained: dict) -> dict:
    """What a resumed (or continued) run ends with: its losses, full parameters, the ignored module's own
    parameters on this rank, its whole optimizer state."""
    return {**trained, "full": full_params(api, model), "ign": copied(dict(model.ign.named_parameters())),
            "osd": state_dicts(api, model, opt, rank0_only=False)[1]}


def case_save_and_resume(api, strategy: str, orig: bool) -> dict:
    def make(seed=0):
        model = Net(seed)
        model = wrap(api, model, strategy, orig, ignored=True)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    model, opt = make()
    train(model, opt, 0)
    out = {}
    for rank0_only in (False, True):
        out[f"msd rank0_only={rank0_only}"], out[f"osd rank0_only={rank0_only}"] = \
            state_dicts(api, model, opt, rank0_only)
    # offload_to_cpu=True: torch FSDP1 fails on a CPU-only run (offloading a CPU tensor "to CPU" frees the
    # full parameter it still reads: "setStorage ... out of bounds"); on CPU it moves nothing, so torch's
    # offload_to_cpu=False is the oracle of ours' True.
    out["msd rank0_only=True offload"] = state_dicts(api, model, opt, True, offload=api.ours)[0]
    if not orig:  # the older entry point (torch's is deprecated; ours is minifsdp.checkpoint's): rank0_only
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["full_optim_state_dict"] = copied(minifsdp.checkpoint.full_optim_state_dict(model, opt) if api.ours
                                                  else api.FSDP.full_optim_state_dict(model, opt))
    msd = out["msd rank0_only=False"]
    for rank0_only in (False, True):
        m, o, trained = resume(api, make, msd, out[f"osd rank0_only={rank0_only}"], rank0_only, STEPS)
        out[f"resumed rank0_only={rank0_only}"] = after(api, m, o, trained)
    if orig:  # the optimizer state dict at FullOptimStateDictConfig's default offload_to_cpu=True, and a resume
        out["osd offload"] = state_dicts(api, model, opt, False, optim_offload=True)[1]
        m, o, trained = resume(api, make, msd, out["osd offload"], False, STEPS)
        out["resumed offload"] = after(api, m, o, trained)
    out["continued"] = after(api, model, opt, train(model, opt, STEPS))
    return out


def case_rank0_only(api, strategy: str, orig: bool, model_cls: str) -> dict:
    model = {"Net": Net, "BareRoot": BareRoot}[model_cls]()
    model = wrap(api, model, strategy, orig, ignored=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, opt, 0)
    # under NO_SHARD torch takes the default config whatever was set, so offload_to_cpu=True runs there
    offload = strategy == "NO_SHARD" or api.ours
    return {"msd": state_dicts(api, model, opt, True)[0],
            "msd offload": state_dicts(api, model, opt, True, offload=offload)[0],
            "osd": state_dicts(api, model, opt, True)[1]}


def case_replicas_apart(api, orig: bool) -> dict:
    """NO_SHARD, each rank's optimizer state made its own after a step (as replicas whose gradients were never
    reduced have it: a wrapped container the root iterates rather than calls): whose state each rank saves."""
    model = wrap(api, Net(), "NO_SHARD", orig, ignored=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    train(model, opt, 0, steps=1)
    for state in opt.state.values():
        state["exp_avg"].add_(dist.get_rank())
    return {"osd": state_dicts(api, model, opt, rank0_only=False)[1]}


SAVE_AFTER = (0, 1, 3)  # steps after whose update the scaler is saved: its tracker at 1 and 2 of 3, backed off
SCALER_STEPS, INF_AT = 7, 3


def case_scaler_resume(api) -> dict:
    """growth_interval=3, init_scale=2**8, an inf at step 3 on rank 1: the scale grows after step 2, backs off
    after step 3, grows after step 6.  Saved after steps ``SAVE_AFTER``; each save loaded into a fresh scaler
    built with other settings (the state dict must bring them all), trained to the end."""
    cls = minifsdp.ShardedGradScaler if api.ours else _torch_scaler()

    def make(seed=0):
        model = wrap(api, Net(seed), "FULL_SHARD", False, ignored=False)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, opt = make()
    scaler = cls(device="cpu", init_scale=2.0**8, growth_interval=3)
    saves, steps = {}, []
    for step in range(SCALER_STEPS):
        steps.append(train(model, opt, step, 1, scaler=scaler, inf_at=INF_AT))
        if step in SAVE_AFTER:
            saves[step] = (scaler.state_dict(), *state_dicts(api, model, opt, rank0_only=False))
    out = {"continued": {"scales": [s for t in steps for s in t["scales"]],
                         "losses": [x for t in steps for x in t["losses"]], "full": full_params(api, model)},
           "saved": {s: v[0] for s, v in saves.items()}}
    for step, (scaler_sd, msd, osd) in saves.items():
        fresh = cls(device="cpu", init_scale=3.0, growth_interval=50, growth_factor=4.0, backoff_factor=0.25)
        fresh.load_state_dict(scaler_sd)
        m, _, trained = resume(api, make, msd, osd, False, step + 1, steps=SCALER_STEPS - step - 1,
                               scaler=fresh, inf_at=INF_AT)
        out[f"resumed after {step}"] = {**trained, "full": full_params(api, m)}
    return out


def _torch_scaler():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler


CASES = {"save_and_resume": case_save_and_resume, "rank0_only": case_rank0_only, "scaler": case_scaler_resume,
         "replicas_apart": case_replicas_apart}


def run_cases(cases) -> dict:
    """``{case: {"torch": result, "ours": result}}`` for each ``(name, *args)``; a side that raises gives
    ``{"error": traceback}`` (every rank raises alike here, so the next case still meets the others)."""
    out = {}
    for case in cases:
        res = {}
        for side in SIDES:
            try:
                res[side] = CASES[case[0]](Side(side == "ours"), *case[1:])
            except Exception:  # noqa: BLE001 - the error is the result
                res[side] = {"error": traceback.format_exc()[-2000:]}
        out[case] = res
    return out
