"""Activation checkpointing (chapters 2.3, 2.5): keep a block's input, recompute the rest in backward.

A Block's forward saves ~a dozen tensors for its backward (layer-norm
statistics, the attention matrix, the MLP's 4x-wide hidden state...).  With
checkpointing it saves *nothing* but a reference to its input; in the backward,
the first time autograd asks for one of those tensors, the block's forward runs
again (under grad, same RNG state) and hands back the recomputed tensors:

    forward    x0 -> [block 0] -> x1 -> [block 1] -> x2 -> loss     kept: x0, x1, x2 (+ the graph)
    backward   loss ... needs block 1's saved tensors -> rerun block 1 from x1 -> its gradients
                        needs block 0's saved tensors -> rerun block 0 from x0 -> its gradients

Cost: one extra forward of every checkpointed block (about +1/3 of a step's
compute, since a backward costs about two forwards); gain: a block's activations
live only while its own backward runs.

How (non-reentrant, as ``torch.utils.checkpoint(use_reentrant=False)``): the
forward runs under ``saved_tensors_hooks`` whose *pack* hook stores an index
instead of the tensor; the *unpack* hook, on first use, reruns the forward with
a pack hook that collects the tensors in the same order, and returns the
i-th.  The autograd graph of the first forward is kept, so gradients flow
along it to the parameters exactly as without checkpointing.

Note (with FSDP, the order torch recommends): checkpoint *inside* the FSDP
unit, i.e. the Block's own forward is checkpointed, and FSDP's unit around it
gathers the parameters for the forward and again (pre-backward hook) before
the recompute.  ``apply_activation_checkpointing`` works before or after
wrapping: it patches the forward of each module ``check_fn`` picks, so the
parameter names (and state dicts) stay the plain model's.  torch wraps the
module in a ``CheckpointWrapper`` instead and strips its name prefix in state
dicts; the computation is the same.

Note (the recompute replays the forward's context): backward runs later, outside
the ``torch.autocast`` block and after other ops have drawn random numbers, so the
recompute re-enters what the first forward saw, as ``torch.utils.checkpoint`` does:
* the RNG: the CPU generator's state, and the generator state of every accelerator
  device an input tensor lives on (a CUDA dropout draws from the CUDA generator, not
  the CPU one; without it the recomputed masks differ from the forward's);
* autocast: enabled/dtype for "cpu" and for each device type of the inputs (and
  "cuda" when available), plus the cache flag.  Without it a block run under
  ``torch.autocast("cpu", dtype=torch.bfloat16)`` recomputes in fp32, saves fp32
  tensors where backward expects bf16 ones, and its backward fails with
  "expected m1 and m2 to have the same dtype" (or, for ops that accept mixed
  dtypes, gives other gradients).
Like torch, only the inputs' devices are replayed: a function that creates random
numbers on a device none of its inputs is on is not covered.

Note (bitwise): the recompute performs the same ops on the same inputs in the same
RNG and autocast state, so on CPU every gradient is bitwise equal to the run without
checkpointing, with and without autocast and dropout (``tests/test_activation_checkpointing.py``,
``tests/test_device_paths.py``; on CUDA ``tests/gpu/test_checkpoint_cuda.py``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch.nn as nn

from minifsdp.fsdp.core.units import is_unit

__all__ = ["checkpoint", "apply_activation_checkpointing", "is_checkpointed"]


def _input_devices(args: tuple, kwargs: dict) -> list[torch.device]:
    """The accelerator devices (not cpu, not meta) that the input tensors live on, in first-seen order."""
    found: dict[torch.device, None] = {}
    for t in _tensors_in((args, kwargs)):
        if t.device.type not in ("cpu", "meta"):
            found[t.device] = None
    return list(found)


def _tensors_in(obj):
    """Every tensor in a nest of tuples, lists and dict values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o)


def _device_rng_states(devices: list[torch.device]) -> list[tuple[torch.device, torch.Tensor]]:
    """``(device, generator state)`` for each device, via its backend module (``torch.cuda``, ``torch.xpu``...)."""
    states = []
    for d in devices:
        module = getattr(torch, d.type, None)
        if module is None or not hasattr(module, "get_rng_state"):
            continue  # a device without a generator API: nothing to replay
        states.append((d, module.get_rng_state(d)))
    return states


def _autocast_state(devices: list[torch.device]) -> list[tuple[str, dict]]:
    """``(device_type, autocast kwargs)`` for cpu, the inputs' device types, and cuda when it is there."""
    types = ["cpu"] + [d.type for d in devices] + (["cuda"] if torch.cuda.is_available() else [])
    state = []
    for t in dict.fromkeys(types):
        if torch.amp.is_autocast_available(t):
            state.append((t, {"enabled": torch.is_autocast_enabled(t), "dtype": torch.get_autocast_dtype(t),
                              "cache_enabled": torch.is_autocast_cache_enabled()}))
    return state


@contextlib.contextmanager
def _replayed(cpu_rng: torch.Tensor, device_rng: list, autocast: list):
    """Run the body in the saved RNG and autocast state; afterwards every generator is as it was."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # restores the CPU generator on exit
        torch.set_rng_state(cpu_rng)
        for device, state in device_rng:
            module = getattr(torch, device.type)
            current = module.get_rng_state(device)
            stack.callback(module.set_rng_state, current, device)  # restored on exit, as fork_rng does
            module.set_rng_state(state, device)
        for device_type, kwargs in autocast:
            stack.enter_context(torch.autocast(device_type, **kwargs))
        yield


class _Recomputation:
    """The tensors one checkpointed call would have saved, recomputed on first demand."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        devices = _input_devices(args, kwargs)
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = _device_rng_states(devices)
        self.autocast = _autocast_state(devices)
        self.saved: list[torch.Tensor | None] | None = None

    def get(self, index: int) -> torch.Tensor:
        if self.saved is None or self.saved[index] is None:
            self.saved = self._rerun()
        t, self.saved[index] = self.saved[index], None  # hand it over once: memory goes with it
        return t

    def _rerun(self) -> list[torch.Tensor]:
        collected: list[torch.Tensor] = []

        def pack(t):
            collected.append(t.detach() if t.requires_grad else t)  # values only: no graph kept alive
            return len(collected) - 1

        # Inputs cut from the first forward's graph: the recompute builds a throw-away graph of its own.
        args = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                     for a in self.args)
        with _replayed(self.cpu_rng, self.device_rng, self.autocast), torch.enable_grad():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda i: collected[i]):
                self.fn(*args, **self.kwargs)
        return collected


def checkpoint(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, saving none of its intermediate tensors for backward (see module docstring)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    frame = _Recomputation(fn, args, kwargs)
    counter = iter(range(1 << 62))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: next(counter), frame.get):
        return fn(*args, **kwargs)


def _checkpointed_forward(original_forward, *args, **kwargs):
    return checkpoint(original_forward, *args, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    return "_minifsdp_original_forward" in module.__dict__


def apply_activation_checkpointing(model: nn.Module, check_fn: Callable[[nn.Module], bool]) -> nn.Module:
    """Checkpoint every submodule for which ``check_fn(module)`` is true, e.g. ``lambda m: isinstance(m, Block)``.

    Works on a plain model or an FSDP-wrapped one (FSDP units themselves are
    never checkpointed: their hooks must run once).  Returns ``model``.
    """
    picked = [m for m in model.modules() if check_fn(m)]
    for m in picked:
        if is_unit(m):
            raise ValueError("check_fn picked an FSDP unit; checkpoint the module inside it instead "
                             "(check_fn=lambda m: isinstance(m, Block), which matches the wrapped Block)")
        if is_checkpointed(m):
            continue
        original = m.forward
        m.__dict__["_minifsdp_original_forward"] = original
        m.forward = functools.partial(_checkpointed_forward, original)
    if not picked:
        raise ValueError("apply_activation_checkpointing: check_fn matched no module; e.g. "
                         "check_fn=lambda m: isinstance(m, Block)")
    return model
