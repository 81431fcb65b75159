"""Chapters 2.3 and 2.4, at real scale: what one training step holds and sends per rank, before you pay for it.

``python -m minifsdp plan`` prints this module's answer for a model (:mod:`minifsdp.memory.plan_shapes`)
and a run (:class:`Run`).  Every number is a function of shapes, counted the way FSDP lays the bytes out:

    model_state(shape, run)   parameters, gradients, optimizer state per rank (the census at rest, exactly)
    collectives(shape, run)   every collective of one step: bytes this rank sends (count_bytes(), exactly)
    moments(shape, run)       the bytes alive at each point of the step where the peak can fall
    peak(shape, run)          the largest of those, and where in the step it is

Note (which 16 bytes per parameter): with fp32 AdamW, a parameter costs 4 (itself) + 4 (its gradient) + 8
(Adam's two moments) = 16 bytes.  torch's ``MixedPrecision`` keeps the same 16: the sharded parameter stays
fp32 (it is the master copy) and only the gathered copy and the activations are 16-bit.  The ZeRO paper's
16Ψ is a different sum, mixed-precision Adam: 2 (fp16 parameter) + 2 (fp16 gradient) + 12 (fp32 master, m,
v).  Equal totals, different parts, so FSDP's sharded numbers are not the paper's stage 1-3 rows.

Note (what the exact numbers include): FSDP pads each unit's flat parameter to a multiple of the shard group
(``sharded_numel``), and the padding is stored like any element: in the parameter, its gradient and both
moments, and it travels in every all-gather and reduce-scatter.  AdamW keeps a 4-byte ``step`` per tensor it
optimizes (one per unit for FSDP).  DDP (torch's and ours) keeps its gradient buckets between steps, a second
copy of the gradients.  FULL_SHARD does not free the root unit after its forward (the backward starts
there), so the root is gathered once, every other unit twice.

Note (when a unit's parameters are freed): in the backward, autograd first computes each parameter's
gradient (the pieces), then concatenates them into the unit's flat gradient.  torch FSDP1 frees the gathered
parameters after that, so the concatenation sits on top of them (gathered + pieces + flat); minifsdp's FSDP
frees them as soon as autograd has every piece, before the concatenation (``register_free_before_concat``
in ``minifsdp/fsdp/core/backward.py``).  ``Run(frees_before_concat=...)`` picks; torch's is the default.

Note (beyond the strategy): ``Run(impl="fsdp2")`` plans ``fully_shard``, each parameter padded on its own
(:mod:`minifsdp.memory.plan_fsdp2`: the shards, the per-rank optimizer state, ``reshard_after_forward``);
``Run(ac=...)`` which blocks keep what (:mod:`minifsdp.memory.plan_ac`); ``Run(offload="params")`` keeps the model
state in the CPU's memory (:mod:`minifsdp.memory.plan_options` says what torch offloads and refuses the rest).

One step of FULL_SHARD with BACKWARD_PRE, the moments ``moments`` evaluates (units: root, blocks 0..L-1)::

    forward    gather root | gather b0, run, free | ... | head + loss     activations pile up
    backward   loss grads  <- root and b(L-1) gathered, every activation alive: usually the peak
               b(L-1) .. b0: gather the next (prefetch), gradient whole, reduce-scatter, free
               (reduce dtype wider than the compute's, e.g. fp32 under bf16: free, cast the gradient, reduce)
    optimizer  every gradient shard alive, plus foreach AdamW's one temporary (sqrt of v)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minifsdp.memory.plan_ac import saved_per_unit
from minifsdp.memory.plan_fsdp2 import kept_after_forward, local_elements, padded_shards, reshard_group, tensor_count
from minifsdp.memory.plan_options import options
from minifsdp.memory.plan_shapes import ModelShape

__all__ = ["Run", "Collective", "STRATEGIES", "model_state", "collectives", "bytes_sent", "moments", "peak",
           "ring_all_reduce_sent"]

STRATEGIES = ("DDP", "NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD")
LOW_PRECISION = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of the gathered parameters, activations, reductions
# bytes per parameter of the model state (fp32 parameter + fp32 gradient + the optimizer's state), and why
OPTIMIZERS = {"adamw": (16, "AdamW: 4 (parameter) + 4 (gradient) + 8 (m and v), and a 4-byte step per tensor"),
              "sgd": (12, "SGD with momentum: 4 (parameter) + 4 (gradient) + 4 (momentum buffer)")}
DDP_BUCKET_BYTES = 25 * 2**20  # bucket_cap_mb=25, torch's default and ours
CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers", "ddp_buckets", "unsharded_parameters",
              "unsharded_gradients", "activations", "temporaries")


@dataclass(frozen=True)
class Run:
    """How the model is trained: ranks, strategy, precision and reduce dtype, optimizer, batch per rank, wrapping;
    which FSDP, when fsdp2 reshards, activation checkpointing, CPU offload (:mod:`minifsdp.memory.plan_options`).
    Names are case-insensitive ("BF16", "full_shard")."""

    world_size: int
    strategy: str = "FULL_SHARD"
    precision: str = "fp32"  # fp32 | bf16 | fp16: MixedPrecision(param_dtype=reduce_dtype=that), fp32 master
    reduce_dtype: str = ""  # the gradients' reduction dtype (MixedPrecision's reduce_dtype); "": the precision's
    optimizer: str = "adamw"  # adamw | sgd (with momentum)
    batch: int = 1  # sequences per rank
    seq: int = 0  # tokens per sequence; 0: the model's context length
    activation_checkpointing: bool = False  # True: ac "full"; after construction, whether any block is checkpointed
    wrap: str = "layer"
    gpus_per_node: int = 8
    backward_prefetch: bool = True  # BackwardPrefetch.BACKWARD_PRE, FSDP's default
    frees_before_concat: bool = False  # minifsdp's FSDP: True (Note (when a unit's parameters are freed))
    impl: str = "fsdp1"  # fsdp1 (FullyShardedDataParallel) | fsdp2 (fully_shard)
    reshard_after_forward: str = "true"  # fsdp2's: true | false | k | torchtitan (the root is always kept)
    ac: str = "none"  # none | full | selective | every-K
    offload: str = "none"  # none | params: parameters, gradients and optimizer state on the CPU (torch's CPUOffload)

    def __post_init__(self):
        object.__setattr__(self, "strategy", str(self.strategy).upper().replace("SHARDINGSTRATEGY.", ""))
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}.")
        for field in ("precision", "reduce_dtype", "optimizer"):  # names are case-insensitive
            object.__setattr__(self, field, str(getattr(self, field)).lower())
        object.__setattr__(self, "reduce_dtype", self.reduce_dtype or self.precision)
        if self.precision not in LOW_PRECISION or self.reduce_dtype not in LOW_PRECISION:
            raise ValueError(f"unknown precision {self.precision!r} or reduce dtype {self.reduce_dtype!r}; use "
                             f"fp32, bf16 or fp16.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use {' or '.join(OPTIMIZERS)}.")
        if min(self.world_size, self.batch, self.gpus_per_node) < 1 or self.seq < 0:
            raise ValueError(f"world size, batch and GPUs per node must be positive and seq at least 0, got "
                             f"{self.world_size}, {self.batch}, {self.gpus_per_node} and {self.seq}.")
        for field, value in options(self.strategy, self.impl, self.reshard_after_forward, self.ac,
                                    self.activation_checkpointing, self.offload).items():
            object.__setattr__(self, field, value)
        object.__setattr__(self, "activation_checkpointing", self.ac != "none")
        object.__setattr__(self, "reshard_after_forward", reshard_group(self.reshard_after_forward, self.shard_size))
        if self.strategy == "HYBRID_SHARD" and self.world_size % self.gpus_per_node:
            raise ValueError(f"HYBRID_SHARD shards inside a node: world size {self.world_size} is not a multiple "
                             f"of {self.gpus_per_node} GPUs per node; use a multiple of it, or --gpus-per-node "
                             f"that divides {self.world_size}.")

    @property
    def shard_size(self) -> int:
        """Ranks one unit is split over: N (FULL_SHARD, SHARD_GRAD_OP), a node (HYBRID_SHARD), 1 (replicated)."""
        if self.strategy in ("DDP", "NO_SHARD") or self.world_size == 1:
            return 1
        return self.gpus_per_node if self.strategy == "HYBRID_SHARD" else self.world_size

    @property
    def offloaded(self) -> bool:
        return self.offload == "params"

    @property
    def fsdp(self) -> bool:
        return self.strategy != "DDP"

    @property
    def low_bytes(self) -> int:
        return LOW_PRECISION[self.precision]

    @property
    def reduce_bytes(self) -> int:
        """Bytes of one gradient element on the wire: the reduce dtype's (FSDP); DDP's gradients stay fp32."""
        return LOW_PRECISION[self.reduce_dtype] if self.fsdp else 4


@dataclass(frozen=True)
class Collective:
    """One collective of the step, seen from one rank."""

    kind: str  # "all-gather" | "reduce-scatter" | "all-reduce"
    phase: str  # "forward" | "backward"
    unit: int  # index into unit_numels (DDP: the bucket)
    numel: int  # elements of the whole collective (the padded unit, a shard, a bucket)
    group_size: int
    bytes_sent: int  # by this rank
    across_nodes: bool  # whether its ring leaves the node (then the slower link bounds it)


def ring_all_reduce_sent(numel: int, n: int, rank: int, itemsize: int) -> int:
    """Bytes ``rank`` sends in a ring all-reduce of ``numel`` elements over ``n`` ranks: every chunk but its own
    in the reduce-scatter, every chunk but the next rank's in the all-gather (``minifsdp.comm.ring``)."""
    if n == 1:
        return 0
    return (2 * numel - _chunk(numel, n, rank % n) - _chunk(numel, n, (rank + 1) % n)) * itemsize


def _chunk(numel: int, n: int, i: int) -> int:
    """Elements of chunk ``i`` of ``chunk_bounds(numel, n)`` (the first ``numel % n`` are one longer), in closed
    form: a plan at a billion ranks costs what one at eight does."""
    base, extra = divmod(numel, n)
    return base + (1 if i < extra else 0)


def _ddp_buckets(shape: ModelShape) -> list[int]:
    """Elements of each DDP bucket: tensors in reverse order, a bucket closed once it holds 25 MiB (fp32)."""
    buckets, size = [], 0
    for numel in reversed([n for unit in shape.tensor_numels() for n in unit]):
        size += numel
        if 4 * size >= DDP_BUCKET_BYTES:
            buckets.append(size)
            size = 0
    return buckets + ([size] if size else [])


def _shards(shape: ModelShape, run: Run) -> list[int]:
    """Elements of this rank's piece of each unit, padding included: ceil(unit / shard group) (FSDP1: one flat
    parameter), or each parameter's padded rows summed (FSDP2: :func:`~minifsdp.memory.plan_fsdp2.padded_shards`)."""
    g = run.shard_size
    if run.impl == "fsdp2":
        return padded_shards(shape, run.wrap, g)
    return [math.ceil(u / g) for u in shape.unit_numels(run.wrap)]


def model_state(shape: ModelShape, run: Run, rank: int = 0) -> dict[str, int]:
    """Bytes ``rank`` holds after ``optimizer.step()``: parameters, gradients, optimizer state (exact), and beside
    them the buffers and DDP's buckets (the census at rest is their sum); ``host``: the part of the model state
    CPU offload keeps in the CPU's memory (the rest is on the GPU).  FSDP2's optimizer state (and its offloaded
    gradients) are each parameter's real rows, which differ by rank (:mod:`minifsdp.memory.plan_fsdp2`)."""
    per_element, step = (8, 4) if run.optimizer == "adamw" else (4, 0)  # AdamW: m, v and a step per tensor
    if run.impl == "fsdp2":
        padded = sum(_shards(shape, run))
        local = sum(local_elements(shape, run.wrap, run.shard_size, rank % run.shard_size))
        out = {"parameters": 4 * padded, "gradients": 4 * (local if run.offloaded else padded),
               "optimizer_state": per_element * local + step * tensor_count(shape, run.wrap)}
    else:
        if run.fsdp:
            elements = sum(_shards(shape, run))
            optimized = sum(1 for u in shape.unit_numels(run.wrap) if u)  # one flat parameter per unit
        else:
            elements, optimized = shape.params, sum(len(unit) for unit in shape.tensor_numels())
        out = {"parameters": 4 * elements, "gradients": 4 * elements,
               "optimizer_state": per_element * elements + step * optimized}
    out["model_state"] = sum(out.values())
    out["host"] = out["model_state"] if run.offloaded else 0
    out["buffers"] = _buffer_bytes(shape)
    out["ddp_buckets"] = 0 if run.fsdp else 4 * shape.params
    out["at_rest"] = out["model_state"] + out["buffers"] + out["ddp_buckets"]
    return out


def _buffer_bytes(shape: ModelShape) -> int:
    if shape.arch == "gpt":  # one causal mask (bool, seq x seq) per attention layer
        return shape.layers * shape.seq * shape.seq
    if shape.arch == "llama":  # the rotary embedding's inverse frequencies (fp32)
        return shape.hidden // shape.heads // 2 * 4
    return 0


def collectives(shape: ModelShape, run: Run, rank: int = 0) -> list[Collective]:
    """Every collective one step issues, in order, with the bytes ``rank`` sends (our ring's, exactly)."""
    n, g, low, red = run.world_size, run.shard_size, run.low_bytes, run.reduce_bytes
    if n == 1:
        return []
    whole = n <= run.gpus_per_node  # all ranks inside one node
    if not run.fsdp:  # gradients stay fp32 under autocast; one all-reduce per bucket, after the backward's grads
        return [Collective("all-reduce", "backward", i, b, n, ring_all_reduce_sent(b, n, rank, 4), not whole)
                for i, b in enumerate(_ddp_buckets(shape))]
    units = shape.unit_numels(run.wrap)
    if run.strategy == "NO_SHARD":
        return [Collective("all-reduce", "backward", i, u, n, ring_all_reduce_sent(u, n, rank, red), not whole)
                for i, u in reversed(list(enumerate(units)))]
    inside = g <= run.gpus_per_node
    out = [Collective("all-gather", "forward", i, s * g, g, s * (g - 1) * low, not inside)
           for i, s in enumerate(_shards(shape, run))]
    root = shape.root_is_a_unit(run.wrap)
    for i, s in reversed(list(enumerate(_shards(shape, run)))):
        kept = kept_after_forward(run.reshard_after_forward, i, len(units), root)
        if run.strategy in ("FULL_SHARD", "HYBRID_SHARD") and kept < 1:  # freed after forward (all or 1/k kept)
            k = round(1 / kept) if kept else g  # gathered again from the k ranks that keep a piece each, or all g
            out.append(Collective("all-gather", "backward", i, s * g, k, s * g // k * (k - 1) * low,
                                  k > run.gpus_per_node))
        out.append(Collective("reduce-scatter", "backward", i, s * g, g, s * (g - 1) * red, not inside))
        if run.strategy == "HYBRID_SHARD" and n > g:  # the shard's gradient, summed across the nodes
            out.append(Collective("all-reduce", "backward", i, s, n // g,
                                  ring_all_reduce_sent(s, n // g, rank // g, red), True))
    return out


def bytes_sent(shape: ModelShape, run: Run, rank: int = 0) -> int:
    """Bytes ``rank`` sends in one step (the sum of :func:`collectives`)."""
    return sum(c.bytes_sent for c in collectives(shape, run, rank))


# ---- the step, moment by moment ----------------------------------------------------------------------------


def _activations(shape: ModelShape, run: Run) -> tuple[list[int], int, int, int]:
    """(bytes each non-root unit keeps for its backward under ``run.ac`` (:mod:`minifsdp.memory.plan_ac`), bytes
    one block holds while it runs or is recomputed, the root's (embeddings, head, loss), one gradient flowing
    between units)."""
    seq, b = run.seq or shape.seq, run.low_bytes
    full = max(shape.saved_per_unit(run.batch, seq, b), default=0)
    per_unit = saved_per_unit(shape, run.ac, run.batch, seq, b)
    root = sum(shape.saved_in_root(run.batch, seq, b).values())
    return per_unit, full, root, shape.flow_bytes(run.batch, seq, b)


def moments(shape: ModelShape, run: Run) -> list[tuple[str, dict[str, int]]]:
    """(where, bytes by category) at each point of one step where the peak can fall, in step order.

    The step starts after ``optimizer.zero_grad()`` (torch's default: gradients to None), so the gradient
    shards appear unit by unit in the backward.  Prefetching: FSDP's default BACKWARD_PRE (FSDP2's default
    too).  FSDP2 frees a group's gathered parameters before it copies the gradients into the reduce-scatter's
    input (``FSDPParamGroup.post_backward``); CPU offload keeps the model state off the GPU."""
    state = model_state(shape, run)
    seq = run.seq or shape.seq
    units, shards = shape.unit_numels(run.wrap), _shards(shape, run)
    g, low = run.shard_size, run.low_bytes
    grad_bytes = low if run.fsdp else 4  # the unsharded gradient is computed in the compute dtype
    sharded = run.fsdp and g > 1
    # the gathered copy of each unit while it is in use (replicated fp32 strategies compute on the parameter)
    gathered = [s * g * low if (sharded or low != 4) else 0 for s in shards]
    free_after_forward = sharded and run.strategy in ("FULL_SHARD", "HYBRID_SHARD")
    root = shape.root_is_a_unit(run.wrap)
    # what of each unit's gathered copy stays from its forward to its backward (FULL_SHARD: the root's)
    kept = [gathered[i] * (kept_after_forward(run.reshard_after_forward, i, len(units), root)
                           if free_after_forward else 1) for i in range(len(units))]
    blocks = list(range(1 if root else 0, len(units)))  # the units that run between the root's two ends
    per_unit, full, root_acts, flow = _activations(shape, run)
    block_acts = dict(zip(blocks, per_unit))
    loss = shape.loss_backward_bytes(run.batch, seq, run.low_bytes)
    on_gpu = 0 if run.offloaded else 1
    fixed = {"parameters": on_gpu * state["parameters"], "optimizer_state": on_gpu * state["optimizer_state"],
             "buffers": state["buffers"], "ddp_buckets": state["ddp_buckets"]}

    def name(i):  # what a user calls unit i
        if root:
            return "the root unit (embeddings)" if i == 0 else f"block {i - 1}"
        return f"layer {i}"

    def moment(where, grads=0, held=None, unsharded_grads=0, acts=0, temporaries=0):
        m = dict(fixed, gradients=grads, unsharded_parameters=int(sum((held or {}).values())),
                 unsharded_gradients=unsharded_grads, activations=acts, temporaries=temporaries)
        return where, {c: m[c] for c in CATEGORIES}

    out = []
    held = {0: gathered[0]} if root else {}  # unit -> its gathered bytes on this rank now
    acts = root_acts  # (the head's part too: saved at the forward's end, shown from its start)
    for i in blocks:  # forward
        out.append(moment(f"forward, {name(i)}", held=held | {i: gathered[i]}, acts=acts + block_acts[i]))
        acts += block_acts[i]
        held = held | ({i: kept[i]} if kept[i] else {})
    if run.backward_prefetch and blocks and kept[blocks[-1]] < gathered[blocks[-1]]:
        held[blocks[-1]] = gathered[blocks[-1]]  # the first block of the backward, prefetched
    out.append(moment("backward, start: the loss's gradients, every activation alive", acts=acts, held=held,
                      temporaries=loss))
    # A unit's gradient: its pieces (one per parameter), then the flat gradient they are concatenated into,
    # both alive unless the gathered parameters were freed before the concatenation (the pieces sit on
    # those instead).  DDP's gradients are the parameters' own .grad (its buckets are counted apart).
    pieces = 1 if sharded and (run.frees_before_concat or run.impl == "fsdp2") else 2
    grads_done = 0
    order = list(reversed(blocks)) + ([0] if root else [])  # the root's embeddings end the backward
    for k, i in enumerate(order):
        nxt = {order[k + 1]: gathered[order[k + 1]]} if run.backward_prefetch and k + 1 < len(order) else {}
        before = acts - block_acts.get(i, 0)  # the activations of every unit before this one
        checkpointed = run.ac == "full" or (run.ac != "none" and block_acts.get(i, full) < full)
        recompute = full if i in block_acts and checkpointed else 0  # its forward runs again
        # the gradient coming in and the one going out; the first layer computes none for its input (the batch)
        flows = 0 if i == 0 and root else 1 if i == 0 else 2
        out.append(moment(f"backward, {name(i)}, its gradient being formed",
                          grads=grads_done + (0 if run.fsdp else 4 * units[i]), held=held | {i: gathered[i]} | nxt,
                          unsharded_grads=pieces * units[i] * grad_bytes if run.fsdp else 0,
                          acts=before + recompute, temporaries=flows * flow))
        rest = {u: b for u, b in (held | nxt).items() if u != i}
        if run.impl == "fsdp2" and run.world_size > 1:  # resharded, then the gradients copied into the RS input
            out.append(moment(f"backward, {name(i)}, its gradients copied into the reduce-scatter's input",
                              grads=grads_done, held=rest,
                              unsharded_grads=units[i] * grad_bytes + shards[i] * g * run.reduce_bytes,
                              acts=before, temporaries=flows * flow + shards[i] * run.reduce_bytes))
        elif run.fsdp and run.world_size > 1 and run.reduce_bytes != grad_bytes:  # torch frees, casts the grad
            out.append(moment(f"backward, {name(i)}, its gradient cast to {run.reduce_dtype} for the reduction",
                              grads=grads_done, held=rest,
                              unsharded_grads=units[i] * grad_bytes + shards[i] * g * run.reduce_bytes,
                              acts=before, temporaries=flows * flow + shards[i] * run.reduce_bytes))
        grads_done += on_gpu * 4 * (shards[i] if run.fsdp else units[i])
        acts = before
        held = {u: b for u, b in held.items() if u != i}
    foreach = 4 * (sum(shards) if run.fsdp else shape.params) if run.optimizer == "adamw" else 0
    out.append(moment("optimizer step" + (" (on the CPU)" if run.offloaded else ""),
                      grads=on_gpu * state["gradients"], temporaries=on_gpu * foreach))
    return out


def peak(shape: ModelShape, run: Run) -> tuple[int, str, dict[str, int]]:
    """(bytes, where, breakdown) of the largest of :func:`moments`."""
    where, parts = max(moments(shape, run), key=lambda m: sum(m[1].values()))
    return sum(parts.values()), where, parts
