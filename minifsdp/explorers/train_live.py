"""Chapter 3 (FSDP in practice): the training job, live: start it, watch its loss, stop it, resume it.

The learner picks the run's length, N (1 or 2 ranks) and the sharding strategy and presses **start**: the panel
runs the chapter's job as a process of its own, exactly as a terminal would::

    python -m minifsdp train --world-size N --steps S --strategy X --checkpoint-every K \
        --checkpoint-dir DIR --log-json DIR/log.jsonl

and, once a second while it runs, reads what the job writes (``minifsdp/training/train.py``): one JSON line per
step in ``DIR/log.jsonl`` (step, loss, lr, grad_norm, tokens_per_s) and a checkpoint every K steps
(``DIR/step_*``, the newest 2 kept), and redraws the loss curve.  **stop** kills the job and its ranks
(SIGKILL to its process group: a preemption, nothing saved on the way out); **resume** runs the same command
with ``--resume``, which loads the newest checkpoint and continues from its step (the job drops the log's lines
after it)::

    start:   1 2 3 4 5 6 7 [stop]       checkpoints 4, 6        log: steps 1..7
    resume:              load 6 -> 7 8 9 ... S                  log: steps 1..6, then 7..S again

The job writes no sample text while it trains (``python -m minifsdp generate --checkpoint DIR`` samples its
final weights once it has finished).  Every number shown is read from the job's own files; ``compute`` before a
start shows the command and nothing else.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from minifsdp.explorers.panel import live_panel, static_view, with_kernel_line
from minifsdp.explorers.panel import show as show_panel
from minifsdp.training.checks import checkpoint_steps

__all__ = ["DEFAULT", "STRATEGIES", "command", "read_log", "Job", "TrainView", "compute", "format_run", "loss_png",
           "fallback", "panel", "show"]

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
DEFAULT = {"steps": 60, "world_size": 1, "strategy": "FULL_SHARD", "checkpoint_every": 5}
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding minifsdp/: the job imports this copy


def _setting(setting: dict | None) -> dict:
    s = {**DEFAULT, **(setting or {})}
    if not 1 <= int(s["steps"]) <= 100_000:
        raise ValueError(f"steps must be 1 to 100000, got {s['steps']}")
    if int(s["world_size"]) not in (1, 2):
        raise ValueError(f"N must be 1 or 2 ranks, got {s['world_size']}")
    if s["strategy"] not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {s['strategy']!r}")
    if int(s["checkpoint_every"]) < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {s['checkpoint_every']}")
    return s


def command(setting: dict | None, run_dir: str = "DIR", resume: bool = False) -> list[str]:
    """The job's command line for ``setting``, writing into ``run_dir``."""
    s = _setting(setting)
    return ["python", "-m", "minifsdp", "train", "--world-size", str(s["world_size"]), "--steps", str(s["steps"]),
            "--strategy", s["strategy"], "--checkpoint-every", str(s["checkpoint_every"]),
            "--checkpoint-dir", run_dir, "--log-json", os.path.join(run_dir, "log.jsonl")] + \
        (["--resume"] if resume else [])


def read_log(run_dir: str | None) -> list[dict]:
    """The job's records so far, one dict per step; a line still being written (no newline yet) is left out."""
    path = os.path.join(run_dir, "log.jsonl") if run_dir else None
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


class Job:
    """The training job as a background process in ``run_dir`` (a new temporary folder by default)."""

    def __init__(self, setting: dict | None = None, run_dir: str | None = None):
        self.setting = _setting(setting)
        self.run_dir = run_dir
        self.proc: subprocess.Popen | None = None
        self.stopped = False
        self.starts: list[str] = []  # "start", "resume": what this job ran, in order

    def _launch(self, resume: bool) -> None:
        if self.running:
            raise RuntimeError("the job is running: stop it first")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        argv = [sys.executable] + command(self.setting, self.run_dir, resume)[1:]
        out = open(os.path.join(self.run_dir, "job.out"), "a")
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.run_dir,
                                     start_new_session=True)  # its own process group: stop kills every rank
        out.close()
        self.stopped = False
        self.starts.append("resume" if resume else "start")

    def start(self) -> None:
        """Run the job from step 0 in a fresh folder."""
        if self.proc is not None and self.running:
            raise RuntimeError("the job is running: stop it first")
        self.run_dir = tempfile.mkdtemp(prefix="minifsdp_train_live_")
        self.starts = []
        self._launch(resume=False)

    def resume(self) -> None:
        """Run the same command with ``--resume``: the job continues from the newest checkpoint in the folder."""
        if self.run_dir is None:
            raise RuntimeError("nothing to resume: start a run first")
        if not checkpoint_steps(self.run_dir, "ours"):
            raise RuntimeError(f"no checkpoint in {self.run_dir} yet: start again")
        self._launch(resume=True)

    def stop(self) -> None:
        """Kill the job and its ranks (SIGKILL to its process group), as a preemption would."""
        if self.running:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.stopped = True

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def state(self) -> str:
        if self.proc is None:
            return "not started"
        if self.running:
            return "running" + (" (resumed)" if self.starts[-1] == "resume" else "")
        if self.stopped:
            return "stopped"
        code = self.proc.returncode
        return "finished" if code == 0 else f"exited with code {code}: {self.output()[-400:]}"

    def output(self) -> str:
        """What the job printed (its stdout and stderr, tqdm's bar included)."""
        path = os.path.join(self.run_dir or "", "job.out")
        return Path(path).read_text(errors="replace") if self.run_dir and os.path.exists(path) else ""

    def wait(self, timeout_s: float = 600) -> None:
        if self.proc is not None:
            self.proc.wait(timeout=timeout_s)

    def view(self) -> TrainView:
        return compute({**self.setting, "run_dir": self.run_dir, "resume": self.starts[-1:] == ["resume"]},
                       state=self.state)


@dataclass(frozen=True)
class TrainView:
    """What ``compute`` returns: the setting, its command, and what the job has written so far."""
    setting: dict
    command: list[str]
    state: str
    records: list[dict] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


def compute(setting: dict | None = None, state: str | None = None) -> TrainView:
    """The command for ``setting`` and, when it names a ``run_dir`` (and ``resume``: the last launch resumed), the
    records and checkpoints the job wrote there."""
    s = _setting(setting)
    run_dir = s.get("run_dir")
    state = state or ("not started" if run_dir is None else "-")
    return TrainView(s, command(s, run_dir or "DIR", bool(s.get("resume"))), state,
                     read_log(run_dir), checkpoint_steps(run_dir, "ours") if run_dir else [])


def format_run(view: TrainView) -> str:
    """The command, the job's state, the newest records, the checkpoints."""
    s = view.setting
    lines = [" ".join(view.command), f"state: {view.state}"]
    if view.state == "not started":
        lines.append(f"press start: TinyGPT-tiny, {s['steps']} steps on {s['world_size']} rank(s), {s['strategy']}, "
                     f"a checkpoint every {s['checkpoint_every']} steps; the loss curve is read from DIR/log.jsonl")
        return "\n".join(lines)
    recs = view.records
    lines.append(f"steps logged: {len(recs)} of {s['steps']}" + (f", last {recs[-1]['step']}" if recs else "")
                 + f"; checkpoints at steps {view.checkpoints or 'none yet'}")
    if recs:
        lines.append(f"{'step':>6}{'loss':>12}{'lr':>12}{'grad norm':>12}{'tokens/s':>12}")
        lines += [f"{r['step']:>6}{r['loss']:>12.6f}{r['lr']:>12.3e}{r['grad_norm']:>12.4f}{r['tokens_per_s']:>12,.0f}"
                  for r in recs[-5:]]
    return "\n".join(lines)


def loss_png(view: TrainView) -> bytes:
    """The loss curve so far, checkpoints marked, as PNG bytes (a Figure of its own: safe off the main thread)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 2.6))
    ax = fig.subplots()
    steps = [r["step"] for r in view.records]
    ax.plot(steps, view.losses, lw=1.2)
    for c in view.checkpoints:
        ax.axvline(c, color="grey", ls=":", lw=0.8)
    ax.set_xlim(0, view.setting["steps"])
    ax.set_xlabel("step (dotted: a checkpoint kept)")
    ax.set_ylabel("loss")
    ax.set_title(f"{view.setting['strategy']}, N = {view.setting['world_size']}: {view.state}", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def fallback(setting: dict | None = None) -> str:
    """Print (and return) the command the panel runs for one setting, and the line saying it needs a kernel."""
    return static_view(format_run(compute(setting)))


def panel():
    """Sliders for the steps and N, a menu for the strategy; start, stop and resume; the curve redrawn each second."""
    import ipywidgets as widgets

    controls = {"steps": widgets.IntSlider(value=DEFAULT["steps"], min=2, max=400, description="steps"),
                "world_size": widgets.IntSlider(value=DEFAULT["world_size"], min=1, max=2, description="N"),
                "strategy": widgets.Dropdown(options=list(STRATEGIES), value=DEFAULT["strategy"],
                                             description="strategy")}
    jobs: list[Job] = []

    def draw(setting: dict) -> None:
        print(format_run(jobs[-1].view() if jobs else compute(setting)))

    box = live_panel(controls, draw, "Chapter 3: the training job, live")
    title, row, out = box.children

    def render() -> None:
        view = jobs[-1].view()
        png = base64.b64encode(loss_png(view)).decode() if view.records else None
        outputs = [{"output_type": "stream", "name": "stdout", "text": format_run(view) + "\n"}]
        if png:
            outputs.append({"output_type": "display_data", "metadata": {},
                            "data": {"image/png": png, "text/plain": "<the loss curve>"}})
        out.outputs = tuple(outputs)

    def watch(job: Job) -> None:
        while job.running:
            render()
            time.sleep(1.0)
        render()

    def act(what: str) -> None:
        try:
            if what == "start":
                if jobs and jobs[-1].running:
                    jobs[-1].stop()
                jobs.append(Job({key: c.value for key, c in controls.items()}))
                jobs[-1].start()
            elif not jobs:
                raise RuntimeError("nothing started yet: press start")
            elif what == "stop":
                jobs[-1].stop()
            else:
                jobs[-1].resume()
        except RuntimeError as err:
            out.outputs = ({"output_type": "stream", "name": "stdout", "text": f"{what}: {err}\n"},)
            return
        threading.Thread(target=watch, args=(jobs[-1],), daemon=True).start()

    buttons = []
    for what in ("start", "stop", "resume"):
        button = widgets.Button(description=what)
        button.on_click(lambda _b, w=what: act(w))
        buttons.append(button)
    box.children = (title, row, widgets.HBox(buttons), out)
    return box


def show(setting: dict | None = None) -> None:
    """A notebook cell's call: the panel in a running kernel; the command as text on a page without one."""
    show_panel(panel, with_kernel_line(format_run(compute(setting))))
