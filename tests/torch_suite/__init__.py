"""torch's own FSDP1 tests, ported: torch's test models with minifsdp's FSDP in place.

One module per file of pytorch's ``test/distributed/fsdp/test_fsdp_*.py``, written anew from what
each of those tests checks.  Every case is a function ``case(api, **params)`` that builds its
models through ``api`` (:class:`tests.torch_suite._workers.Side`): torch FSDP1 on one run, ours
on the other, on the same ranks and seeds; a case raises when its check fails.  A case that
torch FSDP1 itself fails on CPU is skipped with torch's error (not counted); a case that only
ours fails is marked ``xfail(strict=True)`` with the gap, so fixing it flips the mark.

Run the whole port with ``python -m minifsdp torch-suite`` (a table per group) or
``python -m pytest tests/torch_suite`` (the default collection includes it: about 2 minutes on 2
cores); ``-m fast`` selects one or two cases per group.
"""
