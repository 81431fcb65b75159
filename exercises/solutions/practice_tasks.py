"""The answers to tasks 3.2a, 3.2b and 3.3 (``exercises/practice_tasks.py``): the train job's own functions."""

from minifsdp.tools.train import lr_factor
from minifsdp.tools.train_monitor import exposed_communication, find_instability

__all__ = ["lr_factor", "find_instability", "exposed_communication"]
