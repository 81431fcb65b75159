"""The FSDP2 port's collection: only its ``fast`` cases unless ``MINIFSDP_TORCH_SUITE_FSDP2=all`` asks for all.

The whole port takes minutes on 2 cores; CI runs the fast slice through the default collection and
``python -m minifsdp torch-suite`` sets the variable to run everything.
"""

import os

ALL = "MINIFSDP_TORCH_SUITE_FSDP2"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ALL) == "all":
        return
    here = os.path.dirname(__file__)
    keep, drop = [], []
    for item in items:
        inside = str(item.fspath).startswith(here)
        (drop if inside and item.get_closest_marker("fast") is None else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep

