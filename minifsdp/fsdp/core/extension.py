"""The one interface through which torch FSDP1's wider API plugs into the step: :class:`Extension`.

The core is the algorithm.  Everything else torch's ``FullyShardedDataParallel`` does (corner cases,
checks, debugging aids) lives in ``minifsdp/fsdp/`` and joins a unit as a list of extensions, which
the step (``fsdp.py``) calls at nine fixed points, each a moment torch's own runtime names:

    point           when, in one step                                    torch's moment
    on_wrap         laid out, not yet flattened: may return another layout   _init_param_handle_from_module
    on_lazy_init    the root's first forward (or a clip before it)           _lazy_init
    before_forward  each pre-forward, inputs cast, nothing gathered yet      _root_pre_forward, _pre_forward
    before_unshard  before every all-gather (forward, prefetch, backward,    FlatParamHandle.pre_unshard
                    summon_full_params)
    after_unshard   the forward's views (a forward prefetch's: before the    _use_unsharded_flat_param
                    unit's forward), the pre-backward's gather, summon's show
    after_forward   the forward's output is known                            _post_forward
    after_reshard   resharded after forward, backward, at the end: freed     FlatParamHandle.post_reshard
                    or kept, as the plan says; and once at wrap (sharded)
    after_reduce    the gradient is where the optimizer reads it (or, under  _post_backward_use_sharded_grad_views
                    no_sync, kept whole)
    after_backward  the final callback, for each unit                        _post_backward_final_callback

``unit.training_state`` tells which phase an ``after_unshard`` or ``after_reshard`` belongs to, as
torch's handle reads its ``_training_state``.  An extension may read the unit and its handle and
act on its own tensors and on module attributes; the step's state is the step's.

Why one interface, and not a subclass that overrides the step's methods?  A learner reading
``fsdp.py`` sees every place where something else may happen (the ``for ext in self._extensions`` lines);
and each corner case is one small class (``minifsdp/fsdp/fully_sharded.py`` lists them), not a
thread through ten overridden methods.  The core alone runs with no extension.
"""

from typing import Protocol


class Extension(Protocol):
    """What a unit's extension may do at each point; each default does nothing (a subclass writes the points it
    uses).  The step calls each of ``unit._extensions`` in turn (``unit``: ``fsdp.py``'s class; none: core alone)."""

    def on_wrap(self, unit, layout):  # the layout to flatten: this one, another, or None (none of its own)
        return layout

    def on_lazy_init(self, root) -> None: ...
    def before_forward(self, unit, args: tuple, kwargs: dict) -> None: ...
    def before_unshard(self, unit, prefetch: bool) -> None: ...
    def after_unshard(self, unit) -> None: ...
    def after_forward(self, unit, output) -> None: ...
    def after_reshard(self, unit) -> None: ...
    def after_reduce(self, unit) -> None: ...
    def after_backward(self, unit) -> None: ...
