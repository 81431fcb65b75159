"""Serve what a sharded run learned: ``python -m minifsdp generate --checkpoint RUN --prompt TEXT``.

No rank, no process group, no FSDP: at the end of ``train`` the shards were
consolidated (gathered unit by unit, rank 0 only) into one plain state dict,
``RUN/final/full.pt``; it loads into an ordinary, unwrapped ``TinyGPT``:

    RUN/job.json          which model (GPTConfig) the run trained
    RUN/final/full.pt     {"model": plain state dict}: tok_emb.weight, blocks.0.attn.qkv.weight, ...
    RUN/step_*/           a stopped run has no final weights yet: the newest checkpoint is
                          read instead (ours: sharded pieces, loaded into the plain model;
                          torch's: its full state dict)

Decoding samples each next character from the model's distribution, sharpened by
``--temperature`` (below 1: fewer surprises) and cut to the ``--top-k`` most likely
characters, with a generator seeded by ``--seed``: the output is a function of the
weights, the prompt and those three numbers, the same on every machine.
``--temperature 0`` decodes greedily (the most likely character every time), which
on a small character model soon repeats one word or one space forever:

    logits of the next character --/temperature--> keep the top k --softmax--> draw (seeded)

A sequence longer than the model's ``block_size`` keeps only its last
``block_size`` characters as context, as the model was trained.
:func:`char_loss` scores a text instead of writing one: the mean cross-entropy
per character (nats), the number that tells a trained model from an untrained one
on text neither has seen (an untrained model is near ``ln(vocab_size)``).
"""

from __future__ import annotations

import os

import torch

from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from minifsdp.training.checks import JobError, checkpoint_steps, read_job
from minifsdp.training.devices import add_device_argument, resolve_device

__all__ = ["load_trained", "sample", "greedy", "char_loss", "add_arguments", "run_generate"]

TEMPERATURE, TOP_K = 0.8, 10  # the defaults of --temperature and --top-k


def add_arguments(p) -> None:
    """The flags of ``python -m minifsdp generate`` (cli.py adds the subcommand)."""
    p.add_argument("--checkpoint", required=True, help="the run's --checkpoint-dir (or one step_* folder in it)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, default=200, help="characters to generate")
    p.add_argument("--temperature", type=float, default=TEMPERATURE,
                   help="divides the logits before sampling (below 1: safer choices); 0: greedy")
    p.add_argument("--top-k", type=int, default=TOP_K, help="sample among the k most likely characters (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    add_device_argument(p)


def load_trained(path: str) -> TinyGPT:
    """A plain TinyGPT with the weights of the run in ``path`` (its folder, or one of its step_* folders)."""
    run = path if read_job(path) is not None else os.path.dirname(os.path.abspath(path))
    job = read_job(run)
    if job is None:
        raise JobError(f"--checkpoint {path}: no job.json here or in its parent: point it at a folder "
                       "`python -m minifsdp train --checkpoint-dir` wrote")
    model = TinyGPT(GPTConfig(**job["gpt_config"]), seed=0)
    final = os.path.join(run, "final", "full.pt")
    if os.path.abspath(path) != os.path.abspath(run):  # one step_* folder, as asked
        steps_dir = path
    elif os.path.exists(final):
        model.load_state_dict(torch.load(final, map_location="cpu", weights_only=False)["model"])
        return model.eval()
    else:
        steps = checkpoint_steps(run, job["impl"])
        if not steps:
            raise JobError(f"--checkpoint {path}: no final weights and no complete checkpoint yet; train first")
        steps_dir = os.path.join(run, f"step_{steps[-1]:08d}")
    torch_file = os.path.join(steps_dir, "torch_full.pt")
    if os.path.exists(torch_file):
        model.load_state_dict(torch.load(torch_file, map_location="cpu", weights_only=False)["model"])
    else:
        from minifsdp import checkpoint

        checkpoint.load(steps_dir, model)  # our sharded pieces, into the unwrapped model
    return model.eval()


@torch.no_grad()
def sample(model: TinyGPT, corpus: CharCorpus, prompt: str, tokens: int, temperature: float = TEMPERATURE,
           top_k: int = TOP_K, seed: int = 0) -> str:
    """The ``tokens`` characters that continue ``prompt``, each drawn from the next-character distribution.

    ``temperature`` 0 takes the argmax (greedy); otherwise the logits are divided by it, all but the
    ``top_k`` largest dropped (0 keeps all), and one character drawn with a generator seeded by ``seed``.
    """
    ids = [corpus.stoi.get(ch, 0) for ch in prompt] or [0]
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    out = []
    for _ in range(tokens):
        logits = model(torch.tensor([ids[-model.cfg.block_size:]], device=device))[0, -1].float().cpu()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        ids.append(nxt)
        out.append(corpus.itos.get(nxt, "?"))
    return "".join(out)


def greedy(model: TinyGPT, corpus: CharCorpus, prompt: str, tokens: int) -> str:
    """``prompt`` continued by ``tokens`` characters, each the argmax of the next-character logits."""
    return sample(model, corpus, prompt, tokens, temperature=0)


@torch.no_grad()
def char_loss(model: TinyGPT, corpus: CharCorpus, text: str) -> float:
    """Mean cross-entropy per character (nats) of ``text`` under ``model``: non-overlapping windows of
    ``block_size + 1`` characters, each predicting its last ``block_size`` from what precedes it."""
    ids = torch.tensor([corpus.stoi.get(ch, 0) for ch in text])
    T = model.cfg.block_size
    n = (len(ids) - 1) // T
    if n < 1:
        raise ValueError(f"text of {len(text)} characters is shorter than block_size + 1 = {T + 1}")
    x, y = ids[: n * T].view(n, T), ids[1 : n * T + 1].view(n, T)
    was_training = model.training
    model.eval()
    loss = float(model(x, y))
    model.train(was_training)
    return loss


def run_generate(args) -> int:
    if args.tokens < 1:
        raise JobError(f"--tokens must be at least 1, got {args.tokens}")
    if args.temperature < 0 or args.top_k < 0:
        raise JobError(f"--temperature {args.temperature} --top-k {args.top_k}: both must be >= 0 "
                       "(--temperature 0 is greedy, --top-k 0 keeps every character)")
    if not os.path.exists(args.checkpoint):
        raise JobError(f"--checkpoint {args.checkpoint}: no such folder; give the --checkpoint-dir of a train run")
    resolve_device(args.device)  # DeviceError (no GPU): names the fix
    model = load_trained(args.checkpoint).to(args.device)
    corpus = CharCorpus(vocab_size=model.cfg.vocab_size)
    text = sample(model, corpus, args.prompt, args.tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + text, flush=True)
    return 0
