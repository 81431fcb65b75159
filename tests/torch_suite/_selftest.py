"""Faults planted for ``tests/test_torch_suite.py``: the port's checks and its runner must catch them.

- ``case_wrong_param``: ours trains a model whose first parameter was nudged after wrapping, so the
  parity with DDP must fail on our side only;
- ``case_crash_ours``: our side kills its process (SIGSEGV); the runner must blame ours, keep torch's
  result, and still run the case after it;
- ``case_forgot_wait``: ours' ring reductions land late (``test_delays.py``) and their handles claim to be
  done at once, so ours steps with gradients not yet written: the delays port must fail on our side;
- ``case_fails_on_one_rank_only``: our side raises on rank 1 while rank 0 goes on into a collective that waits
  for rank 1: the runner must end the case within seconds, named, with both ranks' tracebacks, and run the rest;
- ``case_fine``: passes on both sides.
"""

import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import ShardingStrategy
from torch.testing._internal.common_fsdp import NestedWrappedModule

from tests.torch_suite import _workers as W


class _Nudged:
    """``api`` whose ``init`` nudges the model's first full parameter by 1e-2 on our side."""

    def __init__(self, api):
        self.api = api

    def __getattr__(self, name):
        return getattr(self.api, name)

    def init(self, *args, **kw):
        model = self.api.init(*args, **kw)
        if self.api.ours:
            with self.api.FSDP.summon_full_params(model):
                with torch.no_grad():
                    next(model.parameters()).add_(1e-2)
        return model


def case_wrong_param(api):
    W.ddp_parity(_Nudged(api), NestedWrappedModule, {})


def case_crash_ours(api):
    if api.ours:
        os.kill(os.getpid(), signal.SIGSEGV)


def case_forgot_wait(api):
    from tests.torch_suite.test_delays import case_late_ring_reductions

    case_late_ring_reductions(api, ShardingStrategy.FULL_SHARD, forget_wait=True)


def case_fails_on_one_rank_only(api):
    if api.ours:
        if dist.get_rank() == 1:
            raise AssertionError("planted: rank 1's check fails")
        dist.all_reduce(torch.ones(1))  # rank 0 goes on, into a collective rank 1 never joins


def case_fine(api):
    W.ddp_parity(api, NestedWrappedModule, {})


CASES = W.Cases()
for _fn in (case_wrong_param, case_crash_ours, case_fails_on_one_rank_only, case_forgot_wait, case_fine):
    CASES.add(_fn)
