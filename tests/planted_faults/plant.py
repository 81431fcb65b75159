"""Plant one fault in the running process: a library function recompiled with one line changed.

A fault is an edit of one function's *source*, made in memory, never on disk::

    Fault(target="minifsdp.fsdp.core.strategy:ShardingPlan.divide_factors",
          old="pre = predivide_factor(self.data_parallel_size)",
          new="pre = float(self.data_parallel_size)")

:func:`prepare` reads the function's source, checks that ``old`` occurs in it exactly once (if the
library changed, the entry is out of date and says so), replaces it, and compiles the result with
the function's own module globals.  :func:`plant` then installs the new function wherever the old
one is reachable: the class or module that defines it, and every loaded ``minifsdp`` / ``tests`` /
``exercises`` module or class that imported it by name (``from ... import f`` copies the reference).
Modules imported afterwards import the planted one.

How the fault reaches every process of a test: ``sitecustomize.py`` in this folder runs at the start
of every Python interpreter that has the folder on ``PYTHONPATH`` and calls :func:`plant_from_environment`,
which plants the fault named by ``MINIFSDP_PLANT_FAULT``: the pytest process, the fork server the
ranks are forked from (so every rank), a rank started with ``spawn``, a ``torchrun`` child.  Each
process appends one line to the file named by ``MINIFSDP_PLANT_REPORT`` ("<pid> planted <name>", or
"<pid> error <message>"), so the test that asked for the fault can see that it was planted.
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import linecache
import os
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

__all__ = ["Fault", "PlantError", "prepare", "plant", "plant_from_environment", "FAULT_ENV", "REPORT_ENV"]

FAULT_ENV = "MINIFSDP_PLANT_FAULT"  # the name of the fault to plant in every process that starts
REPORT_ENV = "MINIFSDP_PLANT_REPORT"  # a file each process appends "<pid> planted <name>" (or an error) to
_SCANNED = ("minifsdp", "tests", "exercises")  # packages whose modules may hold a copied reference


@dataclass(frozen=True)
class Fault:
    """One realistic fault: where it goes, the line it changes, and the test that must catch it.

    ``target``: ``"module:qualname"`` of a function or method.  ``old``: text of that function that
    occurs in it exactly once; ``new``: what replaces it.  ``test``: the node id of the named test
    that must fail under the fault (and pass without it); ``why``: why that test is the one.
    ``pending``: not planted yet, and why (the entry is kept so that enabling it is one edit).
    """

    name: str
    plants: str
    target: str
    old: str
    new: str
    test: str
    why: str
    pending: str = ""


class PlantError(RuntimeError):
    """A fault that cannot be planted as written: the library changed under the entry."""


def _function_of(raw: Any):
    """The plain function behind a class attribute (staticmethod, classmethod, property) or a function."""
    if isinstance(raw, (staticmethod, classmethod)):
        raw = raw.__func__
    elif isinstance(raw, property):
        raw = raw.fget
    if not inspect.isfunction(raw):
        raise PlantError(f"{raw!r} is not a function written in Python: nothing to edit")
    return inspect.unwrap(raw)


def _resolve(target: str):
    """``"pkg.mod:Cls.meth"`` -> (module, owner (the module or the class), attribute name, raw attribute)."""
    module_name, _, qualname = target.partition(":")
    module = importlib.import_module(module_name)
    *path, attr = qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    try:
        raw = inspect.getattr_static(owner, attr)
    except AttributeError:
        raise PlantError(f"{target}: {qualname} does not exist any more; update the fault's entry") from None
    return module, owner, attr, raw


def prepare(fault: Fault):
    """Compile ``fault``'s edited function without installing it: (owner, attribute, old raw, new raw)."""
    module, owner, attr, raw = _resolve(fault.target)
    func = _function_of(raw)
    source = textwrap.dedent(inspect.getsource(func))
    found = source.count(fault.old)
    if found != 1:
        raise PlantError(f"fault {fault.name}: {fault.old!r} occurs {found} times in {fault.target} "
                         f"({inspect.getsourcefile(func)}), not once: update the fault's entry")
    source = source.replace(fault.old, fault.new)
    name = func.__name__
    # A method is compiled inside a function whose argument is named __class__, so that a zero-argument
    # super() in it finds its class as it would in the class body.
    cls = owner if inspect.isclass(owner) else None
    text = ("def __planted__(__class__):\n" + textwrap.indent(source, "    ") + f"    return {name}\n"
            if cls is not None else source)
    filename = f"<planted fault {fault.name}: {fault.target}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)  # tracebacks show the edit
    code = compile(text, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    local: dict[str, Any] = {}
    exec(code, module.__dict__, local)  # the function's globals are its module's, as the original's
    new = local["__planted__"](cls) if cls is not None else local[name]
    return owner, attr, raw, new


def _rebind(raw: Any, new: Any) -> None:
    """Replace every reference to ``raw`` held by a loaded module of ours or by a class defined in one."""
    wrapped = {staticmethod: staticmethod, classmethod: classmethod}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(_SCANNED):
            continue
        for key, value in list(vars(mod).items()):
            if value is raw:
                setattr(mod, key, new)
            elif inspect.isclass(value) and value.__module__ == mod_name:
                for ckey, cvalue in list(vars(value).items()):
                    if cvalue is raw:
                        setattr(value, ckey, new)
                    elif type(cvalue) in wrapped and cvalue.__func__ is raw:  # e.g. staticmethod(summon)
                        setattr(value, ckey, wrapped[type(cvalue)](new))


def plant(fault: Fault) -> None:
    """Install ``fault`` in this process (see the module docstring)."""
    if fault.pending:
        raise PlantError(f"fault {fault.name} is pending: {fault.pending}")
    owner, attr, raw, new = prepare(fault)
    setattr(owner, attr, new)
    if not inspect.isclass(owner):
        _rebind(raw, new)


def plant_from_environment() -> None:
    """Plant the fault ``MINIFSDP_PLANT_FAULT`` names (nothing without it); report to ``MINIFSDP_PLANT_REPORT``."""
    name = os.environ.get(FAULT_ENV)
    if not name:
        return
    try:
        from tests.planted_faults.task_faults import TASK_5_3_FAULT

        if name == TASK_5_3_FAULT.name:  # the student edition has no catalog.py, and plants this one
            plant(TASK_5_3_FAULT)
        else:
            from tests.planted_faults.catalog import by_name

            plant(by_name(name))
        line = f"{os.getpid()} planted {name}"
    except Exception as e:  # noqa: BLE001 - reported to the test that asked for the fault
        line = f"{os.getpid()} error {type(e).__name__}: {e}".replace("\n", " ")
    report = os.environ.get(REPORT_ENV)
    if report:
        with open(report, "a") as f:
            f.write(line + "\n")
