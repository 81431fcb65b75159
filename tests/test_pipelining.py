"""Pipeline parallelism (minifsdp.parallel.pipelining / pipeline_schedules) against torch's own.

Oracle: ``torch.distributed.pipelining``'s ``PipelineStage`` with ``ScheduleGPipe`` / ``Schedule1F1B`` on the same
split of the same model and data, on CPU gloo: per-micro-batch losses, the last stage's outputs and every
stage's gradients after each of 2 SGD steps equal torch's **bitwise** (the same operations in the same order:
an unscaled backward per micro-batch, accumulation in ``.grad``, one division by M).  Second oracle: the
unsharded model on the whole batch, in fp32, to rtol 1e-5 / atol 1e-7 (micro-batch accumulation then a division
by M adds in a different order than one big backward; measured differences are ~1e-8).
The order of forwards and backwards each of our stages runs is checked against the order torch's stage runs
(recorded by wrapping torch's ``forward_one_chunk`` / ``backward_one_chunk``), never against a hand-written one.

One spawn per world size: 2 ranks (an MLP and the tiny GPT in 2 stages, faults, errors, bubble timing) and
4 ranks (an MLP in 4 stages, M = 4 and 8).
"""

import pytest
import torch

import minifsdp
from minifsdp.parallel.pipelining import action_order, bubble_fraction, measured_bubble_fraction, simulate_timeline
from tests import _workers_pp as w
from tests._workers_fsdp import assert_bitwise, bitwise_differences

RTOL, ATOL = 1e-5, 1e-7


@pytest.fixture(scope="module")
def run2():
    return minifsdp.spawn(w.suite, args=(2, ["mlp", "gpt"], [4], True), world_size=2, timeout_s=150)


@pytest.fixture(scope="module")
def run4():
    return minifsdp.spawn(w.suite, args=(4, ["mlp"], [4, 8], False), world_size=4, timeout_s=150)


def _runs(request, ws):
    return request.getfixturevalue(f"run{ws}")


def step_of(record: dict) -> dict:
    """What a pipeline step must reproduce bitwise (``assert_bitwise``): the losses (the last stage's), the
    output (None on the other stages) and every gradient, by name; a step with no gradient proves nothing."""
    assert record["grads"], "a step without gradients"
    return {k: record[k] for k in ("losses", "out", "grads")}


CASES = [(2, "mlp", 4), (2, "gpt", 4), (4, "mlp", 4), (4, "mlp", 8)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ws,model,M", CASES)
def test_losses_outputs_and_grads_equal_torch_bitwise(request, ws, model, M, schedule):
    runs = _runs(request, ws)
    for rank, res in enumerate(runs):
        ours, theirs = res["parity"][(model, schedule, M, "ours")], res["parity"][(model, schedule, M, "torch")]
        assert len(ours) == len(theirs) == w.STEPS
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert_bitwise(step_of(a), step_of(b), f"rank {rank} step {step}")
            assert len(a["losses"]) == (M if rank == ws - 1 else 0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ws,model,M", CASES)
def test_action_order_equals_torch(request, ws, model, M, schedule):
    for rank, res in enumerate(_runs(request, ws)):
        ours, theirs = res["parity"][(model, schedule, M, "ours")], res["parity"][(model, schedule, M, "torch")]
        for a, b in zip(ours, theirs):
            assert len(a["actions"]) == len(b["actions"]) == 2 * M
            assert a["actions"] == b["actions"], rank
            # the simulated timeline (the docstring's pictures) runs the same order
            row = [x for x in simulate_timeline(schedule, ws, M)[rank] if x is not None]
            assert row == b["actions"]


def test_pipeline_group_argument(run4):
    """group=: two 2-stage pipelines on ranks [0, 1] and [2, 3], each equal to torch's on the same group, bitwise;
    the second pipeline's data differ, so its gradients must differ from the first's."""
    for rank, res in enumerate(run4):
        for name in ("gpipe", "1f1b"):
            ours, theirs = res["two_pipelines"][(name, "ours")], res["two_pipelines"][(name, "torch")]
            assert len(ours) == len(theirs) == w.STEPS
            for a, b in zip(ours, theirs):
                assert_bitwise(step_of(a), step_of(b), f"rank {rank} {name}")
                assert len(a["losses"]) == (4 if rank % 2 == 1 else 0)
    first, second = run4[0]["two_pipelines"][("gpipe", "ours")][0], run4[2]["two_pipelines"][("gpipe", "ours")][0]
    assert bitwise_differences(step_of(first), step_of(second))


def test_order_check_can_fail(run2):
    """The order comparison is not vacuous: GPipe's order is not 1F1B's on any stage (M=4, 2 stages)."""
    for res in run2:
        assert res["parity"][("mlp", "gpipe", 4, "ours")][0]["actions"] != \
            res["parity"][("mlp", "1f1b", 4, "torch")][0]["actions"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ws,M", [(2, 4), (4, 4), (4, 8)])
def test_mlp_equals_unsharded_model(request, ws, M, schedule):
    for rank, res in enumerate(_runs(request, ws)):
        ours, plain = res["parity"][("mlp", schedule, M, "ours")], res["parity"][("mlp", "unsharded")]
        assert len(ours) == len(plain) == w.STEPS
        for a, u in zip(ours, plain):
            assert a["grads"].keys() == u["grads"].keys() and a["grads"]
            for n in a["grads"]:
                torch.testing.assert_close(a["grads"][n], u["grads"][n], rtol=RTOL, atol=ATOL)
            if rank == ws - 1:  # the mean of equal micro-batches' mean losses is the batch's mean loss
                torch.testing.assert_close(torch.stack(a["losses"]).mean(), u["loss"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_equals_unsharded_model_with_tied_weight_summed(run2, schedule):
    """The tiny GPT ties lm_head.weight to tok_emb.weight; split in two stages, each stage holds one copy and
    gets a part of its gradient: stage 0 the embedding's, stage 1 the head's.  Their sum is the unsharded
    gradient (first step; afterwards the copies drift apart unless the sum is all-reduced between the two
    stages, which neither torch's schedules nor ours do)."""
    first = [res["parity"][("gpt", schedule, 4, "ours")][0] for res in run2]
    plain = [res["parity"][("gpt", "unsharded")][0] for res in run2]
    tied = {0: "tok_emb.weight", 1: "lm_head.weight"}
    for rank in (0, 1):
        assert first[rank]["grads"].keys() == plain[rank]["grads"].keys()
        for n, g in first[rank]["grads"].items():
            if n != tied[rank]:
                torch.testing.assert_close(g, plain[rank]["grads"][n], rtol=RTOL, atol=ATOL)
        assert not torch.allclose(first[rank]["grads"][tied[rank]], plain[rank]["grads"][tied[rank]], atol=1e-4)
    torch.testing.assert_close(first[0]["grads"]["tok_emb.weight"] + first[1]["grads"]["lm_head.weight"],
                               plain[0]["grads"]["tok_emb.weight"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.stack(first[1]["losses"]).mean(), plain[1]["loss"], rtol=RTOL, atol=ATOL)


def test_a_dropped_backward_fails_the_gradient_check(run2):
    """Stage 0 skipping the backward of its last micro-batch: the step check above catches it on stage
    0; stage 1, which ran every backward, still passes."""
    dropped = [res["faults"]["drop_backward"][0] for res in run2]
    torch_ = [res["parity"][("mlp", "gpipe", 4, "torch")][0] for res in run2]
    assert bitwise_differences(step_of(dropped[0]), step_of(torch_[0]))
    assert_bitwise(step_of(dropped[1]), step_of(torch_[1]), "stage 1")


def test_missing_grad_scaling_fails_the_gradient_check(run2):
    """Without the division by M the gradients are M times torch's: caught by the same check."""
    for res in run2:
        unscaled, ref = res["faults"]["no_grad_scaling"][0], res["parity"][("mlp", "gpipe", 4, "torch")][0]
        assert bitwise_differences(step_of(unscaled), step_of(ref))
        assert unscaled["grads"].keys() == ref["grads"].keys()
        for n in ref["grads"]:
            torch.testing.assert_close(unscaled["grads"][n], 4 * ref["grads"][n], rtol=RTOL, atol=ATOL)


def test_forward_only_schedule(run2):
    """No loss_fn: forwards only, under no_grad; the last stage returns the whole batch's output."""
    first, last = run2[0]["faults"]["forward_only"], run2[1]["faults"]["forward_only"]
    assert first["actions"] == last["actions"] == ["F0", "F1", "F2", "F3"]
    assert first["out"] is None and first["grads"] == [] and last["grads"] == []
    assert last["requires_grad"] is False
    torch.testing.assert_close(last["out"], last["expected"], rtol=RTOL, atol=1e-6)


def test_clear_errors(run2):
    e0, e1 = run2[0]["errors"], run2[1]["errors"]
    assert "must divide into n_microbatches=4" in e0["indivisible"] and "input's" in e0["indivisible"]
    assert "must divide into n_microbatches=4" in e1["indivisible"] and "target's" in e1["indivisible"]
    assert "first stage takes the batch" in e0["input_on_non_first"]
    assert "not the first stage" in e1["input_on_non_first"]
    assert "needs the target" in e1["missing_target"]
    for e in (e0, e1):
        assert "n_microbatches (1) >= the number of stages (2)" in e["few_microbatches_1f1b"]
        assert "stage i must live on rank i" in e["wrong_stage_index"]
        assert "num_stages=3 but the pipeline group has 2 ranks" in e["wrong_num_stages"]


@pytest.mark.parametrize("ws,model,M", CASES)
def test_1f1b_holds_at_most_stages_minus_index_microbatches(request, ws, model, M):
    """GPipe holds all M micro-batches' activations before its first backward; 1F1B at most S - s on stage s."""
    for rank, res in enumerate(_runs(request, ws)):
        gpipe = res["parity"][(model, "gpipe", M, "ours")][0]
        f1b1 = res["parity"][(model, "1f1b", M, "ours")][0]
        assert gpipe["peak_in_flight"] == M
        assert f1b1["peak_in_flight"] == min(M, ws - rank)
        assert f1b1["peak_activation_bytes"] * M == gpipe["peak_activation_bytes"] * min(M, ws - rank)


@pytest.mark.parametrize("S,M", [(2, 4), (3, 4), (4, 8), (4, 4), (8, 32)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_bubble_is_the_formula(schedule, S, M):
    """With one time unit per F and per B, every stage is idle (S-1)/(M+S-1) of the time, in both schedules."""
    slots = simulate_timeline(schedule, S, M)
    assert len(slots) == S
    for s, row in enumerate(slots):
        assert len(row) == 2 * (M + S - 1)
        assert sum(a is None for a in row) / len(row) == pytest.approx(bubble_fraction(S, M))
        assert [a for a in row if a] == action_order(schedule, s, S, M)


def test_measured_bubble_near_the_formula(run2):
    """Stages that take 50 ms per F and per B (sleeps), 2 stages, 4 micro-batches: the idle share measured from
    the recorded events is the formula's 0.2 plus the messages' latency (a loose upper bound: a loaded machine
    delays the wake-ups)."""
    theory = bubble_fraction(2, 4)
    for name in ("gpipe", "1f1b"):
        measured = measured_bubble_fraction([res["bubbles"][name]["events"] for res in run2])
        print(f"{name}: measured bubble {measured:.3f}, formula {theory:.3f}")
        assert theory - 0.03 < measured < theory + 0.15
