"""Run a notebook cell on N real ranks: the ``%%ranks`` cell magic.

A learner should *see* the code every rank runs, in the notebook itself, and
it should run the way it would on a cluster: as separate processes, each with
its own memory, talking only through ``torch.distributed``.  So::

    %load_ext minifsdp.notebook

    %%ranks -n 2
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)               # every rank now holds 1 + 2 = 3
    print("sum", t.item())
    result = t.item()

prints each rank's output grouped, in rank order (deterministic, so nbval can
check it), and stores ``[3.0, 3.0]`` (each rank's ``result``) in the notebook
variable ``results``::

    [rank 0] sum 3.0
    [rank 1] sum 3.0

How a cell travels::

    notebook kernel                         spawned rank r (a fresh Python)
    ---------------                         -------------------------------
    cell text + pickled --push vars  ---->  minifsdp.spawn runs _run_cell:
                                              namespace = {rank, world_size, dist,
                                                           torch, pushed vars}
                                              exec(cell text, namespace)
                                              stdout/stderr -> a buffer
    print "[rank r] ..." in rank order <----  (buffer text, namespace["result"])
    results = [result of rank 0, ...]

Why these choices:

* Why not threads?  Threads share one address space and one GIL: "ranks" would
  share tensors by accident and never really run in parallel, which hides the
  very costs (copies, messages, waiting) that data parallelism is about.
* Why not fork?  The kernel has already started torch's thread pools; a child
  forked from a multi-threaded process can inherit a lock that nobody will
  ever release and hang forever.  ``minifsdp.spawn`` always starts fresh
  interpreters ("spawn").
* Why exec the source text?  ``spawn`` sends the function to run by
  *reference* (module name + function name) and the child imports it.  A
  function defined in a notebook lives in ``__main__`` of the kernel, which the
  child cannot import.  Text, however, pickles fine: the child receives the
  cell's source and runs it.  The same reason means a child cannot see the
  notebook's variables: pass the few it needs with ``--push a,b`` (they are
  pickled), and prefer importing code from ``minifsdp`` inside the cell.

Note (plain Python only): the cell runs with ``exec``, not through IPython, so
``%magics`` and ``!shell`` lines do not work inside a ``%%ranks`` cell.

Note (errors never hang): if any rank raises, ``spawn`` ends the other ranks;
the magic prints that rank's output and the traceback *inside the cell* (with
the cell's own line numbers) and raises :class:`RankCellError` naming the rank.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import pickle
import shlex
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist

from minifsdp.launch import RankFailedError, spawn

__all__ = ["RankRun", "RankCellError", "run_on_ranks", "format_outputs", "load_ipython_extension"]

CELL_FILENAME = "<%%ranks cell>"
_REPORT_START = "<<<minifsdp-rank-report>>>"
_REPORT_END = "<<<end-minifsdp-rank-report>>>"


@dataclass
class RankRun:
    """What one rank did: its rank, everything it printed, and its ``result``."""

    rank: int
    output: str
    result: Any


class RankCellError(RankFailedError):
    """A rank raised while running the cell.  ``report`` holds its output and traceback."""

    def __init__(self, rank: int, report: str):
        self.rank, self.detail, self.report = rank, report, report
        RuntimeError.__init__(self, f"rank {rank} raised in the %%ranks cell:\n{report}")


class _CellFailed(Exception):
    """Raised inside a rank; its message carries the report between markers."""


def _run_cell(source: str, pushed_blob: bytes) -> bytes:
    """Body of every rank (module level, so ``spawn`` can pickle it by reference).

    Runs ``source`` in a fresh namespace and returns ``pickle.dumps((captured output, result))``.

    Note (why bytes): a tensor put on a torch.multiprocessing queue travels as a
    shared-memory file descriptor that the *sending* process must still serve
    when the parent unpickles it; a rank that has already exited cannot
    ("Connection reset by peer").  Plain pickle bytes carry the values themselves.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    namespace: dict[str, Any] = {
        "__name__": "__ranks_cell__",
        "rank": rank,
        "world_size": world_size,
        "dist": dist,
        "torch": torch,
    }
    namespace.update(pickle.loads(pushed_blob))
    # Register the text so tracebacks show the cell's own lines.
    linecache.cache[CELL_FILENAME] = (len(source), None, source.splitlines(True), CELL_FILENAME)
    buffer = io.StringIO()
    try:
        code = compile(source, CELL_FILENAME, "exec")
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            exec(code, namespace)
    except BaseException as exc:  # noqa: BLE001 - report anything, then let spawn stop the others
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code is _run_cell.__code__:
            tb = tb.tb_next  # drop this function's frame: start the traceback at the cell
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        report = buffer.getvalue() + text
        summary = text.strip().splitlines()[-1]  # e.g. "ValueError: boom": what launch.py quotes for other ranks
        raise _CellFailed(f"{_REPORT_START}\n{report}{_REPORT_END}\n{summary}") from None
    result = namespace.get("result")
    try:
        return pickle.dumps((buffer.getvalue(), result))
    except Exception as exc:
        raise TypeError(
            f"rank {rank}: the cell's `result` ({type(result).__name__}) cannot be sent back to the notebook "
            f"({exc}); set `result` to tensors, numbers, strings, lists or dicts of those."
        ) from None


def _pickle_pushed(pushed: dict[str, Any] | None) -> bytes:
    pushed = dict(pushed or {})
    for name, value in pushed.items():
        if not name.isidentifier():
            raise ValueError(f"--push name {name!r} is not a Python identifier")
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"cannot push {name!r} ({type(value).__name__}) to the ranks: {exc}. Functions and classes "
                "defined in the notebook cannot travel to a spawned process; define them inside the %%ranks "
                "cell or import them from a module."
            ) from None
    return pickle.dumps(pushed)


def _extract_report(detail: str) -> str:
    """The failing rank's output + cell traceback, then any "(rank k also failed: ...)" lines."""
    start = detail.find(_REPORT_START)
    end = detail.find(_REPORT_END, start)
    if start == -1 or end == -1:
        return detail  # the rank died outside the cell (a crash, a timeout): show everything
    report = detail[start + len(_REPORT_START) : end].strip("\n") + "\n"
    others = [line for line in detail[end:].splitlines() if line.startswith("(rank ")]
    return report + "".join(line + "\n" for line in others)


def run_on_ranks(
    source: str,
    world_size: int = 2,
    push: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    threads_per_rank: int | None = 1,
) -> list[RankRun]:
    """Run Python ``source`` on ``world_size`` real ranks; return one :class:`RankRun` per rank.

    Inside ``source`` the names ``rank``, ``world_size``, ``dist``, ``torch`` and
    every key of ``push`` are defined; a variable named ``result`` is sent back.

    Raises:
        RankCellError: a rank raised; ``.rank`` names it and ``.report`` holds
            what it printed plus the traceback inside the cell.
        RankFailedError: a rank died or timed out outside the cell.
    """
    if not isinstance(source, str):
        raise TypeError(f"source must be the cell's text (str), got {type(source).__name__}")
    blob = _pickle_pushed(push)
    try:
        runs = spawn(
            _run_cell, (source, blob), world_size=world_size, timeout_s=timeout_s, threads_per_rank=threads_per_rank
        )
    except RankFailedError as err:
        if isinstance(err, RankCellError):
            raise
        if _REPORT_START in err.detail:
            raise RankCellError(err.rank, _extract_report(err.detail)) from None
        raise
    return [RankRun(r, *pickle.loads(blob)) for r, blob in enumerate(runs)]


def format_outputs(runs: Iterable[RankRun]) -> str:
    """Every rank's output, grouped and in rank order, each line prefixed ``[rank r]``."""
    lines = []
    for run in sorted(runs, key=lambda r: r.rank):
        lines += [f"[rank {run.rank}] {line}" for line in run.output.splitlines()]
    return "\n".join(lines) + ("\n" if lines else "")


def _usage_error(message: str) -> Exception:
    """IPython's UsageError (shown as one short line) when IPython is there, else ValueError."""
    try:
        from IPython.core.error import UsageError
    except ImportError:
        return ValueError(message)
    return UsageError(message)


def _parse_magic_line(line: str) -> dict[str, Any]:
    import argparse

    parser = argparse.ArgumentParser(prog="%%ranks", add_help=False, exit_on_error=False)
    parser.add_argument("-n", "--nproc", type=int, default=2, help="number of ranks (world size)")
    parser.add_argument("-o", "--out", default="results", help="notebook variable for the list of results")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a stuck rank is an error")
    parser.add_argument("--push", default="", help="comma-separated notebook variables to send to every rank")
    try:
        args = parser.parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit):
        raise _usage_error(
            f"%%ranks: cannot parse options {line!r}. Usage: %%ranks [-n 2] [-o results] "
            "[--timeout 120] [--push name1,name2]"
        ) from None
    if not args.out.isidentifier():
        raise _usage_error(f"%%ranks -o {args.out!r}: the output name must be a Python identifier")
    args.push = [name.strip() for name in args.push.split(",") if name.strip()]
    return vars(args)


def ranks_magic(line: str, cell: str, user_ns: dict[str, Any]) -> list[Any]:
    """What ``%%ranks`` does, given the notebook namespace (testable without IPython)."""
    __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in tracebacks
    opts = _parse_magic_line(line)
    missing = [name for name in opts["push"] if name not in user_ns]
    if missing:
        raise _usage_error(f"%%ranks --push: no notebook variable named {', '.join(map(repr, missing))}")
    pushed = {name: user_ns[name] for name in opts["push"]}
    # A failing rank raises RankCellError here; its message holds the rank's output and cell traceback.
    runs = run_on_ranks(cell, world_size=opts["nproc"], push=pushed, timeout_s=opts["timeout"])
    sys.stdout.write(format_outputs(runs))
    results = [run.result for run in runs]
    user_ns[opts["out"]] = results
    return results


def load_ipython_extension(ipython) -> None:
    """``%load_ext minifsdp.notebook`` registers the ``%%ranks`` cell magic."""

    def ranks(line, cell):
        __tracebackhide__ = True  # noqa: F841
        ranks_magic(line, cell, ipython.user_ns)  # returns None to the cell: no Out[] echo

    ranks.__doc__ = __doc__
    ipython.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
