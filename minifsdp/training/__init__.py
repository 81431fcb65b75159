"""The training jobs: the commands that train the tiny GPT the way a real run does, ours beside torch's.

Chapter 3 (``chapters/03_fsdp_in_practice.md``: the training job, clipping, schedules, resume, serving, profiling)
is built on them; the README's quickstart runs ``compare`` first.

    compare.py    python -m minifsdp compare: ours against torch's, side by side (losses, parameters, bytes)
    train.py      python -m minifsdp train: schedule, clipping, checkpoints, resume, a log and a trace (3.1-3.3)
    impls.py      the trainers behind train --impl: ours, torch FSDP1, torch FSDP2
    checks.py     the train job's input checks: every bad flag refused before a rank starts
    monitor.py    reading a run's outputs: the first bad step of a log, the exposed communication of a trace
    generate.py   python -m minifsdp generate: serve what a sharded run learned (3.1)
    devices.py    --device cpu|cuda for the jobs: each rank's device and backend, checked before ranks start
"""
