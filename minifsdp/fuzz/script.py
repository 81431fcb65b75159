"""A fuzz program written out as a script a reader can run and read: torch user code, run on torch's and on ours.

The script spells out the wrapping and every step as a torch user would write them (the model comes from
``minifsdp.fuzz.trees``, built from the program's description), runs them on torch's FSDP and on ours in the
same ranks, and prints, step by step, where the two differ.  It is what ``python -m minifsdp fuzz --shrink``
prints for a finding, and what a bug report or a regression test starts from.
"""

from __future__ import annotations

import pprint

from minifsdp.fuzz.program import Program, block_paths

__all__ = ["to_script"]

_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32", None: "None"}


def _fsdp1_kwargs(p: Program) -> str:
    o = p.options
    parts = [f"sharding_strategy=ShardingStrategy.{o['sharding_strategy']}"]
    if o["use_orig_params"]:
        parts.append("use_orig_params=True")
    mp = o["mixed_precision"]
    if mp is not None:
        fields = ", ".join(f"{k}={_DTYPE[v] if k.endswith('dtype') else v}" for k, v in mp.items())
        parts.append(f"mixed_precision=MixedPrecision({fields})")
    if o["backward_prefetch"] != "BACKWARD_PRE":
        parts.append("backward_prefetch=" + (f"BackwardPrefetch.{o['backward_prefetch']}"
                                             if o["backward_prefetch"] else "None"))
    for key, default in (("forward_prefetch", False), ("limit_all_gathers", True)):
        if o[key] != default:
            parts.append(f"{key}={o[key]}")
    if o["cpu_offload"]:
        parts.append("cpu_offload=CPUOffload(offload_params=True)")
    if "HYBRID" in o["sharding_strategy"]:
        parts.append("process_group=hybrid_groups()")
    parts.append('device_id=torch.device("cpu")')
    return ", ".join(parts)


def _wrap_lines(p: Program) -> list[str]:
    w = p.wrap
    if p.impl == "fsdp2":
        o, mp = p.options, p.options["mixed_precision"]
        mesh = 'init_device_mesh("cpu", (2, 2))' if o["mesh"] == "2d" else f'init_device_mesh("cpu", ({p.world_size},))'
        kw = f"mesh={mesh}, reshard_after_forward={o['reshard_after_forward']!r}"
        if mp is not None:
            kw += ", mp_policy=MixedPrecisionPolicy(" + ", ".join(
                f"{k}={_DTYPE[v] if k.endswith('dtype') else v}" for k, v in mp.items()) + ")"
        if o["cpu_offload"]:
            kw += ", offload_policy=CPUOffloadPolicy(pin_memory=False)"
        if o.get("placement") == "shard1":
            n = 2 if o["mesh"] == "2d" else p.world_size
            kw += f", shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % {n} == 0 else None"
        lines = [f"    kw = dict({kw})"]
        if o.get("ac"):
            lines.append(f"    checkpoint_blocks(model, {o['ac']!r})  # apply_activation_checkpointing on each Block")
        lines += [f"    fully_shard(model.get_submodule({path!r}), **kw)" for path in w["manual"]
                  if path in block_paths(p.model)]
        root = "dict(kw, reshard_after_forward=kw['reshard_after_forward'] is not False)"  # an int: inner units only
        if w.get("ignored"):
            paths = ", ".join(repr(x) for x in w["ignored"])
            ignored = f"{{p for x in [{paths}] for p in model.get_submodule(x).parameters()}}"
            root = root[:-1] + f", ignored_params={ignored})"
        lines.append(f"    fully_shard(model, **{root})")
        return lines
    kwargs = _fsdp1_kwargs(p)
    lines = [f"    kw = dict({kwargs})"]
    if w["policy"] == "manual":
        for path in w["manual"]:
            if path not in w["ignored"]:
                parent, _, name = path.rpartition(".")
                lines.append(f"    model.get_submodule({parent!r})._modules[{name!r}] = "
                             f"FSDP(model.get_submodule({path!r}), **kw)")
    policy = {"none": None, "manual": None, "size": f"partial(size_based_auto_wrap_policy, "
                                                      f"min_num_params={w['min_num_params']})",
              "module": "ModuleWrapPolicy({" + ", ".join(f"{c}" for c in w["classes"]) + "})",
              "transformer": "partial(transformer_auto_wrap_policy, transformer_layer_cls={"
                             + ", ".join(w["classes"]) + "})"}[w["policy"]]
    ignored = f", ignored_modules=[{', '.join(f'model.get_submodule({x!r})' for x in w['ignored'])}]" \
        if w["ignored"] else ""
    lines.append(f"    model = FSDP(model, auto_wrap_policy={policy}{ignored}, **kw)")
    if p.options.get("ac"):
        lines.append(f"    checkpoint_blocks(model, {p.options['ac']!r})  # apply_activation_checkpointing, each Block")
    return lines


def _step_lines(p: Program, i: int, step: dict) -> list[str]:
    op, L = step["op"], []
    L.append(f"    # step {i}: {op}")
    if op in ("train", "accum", "no_sync"):
        inside = "    "
        if op == "no_sync":
            L.append("    with model.no_sync():" if p.impl == "fsdp1"
                     else "    model.set_requires_gradient_sync(False)")
            inside = "        " if p.impl == "fsdp1" else "    "
        L.append(f"{inside}x, y = batch(MODEL, {i}, rank)")
        L.append(f"{inside}loss = loss_of(model(x), y)")
        L.append(f"{inside}(scaler.scale(loss) if scaler else loss).backward()")
        if op == "no_sync" and p.impl == "fsdp2":
            L.append("    model.set_requires_gradient_sync(True)")
        L.append(f"    seen['step {i} loss'] = loss.item()")
        L.append(f"    seen['step {i} grads'] = [(n, p.grad) for n, p in model.named_parameters()]")
    if op == "train":
        if step["clip"] is not None:
            if p.options.get("scaler"):
                L.append("    scaler.unscale_(opt)")
            norm = float(step.get("norm_type", 2.0))
            clip = (f"model.clip_grad_norm_({step['clip']}, {norm!r})" if p.impl == "fsdp1"
                    else f"torch.nn.utils.clip_grad_norm_(model.parameters(), {step['clip']}, {norm!r})")
            clip = clip.replace("inf)", "float('inf'))")
            L.append(f"    seen['step {i} total norm'] = {clip}")
        L.append("    (scaler.step(opt), scaler.update()) if scaler else opt.step()")
        L.append(f"    opt.zero_grad(set_to_none={step['set_to_none']})")
        L.append(f"    seen['step {i} params'] = [(n, p.detach().clone()) for n, p in model.named_parameters()]")
    elif op in ("eval", "no_grad"):
        L.append(f"    x, y = batch(MODEL, {i}, rank)")
        if op == "eval":
            L.append("    model.eval()")
        L.append("    with torch.no_grad():")
        L.append(f"        seen['step {i} loss'] = loss_of(model(x), y).item()")
        L.append("    model.train()")
    elif op == "state_dict" and p.impl == "fsdp2":
        L.append(f"    seen['step {i} state'] = sd = model.state_dict()")
        if step["load"]:
            L.append("    model.load_state_dict(sd)")
    elif op == "state_dict":
        cfg = {"FULL": f"FullStateDictConfig(offload_to_cpu={step['offload']}, rank0_only={step['rank0_only']})",
               "SHARDED": f"ShardedStateDictConfig(offload_to_cpu={step['offload']})",
               "LOCAL": f"LocalStateDictConfig(offload_to_cpu={step['offload']})"}[step["type"]]
        L.append(f"    with FSDP.state_dict_type(model, StateDictType.{step['type']}_STATE_DICT, {cfg}):")
        L.append(f"        seen['step {i} state'] = sd = model.state_dict()")
        if step["load"] and not (step["type"] == "FULL" and step["rank0_only"]):
            L.append("        model.load_state_dict(sd)")
    elif op == "optim_state_dict":
        L.append(f"    seen['step {i} optim'] = osd = FSDP.optim_state_dict(model, opt)")
        if step["load"]:
            L.append("    opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))")
    elif op == "summon":
        L.append(f"    with FSDP.summon_full_params(model, writeback={step.get('writeback', True)}, "
                 f"with_grads={step.get('with_grads', False)}):")
        L.append(f"        seen['step {i} full'] = [(n, p.detach().clone()) for n, p in model.named_parameters()]")
        if step.get("edit"):
            L.append("        with torch.no_grad():")
            L.append("            next(iter(model.parameters())).add_(0.5)")
        L.append(f"    seen['step {i} after'] = [(n, p.detach().clone()) for n, p in model.named_parameters()]")
    elif op == "unshard":
        L.append(f"    handle = model.unshard(async_op={step.get('async_op', False)})")
        L.append("    handle.wait() if handle is not None else None")
        L.append("    model.reshard()")
    elif op == "dcp_state_dict":
        L.append(f"    options = StateDictOptions(full_state_dict={step['full']}, cpu_offload={step['offload']})")
        L.append(f"    seen['step {i} state'], seen['step {i} optim'] = msd, osd = get_state_dict(model, opt, "
                 "options=options)")
        if step["load"] and not (step["full"] and step["offload"]):
            L.append("    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)")
    return L


def to_script(p: Program, difference: tuple | None = None) -> str:
    """The program as a runnable Python script (``python script.py``) that prints where the two sides differ."""
    found = f"\n    difference: {difference[0]} at {difference[1]}: {difference[2]}" if difference else ""
    params = "model.parameters()"
    if p.optimizer.get("groups"):
        named = "model.named_parameters()"
        params = (f"[{{'params': [p for n, p in {named} if not n.endswith('bias')], 'weight_decay': 0.1}}, "
                  f"{{'params': [p for n, p in {named} if n.endswith('bias')], 'weight_decay': 0.0}}]")
    opt = {"sgd": f"torch.optim.SGD({params}, lr={p.optimizer['lr']}, momentum=0.9)",
           "adam": f"torch.optim.Adam({params}, lr={p.optimizer['lr']})",
           "adamw": f"torch.optim.AdamW({params}, lr={p.optimizer['lr']})"}[p.optimizer["name"]]
    side = ("FSDP" if p.impl == "fsdp1" else "fully_shard")
    lines = [
        f'"""A fuzz program: torch user code run on torch\'s {"FSDP1" if p.impl == "fsdp1" else "fully_shard"} '
        "and on minifsdp's, compared step by step.",
        "",
        f"    python -m minifsdp fuzz --impl {p.impl} --seed {p.seed} --cases 1{found}",
        "",
        "Run: python this_file.py",
        '"""',
        "from functools import partial",
        "",
        "import torch",
        "import torch.distributed as dist",
        "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.fsdp import *  # noqa: F403 - torch's names, as a torch user imports them",
        "from torch.distributed.fsdp import fully_shard as torch_fully_shard",
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchScaler",
        "from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, "
        "transformer_auto_wrap_policy",
        "from torch.distributed.tensor import Shard",
        "from torch.nn import BatchNorm1d, Linear  # noqa: F401 - wrap policies may name them",
        "",
        "import minifsdp",
        "from minifsdp.fuzz.compare import first_difference",
        "from minifsdp.fuzz.record import tensors_of",
        "from minifsdp.fuzz.sides import RankContext, checkpoint_blocks",
        "from minifsdp.fuzz.trees import Block, batch, build_model, loss_of  # noqa: F401",
        "",
        "MODEL = " + pprint.pformat(p.model, width=110, sort_dicts=True).replace("\n", "\n" + " " * 8),
        "",
        "",
        "def hybrid_groups():",
        "    return RankContext().hybrid_groups()",
        "",
        "",
        f"def run({side}, Scaler):",
        '    """The program on one side: what a user would look at, by name."""',
        "    rank, seen = dist.get_rank(), {}",
        f"    model = build_model(MODEL, seed={p.seed})",
        *_wrap_lines(p),
        f"    opt = {opt}",
        "    scaler = " + ('Scaler(device="cpu")' if p.options.get("scaler") else "None"),
    ]
    for i, step in enumerate(p.steps):
        lines += _step_lines(p, i, step)
    lines += [
        "    return seen",
        "",
        "",
        "def side(*args):",
        "    try:",
        "        return run(*args)",
        "    except Exception as e:  # noqa: BLE001",
        "        return {'raised': type(e).__name__ + ': ' + str(e).splitlines()[0]}",
        "",
        "",
        "def compare():",
        "    theirs = side(" + ("TorchFSDP" if p.impl == "fsdp1" else "torch_fully_shard") + ", TorchScaler)",
        "    ours = side(" + ("minifsdp.FSDP" if p.impl == "fsdp1" else "minifsdp.fully_shard")
        + ", minifsdp.ShardedGradScaler)",
        "    rank = dist.get_rank()",
        "    lines = [f'rank {rank}: torch ' + theirs.get('raised', 'ran every step') + '; ours ' + "
        "ours.get('raised', 'ran every step')]",
        "    for key in sorted(set(theirs) & set(ours) - {'raised'}):",
        "        found = first_difference(tensors_of(ours.get(key)), tensors_of(theirs.get(key)))",
        "        lines.append(f'rank {rank} {key}: ' + ('same' if found is None else 'DIFFERENT ' + found))",
        "    return lines",
        "",
        "",
        'if __name__ == "__main__":',
        f"    for rank_lines in minifsdp.spawn(compare, world_size={p.world_size}):",
        "        print('\\n'.join(rank_lines))",
    ]
    if p.impl == "fsdp1":
        lines = [x.replace("from torch.distributed.fsdp import fully_shard as torch_fully_shard",
                           "from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP") for x in lines]
    return "\n".join(lines) + "\n"
