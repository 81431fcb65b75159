"""``plan``'s run choices beyond the strategy: ``--ac`` (none, full, selective, every-K), ``--offload``, and how
``--impl``, ``--reshard-after-forward``, ``--ac`` and ``--offload`` are said on the command line.

Oracles: for selective checkpointing, torch's own ``create_selective_checkpoint_contexts`` running torchtitan's
op-level policy on Hugging Face's Llama and Qwen2 decoder layers (the live bytes the checkpoint keeps, counted
by the census; with the CPU's flash-attention kernel, ``_scaled_dot_product_flash_attention_for_cpu``, beside
the two GPU kernels of torchtitan's list, and ``preserve_rng_state=False`` as torchtitan's wrapper); for
every-K, torchtitan's counting (blocks K, 2K, ... from 1); for offload, torch's ``CPUOffload`` (what moves:
parameters, gradients, optimizer state) and the card's host link; for the chapter's worked examples, the command
itself, rerun.  Exact.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from minifsdp.memory.census import live_tensor_bytes
from minifsdp.memory.gpus import GPUS
from minifsdp.memory.plan import Run, collectives, model_state, peak
from minifsdp.memory.plan_ac import checkpointed, saved_per_unit, selective_saved
from minifsdp.memory.plan_shapes import PRESETS, ModelShape
from minifsdp.memory.plan_time import host_copies, step_time
from minifsdp.tools.cli import main

ATEN = torch.ops.aten


def _torchtitans_policy(meta):
    """torchtitan's op-level policy (``_save_list``, every second mm recomputed), the CPU's flash kernel added."""
    save = {ATEN.mm.default, ATEN._scaled_dot_product_efficient_attention.default,
            ATEN._scaled_dot_product_flash_attention.default,
            ATEN._scaled_dot_product_flash_attention_for_cpu.default}

    def policy(ctx, func, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        mode = "recompute" if ctx.is_recompute else "forward"
        if func == ATEN.mm.default:
            meta[mode] += 1
        keep = func in save and not (func == ATEN.mm.default and meta[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@pytest.mark.parametrize("family, dtype", [("llama", torch.bfloat16), ("qwen2", torch.float32)],
                         ids=["llama-bf16", "qwen2-fp32"])  # each dtype once, each family once: CI time
def test_selective_keeps_what_torchtitans_policy_saves(family, dtype):
    transformers = pytest.importorskip("transformers")
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    config, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    cfg = config(hidden_size=64, intermediate_size=176, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100, max_position_embeddings=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = model_class(cfg).to(dtype)
    batch, seq, b = 2, 16, torch.finfo(dtype).bits // 8
    x = torch.randn(batch, seq, 64, dtype=dtype, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, torch.arange(seq)[None])
    before = live_tensor_bytes()
    out = checkpoint(model.model.layers[0], x, position_embeddings=cos_sin, use_reentrant=False,
                     preserve_rng_state=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(_torchtitans_policy(defaultdict(int))))
    out = out[0] if isinstance(out, tuple) else out
    kept = live_tensor_bytes() - before - out.untyped_storage().nbytes()
    shape = ModelShape("l", "llama", hidden=64, layers=1, heads=4, kv_heads=2, vocab=100, seq=seq, ffn=176,
                       qkv_bias=family == "qwen2")
    want = selective_saved(shape, batch, seq, b)
    # the block's input existed before (the checkpoint keeps a reference): every other byte is the policy's
    assert kept == sum(want.values()) - batch * seq * 64 * b, (kept, want)
    assert ("q, v, gate, down" if family == "llama" else "o, up") in next(k for k in want if "matmuls" in k)
    assert kept < sum(shape.saved_per_block(batch, seq, b).values())  # less than the block keeps unchecked
    out.sum().backward()


def test_every_k_checkpoints_torchtitans_blocks_and_the_old_flag_is_full(capsys):
    assert checkpointed("every-3", 7) == [False, False, True, False, False, True, False]
    shape = PRESETS["llama-7b"]
    full = shape.saved_per_unit(1, 4096, 2)[0]
    only_input = 4096 * shape.hidden * 2
    assert saved_per_unit(shape, "every-2", 1, 4096, 2)[:4] == [full, only_input, full, only_input]
    assert Run(world_size=8, ac="EVERY-1").ac == "full"
    assert Run(world_size=8, activation_checkpointing=True).ac == "full"
    peaks = [peak(shape, Run(world_size=8, precision="bf16", ac=a))[0] for a in ("none", "every-2", "full")]
    assert peaks[0] > peaks[1] > peaks[2]
    outs = []
    for flags in (["--activation-checkpointing"], ["--ac", "Full"]):
        assert main(["plan", "--model", "gpt2", "--json", *flags]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1] and outs[0]["run"]["ac"] == "full"


def test_offload_moves_the_model_state_to_the_host_and_pays_the_host_link():
    shape, card = PRESETS["llama-7b"], GPUS["h100"]
    on, off = Run(world_size=64, precision="bf16"), Run(world_size=64, precision="bf16", offload="Both")
    state = model_state(shape, off)
    assert off.offload == "params" and state["host"] == state["model_state"] == model_state(shape, on)["model_state"]
    _, _, parts = peak(shape, off)
    assert parts["parameters"] == parts["optimizer_state"] == 0
    assert peak(shape, on)[0] - peak(shape, off)[0] >= model_state(shape, on)["parameters"]
    shards = sum(c.numel // c.group_size for c in collectives(shape, off)  # every gather from the shards, and
                 if c.kind != "all-gather" or c.group_size == 64)  # every reduced gradient back
    assert host_copies(shape, off) == 4 * shards and host_copies(shape, on) == 0
    assert step_time(shape, off, card)["host_link_s"] == 8 * host_copies(shape, off) / card.host_bps
    assert card.host_bps == 512e9 and "PCIe Gen5" in card.host_link  # 64 GB/s each way
    assert GPUS["h100-96"].host_bps == 3600e9 and "NVLink-C2C" in GPUS["h100-96"].host_link


def test_every_new_flag_is_in_help_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    options = capsys.readouterr().out.split("\noptions:", 1)[1]
    for flag, default in (("--impl", "fsdp1"), ("--reshard-after-forward", "true"), ("--ac", "none"),
                          ("--offload", "none")):
        entry = options.split(f"\n  {flag} ", 1)[1].split("\n  --", 1)[0]  # its lines in the option list
        assert f"(default: {default})" in " ".join(entry.split()), (flag, entry)


def test_the_json_says_every_choice(capsys):
    assert main(["plan", "--model", "llama-7b", "--world-size", "64", "--impl", "FSDP2", "--reshard-after-forward",
                 "8", "--ac", "Selective", "--offload", "params", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {k: r["run"][k] for k in ("impl", "reshard_after_forward", "ac", "offload")} == \
        {"impl": "fsdp2", "reshard_after_forward": "8", "ac": "selective", "offload": "params"}
    assert r["host_bytes_per_rank"] == r["model_state_bytes_per_rank"] and r["host_link_s"] > 0
    assert "q, v, gate, down" in r["assumptions"]["activation_checkpointing"]


@pytest.mark.parametrize("argv, says", [
    (["--impl", "fsdp3"], "unknown --impl 'fsdp3'; use fsdp1"),
    (["--reshard-after-forward", "false"], "--reshard-after-forward false is fully_shard's (give --impl fsdp2)"),
    (["--impl", "fsdp2", "--reshard-after-forward", "3"], "--reshard-after-forward 3: an int is the ranks"),
    (["--impl", "fsdp2", "--reshard-after-forward", "maybe"], "unknown --reshard-after-forward 'maybe'; use true"),
    (["--impl", "fsdp2", "--strategy", "shard_grad_op"], "for SHARD_GRAD_OP, use --reshard-after-forward false"),
    (["--ac", "every-0"], "unknown --ac 'every-0'; use none, full, selective"),
    (["--ac", "some"], "unknown --ac 'some'"),
    (["--ac", "selective", "--activation-checkpointing"], "--activation-checkpointing is --ac full; give one"),
    (["--offload", "optimizer"], "--offload optimizer: torch has no optimizer-only offload"),
    (["--offload", "disk"], "unknown --offload 'disk'; use none or params"),
    (["--offload", "params", "--strategy", "ddp"], "--offload params: DDP has no CPU offload"),
])
def test_bad_choices_are_one_line_naming_the_flag_and_the_fix(capsys, argv, says):
    assert main(["plan", "--model", "gpt2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_the_chapters_worked_examples_are_the_commands_output(capsys):
    """chapters/results/plan_options.txt, which chapter 2.3 quotes, is what each command prints now."""
    text = (Path(__file__).resolve().parents[1] / "chapters" / "results" / "plan_options.txt").read_text()
    runs = [block.split("\n", 1) for block in text.split("$ python -m minifsdp plan ")[1:]]
    flags = {f for command, _ in runs for f in command.split() if f.startswith("--")}
    assert {"--impl", "--reshard-after-forward", "--ac", "--offload"} <= flags
    for command, printed in runs:
        assert main(["plan", *command.split()]) == 0
        assert capsys.readouterr().out.rstrip("\n") == printed.rstrip("\n"), command
