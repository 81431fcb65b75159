"""Checkpoints: state dicts vs torch FSDP1, save/load, resume, resharding, DCP vs torch FSDP2, bad checkpoints.

Multi-rank checks run in two spawns (2 ranks, 4 ranks) whose workers live in
``tests/_workers_checkpoint.py``; each returns one record per check.  Every
comparison is bitwise (``torch.equal``): loading copies numbers, and the runs we
compare take the same arithmetic in the same order (our FSDP is bitwise torch
FSDP1's).  Where that is not so the test says why and names its tolerance.
The single-process tests (plain ``nn.Module``, no process group) cover the
files themselves: truncated, corrupted, wrong model, half-written, rotation.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import minifsdp
from minifsdp import checkpoint
from minifsdp.checkpoint import CheckpointManager
from minifsdp.models import MLP, TinyGPT
from tests import _workers_checkpoint as w
from tests._workers_fsdp import assert_bitwise, full_items


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return minifsdp.spawn(w.two_rank_worker, args=(str(tmp_path_factory.mktemp("ckpt2")),), world_size=2,
                          timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_full_state_dicts_equal_torch_fsdp1(two_ranks, opt):
    """Oracle: torch FSDP1's full state dict and ``FSDP.optim_state_dict``, bitwise, on both ranks."""
    for r in two_ranks:
        assert r[f"{opt} full sd vs torch"] == []
        assert r[f"{opt} full optim vs torch"] == []
        assert r[f"{opt} ours -> torch FSDP1 -> back"] == [] and r[f"{opt} ours -> plain"] == []
        assert r[f"{opt} torch state -> ours, next step"] == []  # torch's model+optimizer state, loaded into ours
    assert two_ranks[0]["adamw optim keys"] == ["exp_avg", "exp_avg_sq", "step"]
    assert two_ranks[0]["sgd optim keys"] == ["momentum_buffer"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_save_load_continue(two_ranks, kind):
    for rank, r in enumerate(two_ranks):
        assert r[f"{kind} load equal"] == []
        assert r[f"{kind} two loads continue equal"] == []
        assert r[f"{kind} lr restored"] == 0.01  # the hyperparameters came back too
        assert r[f"{kind} numbers"]["extra"] == {"rank": rank}  # each rank gets its own extra
    files = two_ranks[0][f"{kind} numbers"]["file_bytes"]
    if kind == "sharded":  # each rank writes about half (its shard + rank 0's buffers), none is empty
        assert sorted(files) == ["rank00000.pt", "rank00001.pt"]
        assert all(0 < s < 0.7 * sum(files.values()) for s in files.values())
    else:  # one file, by rank 0
        assert list(files) == ["full.pt"]


@pytest.mark.timeout(300)
def test_resume_is_bitwise_the_run_that_never_stopped(two_ranks):
    """Oracle: the same 6 steps without stopping (random input masking: the RNG state must come back)."""
    for r in two_ranks:
        assert r["resume"] == {"kept": [2, 3], "losses_equal": True, "params_diff": []}


@pytest.mark.timeout(300)
def test_missing_rank_file_is_named_on_every_rank(two_ranks):
    for r in two_ranks:
        assert "rank00001.pt: missing" in r["errors"]["missing"]


@pytest.mark.timeout(300)
def test_dcp_interop_with_torch_fsdp2(two_ranks):
    """Oracle: torch FSDP2 + torch.distributed.checkpoint, both directions (model and AdamW state), bitwise.

    The step after loading is bitwise FSDP2's too: at 2 ranks each gradient number is one two-term
    sum in either sharding, and AdamW is elementwise.
    """
    for r in two_ranks:
        assert r["dcp"] == {"fsdp2 -> ours": [], "next step": [], "ours -> fsdp2": [], "ours -> fsdp2, next step": []}


# ---------------------------------------------------------------- single process: the files themselves


def _trained():
    torch.manual_seed(0)
    model = TinyGPT(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 96, (2, 16))
    model(x, x).backward()
    opt.step()
    return model, opt


def test_plain_module_round_trip_and_full_file_is_a_plain_state_dict(tmp_path):
    model, opt = _trained()
    checkpoint.save(str(tmp_path / "s"), model, opt, extra={"step": 1})
    checkpoint.save(str(tmp_path / "f"), model, opt, full=True)
    for name in ("s", "f"):
        fresh = TinyGPT(seed=1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        checkpoint.load(str(tmp_path / name), fresh, fresh_opt)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
        s1, s2 = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
        assert all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])
    plain = TinyGPT(seed=2)
    plain.load_state_dict(torch.load(tmp_path / "f" / "full.pt", weights_only=False)["model"])
    assert torch.equal(plain.lm_head.weight, model.lm_head.weight)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["world_size"] == 1 and manifest["tied"] == {
        "lm_head.weight": "tok_emb.weight"}
    assert set(manifest["files"]["rank00000.pt"]) == {"bytes", "sha256", "pieces"}


def _expect_error(path, model, match, **kw):
    with pytest.raises(checkpoint.CheckpointError, match=match):
        checkpoint.load(str(path), model, **kw)


def test_bad_checkpoints_give_clear_errors(tmp_path):
    model, _ = _trained()
    good = tmp_path / "good"
    checkpoint.save(str(good), model)
    data = (good / "rank00000.pt").read_bytes()
    for name, edit, match in [
        ("truncated", lambda p: p.write_bytes(data[: len(data) // 2]), r"rank00000.pt: truncated"),
        ("corrupted", lambda p: p.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:]),
         r"rank00000.pt: corrupted"),
        ("missing", lambda p: p.unlink(), r"rank00000.pt: missing"),
    ]:
        bad = tmp_path / name
        bad.mkdir()
        (bad / "manifest.json").write_bytes((good / "manifest.json").read_bytes())
        (bad / "rank00000.pt").write_bytes(data)
        edit(bad / "rank00000.pt")
        _expect_error(bad, model, match)
    _expect_error(good, MLP(seed=0), r"manifest.json: wrong model")
    _expect_error(tmp_path / "nowhere", model, r"no such checkpoint directory")
    os.makedirs(tmp_path / "half.tmp")
    _expect_error(tmp_path / "half.tmp", model, r"manifest.json: missing .*did not finish")
    _expect_error(good, model, r"saved without an optimizer", optimizer=torch.optim.SGD(model.parameters(), lr=1))
    manifest = json.loads((good / "manifest.json").read_text())
    for field, value, match in (("version", 99, "format version 99"), ("world_size", 4, "written by 4 ranks")):
        other = tmp_path / f"m_{field}"
        other.mkdir()
        (other / "rank00000.pt").write_bytes(data)
        (other / "manifest.json").write_text(json.dumps({**manifest, field: value}))
        _expect_error(other, model, match, reshard=False)


def test_nothing_saved_is_lost(tmp_path, monkeypatch):
    """A save that dies half-way leaves the previous checkpoints intact; a save never clobbers one."""
    model, opt = _trained()
    mgr = CheckpointManager(str(tmp_path), keep=2)
    for s in (1, 2, 3):
        mgr.save(s, model, opt, extra={"step": s})
    assert mgr.steps() == [2, 3]
    with pytest.raises(checkpoint.CheckpointError, match="already there; pass overwrite=True"):
        checkpoint.save(mgr.path(3), model, opt)

    import minifsdp.checkpoint.save_load as ck

    def die(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ck, "write_manifest", die)  # the crash: every rank file written, no manifest
    with pytest.raises(checkpoint.CheckpointError, match="disk full"):
        mgr.save(4, model, opt, extra={"step": 4})
    monkeypatch.undo()
    assert mgr.steps() == [2, 3] and os.path.isdir(mgr.path(4) + ".tmp")
    fresh = TinyGPT(seed=1)
    assert mgr.load_latest(fresh, torch.optim.AdamW(fresh.parameters())) == {"step": 3}
    mgr.save(4, model, opt, extra={"step": 4})  # the stale .tmp is cleared, the rotation keeps 2
    assert mgr.steps() == [3, 4] and not os.path.exists(mgr.path(4) + ".tmp")
    checkpoint.save(mgr.path(4), model, opt, extra={"step": 44}, overwrite=True)
    assert checkpoint.load(mgr.path(4), fresh) == {"step": 44}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return minifsdp.spawn(w.reshard_worker, args=(str(tmp_path_factory.mktemp("ckpt4")),), world_size=4,
                          timeout_s=300)


@pytest.mark.timeout(400)
def test_reshard_saved_at_4_loads_at_1_2_3_ranks_and_into_the_plain_model(four_ranks):
    """Every number each rank holds (parameters and AdamW state) equals the saved whole tensor's, bitwise;
    the first step after loading has the plain model's loss (oracle: TinyGPT loaded with the saved numbers)."""
    for n in (1, 2, 3):
        for rank in range(n):
            assert four_ranks[rank][f"{n} ranks"] == {"pieces": [], "summon": [], "continues": True,
                                                      "extra": {"step": 2}}
    assert four_ranks[0]["plain"] == []


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "use_orig_params"])
def test_reshard_at_4_ranks_into_another_strategy(four_ranks, layout):
    """Oracle for the next step: the FULL_SHARD run that saved the checkpoint, continuing.

    Bitwise, except HYBRID_SHARD: it sums a gradient as (g0 + g1) + (g2 + g3) (reduce-scatter in each
    pair, then all-reduce across pairs) where FULL_SHARD sums g0 + g1 + g2 + g3 in one reduce-scatter;
    fp32 rounding of that other order: max abs difference <= 1e-7 (measured 7.5e-9).
    """
    for r in four_ranks:
        rec = r[layout]
        assert rec["pieces"] == [] and rec["round_trip"] == []
        if layout == "HYBRID_SHARD":
            assert rec["max_diff"] <= 1e-7
        else:
            assert rec["next_step"] == []
        # a sharded save of a replicated layout writes every number once: NO_SHARD rank 0, HYBRID the first pair
        want = {"NO_SHARD": ["rank00000.pt"], "HYBRID_SHARD": ["rank00000.pt", "rank00001.pt"]}
        assert rec["written"] == want.get(layout, [f"rank{i:05d}.pt" for i in range(4)])


@pytest.fixture(scope="module")
def hybrid_save(tmp_path_factory):
    return minifsdp.spawn(w.hybrid_save_worker, args=(str(tmp_path_factory.mktemp("ckpt_hybrid")),), world_size=4,
                          timeout_s=300)


@pytest.mark.timeout(400)
def test_sharded_save_at_hybrid_layout_keys_pieces_by_shard_rank(hybrid_save):
    """A sharded save at HYBRID_SHARD, shard groups {0, 1} and {2, 3}: global rank 2 is shard rank 0.

    Each rank's pieces are its shard of each parameter, found from its rank in the shard group: the
    global rank (the same number at 2 ranks, or in the first replica) would miss or misplace them on
    ranks 2 and 3.  Oracles, all bitwise: torch FSDP1 HYBRID_SHARD on the same groups, seed and data for
    the 3 steps (ours never stopping is its twin); the same layout loading the checkpoint and taking the
    3rd step equals both; loaded at 3 ranks (FULL_SHARD), at 2 ranks (SHARD_GRAD_OP, ``use_orig_params=True``)
    and into the plain TinyGPT, every parameter and AdamW state equals what was saved.  The loads at 3 and 2
    ranks also check each layout's last rank: its range ends in padding at 3 ranks, on a real number at 2.
    """
    runs = hybrid_save
    assert [r["shard rank"] for r in runs] == [0, 1, 0, 1]
    assert runs[0]["written"] == ["rank00000.pt", "rank00001.pt"]  # the first replica writes, once
    for rank, r in enumerate(runs):  # the run that never stopped is torch FSDP1's
        assert r["never stopped"]["losses"] == r["torch"]["losses"], rank
        for name, a, b in full_items(r["never stopped"]["full"], r["torch"]["full"]):
            assert_bitwise(a, b, f"rank {rank} never stopped vs torch FSDP1: {name}")
    for rank, r in enumerate(runs):  # what each rank loaded at the same layout is what was saved
        assert r["resumed"]["extra"] == {"step": 2, "rank": rank}
        assert_bitwise(r["resumed"]["loaded"], r["saved"], f"rank {rank} loaded at the same layout")
    for rank, r in enumerate(runs):  # and its next step is the one that never stopped took
        assert r["resumed"]["losses"] == r["torch"]["losses"], rank
        assert_bitwise(r["resumed"]["full"], r["never stopped"]["full"], f"rank {rank} resumed vs never stopped")
    for n in (3, 2):
        for rank, r in enumerate(runs[:n]):
            assert_bitwise(r[f"{n} ranks"], r["saved"], f"rank {rank} loaded at {n} ranks")
    assert runs[0]["plain"]["pieces"] == []
    assert_bitwise(runs[0]["plain"]["model"], runs[0]["saved"]["model"], "the plain model")
