"""ShardedGradScaler (chapter 4.1): fp16 loss scaling when each rank holds only a shard of the gradients.

    scaler = ShardedGradScaler()
    scaler.scale(loss).backward()     # loss * S: small fp16 gradients no longer flush to zero
    scaler.step(opt)                  # unscale (x 1/S); skip the step if ANY rank saw inf/nan
    scaler.update()                   # S * backoff after a skip, S * growth after growth_interval good steps

The API is ``torch.amp.GradScaler``'s, as torch's ``ShardedGradScaler`` has it (``get_scale``,
``get/set_growth_factor``, ``get/set_backoff_factor``, ``get/set_growth_interval``, ``is_enabled``,
``state_dict`` / ``load_state_dict``, ``unscale_``, ``update(new_scale)``, several optimizers per
step), and the numbers are torch's: the scale is an fp32 scalar, ``1/S`` is computed in float64 and
rounded to fp32, and the growth rule is torch's CPU one.

    one step, two ranks, an inf in rank 1's shard only:

    rank 0: unscale, found_inf = 0  --+
                                      +-- all-reduce (sum) --> 1 on both ranks --> both skip, S *= 0.5
    rank 1: unscale, found_inf = 1  --+

Note (every rank agrees): rank 0 may see finite numbers in its shard while rank 1 overflows.
The per-rank flag is all-reduced (a sum) before the decision; otherwise the ranks would step
different models.  A rank with no gradients at all (its shards of every trainable parameter
are empty) still joins the all-reduce with a 0.

Note (the flag's device): on a plain "nccl" group a CPU flag cannot be all-reduced; the flag is
made on ``collective_device`` (CPU on gloo or "cpu:gloo,cuda:nccl", the gradients' GPU on NCCL)
and read back on CPU.

Note (``device``, on purpose not torch's): torch's default ``device="cuda"`` *disables* the scaler,
with a warning, on a machine without CUDA; ours keeps the scale as a CPU scalar read in Python and
scales wherever the gradients are, so ``device`` is accepted for torch's signature and not used.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from minifsdp.fsdp.checks import collective_device

__all__ = ["ShardedGradScaler"]

READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"  # one optimizer's stage in the current step


class ShardedGradScaler:
    """torch's ``ShardedGradScaler`` (``torch.distributed.fsdp.sharded_grad_scaler``), same arguments."""

    def __init__(self, device: str | None = None, init_scale: float = 2.0**16, backoff_factor: float = 0.5,
                 growth_factor: float = 2.0, growth_interval: int = 2000, enabled: bool = True,
                 process_group=None):
        if not 0.0 < backoff_factor < 1.0 or growth_factor <= 1.0:
            raise ValueError("need 0 < backoff_factor < 1 < growth_factor")
        self.device = device
        self._enabled = enabled
        self._scale = torch.full((), float(init_scale), dtype=torch.float32)
        self._backoff_factor, self._growth_factor = backoff_factor, growth_factor
        self._growth_interval = growth_interval
        self._growth_tracker = 0  # clean steps since the last change of the scale
        self.process_group = process_group
        self._stages: dict[int, str] = {}  # id(optimizer) -> READY / UNSCALED / STEPPED
        self._found_inf: dict[int, torch.Tensor] = {}  # id(optimizer) -> the all-reduced flag (CPU)

    # ------------------------------------------------------------------ settings
    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        return self._scale.item() if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = new_interval

    def state_dict(self) -> dict:
        """torch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker ({} if disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:  # as torch: a no-op
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty (saved from a disabled scaler?)")
        self._scale.fill_(float(state_dict["scale"]))
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._growth_tracker = int(state_dict["_growth_tracker"])

    # ------------------------------------------------------------------ the step
    def scale(self, outputs):
        """``outputs * S`` in the outputs' dtype; a tensor, or a list/tuple (nested) of them."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return (outputs * self._scale.to(outputs.device)).to(outputs.dtype)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale; agree on "found inf" across ranks (collective)."""
        if not self._enabled:
            return
        stage = self._stages.get(id(optimizer), READY)
        if stage == UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage == STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._scale.double().reciprocal().float()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        found = torch.zeros(1, dtype=torch.float32,
                            device=collective_device(self.process_group, like=grads[0] if grads else None))
        for g in grads:
            if not torch.isfinite(g).all():
                found.fill_(1.0)
            g.mul_(inv_scale.to(g.device))
        dist.all_reduce(found, group=self.process_group)  # sum of per-rank flags: > 0 if any rank overflowed
        self._found_inf[id(optimizer)] = found.cpu()
        self._stages[id(optimizer)] = UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """``optimizer.step(*args, **kwargs)`` unless some rank found inf/nan; returns None when skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if self._stages.get(id(optimizer), READY) == STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if self._stages.get(id(optimizer), READY) == READY:
            self.unscale_(optimizer)
        out = optimizer.step(*args, **kwargs) if self._found_inf[id(optimizer)].item() == 0 else None
        self._stages[id(optimizer)] = STEPPED
        return out

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Back off after an overflow in any optimizer, grow after ``growth_interval`` clean steps (torch's
        rule); or set the scale to ``new_scale``.  Every optimizer starts the next step afresh."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale.copy_(torch.as_tensor(new_scale, dtype=torch.float32).reshape(()))
        else:
            if not self._found_inf:
                raise RuntimeError("update() before step(): call scaler.step(optimizer) first "
                                   "(torch: 'No inf checks were recorded prior to update.')")
            found = sum(f.item() for f in self._found_inf.values())
            if found >= 1.0:
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._stages.clear()
        self._found_inf.clear()
