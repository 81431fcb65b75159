"""A fuzz program: one random but seeded use of FSDP, written down as plain data (JSON), drawn from a seed.

    seed 1234 --draw--> Program(impl="fsdp1", world_size=3,
                                model={blocks: [mlp -> dataclass, bn, nested[linear]], out: dict, ...},
                                wrap={policy: module, classes: [Block], ignored: []},
                                options={sharding_strategy: SHARD_GRAD_OP, mixed_precision: {bf16, fp32}, ...},
                                optimizer={name: adamw}, steps=[train, no_sync, train(clip 0.5), state_dict FULL])

The same program runs on torch's FSDP and on ours (``run.py``), and the two records are compared
(``compare.py``).  Everything a program does is in these fields, so a difference can be shrunk
(``shrink.py``: drop a step, a block, an option, and keep what still differs) and printed as a script
(``script.py``).  Sizes are drawn so that no world size from 2 to 4 divides a flat parameter.

What is drawn, and how often, is the fuzzer's idea of "what users write": every option torch FSDP1 and
``fully_shard`` take, the containers models return, frozen, tied, unused parameters, a module called twice,
gradient accumulation, ``no_sync``, eval and no-grad forwards, clipping, the state dicts and their round trips.
"""

from __future__ import annotations

import dataclasses
import json
import random

from minifsdp.fuzz.trees import KINDS, RETURNS

__all__ = ["Program", "draw", "IMPLS"]

IMPLS = ("fsdp1", "fsdp2")
DTYPES = ("bf16", "fp16", "fp32")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
STEPS_FSDP1 = {"train": 40, "accum": 10, "no_sync": 10, "eval": 7, "no_grad": 4, "state_dict": 12,
               "optim_state_dict": 6, "summon": 6}
STEPS_FSDP2 = {"train": 40, "accum": 10, "no_sync": 10, "eval": 7, "no_grad": 4, "state_dict": 8, "dcp_state_dict": 8,
               "unshard": 5}


@dataclasses.dataclass
class Program:
    """Everything one fuzz case does; see the module docstring for an example."""
    seed: int
    impl: str
    world_size: int
    model: dict
    wrap: dict
    options: dict
    optimizer: dict
    steps: list

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Program:
        return cls(**json.loads(text))

    def replace(self, **changes) -> Program:
        """A copy with ``changes`` (deep: the nested dicts are copied, never shared with ``self``)."""
        fields = json.loads(self.to_json())
        fields.update(json.loads(json.dumps(changes)))
        return Program(**fields)

    def summary(self) -> str:
        """One line: what a reader needs to recognise the program."""
        kinds = ",".join(_kind_line(b) for b in self.model["blocks"])
        opts = " ".join(f"{k}={v}" for k, v in sorted(self.options.items()) if v not in (None, False))
        steps = ",".join(s["op"] for s in self.steps)
        return (f"seed={self.seed} {self.impl} N={self.world_size} [{kinds}] out={self.model['out']} "
                f"wrap={self.wrap.get('policy')} {opts} opt={self.optimizer['name']} steps={steps}")


def _kind_line(block: dict) -> str:
    inner = "(" + ",".join(_kind_line(c) for c in block.get("children", ())) + ")" if block.get("children") else ""
    return f"{block['kind']}{inner}:{block.get('ret', 'tensor')}"


def draw(seed: int, impl: str = "fsdp1") -> Program:
    """The program ``seed`` stands for: the same seed draws the same program on every machine."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    rng = random.Random(f"{impl}:{seed}")
    model = _draw_model(rng)
    if impl == "fsdp1":
        options = _draw_fsdp1_options(rng)
        world = 4 if "HYBRID" in options["sharding_strategy"] else rng.choices([1, 2, 3], [1, 5, 4])[0]
        wrap = _draw_fsdp1_wrap(rng, model)
        steps = _draw_steps(rng, STEPS_FSDP1, options)
    else:
        options = _draw_fsdp2_options(rng)
        world = 4 if options["mesh"] == "2d" else rng.choices([1, 2, 3], [1, 5, 4])[0]
        if options["reshard_after_forward"] == 2 and world % 2:  # an int must divide the shard group's size
            options["reshard_after_forward"] = True
        wrap = _draw_fsdp2_wrap(rng, model)
        steps = _draw_steps(rng, STEPS_FSDP2, options)
    optimizer = {"name": rng.choice(["sgd", "adam", "adamw"]), "lr": rng.choice([0.1, 0.01]),
                 # decay / no-decay groups by name: only where the original names are there to group by
                 "groups": (impl == "fsdp2" or options["use_orig_params"]) and rng.random() < 0.3}
    return Program(seed=seed, impl=impl, world_size=world, model=model, wrap=wrap, options=options,
                   optimizer=optimizer, steps=steps)


def _draw_block(rng: random.Random, depth: int) -> dict:
    kinds = KINDS if depth == 0 else KINDS[:-1]  # one level of nesting
    kind = rng.choices(kinds, [5, 5, 3, 2, 2, 2, 1, 3][: len(kinds)])[0]
    block = {"kind": kind, "hidden": rng.choice([3, 5, 6, 9]),
             "ret": rng.choices(RETURNS, [6, 2, 2, 2, 1, 1, 2])[0]}
    if kind == "nested":
        block["children"] = [_draw_block(rng, depth + 1) for _ in range(rng.choice([1, 2]))]
    return block


def _draw_model(rng: random.Random) -> dict:
    tokens = rng.random() < 0.25
    vocab = rng.choice([7, 11, 13])
    tie = tokens and rng.random() < 0.5
    blocks = [_draw_block(rng, 0) for _ in range(rng.choice([1, 2, 2, 3, 4]))]
    model = {"input": "tokens" if tokens else "dense", "d": rng.choice([5, 6, 7, 9, 11]), "d_in": rng.choice([3, 5, 7]),
             "vocab": vocab, "d_out": vocab if tie else rng.choice([3, 4, 5]), "tie": tie,
             "container": rng.choice(["sequential", "modulelist", "moduledict"]),
             "blocks": blocks, "out": rng.choices(RETURNS, [6, 2, 2, 2, 1, 1, 2])[0],
             "batch": rng.choice([2, 3, 4, 6]), "repeat": None, "frozen": []}
    if rng.random() < 0.12:  # a module called twice in one forward
        model["repeat"] = rng.randrange(len(blocks))
    if rng.random() < 0.15:  # frozen parameters: a whole block, or one weight inside one
        i = rng.randrange(len(blocks))
        first = {"mlp": ".up", "conv": ".conv"}.get(blocks[i]["kind"], ".fc")  # one Linear (or Conv) inside
        model["frozen"] = [f"blocks.{_block_key(model, i)}" + ("" if rng.random() < 0.5 else first)]
    return model


def _block_key(model: dict, i: int) -> str:
    return f"b{i}" if model["container"] == "moduledict" else str(i)


def block_paths(model: dict) -> list[str]:
    """The module path of every top-level block (``blocks.0``, ``blocks.b1``, ...)."""
    return [f"blocks.{_block_key(model, i)}" for i in range(len(model["blocks"]))]


def _dtype_or_none(rng: random.Random, p_none: float) -> str | None:
    return None if rng.random() < p_none else rng.choice(DTYPES)


def _draw_fsdp1_options(rng: random.Random) -> dict:
    mp = None
    if rng.random() < 0.35:
        mp = {"param_dtype": _dtype_or_none(rng, 0.2), "reduce_dtype": _dtype_or_none(rng, 0.4),
              "buffer_dtype": _dtype_or_none(rng, 0.6), "keep_low_precision_grads": rng.random() < 0.3,
              "cast_forward_inputs": rng.random() < 0.2, "cast_root_forward_inputs": rng.random() < 0.9}
    return {"sharding_strategy": rng.choices(STRATEGIES, [6, 3, 2, 1, 1])[0],
            "use_orig_params": rng.random() < 0.4, "mixed_precision": mp,
            "backward_prefetch": rng.choices(["BACKWARD_PRE", "BACKWARD_POST", None], [3, 1, 1])[0],
            "forward_prefetch": rng.random() < 0.2, "limit_all_gathers": rng.random() < 0.8,
            "cpu_offload": rng.random() < 0.05, "scaler": False, "ac": _draw_ac(rng)}


def _draw_ac(rng: random.Random) -> str | None:
    """Activation checkpointing of every Block with torch's apply_activation_checkpointing, as users apply it."""
    return rng.choices([None, "no_reentrant", "reentrant"], [8, 1, 1])[0]


def _draw_fsdp1_wrap(rng: random.Random, model: dict) -> dict:
    policy = rng.choices(["none", "size", "module", "transformer", "manual"], [1, 2, 4, 2, 2])[0]
    paths = block_paths(model)
    wrap = {"policy": policy, "min_num_params": rng.choice([1, 20, 40, 80]),
            "classes": rng.choice([["Block"], ["Block"], ["Linear"], ["Block", "BatchNorm1d"]]),
            "manual": [p for p in paths if rng.random() < 0.6], "ignored": []}
    if rng.random() < 0.1 and len(paths) > 1:
        wrap["ignored"] = [rng.choice(paths)]
    return wrap


def _draw_fsdp2_options(rng: random.Random) -> dict:
    mp = None
    if rng.random() < 0.35:
        mp = {"param_dtype": _dtype_or_none(rng, 0.2), "reduce_dtype": _dtype_or_none(rng, 0.4),
              "output_dtype": _dtype_or_none(rng, 0.8), "cast_forward_inputs": rng.random() < 0.9}
    return {"reshard_after_forward": rng.choices([True, False, 2], [5, 2, 1])[0], "mixed_precision": mp,
            "mesh": "2d" if rng.random() < 0.12 else "1d", "cpu_offload": rng.random() < 0.05,
            "reshard_after_backward": rng.random() < 0.9, "scaler": False, "ac": _draw_ac(rng),
            "placement": "shard1" if rng.random() < 0.1 else None}


def _draw_fsdp2_wrap(rng: random.Random, model: dict) -> dict:
    paths = block_paths(model)
    wrap = {"policy": "manual", "manual": [p for p in paths if rng.random() < 0.7],
            "ignored": [], "explicit_prefetch": rng.random() < 0.15}
    if rng.random() < 0.08 and len(paths) > 1:  # ignored_params: one block's parameters left alone
        wrap["ignored"] = [rng.choice(paths)]
        wrap["manual"] = [p for p in wrap["manual"] if p not in wrap["ignored"]]
    return wrap


def _draw_steps(rng: random.Random, weights: dict, options: dict) -> list:
    ops, w = list(weights), list(weights.values())
    steps = [_step(rng, "train")] + [_step(rng, op) for op in rng.choices(ops, w, k=rng.choice([1, 2, 3, 4]))]
    if steps[-1]["op"] not in ("train", "state_dict", "optim_state_dict"):
        steps.append(_step(rng, "train"))
    mp = options.get("mixed_precision") or {}
    options["scaler"] = mp.get("param_dtype") == "fp16" and rng.random() < 0.5
    return steps


def _step(rng: random.Random, op: str) -> dict:
    step = {"op": op}
    if op == "train":
        step.update(clip=rng.choice([None, None, None, 0.05, 100.0]), set_to_none=rng.random() < 0.8,
                    norm_type=rng.choice([2.0, 2.0, 1.0, "inf"]))
    elif op == "state_dict":
        step.update(type=rng.choice(["FULL", "FULL", "SHARDED", "LOCAL"]), rank0_only=rng.random() < 0.3,
                    offload=rng.random() < 0.3, load=rng.random() < 0.5)
    elif op == "optim_state_dict":
        step.update(rank0_only=rng.random() < 0.3, load=rng.random() < 0.6)
    elif op == "summon":  # an edit inside is written back (or not), as writeback says
        step.update(writeback=rng.random() < 0.7, edit=rng.random() < 0.5, with_grads=rng.random() < 0.2)
    elif op == "dcp_state_dict":  # torch.distributed.checkpoint.state_dict's get/set, FSDP2's own checkpoint API
        step.update(full=rng.random() < 0.5, offload=rng.random() < 0.3, load=rng.random() < 0.6)
    elif op == "unshard":
        step.update(async_op=rng.random() < 0.5)
    return step
