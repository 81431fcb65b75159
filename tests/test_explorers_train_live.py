"""Chapter 3's live training explorer (``minifsdp/explorers/train_live.py``) reads what the job writes, and its
buttons start, stop and resume the real job.

Oracle: the job itself (``python -m minifsdp train``, run by the explorer as a process): the lines of its
``--log-json`` file, the summary it prints at the end, the checkpoints its manager keeps, and its own promise
that a resumed run logs bitwise the losses of the run that never stopped.  The run is tiny (TinyGPT-tiny, 1 rank,
40 steps, a checkpoint every 2) but real: started, killed after a few steps, resumed; about a minute on a loaded
2-core machine, so those two tests are ``--extended`` (``tests/_tiers.py``); the parsing and the panel stay in the
default tier.
"""

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from minifsdp.explorers import panel, train_live

SETTING = {"steps": 40, "world_size": 1, "checkpoint_every": 2}


@pytest.fixture(scope="module")
def stopped_and_resumed():
    job = train_live.Job(SETTING)
    job.start()
    deadline = time.monotonic() + 300
    while len(train_live.read_log(job.run_dir)) < 3:  # a few steps logged, at least one checkpoint written
        assert job.running, job.output()
        assert time.monotonic() < deadline, "the job logged nothing in 300 s"
        time.sleep(0.05)
    job.stop()
    with open(os.path.join(job.run_dir, "log.jsonl")) as f:
        lines = f.read()
    pgid = job.proc.pid
    ps = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout.split("\n")
    stopped = {"view": job.view(), "lines": lines, "returncode": job.proc.returncode,
               "alive": [line for line in ps if line.split() and line.split()[0] == str(pgid)
                         and not line.split()[1].startswith("Z")]}
    job.resume()
    job.wait(timeout_s=300)
    yield job, stopped
    shutil.rmtree(job.run_dir, ignore_errors=True)


def test_the_log_is_read_line_by_line_leaving_out_a_line_being_written(tmp_path):
    recs = [{"step": 1, "loss": 4.5, "lr": 3e-3, "grad_norm": 1.0, "tokens_per_s": 10.0}, {"step": 2, "loss": 4.25,
            "lr": 3e-3, "grad_norm": 0.5, "tokens_per_s": 20.0}]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    (tmp_path / "log.jsonl").write_text(text + '{"step": 3, "lo')  # the job is writing step 3
    assert train_live.read_log(str(tmp_path)) == recs
    view = train_live.compute({**SETTING, "run_dir": str(tmp_path)}, state="running")
    assert view.losses == [4.5, 4.25] and view.checkpoints == []
    assert train_live.read_log(None) == [] and train_live.read_log(str(tmp_path / "none")) == []
    with pytest.raises(ValueError, match="N must be 1 or 2"):
        train_live.compute({"world_size": 3})
    with pytest.raises(RuntimeError, match="nothing to resume"):
        train_live.Job(SETTING).resume()


def test_the_fallback_is_the_command_and_the_panel_has_start_stop_resume(capsys):
    text = train_live.fallback()
    assert text == capsys.readouterr().out.rstrip("\n") and text.endswith(panel.NEEDS_KERNEL)
    assert text.startswith("python -m minifsdp train --world-size 1 --steps 60 --strategy FULL_SHARD")
    pytest.importorskip("ipywidgets")
    box = train_live.panel()
    assert train_live.format_run(train_live.compute({})) in capsys.readouterr().out
    steps = box.children[1].children[0]
    steps.value = 61
    assert train_live.format_run(train_live.compute({"steps": 61})) in capsys.readouterr().out
    assert [b.description for b in box.children[2].children] == ["start", "stop", "resume"]


@pytest.mark.timeout(700)
def test_the_explorer_reads_the_losses_the_job_logged(stopped_and_resumed):
    job, stopped = stopped_and_resumed
    logged = [json.loads(line) for line in stopped["lines"].splitlines()]
    assert stopped["view"].records == logged and len(logged) >= 3
    view = job.view()
    assert view.state == "finished" and [r["step"] for r in view.records] == list(range(1, 41))
    done = re.search(r"done: step 40/40, loss (\d+\.\d+)", job.output())
    assert done and f"{view.losses[-1]:.4f}" == done.group(1)  # the job's own summary of its last step
    assert view.checkpoints == [38, 40] and "--resume" in view.command
    assert train_live.format_run(view).splitlines()[-1].split()[:2] == ["40", f"{view.losses[-1]:.6f}"]
    assert train_live.loss_png(view).startswith(b"\x89PNG")


@pytest.mark.timeout(700)
def test_stop_kills_the_job_and_resume_continues_from_the_checkpoint(stopped_and_resumed):
    job, stopped = stopped_and_resumed
    assert stopped["returncode"] == -9 and stopped["view"].state == "stopped"
    assert stopped["alive"] == []  # every rank of the job went with it
    first = stopped["view"].records
    resumed_from = stopped["view"].checkpoints[-1]
    assert 2 <= resumed_from <= len(first) and job.starts == ["start", "resume"]
    assert f"resuming from step {resumed_from}" in job.output()
    after = job.view().records
    assert after[:resumed_from] == first[:resumed_from]  # the lines before the checkpoint are kept as written
    # steps the first run logged after its last checkpoint were run again from it: bitwise the same losses
    again = first[resumed_from:]
    assert [r["loss"] for r in after[resumed_from:resumed_from + len(again)]] == [r["loss"] for r in again]


@pytest.mark.timeout(400)
def test_the_panels_start_button_runs_the_job_and_its_output_follows_it():
    """The panel's own path: start pressed, its watcher thread redraws the output from the job's files each second
    until the job ends; the last drawing is the finished run's text and its loss curve."""
    pytest.importorskip("ipywidgets")
    box = train_live.panel()
    controls, buttons, out = box.children[1].children, box.children[2].children, box.children[3]
    controls[0].value = 4  # steps
    buttons[0].click()  # start
    deadline = time.monotonic() + 300
    while "state: finished" not in "".join(o.get("text", "") for o in out.outputs):
        assert time.monotonic() < deadline, out.outputs
        assert "exited with code" not in "".join(o.get("text", "") for o in out.outputs), out.outputs
        time.sleep(0.5)
    text, picture = out.outputs
    run_dir = re.search(r"--checkpoint-dir (\S+)", text["text"]).group(1)
    view = train_live.compute({**train_live.DEFAULT, "steps": 4, "run_dir": run_dir}, state="finished")
    assert text["text"] == train_live.format_run(view) + "\n" and len(view.records) == 4
    assert "image/png" in picture["data"]
    shutil.rmtree(run_dir, ignore_errors=True)
