"""Where a student's functions go inside our FSDP (``python -m minifsdp train --impl student``).

Our FSDP already has three points where one piece of it can be swapped for another,
and each exercise's function fits one of them; nothing in ``minifsdp/fsdp`` knows
about exercises:

    exercise                          plug point (already in the core)       what we swap in
    2.2a-c ring_reduce_scatter,       a unit's ``comm`` (sharding.Comm: the  StudentComm: the same three
           ring_all_gather,           three collectives FSDP calls)          methods, calling your functions
           ring_all_reduce
    2.1a   flatten_and_shard          the handle's local shard               each unit's ``flat_param`` is your
                                      (``flat_param``, before step 1)        shard of the original parameters
    2.1a   unflatten                  the unit's views of the full buffer    StudentViews: an extension that
                                      (``after_unshard``, an extension       points the names at your
                                      point: core/extension.py)              unflatten's views
    2.5    prefetch_target            the root's ``ExecutionOrder``          StudentOrder: asks your function
                                      (prefetch.py)                          which unit to gather next

Your function's answer is what FSDP uses.  Each call is also *watched*: the same
inputs go through minifsdp's own function, and the first call whose answer differs
is remembered (which function, step, call, what differed), so that a run whose
losses drift can say which function drifted first.  The watch needs its own
messages: our ring runs on a second process group over the same ranks, so a stray
message from a wrong ring can never be read by ours.

Note (sync collectives): your ring functions are synchronous, so StudentComm runs
them at once and returns a finished work object: FSDP still waits where it always
does; nothing overlaps (the numbers are the same either way).

Note (an error names its task): a stub's ``NotImplementedError``, or any exception
from your function, becomes a :class:`StudentError` naming the function, its task
and its text, raised on every rank (every rank calls the function at the same point).
"""

from __future__ import annotations

import importlib
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn

# the ring tuned for gloo: bitwise the textbook ring (minifsdp/comm/ring.py), which the student edition cuts
# out of its library (the student's own runs there), so the watch compares with this one
from minifsdp.comm import tuned as our_ring
from minifsdp.fsdp.core.extension import Extension
from minifsdp.fsdp.core.flat_param import unflatten as our_unflatten
from minifsdp.fsdp.core.fsdp import TrainingState
from minifsdp.fsdp.core.prefetch import ExecutionOrder
from minifsdp.fsdp.core.prefetch import prefetch_target as our_prefetch_target
from minifsdp.fsdp.core.units import clean_name, is_unit, units, units_with_params

__all__ = ["FUNCTIONS", "StudentError", "Plug", "StudentComm", "StudentViews", "StudentOrder", "plug_into"]

_FSDP = ("exercises/README_fsdp.md", "pytest tests/exercises/test_fsdp_exercises.py --impl=student -k 2.1a")
_RING = ("exercises/README_ring.md", "pytest tests/exercises/test_ring_exercises.py --impl=student -k ")
# function -> (task, exercise text, the command that grades that task alone)
FUNCTIONS = {
    "flatten_and_shard": ("2.1a", *_FSDP),
    "unflatten": ("2.1a", *_FSDP),
    "ring_reduce_scatter": ("2.2a", _RING[0], _RING[1] + "2.2a"),
    "ring_all_gather": ("2.2b", _RING[0], _RING[1] + "2.2b"),
    "ring_all_reduce": ("2.2c", _RING[0], _RING[1] + "2.2c"),
    "prefetch_target": ("2.5", "exercises/README_overlap.md",
                        "pytest tests/exercises/test_overlap_exercises.py --impl=student -k 2_5"),
}


class StudentError(RuntimeError):
    """A plugged function raised (a stub: the task is not done) or returned something FSDP cannot use."""


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The numbers as integers of the same width: equal bits compare equal, NaN and inf included
    (an fp16 step whose gradients overflow is the same in both runs, and NaN != NaN as floats)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def _differ(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if bitwise equal; else how many numbers differ and the first one."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    bad = (_bits(got) != _bits(want)).nonzero().reshape(-1)
    if not bad.numel():
        return None
    i = int(bad[0])
    return (f"{bad.numel()} of {want.numel()} numbers differ (first at index {i}: "
            f"got {got.reshape(-1)[i].item():.9g}, want {want.reshape(-1)[i].item():.9g})")


class Plug:
    """The student's functions (by name), how often FSDP called each, and the first wrong answer of each.

    ``modules``: function name -> the module it comes from (``exercises.ring_collectives``, ...).
    """

    def __init__(self, modules: dict[str, str]):
        self.modules = dict(modules)
        self.fns = {}
        for name, mod_name in self.modules.items():
            try:
                mod = importlib.import_module(mod_name)
            except ImportError as e:
                raise StudentError(f"cannot import {mod_name} (for {name}): {e}; run from the repository root, "
                                   "where exercises/ is") from e
            if not callable(getattr(mod, name, None)):
                raise StudentError(f"{mod_name} has no function {name} (Task {FUNCTIONS[name][0]})")
            self.fns[name] = getattr(mod, name)
        self.calls: Counter = Counter()
        self.wrong: dict[str, str] = {}  # function -> where and how its first wrong answer differed
        self.step = 0  # the training step running now (1-based; 0 before the first)

    def call(self, name: str, *args, **kwargs):
        """Run the student's ``name``; any exception becomes a StudentError that names the task."""
        self.calls[name] += 1
        task, text, grader = FUNCTIONS[name]
        where = f"{self.modules[name]}.{name}"
        try:
            return self.fns[name](*args, **kwargs)
        except NotImplementedError as e:
            raise StudentError(
                f"Task {task} is not done yet: {where} raised NotImplementedError({str(e)!r}).\n"
                f"Finish it (the text and hints: {text}), grade it alone with `{grader}`, then run it inside "
                "FSDP again; or plug in only the tasks you have finished: --student with those of 2.1a,2.2,2.5, "
                "comma-separated.") from e
        except StudentError:
            raise
        except Exception as e:
            raise StudentError(f"{where} (Task {task}) raised {type(e).__name__}: {e}\n"
                               f"(called by FSDP at step {self.step}; the text: {text})") from e

    def note(self, name: str, problem: str | None) -> None:
        """Remember the first wrong answer of ``name`` (``problem`` None: this one was right)."""
        if problem is not None and name not in self.wrong:
            self.wrong[name] = f"step {self.step}, call {self.calls[name]}: {problem}"


class _Done:
    """What a finished collective returns, so that FSDP can ``wait()`` on it as on any other."""

    def wait(self):
        return True


class StudentComm:
    """The three collectives FSDP calls (``minifsdp.comm.get_collectives``'s interface), each the student's ring.

    ``mirror``: a process group over the same ranks, on which our ring recomputes each
    answer for the watch.  Only groups of every rank are supported (not HYBRID_SHARD's).
    """

    kind = "student"

    def __init__(self, plug: Plug, mirror):
        self.plug, self.mirror = plug, mirror  # neither torch's nor our ring is used

    def _check_group(self, group) -> None:
        if dist.get_world_size(group) != dist.get_world_size():
            raise StudentError("--impl student plugs ring collectives only where FSDP's group is every rank "
                               "(FULL_SHARD, SHARD_GRAD_OP, NO_SHARD), not HYBRID_SHARD's subgroups")

    def _watched(self, name: str, what: str, ours, out, inp, group):
        """The student's ``name(out, inp)``, then ours on a copy of the input over the mirror group: each
        difference (in ``out``, or a changed input, ``what``) is noted against ``name``."""
        self._check_group(group)
        before = inp.clone()
        self.plug.call(name, out, inp, group=group)
        if _differ(inp, before) is not None:
            self.plug.note(name, f"it modified its input ({what})")
        want = torch.empty_like(out)
        ours(want, before, group=self.mirror)
        self.plug.note(name, _differ(out, want))
        return _Done()

    def all_gather(self, out, inp, group=None, async_op: bool = False):
        return self._watched("ring_all_gather", "this rank's shard", our_ring.ring_all_gather, out, inp, group)

    def reduce_scatter(self, out, inp, op="sum", group=None, async_op: bool = False):
        return self._watched("ring_reduce_scatter", "the gradient", our_ring.ring_reduce_scatter, out, inp, group)

    def all_reduce(self, t, op="sum", group=None, async_op: bool = False):
        self._check_group(group)
        want = t.clone()
        self.plug.call("ring_all_reduce", t, group=group)
        our_ring.ring_all_reduce(want, group=self.mirror)
        self.plug.note("ring_all_reduce", _differ(t, want))
        return _Done()


class StudentViews(Extension):
    """In each forward, once our views of the full flat buffer are set, the student's ``unflatten``'s replace them.

    Appended to a built unit's extensions (``core/extension.py``); only for ``use_orig_params=False``, the
    train job's (no alignment gaps, no frozen views).
    """

    def __init__(self, plug: Plug):
        self.student_plug = plug

    def after_unshard(self, unit) -> None:
        if unit.training_state is not TrainingState.FORWARD:
            return
        h, plug, slots = unit._handle, self.student_plug, unit._handle.layout.slots
        views = plug.call("unflatten", h.unsharded, [s.shape for s in slots])
        if not isinstance(views, (list, tuple)) or len(views) != len(slots) \
                or not all(isinstance(v, torch.Tensor) for v in views):
            raise StudentError(f"unflatten (Task 2.1a) must return a list of {len(slots)} tensors (one per shape), "
                               f"got {type(views).__name__}")
        bad = [f"{s.fqn} shape {tuple(v.shape)}, want {tuple(s.shape)}" for s, v in zip(slots, views)
               if v.shape != s.shape]
        if bad:
            raise StudentError(f"unflatten (Task 2.1a) in unit {h.name}: " + "; ".join(bad))
        ours = our_unflatten(h.unsharded.detach(), h.layout)
        for s, v, o in zip(slots, views, ours):
            problem = _differ(v.detach(), o)
            if problem is None and v.untyped_storage().data_ptr() != h.unsharded.untyped_storage().data_ptr():
                problem = f"{s.fqn} is a copy, not a view of the flat buffer (FSDP would hold it twice)"
            plug.note("unflatten", f"unit {h.name}, {s.fqn}: {problem}" if problem else None)
        for s, v in zip(slots, views):
            setattr(s.module, s.name, v)
        for sh in h.layout.shared:
            setattr(sh.module, sh.name, views[sh.primary])


def _unit_name(unit) -> str:
    if unit is None:
        return "None"
    h = getattr(unit, "_handle", None)
    return h.name if h is not None else type(unit).__name__


class StudentOrder(ExecutionOrder):
    """The root's execution order, but the unit to prefetch is the student's ``prefetch_target``'s answer."""

    def __init__(self, plug: Plug):
        super().__init__()
        self.plug = plug

    def _target(self, unit, mode: str):
        got = self.plug.call("prefetch_target", list(self.pre_forward), list(self.post_forward), unit, mode)
        if got is not None and not any(got is u for u in self.pre_forward + self.post_forward):
            raise StudentError(f"prefetch_target (Task 2.5) must return one of the recorded units or None, "
                               f"got {type(got).__name__} {got!r:.60}")
        want = our_prefetch_target(self.pre_forward, self.post_forward, unit, mode)
        if got is not want:
            self.plug.note("prefetch_target", f"{mode} from unit {_unit_name(unit)}: chose {_unit_name(got)}, "
                                              f"want {_unit_name(want)}")
        return got

    def next_in_forward(self, unit):
        target = None if self.first_iteration else self._target(unit, "forward")
        return None if target in self.started else target  # (its forward began already: the core's rule)

    def next_in_backward(self, unit):
        return self._target(unit, "backward")


def _install_shards(model: nn.Module, twin: nn.Module, plug: Plug) -> None:
    """Every unit's local shard := the student's ``flatten_and_shard`` of the twin's (original) parameters."""
    names = {id(u): clean_name(n) for n, u in model.named_modules() if is_unit(u)}
    originals = dict(twin.named_parameters(remove_duplicate=False))
    for u in units_with_params(model):
        h, prefix = u._handle, names[id(u)]
        tensors = [originals[f"{prefix}.{s.fqn}" if prefix else s.fqn].detach() for s in h.layout.slots]
        got = plug.call("flatten_and_shard", tensors, h.rank, h.layout.world_size)
        want = h.flat_param.detach()
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise StudentError(f"flatten_and_shard (Task 2.1a) for unit {prefix or 'root'} (N={h.layout.world_size}, "
                               f"rank {h.rank}) returned {getattr(got, 'shape', type(got).__name__)}; FSDP needs "
                               f"a 1-D shard of ceil({h.layout.numel} / N) = {want.numel()} numbers")
        problem = _differ(got, want)
        plug.note("flatten_and_shard", problem and f"unit {prefix or 'root'}: {problem}")
        with torch.no_grad():
            h.flat_param.copy_(got)


def plug_into(model: nn.Module, twin: nn.Module, plug: Plug, mirror=None) -> None:
    """Put ``plug``'s functions into the built, not yet run, FSDP ``model`` (see the table above).

    ``twin``: the same model unwrapped (same seed), whose parameters the student flattens;
    ``mirror``: the watch's process group (needed when ring functions are plugged).
    """
    fns = plug.fns
    if "flatten_and_shard" in fns:
        _install_shards(model, twin, plug)
    if "unflatten" in fns:
        for u in units_with_params(model):
            if getattr(u, "use_orig_params", False):
                raise StudentError("--impl student plugs unflatten only with use_orig_params=False")
            u._extensions.append(StudentViews(plug))
    if {"ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"} & set(fns):
        comm = StudentComm(plug, mirror)
        for u in units(model):
            u.comm = comm
            if u._handle is not None:
                u._handle.comm = comm
    if "prefetch_target" in fns:
        model._lazy_init()  # what the first forward would do (core/fsdp.py); then its order is ours to replace
        model._root_state.order = StudentOrder(plug)
