"""``python -m minifsdp plan`` as a new user types it: bad input gets one line naming the flag and the fix, names in
any case, a plan at a billion ranks costs what one at eight does, ``--help`` explains itself.

Oracles: the command's own exit status and stderr (one line, exit 2, the flag named); for the world size, the
closed-form ring count against ``minifsdp.comm.ring.chunk_bounds`` (the chunks our ring really sends) and the
wall time of a plan at 10^9 ranks; for the optimizer, the bytes per parameter each one keeps (AdamW 4 + 4 + 8,
SGD with momentum 4 + 4 + 4) against ``model_state``.
"""

from __future__ import annotations

import json
import time

import pytest

from minifsdp.comm.ring import chunk_bounds
from minifsdp.commands.cli import main
from minifsdp.memory.plan import Run, model_state, ring_all_reduce_sent
from minifsdp.memory.plan_shapes import preset


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, says", [
    (["--model", "llama-7b", "--seq", "0"], "--seq is tokens per sequence: give a positive whole number, got 0"),
    (["--model", "llama-7b", "--seq", "-5"], "--seq is tokens per sequence: give a positive whole number, got -5"),
    (["--layers", "2", "--hidden", "256", "--heads", "0"], "--heads is attention heads: give a positive"),
    (["--layers", "2", "--hidden", "256", "--heads", "3"], "3 heads do not divide --hidden 256"),
    (["--layers", "2", "--hidden", "256", "--kv-heads", "3"], "3 --kv-heads do not divide"),
    (["--layers", "2", "--hidden", "256", "--ffn", "0"], "--ffn is the MLP's inner width: give a positive"),
    (["--layers", "2", "--hidden", "256", "--ffn", "512", "--params", "1e9"], "give --params or --ffn, not both"),
    (["--model", "llama-7b", "--batch", "0"], "--batch is sequences per GPU: give a positive whole number"),
    (["--model", "llama-7b", "--gpus-per-node", "0"], "--gpus-per-node is GPUs per node: give a positive"),
    (["--model", "llama-7b", "--optimizer", "adafactor"], "--optimizer 'adafactor' is not modelled; use adamw or sgd"),
    (["--model", "llama-7b", "--precision", "fp8"], "unknown --precision 'fp8'"),
    (["--model", "llama-7b", "--reduce-dtype", "fp64"], "unknown --reduce-dtype 'fp64'"),
    (["--model", "llama-7b", "--wrap", "block"], "unknown --wrap 'block'"),
    (["--model", "llama-7b", "--gpu-memory", "0"], "--gpu-memory takes a positive number of GB"),
    (["--model", "llama-7b", "--layers", "4"], "not both"),
    (["--model", "llama-7b", "--world-size", "0"], "--world-size must be positive"),
    (["--model", "mlp", "--seq", "5"], "--seq has no meaning for mlp, an MLP"),
    (["--model", "gpt2", "--link-gbps", "0,400"], "--link-gbps takes positive speeds"),
])
def test_bad_input_names_the_flag_and_the_fix(capsys, argv, says):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1, err


def test_a_sequence_past_the_context_warns_and_is_planned(capsys):
    code, out, err = _cli(capsys, "--model", "llama-7b", "--seq", "100000", "--json")
    assert code == 0 and json.loads(out)["run"]["seq"] == 100000
    assert "warning: --seq 100000 is past llama-7b's context of 4096 tokens" in err
    assert json.loads(out)["warnings"] == [err.split("warning: ")[1].strip()]
    code, _, err = _cli(capsys, "--model", "llama-7b", "--seq", "4096")
    assert code == 0 and err == ""


def test_names_are_case_insensitive(capsys):
    code, lower, _ = _cli(capsys, "--model", "llama-7b", "--precision", "bf16", "--strategy", "shard_grad_op",
                          "--gpu", "h100", "--optimizer", "adamw", "--arch", "llama", "--json")
    code2, upper, _ = _cli(capsys, "--model", "LLAMA-7B", "--precision", "BF16", "--strategy", "SHARD_GRAD_OP",
                           "--gpu", "H100", "--optimizer", "AdamW", "--json")
    assert code == code2 == 0 and json.loads(lower) == json.loads(upper)
    assert _cli(capsys, "--layers", "2", "--hidden", "256", "--arch", "GPT")[0] == 0
    assert _cli(capsys, "--model", "gpt2", "--gpu", "RTX-4090")[0] == 0
    assert _cli(capsys, "--model", "gpt2", "--strategy", "ddp,Full_Shard")[0] == 0


def test_ring_count_in_closed_form_is_the_rings_chunks():
    for numel, n in [(10, 3), (7, 7), (5, 8), (1000, 64), (262_148_097, 6)]:
        sizes = [b - a for a, b in chunk_bounds(numel, n)]
        for rank in (0, 1, n - 1):
            assert ring_all_reduce_sent(numel, n, rank, 2) == \
                (2 * numel - sizes[rank % n] - sizes[(rank + 1) % n]) * 2


def test_a_plan_at_a_billion_ranks_costs_what_one_at_eight_does(capsys):
    start = time.perf_counter()
    code, out, _ = _cli(capsys, "--model", "llama-7b", "--precision", "bf16", "--world-size", "1000000000", "--json")
    assert code == 0 and time.perf_counter() - start < 5  # was: an N-long list per collective (10^7 ranks: 52 s)
    r = json.loads(out)
    assert r["model_state_bytes_per_rank"] < 1000 and r["bytes_sent_per_rank_per_step"] > 0


def test_each_optimizer_says_its_own_bytes_per_parameter(capsys):
    shape = preset("llama-7b")
    units = len(shape.unit_numels())
    assert model_state(shape, Run(1, optimizer="adamw"))["model_state"] == 16 * shape.params + 4 * units
    assert model_state(shape, Run(1, optimizer="sgd"))["model_state"] == 12 * shape.params
    _, out, _ = _cli(capsys, "--model", "llama-7b", "--optimizer", "sgd", "--world-size", "1")
    assert "12 bytes per parameter" in out and "momentum" in out and "AdamW" not in out and "16 bytes" not in out
    _, out, _ = _cli(capsys, "--model", "llama-7b", "--world-size", "1")
    assert "16 bytes per parameter" in out and "AdamW" in out


def test_help_has_a_description_defaults_and_three_examples(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert "Will a model fit" in text
    assert "(default: FULL_SHARD)" in text and "(default: h100)" in text and "(default: 8)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    examples = text.split("examples:")[1]
    assert examples.count("python -m minifsdp plan") == 3
