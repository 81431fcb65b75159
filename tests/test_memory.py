"""Chapter 2.3 / 2.4: the memory tracker, the ZeRO formulas, the fixed activation hook.

Oracles: hand-computed byte counts (autograd's saved-tensor rules, Adam's state
layout, FSDP1's padding) and the ZeRO paper's published numbers.  Byte counts
are integers, so every comparison here is exact unless it says otherwise.
"""

from __future__ import annotations

import itertools

import matplotlib
import pytest
import torch
import torch.nn as nn

from minifsdp import spawn
from minifsdp.memory.activation_sizes import activation_sizes, register_activation_size_hooks
from minifsdp.memory.tracker import CATEGORIES, MemoryTracker, snapshot
from minifsdp.memory.zero_formulas import (
    format_rows,
    memory_rows,
    model_state_bytes,
    plot_memory_vs_world_size,
    plot_timeline,
    sharded_numel,
)
from minifsdp.models import CharCorpus, TinyGPT
from tests._workers_memory import measure_setups

matplotlib.use("Agg")

# ---- the formulas ------------------------------------------------------------------------------


def test_zero_paper_numbers():
    """ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12)."""
    psi, n = 7.5e9, 64
    total = {s: model_state_bytes(psi, n, s, "mixed_adam")["total"] for s in ("DDP", "ZERO_1", "ZERO_2", "ZERO_3")}
    # the paper prints 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    assert total == {"DDP": 120e9, "ZERO_1": 31.40625e9, "ZERO_2": 16.640625e9, "ZERO_3": 1.875e9}


def test_fp32_adam_formulas():
    """What we train on CPU: 4Ψ + 4Ψ + 8Ψ; Ψ = 1000, N = 4."""
    f = lambda s: model_state_bytes(1000, 4, s)  # noqa: E731
    assert f("DDP") == {"parameters": 4000, "gradients": 4000, "optimizer_state": 8000, "total": 16000}
    assert f("ZERO_1")["total"] == 8000 + 2000  # 8Ψ + 8Ψ/N
    assert f("SHARD_GRAD_OP") == {"parameters": 4000, "gradients": 1000, "optimizer_state": 2000, "total": 7000}
    assert f("FULL_SHARD") == {"parameters": 1000, "gradients": 1000, "optimizer_state": 2000, "total": 4000}
    assert f(3) == f("ZeRO-3") == f("ShardingStrategy.FULL_SHARD")
    assert model_state_bytes(1000, 4, "DDP", extra_optimizer_bytes=12)["optimizer_state"] == 8012


def test_formula_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="unknown strategy 'HYBRID'"):
        model_state_bytes(10, 2, "HYBRID")
    with pytest.raises(ValueError, match="unknown precision"):
        model_state_bytes(10, 2, "DDP", precision="bf16")


def test_sharded_numel_counts_padding():
    assert sharded_numel([10], 4) == 3  # 10 -> padded to 12 -> 3 per rank
    assert sharded_numel([10, 8], 4) == 3 + 2
    assert sharded_numel([4160, 12704, 12704], 2) == (4160 + 2 * 12704) // 2  # even: no padding


def test_rows_table_and_plot():
    rows = memory_rows(1000, [1, 2, 4], measured={("FULL_SHARD", 2): 8100.0})
    fs2 = next(r for r in rows if r["strategy"] == "FULL_SHARD" and r["world_size"] == 2)
    assert fs2["formula_bytes"] == 8000 and fs2["measured_over_formula"] == pytest.approx(8100 / 8000)
    assert "FULL_SHARD" in format_rows(rows) and len(format_rows(rows).splitlines()) == 1 + 9
    fig = plot_memory_vs_world_size(rows)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["DDP (formula)", "SHARD_GRAD_OP (formula)", "FULL_SHARD (formula)", "FULL_SHARD (measured)"]
    matplotlib.pyplot.close(fig)


# ---- snapshot and the tracker on one process ------------------------------------------------------


def test_snapshot_counts_each_storage_once():
    gpt = TinyGPT(seed=0)  # lm_head.weight IS tok_emb.weight: parameters() yields it once
    assert snapshot(gpt)["parameters"] == 4 * sum(p.numel() for p in gpt.parameters())
    m = nn.Module()
    base = torch.zeros(10)
    m.a, m.b = nn.Parameter(base[:6]), nn.Parameter(base[4:])  # two views of one 10-float storage
    assert snapshot(m)["parameters"] == 40


def _adam_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 8))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(256, 64), torch.randn(256, 8)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # Adam's state exists from here on
    opt.zero_grad(set_to_none=True)  # grads are allocated again by the tracked backward
    return model, opt, x, y


def test_tracker_one_process_step():
    model, opt, x, y = _adam_mlp()
    with MemoryTracker(model, opt) as mt:
        mt.mark("forward")
        loss = nn.functional.mse_loss(model(x), y)
        mt.mark("backward")
        loss.backward()
        mt.mark("step")
        opt.step()
    at_rest = snapshot(model, opt)
    peak = mt.breakdown_at_peak
    assert set(peak) == set(CATEGORIES) | {"total"}
    assert sum(peak[c] for c in CATEGORIES) == peak["total"] == mt.peak_bytes
    assert mt.peak_bytes >= at_rest["parameters"] + at_rest["gradients"] + at_rest["optimizer_state"]
    assert peak["parameters"] == at_rest["parameters"] and peak["optimizer_state"] == at_rest["optimizer_state"]
    # Autograd saves (oracle: its saved-tensor rules): x for the first addmm's weight grad, tanh's OUTPUT
    # (its backward is 1 - y^2; the pre-tanh tensor is freed), and mse_loss's input and target.  x and y
    # were made before the region, so they do not count (as the allocator would not count them).
    expected_activations = 4 * (256 * 1024 + 256 * 8)
    assert mt.breakdown_at("backward")["activations"] == expected_activations
    assert mt.breakdown_at("forward")["activations"] == 0 and mt.breakdown_at("forward")["gradients"] == 0
    assert mt.breakdown_at("end")["gradients"] == at_rest["gradients"] == at_rest["parameters"]
    assert [m for m, _ in mt.marks] == ["forward", "backward", "step", "end"]
    assert max(b for _, b in mt.timeline) == mt.peak_bytes
    with pytest.raises(KeyError, match="no mark named 'fwd'"):
        mt.breakdown_at("fwd")
    fig = plot_timeline(mt)
    dot = next(line for line in fig.axes[0].get_lines() if line.get_label().startswith("peak"))
    assert dot.get_ydata()[0] == mt.peak_bytes / 1024
    matplotlib.pyplot.close(fig)


def _allocator_peak_increase(fn) -> tuple[int, int]:
    """(peak, final) bytes above the start, from the CPU allocator's own events (torch.profiler)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation:  # alloc_size < 0 for a free
            sizes.append((e.start_time_ns, e.extra_fields.alloc_size))
    running = list(itertools.accumulate(size for _, size in sorted(sizes)))
    return max(running), running[-1]


def test_tracker_agrees_with_the_allocator():
    """Oracle: the allocator's events (torch.profiler, profile_memory=True) for the same TinyGPT step.

    The profiler knows bytes but not whose; we know whose, and must not miss any.  Tolerance: 64 bytes,
    for scratch a kernel allocates and frees inside itself (no op returns it, so no tracker can see it).
    """
    corpus = CharCorpus()

    def setup():
        model = TinyGPT(seed=0)
        opt = torch.optim.AdamW(model.parameters())
        model(*corpus.batch(0, 8, 32)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return model, opt

    def step(model, opt):
        model(*corpus.batch(1, 8, 32)).backward()  # the batch is made inside: both count it
        opt.step()

    model, opt = setup()
    allocator_peak, allocator_final = _allocator_peak_increase(lambda: step(model, opt))
    model, opt = setup()
    with MemoryTracker(model, opt) as mt:
        step(model, opt)
    start = mt.timeline[0][1]
    assert abs((mt.peak_bytes - start) - allocator_peak) <= 64
    assert mt.current_bytes - start == allocator_final == snapshot(model, opt)["gradients"]


def test_tracker_sees_frees_and_storage_resizes():
    """FSDP allocates its all-gather buffer with storage.resize_(n): not an aten op, so we wrap it."""
    buf = torch.empty(0)
    for track in (True, False):
        with MemoryTracker(track_storage_resize=track) as mt:
            buf.untyped_storage().resize_(1 << 20)
            buf.untyped_storage().resize_(0)
            tmp = torch.ones(1 << 16)  # 256 KiB, then freed
            del tmp
        start = mt.timeline[0][1]  # every tensor alive in this process at the start ("resident")
        assert mt.current_bytes == start
        assert mt.peak_bytes - start == ((1 << 20) if track else 4 << 16)
        assert mt.storage_resizes == (2 if track else 0)


def test_tracker_misuse_says_what_to_do():
    mt = MemoryTracker()
    with pytest.raises(RuntimeError, match="inside `with MemoryTracker"):
        mt.mark("forward")
    with pytest.raises(RuntimeError, match="once the `with MemoryTracker"):
        _ = mt.breakdown_at_peak
    with MemoryTracker():
        with pytest.raises(RuntimeError, match="already running"):
            with MemoryTracker():
                pass


# ---- the activation hook, source vs ours --------------------------------------------------------------


class _TupleOut(nn.Module):
    def forward(self, x):
        return x * 2, x + 1  # like attention returning (output, weights)


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = _TupleOut()

    def forward(self, x):
        a, b = self.pair(x)
        return {"sum": a + b, "parts": [a, None], "note": "ok", "none": None}


def test_source_hook_crashes_on_tuple_output_ours_does_not():
    def hook_fn(module, input, output):  # the source, 2.3, verbatim
        print(f"{module.__class__.__name__}: {output.element_size() * output.nelement() / 1024**2:.2f} MB")

    layer = _TupleOut()
    hook = layer.register_forward_hook(hook_fn)
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'element_size'"):
        layer(torch.zeros(4))
    hook.remove()

    report = activation_sizes(_Mixed(), torch.zeros(4, 8))
    assert report == [("pair", "_TupleOut", 2 * 32 * 4), ("(root)", "_Mixed", 2 * 32 * 4)]
    handles, report = register_activation_size_hooks(nn.Identity())
    assert len(handles) == 1
    handles[0].remove()


# ---- 2 ranks: torch DDP vs torch FSDP1, measured the same way -------------------------------------------


def _own(got: dict) -> dict:
    """One setup's numbers without what earlier setups in the process left behind (its "baseline").

    The tracker counts every live tensor, so a setup measured after others also counts what they
    leaked (as "resident"); subtracting the census taken just before it was built leaves its own bytes.
    """
    base = got["baseline"]
    own = lambda b: {**b, "resident": b["resident"] - base, "total": b["total"] - base}  # noqa: E731
    return {**got, "peak": got["peak"] - base, "at_peak": own(got["at_peak"]),
            "end_of_forward": own(got["end_of_forward"]), "end": own(got["end"])}


@pytest.mark.timeout(240)  # 19 s on a quiet 2-core machine (8 setups, one spawn), 98 s measured under heavy load
def test_two_ranks_ddp_vs_fsdp1_memory():
    kinds = ["DDP", "FULL_SHARD", "SHARD_GRAD_OP", "FSDP2_FULL_SHARD", "FSDP2_DEFAULT", "FULL_SHARD@odd",
             "OURS_FULL_SHARD", "OURS_SHARD_GRAD_OP", "OURS_FULL_SHARD@odd"]
    results = [{k: _own(v) for k, v in r.items()} for r in spawn(measure_setups, args=(kinds,), world_size=2)]
    n = 2
    for r in results:  # the ranks hold the same-sized shards here (every unit's numel is even)
        ddp, fs, sgo, fsdp2 = r["DDP"], r["FULL_SHARD"], r["SHARD_GRAD_OP"], r["FSDP2_FULL_SHARD"]
        psi, tensors = ddp["n_params"], ddp["n_tensors"]
        model_state = lambda s: {k: v for k, v in s.items() if k in ("parameters", "gradients", "optimizer_state")}  # noqa: E731

        # DDP: 16Ψ plus Adam's 4-byte step per parameter tensor. Exact.
        want = model_state_bytes(psi, n, "DDP", extra_optimizer_bytes=4 * tensors)
        assert model_state(ddp["rest"]) == {k: want[k] for k in model_state(want)}
        # FSDP1 at rest (both strategies reshard after the backward): 16Ψ/N over the padded flat
        # parameters, plus one 4-byte step per flat parameter (one per unit: root + 2 blocks). Exact.
        units = fs["units"]
        shard = sharded_numel([padded for _, padded in units], n)
        want = model_state_bytes(shard * n, n, "FULL_SHARD", extra_optimizer_bytes=4 * len(units))
        for got in (fs, sgo):
            assert model_state(got["rest"]) == {k: want[k] for k in model_state(want)}
        # Odd-sized units (n_embd = 33): each block's flat parameter gets one element of padding.
        odd = r["FULL_SHARD@odd"]
        assert [padded - unpadded for unpadded, padded in odd["units"]] == [0, 1, 1]
        shard = sharded_numel([unpadded for unpadded, _ in odd["units"]], n)  # ceil() = the padding
        want = model_state_bytes(shard * n, n, "FULL_SHARD", extra_optimizer_bytes=4 * len(odd["units"]))
        assert model_state(odd["rest"]) == {k: want[k] for k in model_state(want)}
        assert model_state(odd["rest"])["parameters"] == 4 * (odd["n_params"] + 2) // n  # + 1 pad per block

        # FSDP2 shards each parameter on dim 0 (every dim 0 here is even at N = 2: no padding) and Adam keeps
        # one step counter per original parameter (28) instead of one per flat parameter (3).
        assert fsdp2["rest"]["parameters"] == fs["rest"]["parameters"] == 4 * psi // n
        assert fsdp2["rest"]["gradients"] == fs["rest"]["gradients"]
        assert fsdp2["rest"]["optimizer_state"] - fs["rest"]["optimizer_state"] == 4 * (tensors - len(units))
        # Against the ideal 16Ψ/N the only gap is padding (< N elements a unit) and the step counters.
        ideal = model_state_bytes(psi, n, "FULL_SHARD")["total"]
        assert 0 <= sum(model_state(fs["rest"]).values()) - ideal <= 16 * (n - 1) * len(units) + 4 * len(units)

        # The all-gathered parameters are seen (allocated and freed through storage.resize_):
        root, blocks = units[0][1] * 4, [u[1] * 4 for u in units[1:]]  # fsdp_modules(): root first
        assert fs["resizes"] > 0 and sgo["resizes"] > 0 and fsdp2["resizes"] > 0 and ddp["resizes"] == 0
        # end of forward: FULL_SHARD freed every block but keeps the root (torch never reshards the root after
        # its forward); SHARD_GRAD_OP keeps every unit unsharded until the backward is done.
        assert fs["end_of_forward"]["unsharded_parameters"] == root
        assert sgo["end_of_forward"]["unsharded_parameters"] == root + sum(blocks) == 4 * psi
        assert ddp["end_of_forward"]["unsharded_parameters"] == 0
        # at FULL_SHARD's peak (start of the backward): the root plus at least one re-gathered block
        sums = {root + sum(c) for k in range(1, len(blocks) + 1) for c in itertools.combinations(blocks, k)}
        assert fs["at_peak"]["unsharded_parameters"] in sums
        # FSDP2 reshards the root after its forward too
        assert fsdp2["end_of_forward"]["unsharded_parameters"] == 0
        # Same model, same local batch: the saved activations are byte-for-byte the same size.
        for got in (fs, sgo, fsdp2):
            assert got["end_of_forward"]["activations"] == ddp["end_of_forward"]["activations"]
        # Peaks (measured, then asserted): every peak falls at the start of the backward, where the
        # activations (the same in all) and the same temporaries sit on top of the model state, so the
        # order is the model state's: 16Ψ/N + root + a block  <  16Ψ/N + 4Ψ (all unsharded)  <  16Ψ.
        assert fs["peak"] < sgo["peak"] < ddp["peak"]
        for got in (ddp, fs, sgo):
            assert got["peak_phase"] == "backward"
            assert got["at_peak"]["total"] == got["peak"]
            for c in ("parameters", "gradients", "optimizer_state", "buffers"):  # .grad kept: set_to_none=False
                assert got["at_peak"][c] == got["rest"][c]
            assert got["found_at_exit"] == 0  # the running count missed no storage alive at the end

        # Ours against torch FSDP1 (oracle), measured by the same tracker in the same ranks: byte for byte
        # the same at rest, at the end of the forward, at the peak (and the peak falls in the same phase),
        # at the end, category by category; the same flat-parameter sizes (padding included) and the same
        # number of storage resizes (one allocation and one free per all-gather).  This holds because ours
        # frees and re-gathers exactly where torch FSDP1 does (root kept after its forward, blocks freed,
        # re-gathered in the backward; what torch's default BACKWARD_PRE prefetches is gathered after the
        # peak here) and allocates the same gradient buffers.  Exact: the counts are integers.
        for ours_kind, torch_kind in (("OURS_FULL_SHARD", "FULL_SHARD"), ("OURS_SHARD_GRAD_OP", "SHARD_GRAD_OP"),
                                      ("OURS_FULL_SHARD@odd", "FULL_SHARD@odd")):
            ours, theirs = r[ours_kind], r[torch_kind]
            for key in ("units", "rest", "end_of_forward", "peak", "peak_phase", "at_peak", "end", "resizes"):
                assert ours[key] == theirs[key], f"{ours_kind} vs {torch_kind}, {key}: {ours[key]} != {theirs[key]}"
        # Ours' peak is no higher than torch's best (FSDP1; FSDP2 with fully_shard's defaults, and
        # with the root resharded after forward too).  Exact: integers; a tie with FSDP1 is the equality above.
        best = min(r[k]["peak"] for k in ("FULL_SHARD", "FSDP2_FULL_SHARD", "FSDP2_DEFAULT"))
        assert r["OURS_FULL_SHARD"]["peak"] <= best, {k: r[k]["peak"] for k in r}
