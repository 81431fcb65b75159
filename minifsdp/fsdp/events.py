"""What an FSDP unit reports while it runs, for a tracer that may or may not be attached.

The unit and its handle call ``span(tracer, kind, unit_name)`` around a wait or a
compute, and ``tracer.instant(kind, unit_name, ...)`` when they issue a collective.
With no tracer attached (``tracer is None``, the usual case) nothing is recorded
and nothing is imported: the recorder itself (``Tracer``, its plots and Chrome
trace export) is ``minifsdp/tools/tracing.py``, which attaches to a model from
outside.  So the core does not depend on the tools; the tools depend on the core.

Kinds (the tracer's docstring says what each means): ``"all-gather issued"``,
``"all-gather wait"``, ``"forward"``, ``"backward"``, ``"reduce-scatter issued"``,
``"reduce-scatter wait"``.
"""

from __future__ import annotations

import contextlib

__all__ = ["span"]


def span(tracer, kind: str, unit: str):
    """A context that records ``kind`` for ``unit`` on ``tracer`` from enter to exit; nothing if no tracer."""
    if tracer is None:
        return contextlib.nullcontext()
    return _Span(tracer, kind, unit)


class _Span:
    def __init__(self, tracer, kind: str, unit: str):
        self.tracer, self.kind, self.unit = tracer, kind, unit

    def __enter__(self):
        self.tracer.open(self.kind, self.unit)

    def __exit__(self, *exc):
        self.tracer.close(self.kind, self.unit)
