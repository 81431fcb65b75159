"""Explorers: a panel a learner drives in a chapter's notebook, every number computed by the library.

A learner reading a chapter asks "what if": what if N were 3, or the weight had 7 rows?  Each explorer
answers one such question for one section of the book, with the library's own functions (the layout FSDP
builds, the ring's schedule, FSDP2's rows), never with a picture drawn in advance.  Every explorer module has:

* ``compute(setting) -> data``: the same data for the same setting (mixed_precision's runs a few steps, seeded;
  pitfall_pair's spawns ranks, on a button, and keeps each result; train_live's reads what a running job wrote),
  tested in ``tests/test_explorers.py``, ``tests/test_explorers_more.py``, ``tests/test_explorers_pitfalls.py`` and
  ``tests/test_explorers_train_live.py`` against the library, the job and torch;
* ``panel()``: an ipywidgets panel whose controls are a setting and whose output is ``compute`` of it;
* ``fallback(setting)``: one setting's output as text, and a line saying the panel needs a running kernel
  (``panel.static_view``);
* ``show()``: what a notebook cell calls (:func:`minifsdp.explorers.panel.show`).

Modules, by chapter:

    ddp_buckets.py         ch 1.2: which gradients share a DDP bucket, their all-reduces against the backward
    shard_layout.py        ch 2.1: each rank's slice of each unit's flat parameter (build_layout)
    ring_time.py           ch 2.2: the ring step by step, and ring / parameter server / tree in the alpha-beta model
    train_live.py          ch 3.2: the training job run in the background, its loss read live; start, stop, resume
    mixed_precision.py     ch 4.1: one unit's casts under MixedPrecision, the bytes sent, the loss against fp32
    pipeline_schedule.py   ch 4.4: GPipe's and 1F1B's ticks, stage by stage, and the bubble
    flat_vs_rows.py        ch 5: FSDP1's flat shard of a parameter beside FSDP2's rows of it
    pitfall_pair.py        ch 6: a pitfall run on torch's FSDP and on ours in the same ranks, side by side
"""
