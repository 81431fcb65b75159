"""Rank functions for tests/test_pipelining.py (module level, so spawn can pickle them).

One spawn per world size runs everything: torch's ``torch.distributed.pipelining`` schedules and ours on the
same split of the same model and data, side by side in each process, plus the unsharded model on the whole
batch, the fault-injected variants and the error cases.  The parent gets back plain tensors, lists and strings.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import Schedule1F1B as Torch1F1B
from torch.distributed.pipelining import ScheduleGPipe as TorchGPipe

from minifsdp.models import CharCorpus, GPTConfig, TinyGPT
from minifsdp.parallel.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

STEPS = 2
LR = 0.1
SCHEDULES = {"gpipe": (ScheduleGPipe, TorchGPipe), "1f1b": (Schedule1F1B, Torch1F1B)}


# ---- models and their splits --------------------------------------------------------------------------
def _mlp(num_stages: int) -> nn.Sequential:
    """Linear/ReLU pairs, two modules per stage, the last stage ending on a Linear."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dims = [16] + [32] * num_stages + [8]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(dims) - 2 else [])
        return nn.Sequential(*layers)


def _mlp_stage(full: nn.Sequential, s: int, num_stages: int) -> nn.Module:
    end = len(full) if s == num_stages - 1 else 2 * s + 2
    return full[2 * s:end]


class GPTHead(nn.Module):
    """Stage 0 of the tiny GPT: token + position embeddings and the first half of the blocks."""

    def __init__(self, gpt: TinyGPT, n_blocks: int):
        super().__init__()
        self.tok_emb, self.pos_emb, self.blocks = gpt.tok_emb, gpt.pos_emb, gpt.blocks[:n_blocks]

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return x


class GPTTail(nn.Module):
    """The last stage: the remaining blocks, the final LayerNorm and the LM head (its weight tied to tok_emb)."""

    def __init__(self, gpt: TinyGPT, n_blocks: int):
        super().__init__()
        self.blocks, self.ln_f, self.lm_head = gpt.blocks[n_blocks:], gpt.ln_f, gpt.lm_head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _gpt_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _case(model: str, num_stages: int):
    """(full model, stage builder, loss_fn, batches, full-model loss)."""
    if model == "mlp":
        full = _mlp(num_stages)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STEPS)]
        return full, lambda m, s: _mlp_stage(m, s, num_stages), F.mse_loss, batches, lambda m, x, y: F.mse_loss(m(x), y)
    cfg = GPTConfig()
    full = TinyGPT(cfg, seed=0)
    corpus = CharCorpus()
    batches = [corpus.batch(step, 8, cfg.block_size) for step in range(STEPS)]
    half = cfg.n_layer // 2
    return (full, lambda m, s: GPTHead(m, half) if s == 0 else GPTTail(m, half), _gpt_loss, batches,
            lambda m, x, y: m(x, y))


def _run_pipeline(stage_mod, stage, sched, batches, rank, ws):
    """STEPS steps of SGD through ``sched``; per step: losses, grads (by name), output, this stage's actions."""
    opt = torch.optim.SGD(stage_mod.parameters(), lr=LR)
    steps = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        losses: list = []
        actions: list = []
        if isinstance(stage, TorchStage):
            stage._record_into = actions
        if rank == 0:
            out = sched.step(x)
        elif rank == ws - 1:
            out = sched.step(target=y, losses=losses)
        else:
            out = sched.step()
        if isinstance(stage, PipelineStage):
            actions = list(stage.actions)
        steps.append({"losses": [loss.detach().clone() for loss in losses],
                      "out": None if out is None else out.detach(),
                      "grads": {n: p.grad.clone() for n, p in stage_mod.named_parameters() if p.grad is not None},
                      "actions": actions,
                      "peak_in_flight": getattr(stage, "peak_in_flight", None),
                      "peak_activation_bytes": getattr(stage, "peak_activation_bytes", None)})
        opt.step()
    return steps


def _torch_stage(mod, rank, ws):
    """torch's PipelineStage, with its forward_one_chunk / backward_one_chunk wrapped to record their order."""
    st = TorchStage(mod, rank, ws, torch.device("cpu"))
    fwd, bwd = st.forward_one_chunk, st.backward_one_chunk

    def forward_one_chunk(i, *a, **k):
        st._record_into.append(f"F{i}")
        return fwd(i, *a, **k)

    def backward_one_chunk(i, *a, **k):
        st._record_into.append(f"B{i}")
        return bwd(i, *a, **k)

    st.forward_one_chunk, st.backward_one_chunk = forward_one_chunk, backward_one_chunk
    st._record_into = []
    return st


def _unsharded(full, make_stage, batches, whole_loss, rank):
    """The plain model on the whole batch, SGD: per step the loss and the grads of this rank's stage's parameters."""
    model = copy.deepcopy(full)
    sub = make_stage(model, rank)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = whole_loss(model, x, y)
        loss.backward()
        steps.append({"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in sub.named_parameters()}})
        opt.step()
    return steps


class _DropsLastBackward(PipelineStage):
    """A broken first stage: it receives the gradient of its last micro-batch but never runs that backward
    (the message is still taken, so no rank hangs; only this stage's gradients are wrong)."""

    n_microbatches = 0

    def backward_one_chunk(self, chunk_id, loss=None):
        if self.is_first and chunk_id == self.n_microbatches - 1:
            inp, out, _ = self._cache.pop(chunk_id)
            dist.recv(torch.empty_like(out), src=self.next_rank)
            return
        super().backward_one_chunk(chunk_id, loss)


def parity(rank: int, ws: int, models: list[str], n_micro: list[int]):
    out: dict = {}
    for model in models:
        full, make_stage, loss_fn, batches, whole_loss = _case(model, ws)
        out[(model, "unsharded")] = _unsharded(full, make_stage, batches, whole_loss, rank)
        for M in n_micro:
            for name, (ours_cls, torch_cls) in SCHEDULES.items():
                m_t, m_o = make_stage(copy.deepcopy(full), rank), make_stage(copy.deepcopy(full), rank)
                st_t = _torch_stage(m_t, rank, ws)
                st_o = PipelineStage(m_o, rank, ws, torch.device("cpu"))
                out[(model, name, M, "torch")] = _run_pipeline(m_t, st_t, torch_cls(st_t, M, loss_fn=loss_fn),
                                                               batches, rank, ws)
                out[(model, name, M, "ours")] = _run_pipeline(m_o, st_o, ours_cls(st_o, M, loss_fn=loss_fn),
                                                              batches, rank, ws)
    return out


def faults(rank: int, ws: int, M: int):
    """Our MLP pipeline run wrong on purpose: a dropped backward, and no division of the grads by M."""
    full, make_stage, loss_fn, batches, _ = _case("mlp", ws)
    res = {}
    for label, stage_cls, scale in (("drop_backward", _DropsLastBackward, True),
                                    ("no_grad_scaling", PipelineStage, False)):
        mod = make_stage(copy.deepcopy(full), rank)
        st = stage_cls(mod, rank, ws, torch.device("cpu"))
        st.n_microbatches = M
        res[label] = _run_pipeline(mod, st, ScheduleGPipe(st, M, loss_fn=loss_fn, scale_grads=scale),
                                   batches[:1], rank, ws)
    # forward only (no loss_fn): outputs, no graph kept, no gradients
    mod = make_stage(copy.deepcopy(full), rank)
    st = PipelineStage(mod, rank, ws, torch.device("cpu"))
    x = batches[0][0]
    out = Schedule1F1B(st, M).step(x) if rank == 0 else Schedule1F1B(st, M).step()
    res["forward_only"] = {"out": out, "actions": list(st.actions), "expected": full(x).detach(),
                           "grads": [p.grad for p in mod.parameters() if p.grad is not None],
                           "requires_grad": None if out is None else out.requires_grad}
    return res


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def errors(rank: int, ws: int):
    """Wrong uses that each rank detects before sending anything (so no rank waits on another)."""
    full, make_stage, loss_fn, _, _ = _case("mlp", ws)
    st = PipelineStage(make_stage(copy.deepcopy(full), rank), rank, ws, torch.device("cpu"))
    gp = ScheduleGPipe(st, 4, loss_fn=loss_fn)
    x, y = torch.randn(6, 16), torch.randn(6, 8)
    res = {"indivisible": _error(lambda: gp.step(x) if rank == 0 else gp.step(target=y)),
           "input_on_non_first": _error(lambda: gp.step(x) if rank > 0 else gp.step()),
           "few_microbatches_1f1b": _error(lambda: Schedule1F1B(st, ws - 1, loss_fn=loss_fn)),
           "wrong_stage_index": _error(lambda: PipelineStage(nn.Linear(2, 2), (rank + 1) % ws, ws, "cpu")),
           "wrong_num_stages": _error(lambda: PipelineStage(nn.Linear(2, 2), rank, ws + 1, "cpu"))}
    if rank == ws - 1:
        res["missing_target"] = _error(lambda: gp.step())
    return res


class _Sleep(torch.autograd.Function):
    """Identity that takes ``t`` seconds in forward and in backward: a stage whose cost we know."""

    @staticmethod
    def forward(ctx, x, t):
        ctx.t = t
        time.sleep(t)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t)
        return g.clone(), None


class SleepStage(nn.Module):
    def __init__(self, t: float):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.t = t

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.t)


def bubbles(rank: int, ws: int, M: int, t: float):
    """Per schedule: this stage's events of one step (after a warm-up step), on stages of known cost ``t``."""
    res = {}
    for name, (cls, _) in SCHEDULES.items():
        st = PipelineStage(SleepStage(t), rank, ws, "cpu")
        sched = cls(st, M, loss_fn=lambda o, y: o.sum())
        x = torch.ones(M, 4)
        for _ in range(2):
            dist.barrier()
            if rank == 0:
                sched.step(x)
            elif rank == ws - 1:
                sched.step(target=x)
            else:
                sched.step()
        res[name] = {"events": list(st.events), "peak_in_flight": st.peak_in_flight}
    return res


def two_pipelines(rank: int, ws: int):
    """Two 2-stage pipelines side by side on 4 ranks (groups [0, 1] and [2, 3], the shape a DP x PP run takes):
    each group's stage index is the rank in its group; ours and torch's, on different data per pipeline."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group, s = groups[rank // 2], rank % 2
    full, make_stage, loss_fn, batches, _ = _case("mlp", 2)
    batches = [(x + rank // 2, y) for x, y in batches]
    res = {}
    for name, (ours_cls, torch_cls) in SCHEDULES.items():
        m_t, m_o = make_stage(copy.deepcopy(full), s), make_stage(copy.deepcopy(full), s)
        st_t = TorchStage(m_t, s, 2, torch.device("cpu"), group=group)
        st_o = PipelineStage(m_o, s, 2, torch.device("cpu"), group=group)
        res[(name, "torch")] = _run_pipeline(m_t, st_t, torch_cls(st_t, 4, loss_fn=loss_fn), batches, s, 2)
        res[(name, "ours")] = _run_pipeline(m_o, st_o, ours_cls(st_o, 4, loss_fn=loss_fn), batches, s, 2)
    return res


def suite(ws: int, models: list[str], n_micro: list[int], with_extras: bool):
    rank = dist.get_rank()
    res = {"parity": parity(rank, ws, models, n_micro)}
    if ws == 4:
        dist.barrier()
        res["two_pipelines"] = two_pipelines(rank, ws)
    if with_extras:
        dist.barrier()
        res["faults"] = faults(rank, ws, n_micro[0])
        res["errors"] = errors(rank, ws)
        dist.barrier()
        res["bubbles"] = bubbles(rank, ws, 4, 0.05)
    return res
