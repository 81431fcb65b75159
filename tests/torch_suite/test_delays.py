"""Port of the delayed cases of torch's test_fsdp_core.py, with delays that really happen on a CPU.

torch's delay models sleep on a CUDA stream (``NestedWrappedModuleWithDelay``: after the loss, and
before each reduce-scatter; ``MixtureOfExperts``: before an expert is resharded).  On a CPU those
sleeps are skipped, so ``test_core.py`` runs the delayed models undelayed.  The delays exist to shake
out races between computing and communicating: a gradient read before its reduce-scatter wrote it, a
buffer freed while an all-gather still writes into it.  Here the sleeps are real:

* the main thread sleeps after the loss, before each reduction and before each reshard (common_fsdp's
  own ``time.sleep`` branch, switched on for the case; ours' reshard sleeps the same way);
* ours with the ring collectives (which run on a background comm stream): the stream itself sleeps
  before every reduction, so each reduce-scatter's result lands late while the main thread runs on
  towards the optimizer step::

      main thread   backward of unit 2 .. unit 1 .. root | wait for the reductions | opt.step()
      comm stream   [sleep][reduce-scatter 2][sleep][reduce-scatter 1] ...

  An FSDP that forgot to wait would step with gradients not yet written; ``tests/test_torch_suite.py``
  plants exactly that fault (a reduction whose ``wait()`` returns at once) and sees this check fail.

Oracle: DDP (torch's; DummyDDP for the experts model), as test_core.py: assert_close's fp32 defaults.
"""

import contextlib
import time
from unittest import mock

import pytest
import torch.testing._internal.common_fsdp as cf
from torch.distributed.fsdp import ShardingStrategy
from torch.testing._internal.common_fsdp import (
    DummyDDP,
    MixtureOfExperts,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
)

from minifsdp.comm import collectives as C
from minifsdp.comm.stream import stream_for
from minifsdp.fsdp.core.handle import FlatParamHandle
from tests.torch_suite import _harness as H
from tests.torch_suite import _workers as W

DELAY_MS = 25  # torch uses 250; 25 ms is far longer than any of these tiny collectives takes
STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)


@contextlib.contextmanager
def real_cpu_sleeps(api):
    """common_fsdp's delays sleep with ``time.sleep`` (its HPU/XPU branch); ours' end_use sleeps first too."""
    patches = [mock.patch.object(cf, "TEST_HPU", True)]
    if api.ours:
        real_end_use = FlatParamHandle.end_use

        def end_use_late(self, *args, **kwargs):
            time.sleep(DELAY_MS / 1000)
            return real_end_use(self, *args, **kwargs)

        patches.append(mock.patch.object(FlatParamHandle, "end_use", end_use_late))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


@contextlib.contextmanager
def late_ring_reductions(seconds: float, forget_wait: bool = False):
    """Every ring reduce-scatter / all-reduce queues behind a ``seconds`` sleep on its group's comm stream.

    ``forget_wait`` plants the fault this port must catch: the reduction's handle says "done" at once.
    """
    real_rs, real_ar = C.RingCollectives.reduce_scatter, C.RingCollectives.all_reduce

    class _Forgetful:
        def wait(self):
            return True

        def is_completed(self):
            return True

    def late(real):
        def call(self, *args, group=None, async_op=False, **kw):
            stream_for(group).submit(lambda: time.sleep(seconds), "planted delay")
            work = real(self, *args, group=group, async_op=async_op, **kw)
            return _Forgetful() if (forget_wait and async_op) else work
        return call

    with mock.patch.object(C.RingCollectives, "reduce_scatter", late(real_rs)), \
            mock.patch.object(C.RingCollectives, "all_reduce", late(real_ar)):
        yield


def case_delay_after_loss(api, strategy, orig=False):
    with real_cpu_sleeps(api):
        W.ddp_parity(api, NestedWrappedModuleWithDelay, dict(sharding_strategy=strategy, use_orig_params=orig),
                     init_kw={"delay_after_loss_ms": DELAY_MS})


def case_delay_before_reduction(api, strategy, orig=False):
    with real_cpu_sleeps(api):
        W.ddp_parity(api, NestedWrappedModuleWithDelay, dict(sharding_strategy=strategy, use_orig_params=orig),
                     init_kw={"delay_before_reduction_ms": DELAY_MS})


def case_delay_before_free(api, strategy):
    on_cpu = contextlib.nullcontext() if api.ours else W.fsdp1_defaults_to_cpu()
    with real_cpu_sleeps(api), on_cpu:
        W.ddp_parity(api, MixtureOfExperts, dict(sharding_strategy=strategy), ref_wrap=DummyDDP,
                     init_kw={"delay_before_free_ms": DELAY_MS})


def case_late_ring_reductions(api, strategy, orig=False, forget_wait=False):
    """Ours only has a comm stream to delay; torch's side runs the same parity undelayed."""
    kw = dict(sharding_strategy=strategy, use_orig_params=orig)
    if not api.ours:
        W.ddp_parity(api, NestedWrappedModule, kw)
        return
    late_ms = 250 if forget_wait else DELAY_MS  # the planted fault must be caught even on a loaded machine
    with late_ring_reductions(late_ms / 1000, forget_wait=forget_wait):
        W.ddp_parity(api, NestedWrappedModule, dict(kw, collectives="ring"))


CASES = W.Cases()
for _s in STRATEGIES:
    CASES.add(case_delay_after_loss, strategy=_s)
    CASES.add(case_delay_before_reduction, strategy=_s, orig=True)
    CASES.add(case_delay_before_free, strategy=_s)
    for _o in (False, True):
        CASES.add(case_late_ring_reductions, strategy=_s, orig=_o)

XFAIL: dict = {}
FAST = ("late_ring_reductions:strategy=FULL_SHARD,orig=False",)


@pytest.mark.parametrize("cid", H.params(CASES, XFAIL, FAST))
def test_case(cid):
    H.check(__name__, cid)
