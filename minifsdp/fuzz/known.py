"""Differences the fuzzer finds where ours parts from torch on purpose: named, explained, pinned by a test.

A reimplementation that teaches must say where it parts from torch and why: where torch is wrong (a state dict
its own load refuses), or where ours says so earlier or in torch's newer form.  Each entry here is one such
place: a predicate on (program, difference) that recognises it, and the reason, with torch's source.
Chapter 6's table "Where ours parts from torch, and why" lists the same entries, and each has a test that runs
the program on both and asserts both behaviours (``tests/test_fuzz.py``), so a torch release that fixes it
fails that test and the entry goes.

Nothing else may be explained away: a difference no entry matches is a finding, to be fixed in ours.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["Known", "KNOWN", "explain"]


@dataclasses.dataclass(frozen=True)
class Known:
    name: str
    why: str
    matches: Callable  # (program, difference) -> bool


def _step_of(program, where: str) -> dict | None:
    """The step a difference's ``where`` ("step 3 (state_dict)") names, or None."""
    if not where.startswith("step "):
        return None
    i = int(where.split()[1])
    return program.steps[i] if i < len(program.steps) else None


def _sharded_is_dtensor(program, d) -> bool:
    step = _step_of(program, d[1])
    return (program.impl == "fsdp1" and d[0] == "state_types" and step is not None and step["type"] == "SHARDED"
            and all(part.endswith("'DTensor(Shard(dim=0),)' vs 'ShardedTensor'") for part in d[2].split("; ")))


def _local_with_orig_params(program, d) -> bool:
    if program.impl != "fsdp1" or not program.options["use_orig_params"] \
            or program.options["sharding_strategy"] == "NO_SHARD" or program.world_size == 1:
        return False
    if d[0] == "error":  # torch cannot load what it returned: the flat parameters are unexpected keys
        i = d[2].split("torch raised RuntimeError at step ")[-1].split(":")[0]
        return (d[2].startswith("ours raised nothing vs torch raised RuntimeError at step ") and i.isdigit()
                and program.steps[int(i)].get("type") == "LOCAL" and "Error(s) in loading state_dict" in d[2])
    step = _step_of(program, d[1])
    return d[0] in ("state", "state_types") and step is not None and step.get("type") == "LOCAL"


def _local_hybrid_placement(program, d) -> bool:
    """torch raises building a LOCAL state dict's ShardedTensor on a rank outside the first shard group."""
    if program.impl != "fsdp1" or "HYBRID" not in program.options["sharding_strategy"] or d[0] != "error":
        return False
    head = "ours raised nothing vs torch raised ValueError at step "
    i = d[2][len(head):].split(":")[0]
    return (d[2].startswith(head) and i.isdigit() and program.steps[int(i)].get("type") == "LOCAL"
            and "does not exist in input process group" in d[2])


def _twice_under_reentrant_checkpoint(program, d) -> bool:
    """torch raises in the backward of a unit called twice under reentrant checkpointing, or (NO_SHARD with
    use_orig_params, a param_dtype) trains on with a call's part unreduced or dropped; ours trains."""
    if program.impl != "fsdp1" or program.options.get("ac") != "reentrant" or program.model.get("repeat") is None:
        return False
    if d[0] == "error":
        return d[2].startswith("ours raised nothing vs torch raised RuntimeError at step ")
    o = program.options
    quiet = (o["sharding_strategy"] == "NO_SHARD" and o["use_orig_params"]) or \
        (o.get("mixed_precision") or {}).get("param_dtype") is not None
    return quiet and d[0] in ("collectives", "grads", "loss", "params", "after", "full", "full_grads", "optim",
                              "state", "buffers", "total_norm", "scale")


def _tied_refused_at_wrapping(program, d) -> bool:
    """Ours refuses a weight tied across sharded units with use_orig_params at wrapping; torch fails at step 0."""
    return (program.impl == "fsdp1" and program.options["use_orig_params"] and program.model.get("tie")
            and d[0] == "error" and d[2].startswith("ours raised ValueError at wrapping: ")
            and "tied across sharded units" in d[2] and " vs torch raised RuntimeError at step 0: " in d[2])


def _tied_low_precision_grads(program, d) -> bool:
    """torch gives a tied original the kept fp16 gradient without its ``.data`` detour: autograd refuses it."""
    mp = program.options.get("mixed_precision") or {}
    return (program.impl == "fsdp1" and program.options["use_orig_params"] and program.model.get("tie")
            and mp.get("keep_low_precision_grads") and mp.get("param_dtype") in ("fp16", "bf16")
            and d[0] == "error" and "grad_dtype" in d[2] and " vs torch raised RuntimeError at step " in d[2])


def _called_outside_its_unit(program, d) -> bool:
    """A wrapped container the root iterates: under NO_SHARD torch never averages its gradients; ours refuses."""
    return (program.impl == "fsdp1" and d[0] == "error" and d[2].startswith("ours raised RuntimeError at step ")
            and "was called while that unit's forward is not running" in d[2].split(" vs torch ")[0])


def _step_index(program, where: str) -> int | None:
    return int(where.split()[1]) if where.startswith("step ") else len(program.steps) if where == "final" else None


def _full_offload_on_cpu(program, d) -> bool:
    """torch raises at a FULL state dict with offload_to_cpu on a sharded run; ours returns it."""
    if program.impl != "fsdp1" or program.world_size == 1 or program.options["sharding_strategy"] == "NO_SHARD":
        return False
    full_offload = any(s["op"] == "state_dict" and s["type"] == "FULL" and s["offload"] for s in program.steps)
    if d[0] == "error" and d[2].startswith("ours raised nothing vs torch raised crash at a step unknown") \
            and "SIGSEGV" in d[2]:  # a load_state_dict copying from the freed storage dies in C++
        return full_offload
    head = "ours raised nothing vs torch raised RuntimeError at step "
    if d[0] != "error" or not d[2].startswith(head):
        return False
    i = d[2][len(head):].split(":")[0]
    step = program.steps[int(i)] if i.isdigit() and int(i) < len(program.steps) else {}  # (past the last: the end)
    return step.get("op") == "state_dict" and step.get("type") == "FULL" and step.get("offload") \
        and "setStorage" in d[2]


def _orig_params_optim_offload(program, d) -> bool:
    """torch's FULL optim_state_dict with use_orig_params repeats one state tensor for every state name (Adam's
    exp_avg is its exp_avg_sq); ours is right, and a resume from each then differs from that step on."""
    if program.impl != "fsdp1" or not program.options["use_orig_params"] or program.world_size == 1 \
            or program.options["sharding_strategy"] == "NO_SHARD" or program.optimizer["name"] == "sgd":
        return False
    first = next((i for i, s in enumerate(program.steps) if s["op"] == "optim_state_dict"), None)
    i = _step_index(program, d[1])
    if first is None or i is None or i < first:
        return False
    if d[0] == "optim" and i < len(program.steps) and program.steps[i]["op"] == "optim_state_dict":
        return True  # any of them (a later one too: torch repeats the state each time)
    return any(s["op"] == "optim_state_dict" and s["load"] for s in program.steps[first:i])


def _plain_name(name: str) -> str:
    """A parameter's name in the plain model: the FSDP1 and checkpoint wrappers' segments dropped."""
    return ".".join(p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def _frozen_grads_under_no_sync(program, d) -> bool:
    """torch's ``no_sync`` with use_orig_params gives each frozen original a ``.grad``; ours gives none: every
    original that differs is frozen, ours None, torch's a tensor (``grads`` lists each one: compare.py)."""
    step = _step_of(program, d[1])
    if program.impl != "fsdp1" or not program.options["use_orig_params"] or d[0] != "grads" or step is None \
            or step["op"] != "no_sync" or not program.model.get("frozen"):
        return False
    for part in d[2].split("; "):
        name, _, what = part.partition(": ")
        if not (name.endswith(".1") and what.startswith("NoneType None vs tuple ('Tensor',")
                and any(_plain_name(name[:-2]).startswith(f) for f in program.model["frozen"])):
            return False
    return True


KNOWN: list[Known] = [
    Known("sharded_state_dict_is_dtensor",
          "SHARDED_STATE_DICT values: torch FSDP1 returns ShardedTensor (its FutureWarning: 'Please use DTensor "
          "instead and we are deprecating ShardedTensor'; DTensor only with _use_dtensor); ours returns DTensor with "
          "the same local chunk and global shape (state_dict_type.py, Note). The numbers are compared apart and equal.",
          _sharded_is_dtensor),
    Known("local_state_dict_with_orig_params",
          "LOCAL_STATE_DICT with use_orig_params=True: torch returns each original parameter's local view beside "
          "each unit's _flat_param, and its own load_state_dict of that dict fails ('Unexpected key(s) ... "
          "_flat_param'; _state_dict_utils._local_pre_state_dict_hook leaves the original parameters registered). "
          "Ours returns only the flat parameters, as without use_orig_params, and loads them back.",
          _local_with_orig_params),
    Known("local_state_dict_under_hybrid_shard",
          "LOCAL_STATE_DICT under HYBRID_SHARD (or _HYBRID_SHARD_ZERO2) with more than one shard group: torch places "
          "each local shard at the rank within its shard group (_state_dict_utils._local_post_state_dict_hook passes "
          "fsdp_state.rank to Shard.from_tensor_and_offsets), which ShardedTensor reads as a global rank, so every "
          "rank outside the first group raises 'Global rank 0 does not exist in input process group: [2, 3]'. Ours "
          "places it at the global rank (state_dict_type.py) and returns and loads the dict on every rank.",
          _local_hybrid_placement),
    Known("unit_called_twice_under_reentrant_checkpointing",
          "A unit called twice in one forward, inside blocks checkpointed with CheckpointImpl.REENTRANT: torch runs "
          "the unit's pre-backward once per backward, but the reentrant recompute runs the unit's forward and "
          "post-backward once per call, so the second recompute reads the parameters the first call's post-backward "
          "freed ('setStorage ... storage of size 0'; with use_orig_params the 1-D sharded views: 'mat2 must be a "
          "matrix'); under NO_SHARD with use_orig_params, or a param_dtype, it trains on with one call's part of the "
          "gradient left unreduced or dropped (one all-reduce fewer). Ours gathers for each recompute and reduces "
          "each call's part; it trains as torch trains without "
          "checkpointing, within one rounding (tests/test_fsdp_checkpointing_parity.py).",
          _twice_under_reentrant_checkpoint),
    Known("tied_weight_across_sharded_units_refused_at_wrapping",
          "use_orig_params=True and a weight tied across sharded units (an embedding in one unit, the head that "
          "shares it in another): torch marks it flattened by the first unit, the second skips it and its module "
          "keeps the original, whose .data is then a 1-D piece of the shard, so torch fails at the first forward "
          "(\"'weight' must be 2-D\"; _init_utils._get_orig_params). Ours refuses at wrapping, naming both names "
          "and the fix (checks.py, check_ties_across_units): the same program fails, one step earlier and saying why.",
          _tied_refused_at_wrapping),
    Known("tied_weight_low_precision_grads_with_orig_params",
          "MixedPrecision(keep_low_precision_grads=True), use_orig_params=True and a weight tied inside one unit: "
          "torch hands each fp32 original its low-precision gradient through `.data` (so autograd's dtype check is "
          "not met), but the tied name gets `param.grad = prim_param.grad` directly "
          "(_flat_param.FlatParamHandle._use_sharded_grad_views, its shared-parameters loop), which torch 2.13's "
          "grad_dtype check refuses at the first backward. Ours gives the tied name the same low-precision gradient "
          "as its first name, as the option documents; an optimizer that cannot take it (Adam's lerp) fails there.",
          _tied_low_precision_grads),
    Known("unit_called_outside_its_forward",
          "A wrapped container the root iterates (`for b in self.blocks`) rather than calls: the unit's forward never "
          "runs, so under NO_SHARD torch runs its blocks on the whole parameters with no pre- or post-backward hook: "
          "its gradients are never averaged and the replicas drift apart, silently: for ever with use_orig_params; "
          "without it, until a later step's backward meets views the optimizer's in-place update invalidated and "
          "autograd raises (FullyShardedDataParallel.forward is where torch's hooks are set up; nothing checks that "
          "a unit's modules run inside it). Ours refuses the "
          "call at the first forward, naming the unit and the fix (called_outside.py). Under a sharded strategy "
          "both fail in the forward (the parameters are 1-D shards there).",
          _called_outside_its_unit),
    Known("full_state_dict_offload_on_cpu",
          "FULL_STATE_DICT with FullStateDictConfig(offload_to_cpu=True) on a sharded CPU run: torch's values are "
          "views of the unit's gathered flat parameter, which it frees on leaving the unshard ('tensor.cpu()' makes no "
          "copy on the CPU; _state_dict_utils._full_post_state_dict_hook), so reading them raises 'setStorage ... out "
          "of bounds for storage of size 0'. Ours copies (full_state_dict.py) and returns the full tensors.",
          _full_offload_on_cpu),
    Known("orig_params_optim_state_dict_repeats_a_state",
          "FSDP.optim_state_dict with use_orig_params=True and Adam/AdamW (FullOptimStateDictConfig's default "
          "offload_to_cpu=True): torch returns exp_avg equal to exp_avg_sq for every sharded parameter "
          "(_optim_utils._allgather_orig_param_states reuses one gathered tensor for every state name and keeps "
          "views of it; on the CPU '.cpu()' makes no copy), so a resume from it leaves torch's own continued run. "
          "Ours returns each state as it is; a resume from ours equals the continued run.",
          _orig_params_optim_offload),
    Known("frozen_originals_get_grads_under_no_sync",
          "no_sync() with use_orig_params=True and a unit mixing frozen and trainable parameters: torch gives each "
          "frozen original (requires_grad=False) a .grad, a view of the unit's unsharded gradient holding what "
          "autograd computed for it (_flat_param.FlatParamHandle._use_unsharded_grad_views checks no requires_grad; "
          "_use_sharded_grad_views, after a synced backward, sets them to None, as its docstring says). Ours gives "
          "a frozen original no gradient in both, as autograd and DDP do (orig_params.py, Note (frozen originals)).",
          _frozen_grads_under_no_sync),
]


# what a rank says when a peer it waits for in a collective raised instead (gloo times out, closes connections)
_WAITED = ("Timed out waiting", "Connection closed", "Connection reset", "Application timeout")


def explain(program, diffs: list) -> dict:
    """{difference: the name of the known entry that explains it} for the differences some entry matches.

    A rank's error that only says it waited for a peer in vain (a gloo timeout), and a side with nothing wrapped
    (it died first), follow from an error of the same program: whatever explains that error explains them."""
    found = {d: k.name for d in diffs for k in KNOWN if k.matches(program, d)}
    causes = [name for d, name in found.items() if d[0] == "error"]
    for d in diffs:
        waited = d[0] == "error" and any(w in d[2] for w in _WAITED)
        never_wrapped = d[0] == "wrapped" and "NoneType None" in d[2]  # that side died before it wrapped
        if d not in found and causes and (waited or never_wrapped):
            found[d] = causes[0]
    return found
