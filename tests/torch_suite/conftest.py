"""Collection of the port: the ``fast`` mark, and the case ids each module's batch runs.

The batch of a module (see ``_harness.py``) runs exactly the cases pytest selected, after ``-k`` /
``-m`` deselection, which is known only once collection finishes.
"""

from tests._selection import module_name
from tests.torch_suite import _harness


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the CI slice of torch's ported FSDP1 tests")


def pytest_collection_finish(session):
    _harness.SELECTED.clear()
    for item in session.items:
        cid = getattr(getattr(item, "callspec", None), "params", {}).get("cid")
        if cid is not None and module_name(item).startswith("tests.torch_suite."):
            _harness.SELECTED.setdefault(module_name(item), []).append(cid)
