"""What a learner's code may call: the files the grader takes from a learner, and each task's rules.

Why: the oracle is not an answer.  Task 2.2b rebuilds ``dist.all_gather_into_tensor`` from point-to-point
messages; calling it passes every check and teaches nothing.  Each rule below says what a task may not use
and why, and it is checked twice:

* statically, on the learner's file, before any test of the task runs (``tests/exercises/conftest.py``):
  the imports a file may make (:data:`IMPORTS`, plus a task's own), Python's escape hatches (``eval``,
  ``open``, ``getattr`` of a computed name, dunder attributes such as ``__globals__``, ``os.environ``, torch's
  ways to write files or build code: ``torch.save``, ``.tofile``, ``torch.utils.cpp_extension``), the
  names a task's rule forbids, and the library's own answer to the task (:data:`ANSWERED_BY`: a one-line
  import of ``minifsdp.comm.ring.ring_reduce_scatter`` is no answer to 2.2a).  A file that breaks one fails
  every test of its tasks with the line;
* at run time, in every process that runs the learner's code (the learner's process of
  ``course_remote.py``, the ranks of a graded spawn): :func:`install` wraps each forbidden callable before any
  learner module is imported, and a wrapper raises :class:`CourseRuleError`, naming the rule, while a task
  that forbids it is in force (:func:`enforce`).  A reference kept at import time is the wrapper too.

What the grader takes from a learner's copy: :data:`LEARNER_FILES`, the files that hold graded code, and
nothing else (the rest comes from the instructor's repository).  A task not started still has its stub's
``raise NotImplementedError("Task 2.2a: ...")``: :func:`stubs_left` finds it, and the task's tests report
"not done yet" without running (a task built on others, 2.2c, waits for theirs: :data:`BUILT_ON`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
from dataclasses import dataclass

__all__ = ["LEARNER_FILES", "RULES", "ANSWERED_BY", "BUILT_ON", "IMPORTS", "CourseRuleError", "Rule", "file_of",
           "rules_of", "check_source", "stubs_left", "file_verdict", "install", "enforce", "enforce_here"]

# the graded files of a learner's copy, and the tasks each holds
LEARNER_FILES = {
    "exercises/ddp_bucketing.py": ("1.1",),
    "exercises/launch_tasks.py": ("1.3",),
    "exercises/fsdp_tasks.py": ("2.1a", "2.1b", "2.1c"),
    "exercises/ring_collectives.py": ("2.2a", "2.2b", "2.2c"),
    "exercises/memory_tasks.py": ("2.3a", "2.3b", "2.4"),
    "exercises/overlap_tasks.py": ("2.5", "4.1a", "4.1b"),
    "exercises/config_tasks.py": ("2.5b", "3.1"),
    "exercises/practice_tasks.py": ("3.2a", "3.2b", "3.3"),
    "exercises/hf_tasks.py": ("4.2",),
    "exercises/checkpoint_tasks.py": ("4.3a", "4.3b"),
    "exercises/parallel_tasks.py": ("4.4a", "4.4b"),
    "exercises/fsdp2_tasks.py": ("5.1", "5.2"),
    "exercises/fsdp2_catch_fault.py": ("5.3",),
    "exercises/projects/zero1/zero1.py": ("project-zero1",),
    "exercises/projects/hybrid/hybrid.py": ("project-hybrid",),
    "exercises/projects/noshard_accum/accumulate.py": ("project-noshard-accum",),
    "exercises/projects/ac_budget/policy.py": ("project-ac-budget",),
}
BUILT_ON = {"2.2c": ("2.2a", "2.2b")}  # a task whose given code calls other tasks' functions

# modules any learner file may import (and their submodules)
IMPORTS = ("__future__", "math", "cmath", "itertools", "functools", "collections", "dataclasses", "typing", "operator",
           "heapq", "bisect", "statistics", "copy", "enum", "numbers", "contextlib", "time", "warnings", "abc",
           "fractions", "random", "torch", "minifsdp", "exercises")
_HATCHES = {"eval", "exec", "compile", "__import__", "globals", "locals", "vars", "open", "breakpoint", "setattr",
            "delattr", "__builtins__", "__file__", "__loader__", "__spec__", "attrgetter", "methodcaller"}
_DUNDERS_OK = {"__init__", "__name__", "__qualname__", "__class__", "__doc__", "__len__", "__call__", "__enter__",
               "__exit__", "__iter__", "__next__", "__getitem__", "__setitem__", "__contains__", "__repr__", "__str__",
               "__eq__", "__hash__", "__post_init__", "__all__", "__annotations__", "__future__"}
_ATTRS_NEVER = {"os", "sys", "environ", "getenv", "putenv", "unsetenv", "system", "popen", "subprocess", "modules",
                "builtins", "_getframe", "_current_frames", "settrace", "setprofile", "f_back", "f_globals", "f_locals",
                "f_code", "f_builtins", "gi_frame", "cr_frame", "tb_frame", "tb_next", "co_code", "attrgetter",
                "methodcaller", "tofile", "from_file", "save", "load", "numpy", "cpp_extension", "hub", "package",
                "compile", "_C", "_dynamo", "_inductor"}  # (files written or read, foreign code compiled or loaded)
# parts of torch a learner file may not import: they write files, fetch or compile code
_TORCH_NEVER = ("torch.utils.cpp_extension", "torch.hub", "torch.package", "torch._C", "torch._dynamo",
                "torch._inductor", "torch.compiler", "torch.serialization", "torch.utils.data.datapipes",
                "torch.distributed.checkpoint")

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "_all_gather_base",
                "_reduce_scatter_base", "all_gather_object", "broadcast_object_list", "gather_object",
                "scatter_object_list", "all_reduce_coalesced", "all_gather_coalesced", "barrier")


class CourseRuleError(RuntimeError):
    """A learner's code called what its task's rule forbids (the message names the rule)."""


@dataclass(frozen=True)
class Rule:
    """``tasks`` may not use ``names`` (identifiers, anywhere in the file), ``dist_calls`` (attributes of
    ``torch.distributed``) or ``modules`` (imports); ``guards``: ``"module:qualname"`` callables that raise at
    run time while one of ``tasks`` is in force.  ``extra_imports``: modules these tasks may import besides
    :data:`IMPORTS`.  ``library``: ``"module:function"``, the library's (or torch's) own answer to the task,
    which a learner file may not import or reach as an attribute, and which raises at run time as a guard does
    when it is minifsdp's (the learner's function of the same name, in their own file, is theirs).  ``why``:
    the rule in one sentence, the message a learner reads."""

    tasks: tuple[str, ...]
    why: str
    names: tuple[str, ...] = ()
    dist_calls: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    guards: tuple[str, ...] = ()
    extra_imports: tuple[str, ...] = ()
    strings: tuple[str, ...] = ()
    library: tuple[str, ...] = ()


RULES = (
    Rule(("2.2a", "2.2b", "2.2c"),
         "the ring moves data with point-to-point messages only (dist.isend, dist.irecv, dist.send, dist.recv): "
         "the collectives are what it rebuilds",
         names=("allreduce", "allgather", "allgather_into_tensor", "_allgather_base", "_reduce_scatter_base",
                "alltoall", "alltoall_base", "allreduce_coalesced", "reduce_scatter_tensor_coalesced",
                "all_gather_into_tensor", "reduce_scatter_tensor", "_functional_collectives", "get_collectives"),
         dist_calls=_COLLECTIVES, modules=("torch.distributed._functional_collectives",),
         guards=tuple(f"{m}:{c}" for m in ("torch.distributed", "torch.distributed.distributed_c10d")
                      for c in _COLLECTIVES if c != "barrier")),
    Rule(("1.3",), "each rank's slice is computed here, not asked of DistributedSampler (the oracle the task is "
                   "graded against)",
         names=("DistributedSampler",), modules=("torch.utils.data.distributed",),
         guards=("torch.utils.data.distributed:DistributedSampler.__init__",)),
    Rule(("project-zero1",), "ZeRO-1 is built here from collectives: torch's ZeroRedundancyOptimizer (the oracle) "
                             "and torch FSDP are not used",
         names=("ZeroRedundancyOptimizer", "FullyShardedDataParallel", "fully_shard"),
         modules=("torch.distributed.optim", "torch.distributed.fsdp", "torch.distributed._composable"),
         guards=("torch.distributed.optim:ZeroRedundancyOptimizer.__init__",
                 "torch.distributed.fsdp:FullyShardedDataParallel.__init__", "torch.distributed.fsdp:fully_shard")),
    Rule(("5.3",), "the test decides from what FSDP2 does, never from how the grader runs it (its environment, "
                   "its files, the planting code)",
         names=("environ", "getenv", "planted_faults", "sitecustomize", "plant_from_environment"),
         modules=("tests",), strings=("MINIFSDP_", "PLANT_FAULT"), extra_imports=("gc",)),
)

# the library's own answer to a task: the student edition cuts most of them from its library
# (minifsdp/classroom/course_cut.py), but a class is graded with this repository's library, where they are whole;
# the rest the library keeps, because its chapters run them.  Either way, a one-line import is not an answer.
ANSWERED_BY = {
    "1.1": ("minifsdp.ddp.buckets:assign_buckets", "minifsdp.ddp.buckets:fill_buckets"),
    "2.2a": ("minifsdp.comm.ring:ring_reduce_scatter",),
    "2.2b": ("minifsdp.comm.ring:ring_all_gather",),
    "2.2c": ("minifsdp.comm.ring:ring_all_reduce",),
    "2.3a": ("minifsdp.memory.zero_formulas:model_state_bytes",),
    "2.3b": ("minifsdp.memory.zero_formulas:fsdp_model_state_bytes",),
    "2.4": ("minifsdp.memory.zero_formulas:bytes_sent_per_step",),
    "3.2a": ("minifsdp.training.train:lr_factor",),
    "3.2b": ("minifsdp.training.monitor:find_instability",),
    "3.3": ("minifsdp.training.monitor:exposed_communication",),
    "4.2": ("minifsdp.fsdp.core.wrap:transformer_auto_wrap_policy",
            "torch.distributed.fsdp.wrap:transformer_auto_wrap_policy"),
    "4.3a": ("minifsdp.checkpoint.pieces:save_pieces",),
    "4.3b": ("minifsdp.checkpoint.pieces:load_shard",),
    "4.4b": ("minifsdp.parallel.pipeline_schedules:one_f_one_b_order",
             "minifsdp.parallel.pipeline_schedules:action_order"),
}
RULES += tuple(
    Rule((task,), f"the library's {', '.join(s.replace(':', '.') for s in specs)} is this task's answer: write "
                  "yours (the student edition runs yours there)", library=specs)
    for task, specs in ANSWERED_BY.items())


def file_of(task: str) -> str | None:
    """The learner file that holds ``task`` (``exercises/ring_collectives.py`` for ``2.2a``)."""
    return next((f for f, tasks in LEARNER_FILES.items() if task in tasks), None)


def rules_of(tasks) -> list[Rule]:
    return [r for r in RULES if set(r.tasks) & set(tasks)]


# ------------------------------------------------------------------------------------------- statically
def _answers(rule: Rule) -> set[str]:
    """The function names of ``rule.library`` (``ring_reduce_scatter``)."""
    return {spec.rpartition(":")[2] for spec in rule.library}


def _dotted(node) -> str:
    """``torch.distributed.all_reduce`` for an attribute chain of names, else ""."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else ""


def check_source(text: str, tasks, path: str = "") -> list[str]:
    """What in one learner file breaks the rules of ``tasks``: ``["path:line: why"]`` (empty: none)."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        return [f"{path}:{e.lineno}: the file does not parse: {e.msg}"]
    rules = rules_of(tasks)
    allowed = IMPORTS + tuple(m for r in rules for m in r.extra_imports)
    out = []

    def bad(node, why):
        out.append(f"{path}:{getattr(node, 'lineno', 0)}: {why}")

    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    dist_aliases = {"torch.distributed"}
    for node in ast.walk(tree):  # aliases of torch.distributed, wherever they are bound
        if isinstance(node, ast.Import):
            dist_aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            dist_aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if node.level == 0 else ["exercises"]
            for mod in mods:
                if not any(mod == m or mod.startswith(m + ".") for m in allowed) or mod.startswith(
                        ("exercises.solutions", "tests")) or any(mod == m or mod.startswith(m + ".")
                                                                 for m in _TORCH_NEVER):
                    bad(node, f"`import {mod}`: not a module a learner file imports (those are torch, minifsdp, "
                              "exercises and some of the standard library: course_rules.IMPORTS)")
                for r in rules:
                    if any(mod == m or mod.startswith(m + ".") for m in r.modules):
                        bad(node, f"`import {mod}`: rule of task {'/'.join(r.tasks)}: {r.why}")
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if a.name in _HATCHES or a.name in _ATTRS_NEVER or any(
                            full == m or full.startswith(m + ".") for m in _TORCH_NEVER):
                        bad(node, f"`{a.name}`: learner code does not reach around Python ({a.name} is not allowed)")
                    for r in rules:
                        if a.name in r.names or (node.module in dist_aliases and a.name in r.dist_calls) or (
                                node.level == 0 and a.name in _answers(r)):
                            bad(node, f"`{a.name}`: rule of task {'/'.join(r.tasks)}: {r.why}")
        elif isinstance(node, ast.Name):
            if node.id in _HATCHES or (node.id.startswith("__") and node.id not in _DUNDERS_OK):
                bad(node, f"`{node.id}`: learner code does not reach around Python ({node.id} is not allowed)")
            for r in rules:
                if node.id in r.names:
                    bad(node, f"`{node.id}`: rule of task {'/'.join(r.tasks)}: {r.why}")
        elif isinstance(node, ast.Attribute):
            if node.attr in _ATTRS_NEVER or (node.attr.startswith("__") and node.attr not in _DUNDERS_OK):
                bad(node, f"`.{node.attr}`: learner code does not reach around Python (.{node.attr} is not allowed)")
            owner = _dotted(node.value)
            for r in rules:
                if node.attr in r.names or (owner in dist_aliases and node.attr in r.dist_calls) or (
                        node.attr in _answers(r) and owner != "self"):
                    bad(node, f"`{owner + '.' if owner else '.'}{node.attr}`: rule of task {'/'.join(r.tasks)}: "
                              f"{r.why}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                bad(node, "`getattr` of a computed name: learner code names what it uses")
            else:
                name = str(node.args[1].value)
                if name in _ATTRS_NEVER or (name.startswith("__") and name not in _DUNDERS_OK) or any(
                        name in r.names or name in r.dist_calls or name in _answers(r) for r in rules):
                    bad(node, f"`getattr(..., {name!r})`: not allowed in a learner file")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for r in rules:
                if any(s in node.value for s in r.strings):
                    bad(node, f"{node.value[:40]!r}: rule of task {'/'.join(r.tasks)}: {r.why}")
    return sorted(set(out), key=lambda s: (int(s.split(":")[1]) if s.split(":")[1].isdigit() else 0, s))


_STUB = re.compile(r"""raise\s+NotImplementedError\(\s*["'](?:Task\s+([\w.]+)|(project-[\w-]+)):\s*([\w.]+)""")


def stubs_left(text: str, task: str) -> list[str]:
    """The functions of ``task`` whose stub still raises in ``text`` (a learner file), in file order."""
    return [m.group(3) for m in _STUB.finditer(text) if (m.group(1) or m.group(2)) == task]


def file_verdict(root, task: str, impl: str) -> str:
    """Why ``task`` fails before any test of it runs, read from its file in ``root`` ("" when nothing there
    decides it): a rule broken, a stub still in place (its own, or one of the tasks it is built on), no file."""
    for t in (task, *BUILT_ON.get(task, ())):
        rel = file_of(t)
        if rel is None:
            continue
        path = root / rel if impl == "student" else root / "exercises" / "solutions" / rel.removeprefix("exercises/")
        shown = path.relative_to(root).as_posix()
        if not path.is_file():
            return f"task {task}: {shown} is missing"
        text = path.read_text(errors="replace")
        broken = check_source(text, LEARNER_FILES[rel], shown)
        if broken:
            return f"rule broken: {broken[0]}" + (f" (and {len(broken) - 1} more)" if len(broken) > 1 else "")
        left = stubs_left(text, t)
        if left:
            return f"task {task} not done yet: {shown} {left[0]}" + (f" (task {t})" if t != task else "")
    return ""


# ------------------------------------------------------------------------------------------- at run time
_ACTIVE: list[frozenset] = [frozenset()]  # the tasks in force (a stack: enforce() nests)
_INSTALLED: dict[str, object] = {}


def _resolve(spec: str):
    import importlib

    module_name, _, qualname = spec.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _guarded(spec: str, original, rule: Rule):
    label = spec.split(":")[1].removesuffix(".__init__")

    @functools.wraps(original)
    def guard(*args, **kwargs):
        if _ACTIVE[-1] & set(rule.tasks):
            raise CourseRuleError(f"rule of task {'/'.join(sorted(_ACTIVE[-1] & set(rule.tasks)))}: {rule.why} "
                                  f"(called {label})")
        return original(*args, **kwargs)

    guard.__course_original__ = original
    return guard


def install() -> None:
    """Wrap every callable a rule guards (once per process; idle until :func:`enforce` names a task)."""
    for rule in RULES:
        for spec in rule.guards + tuple(s for s in rule.library if s.startswith("minifsdp.")):
            if spec in _INSTALLED:
                continue
            try:
                owner, name = _resolve(spec)
                original = getattr(owner, name)
            except (ImportError, AttributeError):
                continue  # not in this torch: nothing to guard
            _INSTALLED[spec] = original
            setattr(owner, name, _guarded(spec, original, rule))


@contextlib.contextmanager
def enforce(tasks):
    """The rules of ``tasks`` in force inside the block."""
    install()
    _ACTIVE.append(frozenset(tasks))
    try:
        yield
    finally:
        _ACTIVE.pop()


def enforce_here(tasks) -> None:
    """The rules of ``tasks`` in force from now on in this process (a rank that runs the learner's code)."""
    install()
    _ACTIVE.append(frozenset(tasks))
