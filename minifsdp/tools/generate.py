"""Serve what a sharded run learned: ``python -m minifsdp generate --checkpoint RUN --prompt TEXT``.

No rank, no process group, no FSDP: at the end of ``train`` the shards were
consolidated (gathered unit by unit, rank 0 only) into one plain state dict,
``RUN/final/full.pt``; it loads into an ordinary, unwrapped ``TinyGPT``:

    RUN/job.json          which model (GPTConfig) the run trained
    RUN/final/full.pt     {"model": plain state dict}: tok_emb.weight, blocks.0.attn.qkv.weight, ...
    RUN/step_*/           a stopped run has no final weights yet: the newest checkpoint is
                          read instead (ours: sharded pieces, loaded into the plain model;
                          torch's: its full state dict)

Decoding is greedy (the most likely next character, every time), so the output
is a function of the weights and the prompt alone: the same on every machine.
A sequence longer than the model's ``block_size`` keeps only its last
``block_size`` characters as context, as the model was trained.
"""

from __future__ import annotations

import os

import torch

from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from minifsdp.tools.train_checks import JobError, checkpoint_steps, read_job

__all__ = ["load_trained", "greedy", "run_generate"]


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
def greedy(model: TinyGPT, corpus: CharCorpus, prompt: str, tokens: int) -> str:
    """``prompt`` continued by ``tokens`` characters, each the argmax of the next-character logits."""
    ids = [corpus.stoi.get(ch, 0) for ch in prompt] or [0]
    out = []
    for _ in range(tokens):
        context = torch.tensor([ids[-model.cfg.block_size:]])
        nxt = int(model(context)[0, -1].argmax())
        ids.append(nxt)
        out.append(corpus.itos.get(nxt, "?"))
    return "".join(out)


def run_generate(args) -> int:
    if args.tokens < 1:
        raise JobError(f"--tokens must be at least 1, got {args.tokens}")
    if not os.path.exists(args.checkpoint):
        raise JobError(f"--checkpoint {args.checkpoint}: no such folder; give the --checkpoint-dir of a train run")
    model = load_trained(args.checkpoint)
    corpus = CharCorpus(vocab_size=model.cfg.vocab_size)
    print(args.prompt + greedy(model, corpus, args.prompt, args.tokens), flush=True)
    return 0
