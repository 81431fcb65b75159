"""Local ranks: run one function on N real processes, each with a process group.

Why real processes?  Data parallelism is about *separate* workers that only
share what they send each other.  Threads in one Python process would share
memory (and the GIL) and hide exactly the costs the book is about.  So every
"rank" here is an operating-system process with its own copy of the model,
talking to the others over gloo (CPU) or NCCL (GPU).

    parent (your script / notebook / pytest)
      |  hosts the rendezvous store on a free port (port 0: the OS picks)
      |
      +-- start --> rank 0: init_process_group(store) -> fn(*args) -> result
      +-- start --> rank 1: init_process_group(store) -> fn(*args) -> result
      ...
      <-- one message per rank on a queue: ("ok", rank, value) or ("error", rank, traceback)

Note (a clean fork server, never a plain fork): a child forked after torch has
started its thread pool can hang forever, so ranks are never forked from the
caller.  They are forked from multiprocessing's *fork server*: one helper
process, started the first time ``spawn`` runs, that imports torch (and FSDP) and then does
nothing but fork (it never runs a torch op, so it has no thread pool to inherit).
Each rank then starts with torch already imported: about half a second instead
of the several seconds a fresh interpreter takes to import torch, which is most
of a short test's time.  Python 3.14 made this the default start method on Linux
for the same reason.  The rank still unpickles ``fn`` by name, as with "spawn",
so ``fn`` must be importable (defined in a module, not in ``__main__`` of a
notebook; see ``minifsdp.notebook`` for how notebooks run cell code on ranks),
and it gets the caller's current environment variables.  Where there is no
fork server (Windows) or with ``MINIFSDP_START_METHOD=spawn``, every rank is a
fresh interpreter.

Note (no rank hangs the others): when a rank raises, the parent ends every
other rank and raises :class:`RankFailedError` with that rank's traceback.  A
rank that dies without a word (a crash, SIGKILL) is reported with its exit
code or signal.  Each process group also gets a collective ``timeout`` so a
rank blocked in a receive eventually errors instead of waiting forever.

Under ``torchrun`` the same call works unchanged: :func:`spawn` sees the
``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` variables torchrun sets, joins the
group with ``env://`` instead of starting processes, runs ``fn`` once (this
process is one rank) and returns every rank's result, gathered through the
rendezvous store (see the note in :func:`_gather_through_store`).  The group
stays usable after ``spawn`` returns; it is torn down at exit (:func:`teardown`).
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import pickle
import queue
import signal
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "RankFailedError", "launched_by_torchrun", "default_backend", "init_process_group_for_this_attempt",
           "teardown", "on_teardown"]

DEFAULT_TIMEOUT_S = 120.0


class RankFailedError(RuntimeError):
    """A rank raised or died; carries which rank and its traceback text."""

    def __init__(self, rank: int, detail: str):
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed:\n{detail}")


def launched_by_torchrun() -> bool:
    """True when torchrun (or any env:// launcher) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def default_backend(device: str = "cpu") -> str:
    """gloo on CPU; NCCL when asked for CUDA and CUDA is there."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was asked for, but CUDA is not available here; use device='cpu' (gloo).")
        return "nccl"
    return "gloo"


def uses_nccl(backend: str) -> bool:
    """Whether ``backend`` puts NCCL in the group, so each rank must pick its GPU before joining.

    True for "nccl" and for a mixed "device:backend" string that names it
    ("cpu:gloo,cuda:nccl"); False for "gloo".  Case-insensitive, as torch's names.
    """
    parts = (part.rsplit(":", 1)[-1].strip() for part in str(backend).lower().split(","))
    return "nccl" in parts


def _check_world_size(world_size: int, backend: str) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}; pass e.g. world_size=2.")
    if uses_nccl(backend) and world_size > torch.cuda.device_count():
        raise ValueError(
            f"world_size={world_size} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
            "NCCL needs one GPU per rank: lower world_size or use backend='gloo'."
        )


PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "minifsdp"]  # no ops


def _start_method_context():
    """The multiprocessing context ranks start from: the fork server where there is one, else spawn."""
    method = os.environ.get("MINIFSDP_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods() or method == "fork":
        method = "spawn"  # never a plain fork (see the note at the top)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # imported once, by the server (imports only: no torch op, no threads)
    return ctx


def _rank_main(rank, world_size, backend, host, port, timeout_s, fn, args, results, threads, environ):
    """Body of every rank's process (importable, so `spawn` can pickle it)."""
    try:
        if os.environ != environ:  # a forked rank has the fork server's environment: take the caller's
            os.environ.clear()
            os.environ.update(environ)
        if threads:
            torch.set_num_threads(threads)
        os.environ.setdefault("MASTER_ADDR", host)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        if uses_nccl(backend):
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        value = fn(*args)
        # Plain pickle bytes, not the object: torch.multiprocessing would share a
        # tensor through a file descriptor that dies with this process, so a rank
        # that returns before the parent reads its result would lose it.
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put(("error", rank, traceback.format_exc()))
        return
    try:
        teardown()
    except Exception:  # noqa: BLE001 - nothing left to report
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without reporting a result"


def spawn(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    world_size: int = 2,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads_per_rank: int | None = 1,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks and return their results, rank order.

    Args:
        fn: an importable function (module level); it runs after the default
            process group exists, so it may call ``torch.distributed`` directly.
        args: positional arguments, pickled to every rank.
        world_size: number of ranks (>= 1).
        backend: "gloo" (default on CPU), "nccl" (one GPU per rank), or a mixed
            "cpu:gloo,cuda:nccl" (one GPU per rank too).
        timeout_s: collective timeout inside the ranks, and the parent's limit
            on the whole run; a stuck rank becomes an error, never a hang.
        threads_per_rank: torch intra-op threads per rank (1 keeps N ranks from
            fighting over the cores of a laptop); None leaves torch's default.

    Raises:
        RankFailedError: a rank raised (its traceback is in the message) or died.
    """
    backend = backend or "gloo"
    if launched_by_torchrun():
        return _run_under_torchrun(fn, args, backend, timeout_s)
    _check_world_size(world_size, backend)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if getattr(fn, "__qualname__", "").endswith("<lambda>") or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(
            f"fn={fn.__qualname__} cannot be sent to a spawned process: define it at module level "
            "(in a notebook, use the %%ranks cell magic from minifsdp.notebook instead)."
        )

    host = "127.0.0.1"
    # The parent hosts the rendezvous store on port 0: the OS picks a free port, no race.
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    ctx = _start_method_context()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, backend, host, store.port, timeout_s, fn, tuple(args), results, threads_per_rank,
                  dict(os.environ)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        del store


_SECONDARY_HINTS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def _collect(procs, results, world_size: int, timeout_s: float) -> list[Any]:
    """Wait for one message per rank; on the first failure, find its root cause and raise."""
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s + 30  # ranks time out first; this is the backstop
    while len(values) < world_size:
        try:
            status, rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and not p.is_alive()]
            if dead:
                _raise_root_cause(procs, results, values, errors)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailedError(missing[0], f"ranks {missing} gave no result within {timeout_s:.0f} s.") from None
            continue
        if status == "error":
            errors[rank] = payload
            _raise_root_cause(procs, results, values, errors)
        values[rank] = payload
    return [pickle.loads(values[r]) for r in range(world_size)]


def _raise_root_cause(procs, results, values, errors) -> None:
    """One rank failing makes its peers fail too ("connection closed by peer").

    Give the others a moment to report or die, then blame, in this order: a rank
    that died without a word (crash, SIGKILL), a rank whose own code raised, and
    only then a rank that merely lost its peer.
    """
    grace = time.monotonic() + 2.0
    while time.monotonic() < grace:
        try:
            status, rank, payload = results.get(timeout=0.1)
            (errors if status == "error" else values)[rank] = payload
        except queue.Empty:
            pass
    silent = {r: _describe_exit(p.exitcode) for r, p in enumerate(procs)
              if r not in values and r not in errors and not p.is_alive()}

    def also_failed(blamed: int) -> str:
        return "".join(
            f"\n(rank {o} also failed: {e.strip().splitlines()[-1]})" for o, e in sorted(errors.items()) if o != blamed
        )

    if silent:
        r = min(silent)
        raise RankFailedError(r, f"rank {r} {silent[r]}." + also_failed(r))
    primary = [r for r, e in sorted(errors.items()) if not any(h in e for h in _SECONDARY_HINTS)]
    r = primary[0] if primary else min(errors)
    raise RankFailedError(r, errors[r] + also_failed(r))


def _run_under_torchrun(fn, args, backend, timeout_s):
    """One rank of a torchrun job: join the group, run, gather every rank's result."""
    if not dist.is_initialized():
        if uses_nccl(backend):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        init_process_group_for_this_attempt(backend, timeout_s)
    value = fn(*args)
    return _gather_through_store(value, timeout_s)


_GATHER_CALLS = itertools.count()  # spawn is collective: every rank counts its calls alike


def _gather_through_store(value: Any, timeout_s: float) -> list[Any]:
    """Every rank's ``value``, in rank order, exchanged as pickled bytes through the group's store.

    Note (why not ``all_gather_object``): a gloo collective finishes in two
    steps.  Its worker thread marks the work done (``wait()`` returns here) and
    only afterwards drops its own reference to the work, whose tensors were made
    in Python.  Dropping the last reference to such a tensor takes the GIL.  If
    this was the job's last collective, the script could return and the
    interpreter start shutting down in between; the worker thread then dies
    while it asks for the GIL, inside a C++ destructor, and the rank aborts
    ("terminate called without an active exception", exit code -6): 4 runs in
    60 of notebook 01's train_ddp.py on a 2-core machine.  The store is read and
    written by this thread alone, so the gather leaves nothing behind in another
    thread.  (A collective that ``fn`` itself runs last is followed by this
    exchange, which waits for every rank: gloo's thread has long let go by then.)
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    # Keys private to this call and to this restart attempt (attempts may share torchrun's store).
    prefix = f"minifsdp/gather/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/call_{next(_GATHER_CALLS)}"
    store.set(f"{prefix}/rank_{rank}", pickle.dumps(value))
    keys = [f"{prefix}/rank_{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    values = [pickle.loads(store.get(k)) for k in keys]
    # The last rank to finish reading deletes the keys: a long job does not pile results up in the store.
    if store.add(f"{prefix}/read", 1) == world:
        for k in keys + [f"{prefix}/read"]:
            try:
                store.delete_key(k)
            except Exception:  # noqa: BLE001 - a store that cannot delete (FileStore) just keeps them
                break
    return values


def init_process_group_for_this_attempt(backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """``init_process_group`` from torchrun's variables, with keys private to this restart attempt.

    Note (torchrun --max-restarts): since torch 2.5 every attempt of a job shares
    torchrun's rendezvous store, and the process group finds its peers under the
    same key names each time.  After a restart, rank 0 may read the address of
    the *dead* attempt's rank 1 and fail with "Connection refused"
    (pytorch/pytorch#135712, #167288).  Prefixing every key with the attempt
    number (``TORCHELASTIC_RESTART_COUNT``) keeps the attempts apart.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_hosts_store and rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"minifsdp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    # Tear the group down while the interpreter is still whole (atexit runs before shutdown).
    _register_teardown_at_exit()


_TEARDOWN_REGISTERED = False


def _register_teardown_at_exit() -> None:
    global _TEARDOWN_REGISTERED
    if not _TEARDOWN_REGISTERED:
        atexit.register(teardown)
        _TEARDOWN_REGISTERED = True


_TEARDOWN_HOOKS: list[Callable[[], None]] = []


def on_teardown(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook()`` in :func:`teardown`, before the process group is destroyed (once per hook).

    The layers above the launcher register what must stop while the group still
    exists: ``minifsdp.comm.stream`` registers the closing of its comm threads.
    """
    if hook not in _TEARDOWN_HOOKS:
        _TEARDOWN_HOOKS.append(hook)
    return hook


def teardown() -> None:
    """Run the teardown hooks (they stop our comm-stream threads), then destroy the default process group.

    In this order: a ring collective still queued on a comm stream needs the
    group, so the streams finish their jobs and their threads exit first (they
    also let go of the group objects they keep).  Safe to call twice.  Under
    torchrun it runs at exit (atexit: the interpreter is still whole then); a
    spawned rank runs it after reporting its result.
    """
    for hook in reversed(_TEARDOWN_HOOKS):
        try:
            hook()
        except Exception:  # noqa: BLE001 - the group must still be destroyed
            traceback.print_exc()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_destroy_if_initialized = teardown  # the name this atexit hook had before
