"""The explorers of chapters 1.2 (DDP's buckets) and 4 (pipeline schedules, mixed precision) compute what torch and
the library compute, for two settings each.

Oracles: torch's DDP on a one-rank gloo group (its ``_bucket_config`` caps, the buckets its ``Reducer`` rebuilt after
the first backward, as ``_get_ddp_logging_data`` reports them) and torch's own cutting function
(``dist._compute_bucket_assignment_by_size``); the ring's times against the chapter's closed form; the library's
pipeline schedules (``action_order``, ``bubble_fraction``) and the formula (S-1)/(M+S-1), compared as whole numbers;
torch FSDP1 at one rank under the same ``MixedPrecision`` (its handle's dtypes, and its losses and parameters after
the same AdamW steps, **bitwise**), torch's pre-divide factor and ``minifsdp.memory.plan.collectives``.  Times are
compared to 1e-12 relative (float sums in another order); everything else is exact.  The one-rank group lives in
this process (a ``HashStore``): no rank is spawned.
"""

import math
import warnings

import matplotlib
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

from minifsdp.explorers import ddp_buckets, mixed_precision, panel, pipeline_schedule
from minifsdp.explorers.ring_time import ring_cost
from minifsdp.memory.plan import Run, collectives
from minifsdp.memory.plan_shapes import PRESETS
from minifsdp.models import GPTConfig, TinyGPT
from minifsdp.parallel.pipeline_schedules import action_order, bubble_fraction

matplotlib.use("Agg")

BUCKETS = [{"model": "tiny", "bucket_cap_mb": 0.02, "world_size": 4},
           {"model": "small", "bucket_cap_mb": "default", "world_size": 3, "backward_ms": 2.0}]
PRECISIONS = [{"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "bf16", "world_size": 4},
              {"param_dtype": "fp16", "reduce_dtype": "none", "buffer_dtype": "none", "world_size": 6,
               "model": "tiny"},
              {"param_dtype": "none", "reduce_dtype": "bf16", "buffer_dtype": "none", "world_size": 2}]


def _torch_ddp_buckets(setting: dict) -> dict:
    """torch's DDP on the setting's model: its caps, and the buckets it rebuilt after the first backward."""
    model = TinyGPT(getattr(GPTConfig, setting["model"])(), seed=0)
    cap = setting["bucket_cap_mb"]
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=None if cap == "default" else cap)
    x = torch.randint(0, model.cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # the first backward records the order, the second forward rebuilds, the third logs it
        ddp(x[:, :-1], x[:, 1:]).backward()
    data = ddp._get_ddp_logging_data()
    assert data["has_rebuilt_buckets"] == 1
    config = ddp._bucket_config
    return {"caps": list(dict.fromkeys([config.first_bucket_bytes_cap, config.bucket_bytes_cap])),
            "buckets": [[int(i) for i in b.split()] for b in data["rebuilt_per_bucket_param_indices"].split(",")],
            "sizes": [int(s) for s in data["rebuilt_bucket_sizes"].split(",")]}


def _torch_fsdp1_run(setting: dict) -> dict:
    """torch FSDP1 at one rank (NO_SHARD) under the setting's MixedPrecision: the explorer's steps."""
    dtypes = {k: mixed_precision.DTYPES[setting[k]] for k in ("param_dtype", "reduce_dtype", "buffer_dtype")}
    model = TinyGPT(GPTConfig.tiny(), seed=0)
    tokens = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.cfg.vocab_size, (4, model.cfg.block_size + 1), generator=tokens)
               for _ in range(mixed_precision.STEPS)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP on one rank switches to NO_SHARD, with a warning
        fsdp = TorchFSDP(model, device_id=torch.device("cpu"), mixed_precision=TorchMixedPrecision(**dtypes))
    handle = fsdp._handle
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-2, foreach=False)
    losses = []
    for batch in batches:
        loss = fsdp(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with TorchFSDP.summon_full_params(fsdp):
        params = [p.detach().clone() for p in fsdp.module.parameters()]
    return {"param": handle._fwd_bwd_param_dtype, "reduce": handle._reduce_dtype, "losses": losses,
            "params": params}


@pytest.fixture(scope="module")
def torch_runs():
    """Every torch run of this file, in one one-rank gloo group made and destroyed here, on one thread (as the
    explorer measures; the tiny models gain nothing from more, and a loaded machine makes more threads thrash)."""
    made, threads = not dist.is_initialized(), torch.get_num_threads()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    try:
        return {"ddp": [_torch_ddp_buckets(s) for s in BUCKETS], "fsdp1": [_torch_fsdp1_run(s) for s in PRECISIONS]}
    finally:
        torch.set_num_threads(threads)
        if made:
            dist.destroy_process_group()


@pytest.mark.parametrize("case", range(len(BUCKETS)), ids=["tiny-0.02MiB-4", "small-default-3"])
def test_ddp_buckets_are_the_ones_torchs_ddp_rebuilds(case, torch_runs):
    setting, torch_ddp = BUCKETS[case], torch_runs["ddp"][case]
    view = ddp_buckets.compute(setting)
    model = TinyGPT(getattr(GPTConfig, setting["model"])(), seed=0)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    assert view.caps == torch_ddp["caps"]
    if setting["bucket_cap_mb"] == "default":  # the small first bucket
        assert view.caps[0] == dist._DEFAULT_FIRST_BUCKET_BYTES < view.caps[1]
    ours = [[names.index(n) for n in b.params] for b in view.buckets]
    order = list(reversed(range(len(params))))  # torch's own cutting function, on reverse registration order
    cut, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], view.caps, [], order)
    assert ours == [list(b) for b in cut]
    # torch's real buckets: cut in the order the gradients arrived, which swaps neighbours inside a bucket
    assert len(ours) == len(torch_ddp["buckets"]) and len(view.buckets) > 1
    assert [sorted(b) for b in ours] == [sorted(b) for b in torch_ddp["buckets"]]
    assert [b.nbytes for b in view.buckets] == torch_ddp["sizes"]
    n = setting["world_size"]
    alpha, beta = ddp_buckets.DEFAULT["alpha_us"] * 1e-6, 1 / (ddp_buckets.DEFAULT["bandwidth_gbps"] * 1e9)
    end = 0.0
    for b in view.buckets:
        assert b.allreduce_s == ring_cost(b.nbytes, n, alpha, beta).seconds
        if b.nbytes % (4 * n) == 0:  # the chapter's closed form for equal chunks
            assert b.allreduce_s == pytest.approx(2 * (n - 1) * alpha + 2 * (n - 1) / n * b.nbytes * beta, rel=1e-12)
        assert b.start_s == max(b.ready_s, end) and b.end_s == pytest.approx(b.start_s + b.allreduce_s, rel=1e-12)
        end = b.end_s
    assert view.buckets[-1].ready_s == pytest.approx(view.backward_s, rel=1e-12)
    total = sum(p.numel() * 4 for p in params)
    assert view.one_message_s == pytest.approx(view.backward_s + ring_cost(total, n, alpha, beta).seconds, rel=1e-12)
    assert view.step_s < view.one_message_s  # overlap pays here; per parameter pays the latency 28 or 52 times
    assert view.step_s < view.per_parameter_s


def test_a_bucket_cap_or_model_that_is_not_one_is_refused():
    for bad in (0, -1, "big", 1e-9):  # 1e-9 MiB is less than a byte
        with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
            ddp_buckets.compute({"bucket_cap_mb": bad})
    with pytest.raises(ValueError, match="model must be one of"):
        ddp_buckets.compute({"model": "huge"})
    with pytest.raises(ValueError, match="N must be"):
        ddp_buckets.compute({"world_size": 1})


SCHEDULES = [{"schedule": "GPipe", "stages": 4, "microbatches": 8},
             {"schedule": "1F1B", "stages": 3, "microbatches": 5},
             {"schedule": "GPipe", "stages": 5, "microbatches": 2}]


@pytest.mark.parametrize("setting", SCHEDULES, ids=["gpipe-4-8", "1f1b-3-5", "gpipe-5-2"])
def test_the_pipelines_ticks_are_the_librarys_schedule_and_its_bubble_the_formula(setting):
    view = pipeline_schedule.compute(setting)
    s, m = setting["stages"], setting["microbatches"]
    name = pipeline_schedule.SCHEDULES[setting["schedule"]]
    assert len(view.slots) == s
    for stage, row in enumerate(view.slots):  # every stage runs the library's order, nothing else
        assert [a for a in row if a] == action_order(name, stage, s, m)
    tick = {(stage, a): t for stage, row in enumerate(view.slots) for t, a in enumerate(row) if a}
    for (stage, a), t in tick.items():  # an action waits for its input
        if a[0] == "F" and stage > 0:
            assert t > tick[(stage - 1, a)]
        if a[0] == "B":
            assert t > tick[(stage + 1, a)] if stage < s - 1 else t > tick[(stage, "F" + a[1:])]
    idle = sum(a is None for row in view.slots for a in row)
    assert idle * (m + s - 1) == (s - 1) * s * view.ticks  # (S-1)/(M+S-1), in whole numbers
    assert view.bubble == pytest.approx(bubble_fraction(s, m), rel=1e-12) and view.formula == bubble_fraction(s, m)
    assert view.ticks == 2 * (m + s - 1)
    expected_held = [m] * s if name == "gpipe" else [s - stage for stage in range(s)]
    assert view.held == expected_held


def test_a_schedule_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="n_microbatches >= num_stages"):  # as torch's Schedule1F1B
        pipeline_schedule.compute({"schedule": "1F1B", "stages": 5, "microbatches": 3})
    with pytest.raises(ValueError, match="schedule must be one of"):
        pipeline_schedule.compute({"schedule": "zero-bubble"})
    with pytest.raises(ValueError, match="stages must be"):
        pipeline_schedule.compute({"stages": 0})


@pytest.mark.parametrize("case", range(len(PRECISIONS)), ids=["bf16-fp32-4", "fp16-6-tiny", "fp32-reduce-bf16-2"])
def test_mixed_precision_casts_bytes_and_losses_are_torch_fsdp1s_and_the_plans(case, torch_runs):
    setting, torch_run = PRECISIONS[case], torch_runs["fsdp1"][case]
    view = mixed_precision.compute(setting)
    n = setting["world_size"]
    assert (view.dtypes.param, view.dtypes.reduce) == (torch_run["param"], torch_run["reduce"])
    assert [st.dtype for st in view.stages] == [torch.float32, view.dtypes.param, view.dtypes.param,
                                                view.dtypes.param, view.dtypes.reduce, torch.float32]
    f = DefaultState._get_gradient_predivide_factor(n)
    assert view.factors == (f, n / f)
    shape = PRESETS[view.setting["model"]]
    if view.setting["model"] == "tiny":  # the plan's unit is the tiny GPT's first block
        assert shape.unit_numels()[1] == sum(p.numel() for p in TinyGPT(GPTConfig.tiny()).blocks[0].parameters())
    assert [st.numel for st in view.stages] == [math.ceil(shape.unit_numels()[1] / n)] * 2 + \
        [math.ceil(shape.unit_numels()[1] / n) * n] * 3 + [math.ceil(shape.unit_numels()[1] / n)]
    run = Run(n, precision=mixed_precision.NAMES[view.dtypes.param],
              reduce_dtype=mixed_precision.NAMES[view.dtypes.reduce])
    for kind in ("all-gather", "reduce-scatter"):
        assert view.sent[kind] == sum(c.bytes_sent for c in collectives(shape, run) if c.kind == kind)
    low = view.dtypes.param.itemsize
    assert view.sent["all-gather"] * 4 == view.sent_fp32["all-gather"] * low  # the gathered copy's bytes
    # the measured loss: torch FSDP1 at one rank under the same MixedPrecision, bitwise
    assert view.losses == torch_run["losses"] and len(view.losses) == mixed_precision.STEPS
    _, params, _ = mixed_precision.measure_losses(setting["param_dtype"], setting["reduce_dtype"],
                                                  setting["buffer_dtype"])
    assert len(params) == len(torch_run["params"])
    assert all(torch.equal(a, b) for a, b in zip(params, torch_run["params"], strict=True))
    assert view.losses != view.losses_fp32 and view.max_param_diff > 0  # the low precision is really used
    assert view.buffers_cast == []  # the tiny GPT's buffers are bool masks: buffer_dtype leaves them


def test_a_dtype_or_world_size_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        mixed_precision.compute({"param_dtype": "fp8"})
    with pytest.raises(ValueError, match="model must be one of"):
        mixed_precision.compute({"model": "gpt5"})
    with pytest.raises(ValueError, match="N must be"):
        mixed_precision.compute({"world_size": 1})


MODULES = {ddp_buckets: ("format_buckets", "world_size", 5), pipeline_schedule: ("format_schedule", "stages", 5),
           mixed_precision: ("format_precision", "world_size", 5)}


@pytest.mark.parametrize("module", list(MODULES), ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_the_fallback_has_the_kernel_line_and_the_panel_redraws(module, capsys):
    fmt, control, value = MODULES[module]
    text = module.fallback()
    assert text == capsys.readouterr().out.rstrip("\n")
    assert text == panel.with_kernel_line(getattr(module, fmt)(module.compute({})))
    assert text.endswith(panel.NEEDS_KERNEL)
    pytest.importorskip("ipywidgets")
    box = module.panel()
    assert getattr(module, fmt)(module.compute({})) in capsys.readouterr().out  # drawn once for the default
    sliders = [c for c in box.children[1].children if getattr(c, "value", None) == module.DEFAULT[control]
               and c.description in ("N", "stages S")]
    assert len(sliders) == 1
    sliders[0].value = value
    assert getattr(module, fmt)(module.compute({control: value})) in capsys.readouterr().out
