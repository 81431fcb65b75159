"""What the notebooks' cells call, so that a cell shows the idea and not the plumbing.

    ranks.py          for ``%%ranks`` cells (notebook 04's): show (print once), on_all_ranks (a verdict of every rank)
    hf_sharding.py    chapter 4.2 (``chapters/04_advanced_topics.md``, notebook 04): load all-MiniLM-L6-v2, wrap
                      it by layer class (ours or torch FSDP1), embed, fine-tune; a small tied GPT-2
    pitfall_runs.py   chapter 6 (notebook 06's explorer, tests/test_pitfalls.py): each pitfall on torch's FSDP and
                      on ours in the same ranks
    resume_check.py   chapter 4.3 (notebook 04's resume cells): the model, the step and the run that never stops,
                      which every resume is judged against; the source's save_checkpoint

The widgets a learner drives live in ``minifsdp/explorers/``; plots in ``minifsdp/pictures/``.
"""
