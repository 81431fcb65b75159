"""Which tests a session selected, for fixtures that run every selected case in one spawn.

A session's items are not all Python tests: nbval's notebook cells have no ``module``.  Read an item's
module name through :func:`module_name`, never ``item.module`` directly.
"""


def module_name(item) -> str:
    """The dotted name of the test module an item came from ('' for a notebook cell)."""
    return getattr(getattr(item, "module", None), "__name__", "")
