"""Runs at the start of every Python process that has this folder on ``PYTHONPATH`` (``site`` imports it).

With ``MINIFSDP_PLANT_FAULT`` set, it plants that fault (``plant.py``) before anything else runs: in the
pytest process that runs the named test, and in every rank that test starts, forked or spawned.
Without it, it does nothing.  Another ``sitecustomize`` further down ``sys.path`` still runs.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

# (not in multiprocessing's resource tracker, which runs no library code: importing torch there costs seconds)
if os.environ.get("MINIFSDP_PLANT_FAULT") and not any("resource_tracker" in a for a in sys.orig_argv):
    from tests.planted_faults.plant import plant_from_environment

    plant_from_environment()

# this file shadows any other sitecustomize (a distribution's, a virtualenv's): run that one too
_other = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _HERE])
if _other is not None and _other.loader is not None:
    _module = importlib.util.module_from_spec(_other)
    _other.loader.exec_module(_module)
