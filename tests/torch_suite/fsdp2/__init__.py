"""torch's own FSDP2 tests, ported: torch's test matrices with minifsdp's ``fully_shard`` in place of torch's.

One module per file of pytorch's ``test/distributed/_composable/fsdp/test_fully_shard_*.py``, written anew from
what each of those tests checks, on CPU/gloo at 2 or 4 local ranks.  A case is ``case(api, **params)`` run on
every rank twice, once with ``api.fully_shard`` torch's (the control) and once ours (:class:`._side.Side2`),
same seeds; it raises when its check fails.  Most checks are torch's own: train the sharded model beside a
replicated reference (torch's ``replicate()``, or gradients all-reduced by hand) and compare losses with
torch's ``assertEqual`` tolerances, and every local shard and gradient with ``check_sharded_parity``.

A case torch's ``fully_shard`` itself fails on this CPU is skipped with torch's error (not counted); a case only
ours fails is ``xfail(strict=True)`` with the gap, so fixing it flips the mark.  Left out, as in the count of the
FSDP1 port: tests torch decorates as GPU-only, ``torch.compile`` tests, and tests of DTensor parameters that come
in already sharded (tensor parallel), which minifsdp's tensor parallel does not make.

The default test collection runs only the cases marked ``fast`` (about a minute); the whole port runs with
``python -m minifsdp torch-suite`` (or ``MINIFSDP_TORCH_SUITE_FSDP2=all python -m pytest tests/torch_suite/fsdp2``).
"""
