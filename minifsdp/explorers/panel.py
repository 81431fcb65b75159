"""What every explorer shares: a panel redrawn from its setting, and a static view for a page with no kernel.

A panel is a row of controls above one output area.  Moving a control reads every control's value into a
``setting`` (a dict), and the explorer draws ``compute(setting)`` into the output, so nothing the learner
sees is drawn in advance::

    [model: tiny v] [N: ---o--- 3] [strategy: FULL_SHARD v]
    +----------------------------------------------------+
    | rank 0 holds 4,160 numbers: qkv.weight[0:3072] ... |   <- compute(setting), printed and plotted
    +----------------------------------------------------+

:func:`show` is what a notebook cell calls.  In a running kernel it displays the panel.  The display carries a
second, plain-text form of itself: the explorer's fallback (one setting's output, and the line
:data:`NEEDS_KERNEL`).  A page that cannot run widgets (a notebook on GitHub, a notebook opened before its
kernel runs) shows that text instead, and the committed notebooks keep only that text (a widget's id changes
at every run, so nbval ignores these cells' output: ``# NBVAL_IGNORE_OUTPUT``).
"""

from __future__ import annotations

from typing import Any, Callable

NEEDS_KERNEL = ("(a static view of one setting: run this cell in a live kernel, e.g. JupyterLab, "
                "to get the panel and turn its controls)")

__all__ = ["NEEDS_KERNEL", "live_panel", "show", "static_view", "with_kernel_line"]


def with_kernel_line(text: str) -> str:
    """An explorer's text for one setting, followed by the line that says where the panel is."""
    return f"{text.rstrip()}\n{NEEDS_KERNEL}"


def static_view(text: str) -> str:
    """What every explorer's ``fallback`` does with its text for one setting: print it with the kernel line, and
    return what it printed."""
    text = with_kernel_line(text)
    print(text)
    return text


def live_panel(controls: dict[str, Any], draw: Callable[[dict], None], title: str):
    """A VBox: ``title``, the controls, and an output that ``draw(setting)`` fills again after every change.

    ``controls``: setting key -> ipywidgets control (its ``value`` is the setting's value).
    """
    import ipywidgets as widgets

    out = widgets.Output()

    def redraw(_change=None) -> None:
        setting = {key: control.value for key, control in controls.items()}
        with out:
            out.clear_output(wait=True)
            try:
                draw(setting)
            except ValueError as err:  # a setting the library refuses (a shape that is not one): say why
                print(f"not a valid setting: {err}")

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HTML(f"<b>{title}</b>"), widgets.HBox(list(controls.values())), out])


def show(make_panel: Callable[[], Any], fallback_text: str) -> None:
    """Display the panel ``make_panel()`` builds, with ``fallback_text`` as its plain-text form.

    Without ipywidgets, print the fallback text instead.
    """
    from IPython.display import display

    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        print(fallback_text)
        return
    bundle = make_panel()._repr_mimebundle_()
    bundle["text/plain"] = fallback_text  # what a page without a kernel shows
    display(bundle, raw=True)
