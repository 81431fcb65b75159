"""Where two records of one program (ours, torch's) differ: bit for bit, every field, in the order a user meets them.

    wrapped      names, shapes, dtypes and requires_grad of ``named_parameters()`` after wrapping
    step i       loss, gradients, total norm, grad-scaler scale, parameters after the step, the collectives
                 (kind, numel, dtype, in issue order), state dicts, optimizer state dicts, full parameters
    final        the full parameters and the buffers at the end
    error        the step at which a side raised, and the exception's type

Tolerance: none.  Both sides run the same operations in the same order on the same numbers (the parity tests'
premise), so any bit that differs is a difference; a float is compared by its bits (``-0.0`` is not ``0.0``), but
any NaN equals any NaN: IEEE 754 leaves the sign and payload of an arithmetic NaN unspecified.  A difference is
``(field, where, what)``, e.g. ``("grads", "step 2 (accum)", "blocks.0._flat_param: 3 of 40 numbers differ,
max 0.0039")``; its ``field`` is what shrinking keeps.
"""

from __future__ import annotations

import math
import struct

import torch

__all__ = ["differences", "first_difference", "same"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One integer per number: its bits, every NaN made the same NaN (its sign and payload are not an answer)."""
    t = t.detach().cpu().reshape(-1)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def first_difference(a, b, path: str = "") -> str | None:
    """A description of the first place ``a`` and ``b`` differ, or None if they are the same, bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        bits_a, bits_b = _bits(a), _bits(b)
        if not torch.equal(bits_a, bits_b):
            differ = int((bits_a != bits_b).sum())
            diff = (a.double() - b.double()).abs().nan_to_num(float("inf"))
            return f"{path}: {differ} of {a.numel()} numbers differ, max {float(diff.max()):.3g}"
        return None
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} {_short(a)} vs {type(b).__name__} {_short(b)}"
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items ({_short(a)} vs {_short(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            # a (name, ...) pair is named by its name
            sub = x[0] if isinstance(x, tuple) and x and isinstance(x[0], str) else str(i)
            found = first_difference(x, y, f"{path}.{sub}" if path else sub)
            if found:
                return found
        return None
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            found = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if found:
                return found
        return None
    if isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b) and not (math.isnan(a) and math.isnan(b)):
            return f"{path}: {a!r} vs {b!r}"
        return None
    return None if a == b else f"{path}: {_short(a)} vs {_short(b)}"


def _short(x, limit: int = 120) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "..."


# fields whose every mismatch is listed, not only the first: a known difference (known.py) must not hide another
_EVERY = ("state_types", "grads")


def every_difference(a: list, b: list) -> str | None:
    """Every item at which two lists of the same length differ, joined by ``; ``; else as :func:`first_difference`."""
    if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)):
        return first_difference(a, b)
    found = [f for x, y in zip(a, b) if (f := first_difference(x, y, str(x[0]) if isinstance(x, tuple) else ""))]
    return "; ".join(found) or None


def same(a, b) -> bool:
    return first_difference(a, b) is None


def differences(ours: dict, theirs: dict, ops: list | None = None) -> list[tuple[str, str, str]]:
    """Every field in which ``ours`` and ``theirs`` (two ``run.run_side`` records) differ; ``ops`` names steps."""
    out = []
    if (ours["error"] or (None, None))[:2] != (theirs["error"] or (None, None))[:2]:
        out.append(("error", "program", f"ours {_error_line(ours['error'])} vs torch {_error_line(theirs['error'])}"))
    found = first_difference(ours["wrapped"], theirs["wrapped"])
    if found:
        out.append(("wrapped", "after wrapping", found))
    for i, (o, t) in enumerate(zip(ours["steps"], theirs["steps"])):
        where = f"step {i}" + (f" ({ops[i]})" if ops and i < len(ops) else "")
        for field in sorted(set(o) | set(t)):
            if field not in o or field not in t:
                out.append((field, where, f"only {'ours' if field in o else 'torch'} has it"))
                continue
            found = every_difference(o[field], t[field]) if field in _EVERY else first_difference(o[field], t[field])
            if found:
                out.append((field, where, found))
    if ours["final"] is not None and theirs["final"] is not None:
        for field in ("full", "buffers"):
            found = first_difference(ours["final"][field], theirs["final"][field])
            if found:
                out.append((field, "final", found))
    return out


def _error_line(error) -> str:
    if error is None:
        return "raised nothing"
    step, kind, message = error
    where = "wrapping" if step == -1 else "a step unknown" if step is None else f"step {step}"
    return f"raised {kind} at {where}: {message}"
