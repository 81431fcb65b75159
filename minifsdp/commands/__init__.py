"""The command line: ``python -m minifsdp COMMAND`` (``minifsdp/__main__.py`` calls ``cli.main``).

    cli.py           the commands and their flags: compare | train | generate | bench | plan | torch-suite | course
                     | fuzz | route; each imports only what it runs, from the room that holds it (training/,
                     bench/, classroom/, pictures/, fuzz/)
    plan.py          python -m minifsdp plan: will a model fit, what will it send (text, table, JSON, plot); chapters
                     2.3 and 2.4 (``chapters/02_fsdp_core.md`` and its appendix ``02_fsdp_core_deeper.md``)
    torch_suite.py   python -m minifsdp torch-suite: the ports of torch's FSDP1 and FSDP2 tests, a table each
                     (chapter 2's appendix, "parity")
"""
