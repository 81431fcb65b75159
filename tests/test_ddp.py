"""Chapter 1: DataParallel and DistributedDataParallel from scratch, against torch.

Oracles and tolerances (each assertion names its own):

* torch's ``DistributedDataParallel`` on the same seed and data (the rank
  workers in ``_workers_ddp.py`` train both side by side, 5 steps):
  - 2 ranks: bitwise, every variant (a + b == b + a, so the sum does not depend
    on who adds first, and we scale by 1/N exactly as torch's Reducer).
  - 3 and 4 ranks with ``collectives="torch", bucket_layout="torch"``: bitwise
    (same buckets, same flat layout, same gloo all-reduce).
  - ``collectives="textbook"`` against ``"ring"`` (same layout), at every N: bitwise (the textbook
    ring and the tuned one add in the same order).
  - 3 and 4 ranks otherwise: within SGD_TOL / ADAMW_TOL.  A ring adds the N
    contributions of each element in an order set by the chunk the element
    falls in, so a different flat layout (reverse registration order) or a
    different ring (ours vs gloo's) adds in another order, and float addition
    is not associative: the gradients differ in the last bit, and AdamW, which
    divides by sqrt(v), magnifies that more than SGD.  Measured (5 steps):
    at most 6e-8 (SGD) and 8.5e-6 (AdamW); the tolerances leave 10x+ margin.
* one plain model trained on the whole global batch in one process (SGD):
  within ORACLE_TOL (mean of the ranks' means vs one mean: another summation
  order; measured at most 1.2e-7).
"""

import pytest
import torch
import torch.nn.functional as F

import minifsdp
from minifsdp.ddp import DistributedDataParallel
from minifsdp.ddp.buckets import assign_buckets, fill_buckets
from minifsdp.ddp.data_parallel import DataParallel
from minifsdp.models import MLP, CharCorpus, TinyGPT
from tests import _workers_ddp as w

SGD_TOL = 1e-6
ADAMW_TOL = 1e-4
ORACLE_TOL = 1e-6


# ----------------------------------------------------------------------------- buckets (no ranks)
def test_assign_buckets_reverse_order_and_cap_rule():
    params = [torch.empty(100) for _ in range(5)]  # 400 bytes each
    assert assign_buckets(params, 800) == [[4, 3], [2, 1], [0]]
    assert assign_buckets(params, 801) == [[4, 3, 2], [1, 0]]  # closes once it holds >= the cap
    assert assign_buckets(params, 1) == [[4], [3], [2], [1], [0]]
    assert assign_buckets(params, 10**9) == [[4, 3, 2, 1, 0]]
    big = [torch.empty(10), torch.empty(1000), torch.empty(10)]  # the big one closes the bucket it lands in
    assert assign_buckets(big, 100) == [[2, 1], [0]]


def test_buckets_never_mix_dtypes_and_caps_repeat():
    params = [torch.empty(10), torch.empty(10, dtype=torch.float64), torch.empty(10)]
    assert assign_buckets(params, 10**9) == [[2, 0], [1]]
    params = [torch.empty(100) for _ in range(4)]
    assert fill_buckets(params, range(4), [400, 800]) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(params, 0)


# ----------------------------------------------------------------------------- DataParallel (one process)
def test_data_parallel_gradient_equals_full_batch_gradient():
    """Oracle: the same model, one forward on the full batch.  Tolerance 1e-6: chunked sums (measured 5e-8)."""
    model, plain = MLP(seed=0), MLP(seed=0)
    x, y = model.batch(0, batch_size=12)
    F.mse_loss(DataParallel(model, device_ids=[0, 1, 2])(x), y).backward()
    F.mse_loss(plain(x), y).backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=f"MLP grad of {name}")

    gpt, plain = TinyGPT(seed=0), TinyGPT(seed=0)  # tied weights: the sum of both uses reaches the primary
    x, y = CharCorpus().batch(0, 6, 32)
    logits = DataParallel(gpt, device_ids=[0, 1])(x)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
    plain(x, y).backward()
    for (name, a), b in zip(gpt.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=f"GPT grad of {name}")


def test_data_parallel_bad_inputs():
    with pytest.raises(ValueError, match="cannot be split"):
        DataParallel(MLP(seed=0), device_ids=[0, 1, 2])(torch.randn(2, 16))
    with pytest.raises(ValueError, match="device_ids"):
        DataParallel(MLP(seed=0), device_ids=[])


def test_ddp_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        DistributedDataParallel(MLP(seed=0))


# ----------------------------------------------------------------------------- DDP against torch's DDP
def _check_training(res, ws):
    for (model, opt), diffs in res["train"].items():
        for variant, diff in diffs.items():
            where = f"{model}/{opt}/{variant} at {ws} ranks"
            if ws == 2 or variant in ("torch/torch", "textbook/torch vs ring/torch"):
                assert diff == 0.0, f"{where}: expected bitwise equal to torch DDP, max |diff| = {diff:.3g}"
            else:
                tol = SGD_TOL if opt == "sgd" else ADAMW_TOL
                assert diff <= tol, f"{where}: max |diff| = {diff:.3g} > {tol}"
    assert res["no_sync"] == 0.0, f"no_sync (2 micro-batches) differs from torch's no_sync by {res['no_sync']:.3g}"
    assert res["oracle"] <= ORACLE_TOL, f"single-model oracle differs by {res['oracle']:.3g} > {ORACLE_TOL}"


@pytest.mark.timeout(120)
def test_ddp_two_ranks_parity_buckets_and_bad_inputs():
    results = minifsdp.spawn(w.parity_suite, args=(True,), world_size=2, timeout_s=100)
    for rank, res in enumerate(results):
        _check_training(res, 2)
        assert res["small_buckets_diff"] == 0.0, "many small buckets: not bitwise equal to torch DDP"
        assert res["frozen_diff"] == 0.0 and not res["frozen_in_buckets"], "frozen params mishandled"
        # Bad input 1: every rank raises, naming the parameter and the fix (and nobody hung).
        msg = res["shape_error"]
        assert msg and "net.0.weight" in msg and "(32, 16)" in msg and "(33, 16)" in msg and "Fix" in msg, msg
        # Bad input 2: an unused parameter is named at the end of backward, on every rank.
        assert res["unused_error"] and "unused.weight" in res["unused_error"], res["unused_error"]
        if rank:
            continue
        # Each parameter in exactly one bucket; buckets in reverse registration order.
        in_buckets = [n for b in res["buckets"] for n in b["params"]]
        names = [n for n in res["names"]]
        assert sorted(in_buckets) == sorted(names) and in_buckets == names[::-1]
        assert len(res["buckets"]) >= 4, "bucket_cap_mb=0.01 should give several buckets"
        # The trace: launched in bucket order, and the first all-reduce started while backward was still running.
        events, (start, end) = res["events"], res["window"]
        assert [e["bucket"] for e in events] == list(range(len(res["buckets"])))
        assert all(e["issued"] <= e["finished"] for e in events)
        assert events[0]["issued"] < events[-1]["issued"] < end and start <= events[0]["issued"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [3, 4])
def test_ddp_parity_three_and_four_ranks(world_size):
    results = minifsdp.spawn(w.parity_suite, args=(False,), world_size=world_size, timeout_s=100)
    for res in results:
        _check_training(res, world_size)
