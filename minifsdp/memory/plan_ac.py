"""Chapter 2.3 at real scale: what activation checkpointing keeps, and what it costs, for ``plan --ac``.

A block's backward needs tensors from its forward (:meth:`~minifsdp.memory.plan_shapes.ModelShape.saved_per_block`
counts them op by op).  Checkpointing a block keeps less and runs (part of) its forward again in the backward:

    none        every block keeps all it saves
    full        a checkpointed block keeps only its input (B x T x hidden); its whole forward runs again
    every-K     torchtitan's layer-level selective AC (``selective_ac_option="K"``): blocks K, 2K, 3K, ...
                (counting from 1) are checkpointed in full, the others keep everything
    selective   torchtitan's op-level selective AC (``selective_ac_option="op"``): every block keeps its input
                and the outputs of the ops its policy saves; the other ops run again

The op-level policy, as torchtitan writes it (pytorch/torchtitan, ``torchtitan/distributed/activation_checkpoint.py``,
``_save_list`` and ``_get_custom_policy``; earlier ``torchtitan/parallelisms/parallelize_llama.py``): its list
holds ``aten.mm``, the two fused SDPA kernels (flash and memory-efficient attention) and the functional
reduce-scatter (tensor parallel's: none here), and of the matmuls it saves the odd ones (1st, 3rd, ...) and
recomputes every second one, counting afresh in each block.  Two consequences the counts below follow:

* a Linear with a bias is ``aten.addmm``, not ``aten.mm``: it is neither saved nor counted.  Qwen2's q, k, v
  have biases, so its saved matmuls are o and up; TinyGPT's Linears all have biases and its attention is written
  out (``bmm``, softmax), so on the gpt architecture nothing but the block's input is saved (selective = full);
* on a Llama block the matmuls run q, k, v, o, gate, up, down: q, v, gate and down are saved, k, o and up run
  again, and SDPA keeps its output and its log-sum-exp (fp32), as the fused kernel returns them.

The recomputation's FLOPs: 2 per weight per token of each matmul run again (the forward's share of the 6), and
for ``full`` one third of the step (a forward again), as ``plan`` has always counted it.
"""

from __future__ import annotations

from minifsdp.memory.plan_shapes import FP32, ModelShape

__all__ = ["AC_MODES", "parse_ac", "checkpointed", "selective_saved", "saved_per_unit", "recompute_flops",
           "saved_ops"]

AC_MODES = ("none", "full", "selective", "every-K")


def parse_ac(text: str) -> str:
    """``text`` as a mode: "none", "full", "selective" or "every-K" (K a positive whole number; every-1 is
    "full"), case ignored; ValueError (one line naming ``--ac`` and the fix) otherwise."""
    mode = str(text).strip().lower()
    if mode in ("none", "full", "selective"):
        return mode
    k = mode.removeprefix("every-")
    if mode.startswith("every-") and k.isdigit() and int(k) >= 1:
        return "full" if int(k) == 1 else f"every-{int(k)}"
    raise ValueError(f"unknown --ac {text!r}; use none, full, selective (torchtitan's op-level policy) or every-K "
                     f"with K a positive whole number (every-2: every second block checkpointed)")


def checkpointed(mode: str, layers: int) -> list[bool]:
    """Whether each block (0-based) is checkpointed in full: every-K picks blocks K-1, 2K-1, ... (torchtitan
    counts from 1: blocks K, 2K, ...)."""
    if mode.startswith("every-"):
        k = int(mode.removeprefix("every-"))
        return [(i + 1) % k == 0 for i in range(layers)]
    return [mode == "full"] * layers


def _mm_order(shape: ModelShape) -> list[tuple[str, int]]:
    """(name, output columns) of each ``aten.mm`` a block runs, in order (a biased Linear is ``addmm``: absent)."""
    if shape.arch != "llama":
        return []
    h, f, kv = shape.hidden, shape.inner, shape.kv_width
    qkv = [] if shape.qkv_bias else [("q", h), ("k", kv), ("v", kv)]
    return qkv + [("o", h), ("gate", f), ("up", f), ("down", h)]


def selective_saved(shape: ModelShape, batch: int, seq: int, act_bytes: int) -> dict[str, int]:
    """Bytes one block keeps under the op-level policy, by what keeps them: its input, the saved matmuls'
    outputs, SDPA's output and log-sum-exp (llama)."""
    tokens = batch * seq
    out = {"the block's input (the checkpoint's argument)": tokens * shape.hidden * act_bytes}
    kept = [(name, cols) for i, (name, cols) in enumerate(_mm_order(shape)) if i % 2 == 0]  # the 1st, 3rd, ...
    if kept:
        out[f"outputs of the saved matmuls ({', '.join(n for n, _ in kept)})"] = \
            sum(tokens * cols * act_bytes for _, cols in kept)
    if shape.arch == "llama":
        out["SDPA's output and log-sum-exp (fp32)"] = tokens * shape.hidden * act_bytes + \
            batch * shape.heads * seq * FP32
    return out


def saved_ops(shape: ModelShape, mode: str) -> str:
    """One line for the output: what a block keeps under ``mode``."""
    if mode == "none":
        return "every block keeps all it saves"
    if mode != "selective":
        return "a checkpointed block keeps its input only and runs its forward again in the backward"
    mms = _mm_order(shape)
    if not mms:
        return ("selective (op-level) saves none of this block's ops: its Linears have biases (addmm) and its "
                "attention is bmm and softmax, so each block keeps its input only, as full")
    saved = [n for i, (n, _) in enumerate(mms) if i % 2 == 0]
    again = (["q", "k", "v (biased: addmm)"] if shape.qkv_bias else []) + [n for i, (n, _) in enumerate(mms) if i % 2]
    return (f"selective (op-level, torchtitan's _save_list): each block keeps its input, the outputs of the "
            f"matmuls {', '.join(saved)} and of SDPA (output and log-sum-exp); {', '.join(again)} and the "
            f"element-wise ops run again")


def saved_per_unit(shape: ModelShape, mode: str, batch: int, seq: int, act_bytes: int) -> list[int]:
    """Bytes each non-root unit keeps for its backward under ``mode`` (an MLP's Linears are never
    checkpointed by ``plan``: they keep their inputs)."""
    full = shape.saved_per_unit(batch, seq, act_bytes)
    if shape.arch == "mlp" or mode == "none":
        return full
    if mode == "selective":
        return [sum(selective_saved(shape, batch, seq, act_bytes).values())] * len(full)
    only_input = batch * seq * shape.hidden * act_bytes
    return [only_input if c else f for c, f in zip(checkpointed(mode, shape.layers), full)]


def recompute_flops(shape: ModelShape, mode: str, batch: int, seq: int) -> float:
    """Floating-point operations the backward spends running forwards again, per step."""
    if mode == "none" or shape.arch == "mlp":
        return 0.0
    base = shape.matmul_flops(batch, seq)
    if mode == "full" or (mode == "selective" and not _mm_order(shape)):
        return base / 3
    block = shape.unit_flops(batch, seq)[1]
    if mode.startswith("every-"):
        return sum(checkpointed(mode, shape.layers)) * block / 3
    tokens = batch * seq
    again = [(name, cols) for i, (name, cols) in enumerate(_mm_order(shape)) if i % 2]
    h, f, kv = shape.hidden, shape.inner, shape.kv_width
    rows = {"q": h, "k": h, "v": h, "o": h, "gate": h, "up": h, "down": f}  # the matmul's input width
    biased = 2 * tokens * (h * h + 2 * h * kv) if shape.qkv_bias else 0  # Qwen2's q, k, v: addmm, run again
    return shape.layers * (biased + sum(2.0 * tokens * rows[n] * cols for n, cols in again))
