"""``python -m minifsdp plan`` says what it assumed and, when nothing fits, what would: numbers, not a hint.

Oracles: the FLOP count recomputed here from the shape (6 x matmul parameters x tokens + 12 x layers x seq x
hidden x tokens, x 4/3 with checkpointing: the formula ``plan_shapes.unit_flops`` documents, from Kaplan et al.
2020 and PaLM's appendix B), the matmul parameters counted from the tensors; the advice's numbers against
``fits`` and ``peak`` themselves: the smallest world size fits and the one below does not, the largest batch
fits and one more does not under any strategy, checkpointing's peak is the one printed.  Exact, no tolerance.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from minifsdp.commands.cli import main
from minifsdp.memory.plan import STRATEGIES, Run, peak
from minifsdp.memory.plan_shapes import preset
from minifsdp.memory.plan_time import GPUS, advise, fits


def _json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_flop_count_and_the_rates_are_printed_and_in_the_json(capsys, checkpointing):
    shape = preset("llama-7b")
    argv = ["--model", "llama-7b", "--precision", "bf16", "--batch", "2", "--seq", "1024"]
    argv += ["--activation-checkpointing"] if checkpointing else []
    a = _json(capsys, *argv)["assumptions"]
    h, f, kv, L, tokens = shape.hidden, shape.ffn, shape.kv_width, shape.layers, 2 * 1024
    matmul = L * (2 * h * h + 2 * h * kv + 3 * h * f) + shape.vocab * h  # q, o; k, v; gate, up, down; the head
    assert a["matmul_parameters"] == matmul
    flops = (6 * matmul * tokens + 12 * L * 1024 * h * tokens) * (4 / 3 if checkpointing else 1)
    assert a["flops_per_step"] == pytest.approx(flops, rel=1e-12)
    assert a["flops_per_token"] == pytest.approx(flops / tokens, rel=1e-12)
    assert a["peak_flops"] == 989e12 and a["inter_node_bits_per_s"] == 400e9 and a["latency_s"] == 0
    assert "perfect" in a["overlap"] and ("4/3" in a["flops_formula"]) == checkpointing
    assert main(["plan", *argv]) == 0
    text = capsys.readouterr().out
    assert f"{flops:.4g} FLOPs per step" in text and "per token" in text and "latency left out" in text
    assert main(["plan", *argv, "--world-size", "8,16"]) == 0  # the table says it too
    assert "perfect overlap, no latency" in capsys.readouterr().out


def test_an_mlps_flops_count_its_samples(capsys):
    a = _json(capsys, "--model", "mlp", "--batch", "3", "--world-size", "2")["assumptions"]
    weights = 16 * 32 + 32 * 32 + 32 * 8  # the book's MLP: Linear(16, 32), Linear(32, 32), Linear(32, 8)
    assert a["matmul_parameters"] == weights and a["flops_per_step"] == 6 * weights * 3
    assert a["tokens_per_step_per_gpu"] == 3 and "samples" in a["flops_formula"]


def test_the_smallest_world_size_is_any_whole_number():
    shape, gpu = preset("llama-70b"), GPUS["h100"]
    run = Run(8, precision="bf16", activation_checkpointing=True)
    line = advise(shape, run, gpu)
    n = int(re.search(r"the smallest world size that fits is (\d+)", line).group(1))
    assert n == 20  # not a power of two: 16 does not fit, 32 was the old answer
    assert fits(shape, dataclasses.replace(run, world_size=n), gpu)
    assert not fits(shape, dataclasses.replace(run, world_size=n - 1), gpu)


def test_when_nothing_fits_the_advice_gives_the_numbers():
    shape, gpu = preset("llama-7b"), GPUS["h100"]
    run = Run(8, precision="bf16", batch=16)
    line = advise(shape, run, gpu)
    # checkpointing alone: the least peak among the strategies that fit, printed to 0.1 GB
    ckpt = dataclasses.replace(run, activation_checkpointing=True)
    least = min(peak(shape, dataclasses.replace(ckpt, strategy=s))[0] for s in STRATEGIES
                if s != "HYBRID_SHARD" and fits(shape, dataclasses.replace(ckpt, strategy=s), gpu))
    assert f"--activation-checkpointing alone fits (FULL_SHARD, peak {least / 1e9:.1f} GB)" in line
    # the largest batch: it fits under the strategy named, and one more fits under none
    b, strategy = re.search(r"the largest --batch that fits is (\d+) \((\w+)\)", line).groups()
    b = int(b)
    assert fits(shape, dataclasses.replace(run, batch=b, strategy=strategy), gpu)
    assert not any(fits(shape, dataclasses.replace(run, batch=b + 1, strategy=s), gpu) for s in STRATEGIES
                   if s != "HYBRID_SHARD")
    # the world size: none with this batch; with checkpointing, the smallest
    assert "does not fit at any world size" in line
    m = int(re.search(r"with --activation-checkpointing the smallest world size that fits is (\d+)", line).group(1))
    assert fits(shape, dataclasses.replace(ckpt, world_size=m, strategy="FULL_SHARD"), gpu)
    assert not fits(shape, dataclasses.replace(ckpt, world_size=m - 1, strategy="FULL_SHARD"), gpu)


def test_when_even_one_sequence_does_not_fit_the_longest_that_does():
    shape, gpu = preset("llama-7b"), GPUS["rtx4090"]
    line = advise(shape, Run(8), gpu)
    seq = int(re.search(r"--batch 1 --seq (\d+) fits \(FULL_SHARD\)", line).group(1))
    assert fits(shape, Run(8, seq=seq), gpu) and not fits(shape, Run(8, seq=seq + 1), gpu)
