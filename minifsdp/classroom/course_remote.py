"""The learner's code in processes of its own: the grader calls it, reads back plain data, and decides.

Why: a test that imports the learner's module runs the learner's code in the very process that records
whether the test passed, and code that runs there can rewrite the record (a few lines in
``exercises/__init__.py`` once earned every point of the course).  So the process that grades never
imports a learner's module.  The learner's functions run elsewhere and hand back what they returned:

    grader (pytest)                                 the learner's process (one, started on first use)
      f = learner_module("launch_tasks", impl, task)  |
      f.rank_indices(10, 0, 4)  -- pickled call --> imports exercises.launch_tasks, runs rank_indices
                                <-- torch.save bytes -- the value, or the exception (type, message, line)
      compares with torch's own answer

* What comes back is read with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, tuples,
  dicts, sets, dtypes.  Nothing the learner returns can run code in the grader; anything else is refused
  with the type named ("return plain data").
* Tensors are faithful: an argument the function changed in place is changed in the grader too, and a
  returned tensor that is a view of an argument comes back as a view of the grader's argument (same
  storage, offset and strides, gradients flowing into it), so "is it a view, is it a copy" checks still work.
* An exception is raised again in the grader with the learner's file and line appended; a builtin type
  stays its type (``pytest.raises(ValueError)`` works), another becomes :class:`LearnerError`.  A call
  that does not return within its time is stopped (the process is killed, a fresh one serves the next call).
* The process is forked from minifsdp's fork server (``minifsdp.launch``), as ranks are: torch is already
  imported, so it starts in a fraction of a second.  While it runs a task's call, that task's rules are in
  force (``course_rules.enforce``).

Ranks that run the learner's code (``minifsdp.spawn``) hand back data the same way: the rank function
returns :func:`to_bytes` of its outputs and the grader reads them with :func:`from_bytes`; :func:`capture`
runs one learner call there and records its exception with the learner's own line.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import re
import traceback
from typing import Any

import torch

__all__ = ["LearnerError", "LearnerProcess", "learner_module", "capture", "describe", "raise_again",
           "where_in_learner", "failure_in_text", "to_bytes", "from_bytes", "CALL_TIMEOUT_S"]

CALL_TIMEOUT_S = 120.0
_BUILTIN_ERRORS = {e.__name__: e for e in (ValueError, TypeError, KeyError, IndexError, NotImplementedError,
                                           AssertionError, RuntimeError, ZeroDivisionError, AttributeError,
                                           LookupError, ArithmeticError, OverflowError, NameError, ImportError,
                                           ModuleNotFoundError, RecursionError, TimeoutError)}


class LearnerError(Exception):
    """An exception of a type the grader does not import, raised by the learner's code (type and message kept)."""


# ---------------------------------------------------------------------------------------------- data both ways
def to_bytes(obj: Any) -> bytes:
    """``obj`` as ``torch.save`` writes it (tensors keep their shared storages)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    """Read :func:`to_bytes`'s output with torch's weights-only unpickler: data only, never code."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever it was, the grader will not read it
        first = str(e).strip().splitlines()
        why = next((ln.strip() for ln in first if "Unsupported global" in ln), first[-1] if first else repr(e))
        raise LearnerError(f"the learner's code returned something the grader does not read back ({why}): "
                           "return tensors, numbers, strings, lists, tuples or dicts") from None


def where_in_learner(tb) -> str:
    """``exercises/ring_collectives.py:41 in ring_reduce_scatter: req.wait()``: the last frame of a traceback in
    the learner's files (under ``exercises/``, not the grader's ``tests/``), or "" if none is."""
    found = ""
    for frame in traceback.extract_tb(tb):
        path = frame.filename.replace("\\", "/")
        if "/exercises/" in path and "/tests/" not in path:
            rel = path[path.rindex("/exercises/") + 1:]
            found = f"{rel}:{frame.lineno} in {frame.name}" + (f": {frame.line.strip()}" if frame.line else "")
    return found


_FRAME = re.compile(r'File "([^"]*?/exercises/[^"]+)", line (\d+), in (\S+)\n(?:\s+(\S.*))?')


def failure_in_text(text: str) -> str:
    """A rank's traceback (text, e.g. from ``RankFailedError``) in one line: the learner's last frame, then the
    exception's line (gloo's "Timed out waiting 15000ms for recv operation to complete" for a deadlock)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", ln)),
                lines[-1] if lines else "no traceback")
    kind, _, message = last.partition(": ")
    frames = [m for m in _FRAME.finditer(text) if "/tests/" not in m.group(1)]
    if not frames:
        return describe({"type": kind, "message": message[:400], "where": ""})
    path, line, name, code = frames[-1].groups()
    where = f"{path[path.rindex('/exercises/') + 1:]}:{line} in {name}" + (f": {code.strip()}" if code else "")
    return describe({"type": kind, "message": message[:400], "where": where})


def capture(fn, *args, **kwargs) -> dict:
    """Run one learner call: ``{"value": v}``, or ``{"raised": {"type", "message", "where"}}``."""
    try:
        return {"value": fn(*args, **kwargs)}
    except BaseException as e:  # noqa: BLE001 - the learner's exception is data for the grader
        if isinstance(e, KeyboardInterrupt):
            raise
        return {"raised": {"type": type(e).__name__, "message": str(e)[:4000],
                           "where": where_in_learner(e.__traceback__)}}


_SOURCE_TAG = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # gloo's "[/path/unbound_buffer.cc:78] "


def describe(raised: dict) -> str:
    """One line, the learner's place first: ``exercises/ring_collectives.py:41 in ring_all_gather: req.wait():
    RuntimeError: Timed out waiting 15000ms for recv operation to complete``."""
    message = _SOURCE_TAG.sub("", " ".join(str(raised.get("message", "")).split()))
    where = raised.get("where") or ""
    return (f"{where}: " if where else "") + f"{raised.get('type', 'Exception')}: {message}"


def raise_again(raised: dict):
    """Raise the learner's exception in the grader: a builtin type as itself, else :class:`LearnerError`."""
    kind = _BUILTIN_ERRORS.get(raised.get("type"))
    where = raised.get("where") or ""
    message = str(raised.get("message", "")) + (f" [at {where}]" if where else "")
    if kind is NotImplementedError:
        raise NotImplementedError(str(raised.get("message", "")))  # its message is the stub's one line
    if kind is not None:
        raise kind(message)
    raise LearnerError(f"{raised.get('type')}: {message}")


# ---------------------------------------------------------------------------------------------- faithful tensors
def _tensors_in(obj, out: list) -> list:
    """Every tensor in ``obj`` (lists, tuples, dicts, nested), depth first, each object once."""
    if isinstance(obj, torch.Tensor):
        if not any(t is obj for t in out):
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors_in(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors_in(x, out)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return a.numel() == 0 or torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def _faithful(value, mine: list[torch.Tensor], theirs: list[torch.Tensor]):
    """``value`` with every tensor that shares an argument's storage remade as a view of the grader's argument."""
    by_storage = {}
    for m, t in zip(mine, theirs, strict=True):
        by_storage.setdefault(t.untyped_storage().data_ptr(), (m, t))

    def remake(x):
        if isinstance(x, torch.Tensor):
            hit = by_storage.get(x.untyped_storage().data_ptr()) if x.untyped_storage().nbytes() else None
            if hit is not None and hit[0].dtype == x.dtype and hit[0].device == x.device:
                return hit[0].as_strided(x.shape, x.stride(), x.storage_offset())
            return x
        if isinstance(x, list):
            return [remake(v) for v in x]
        if isinstance(x, tuple):
            return tuple(remake(v) for v in x)
        if isinstance(x, dict):
            return {k: remake(v) for k, v in x.items()}
        return x

    return remake(value)


# ---------------------------------------------------------------------------------------------- the process
def _run_many(target: str, calls: list) -> list[dict]:
    """``target`` called once per ``(args, kwargs)`` of ``calls``: each call's :func:`capture` (values only)."""
    return [capture(_run_target, target, args, kwargs) for args, kwargs in calls]


def _run_target(target: str, args: tuple, kwargs: dict):
    """Import ``module`` of ``"module:qualname"`` (the learner's, or a grader's probe) and call the function."""
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj(*args, **kwargs)


def _serve(conn, environ: dict) -> None:
    """The learner's process: answer calls until the grader closes the pipe."""
    from minifsdp.classroom import course_rules

    if os.environ != environ:  # forked from the fork server: take the grader's environment
        os.environ.clear()
        os.environ.update(environ)
    course_rules.install()  # the rules' guards, before any learner module is imported
    while True:
        try:
            request = pickle.loads(conn.recv_bytes())  # from the grader: trusted
        except (EOFError, OSError):
            return
        target, tasks, args, kwargs = request
        with course_rules.enforce(tasks):
            if target.startswith("many:"):  # one round trip for many calls of one function (values only)
                result = {"value": _run_many(target[5:], args[0])}
            else:
                result = capture(_run_target, target, args, kwargs)
        if "value" in result:
            result["args"] = _tensors_in((args, kwargs), [])
        try:
            data = to_bytes(result)
            from_bytes(data)  # what the grader will read: refuse here, with the type named, what it would not
        except Exception as e:  # noqa: BLE001
            data = to_bytes({"raised": {"type": "LearnerError", "where": "", "message": str(e).splitlines()[0]
                                        if str(e) else f"{target} returned {type(result.get('value')).__name__}"}})
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, OSError):
            return


class LearnerProcess:
    """One process that imports the learner's modules and runs their functions for the grader (see the top)."""

    def __init__(self, timeout_s: float = CALL_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._proc = self._conn = None

    def _start(self) -> None:
        from minifsdp.launch import _start_method_context

        ctx = _start_method_context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, dict(os.environ)), daemon=True,
                                 name="minifsdp-learner")
        self._proc.start()
        child.close()

    def close(self) -> None:
        if self._proc is not None:
            self._conn.close()
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._proc = self._conn = None

    def _fail(self, why: str):
        self.close()
        raise TimeoutError(why) if "did not return" in why else RuntimeError(why)

    def call(self, target: str, tasks: tuple[str, ...], args: tuple = (), kwargs: dict | None = None,
             timeout_s: float | None = None):
        """``target(*args, **kwargs)`` in the learner's process under ``tasks``' rules: its value, or its
        exception raised again here (:func:`raise_again`)."""
        kwargs = kwargs or {}
        if self._proc is None or not self._proc.is_alive():
            self._start()
        mine = _tensors_in((args, kwargs), [])
        self._conn.send_bytes(pickle.dumps((target, tuple(tasks), args, kwargs)))
        limit = self.timeout_s if timeout_s is None else timeout_s
        if not self._conn.poll(limit):
            self._fail(f"{target} did not return within {limit:.0f} s (an endless loop, or a wait for a message "
                       "no one sends?)")
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            self._proc.join(timeout=5)
            self._fail(f"the learner's process died while running {target} (exit code {self._proc.exitcode})")
        result = from_bytes(data)
        if not isinstance(result, dict) or ("value" not in result and "raised" not in result):
            raise LearnerError(f"{target}: the learner's process answered something that is not a result")
        if "raised" in result:
            raise_again(result["raised"])
        theirs = result.get("args", [])
        if len(theirs) != len(mine):
            raise LearnerError(f"{target}: the learner's process sent back {len(theirs)} arguments, not {len(mine)}")
        for m, t in zip(mine, theirs, strict=True):
            if isinstance(t, torch.Tensor) and not _same_bits(m, t) and m.shape == t.shape and m.dtype == t.dtype:
                with torch.no_grad():
                    m.copy_(t)  # changed in place there: changed here too
        return _faithful(result["value"], mine, [t for t in theirs if isinstance(t, torch.Tensor)])


class _LearnerFunction:
    def __init__(self, process: LearnerProcess, target: str, tasks: tuple[str, ...]):
        self._process, self.target, self._tasks = process, target, tasks
        self.__name__ = target.rpartition(":")[2]

    def __call__(self, *args, **kwargs):
        return self._process.call(self.target, self._tasks, args, kwargs)

    def many(self, calls: list[tuple[tuple, dict]]) -> list:
        """One round trip for many calls: each call's value, or its exception (an object, not raised).  Values
        only: an argument changed in place is not changed here (use a plain call where that matters)."""
        out = []
        for result in self._process.call(f"many:{self.target}", self._tasks, (list(calls),)):
            if "raised" in result:
                try:
                    raise_again(result["raised"])
                except Exception as e:  # noqa: BLE001 - handed back as an object
                    out.append(e)
            else:
                out.append(result["value"])
        return out

    def __repr__(self) -> str:
        return f"<the learner's {self.target}, run in its own process>"


class _LearnerModule:
    def __init__(self, process: LearnerProcess, module: str, tasks: tuple[str, ...]):
        self._process, self.__name__, self._tasks = process, module, tasks

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _LearnerFunction(self._process, f"{self.__name__}:{name}", self._tasks)


def learner_module(process: LearnerProcess, module: str, tasks) -> _LearnerModule:
    """A stand-in for the learner's module ``module`` (dotted): each function called on it runs in ``process``
    under the rules of ``tasks`` (a task id or several)."""
    tasks = (tasks,) if isinstance(tasks, str) else tuple(tasks)
    return _LearnerModule(process, module, tasks)

