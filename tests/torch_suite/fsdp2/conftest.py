"""The FSDP2 port's collection: CI runs only its slice (``test_ci_slice.py``); the command runs everything else.

The whole port takes many minutes on 2 cores.  The default collection keeps ``test_ci_slice.py`` (a few cases of
each file in one spawn) and drops the other modules; with ``MINIFSDP_TORCH_SUITE_FSDP2=all`` (what
``python -m minifsdp torch-suite`` sets) it is the other way round, so no case is counted twice.
"""

import os

ALL = "MINIFSDP_TORCH_SUITE_FSDP2"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    everything = os.environ.get(ALL) == "all"
    keep, drop = [], []
    for item in items:
        path = str(item.fspath)
        if not path.startswith(here):
            keep.append(item)
        elif (os.path.basename(path) == "test_ci_slice.py") != everything:
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
