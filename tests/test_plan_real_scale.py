"""``python -m minifsdp plan`` at real scale, in one process: shapes against the models' own code, the
activation counts against what autograd saves, and per-rank bytes against the formulas.

Oracles:
* parameter counts: the modules themselves, built on the meta device (no memory): our TinyGPT at GPT-2's
  shapes, Hugging Face's ``LlamaForCausalLM`` at Llama 2's configurations; and the counts published for them;
* activations: every storage autograd saves in a forward (a ``saved_tensors_hooks`` pack hook, each storage
  once, parameters left out), exact in fp32 and bf16;
* real scale: the formulas with fp32 AdamW, 4 (parameter) + 4 (gradient) + 8 (Adam's m and v) = 16 bytes per
  parameter: 16P/N per rank under FULL_SHARD, 16P under NO_SHARD; 3 x 4P(N-1)/N bytes sent per rank under
  FULL_SHARD (less one all-gather of the root unit, gathered once), 2 x 4P(N-1)/N under SHARD_GRAD_OP and
  NO_SHARD; and, where N divides no unit, the exercise's reference (``zero_formulas``), padding included.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from minifsdp.commands.cli import main
from minifsdp.memory import zero_formulas
from minifsdp.memory.plan import Run, bytes_sent, collectives, model_state, moments, peak
from minifsdp.memory.plan_shapes import PRESETS, ModelShape, preset, shape_from_args
from minifsdp.memory.plan_time import GPUS, report, step_time
from minifsdp.models import MLP, Block, GPTConfig, TinyGPT

LLAMA = {"llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320, "llama-70b": 68_976_648_192}  # Llama 2's
GPT2 = {"gpt2": 124_439_808, "gpt2-xl": 1_557_611_200}  # Hugging Face's counts for openai-community/gpt2(-xl)


# ---- shapes -----------------------------------------------------------------------------------------------


def _gpt(shape: ModelShape, device="cpu") -> TinyGPT:
    cfg = GPTConfig(vocab_size=shape.vocab, block_size=shape.seq, n_layer=shape.layers, n_head=shape.heads,
                    n_embd=shape.hidden)
    with torch.device(device):
        return TinyGPT(cfg, seed=0)


@pytest.mark.parametrize("name", ["tiny", "mini", "bench", "gpt2", "gpt2-xl"])
def test_gpt_shapes_are_tinygpts_units_tensor_by_tensor(name):
    shape = PRESETS[name]
    model = _gpt(shape, "meta")
    root = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    blocks = [list(b.parameters()) for b in model.modules() if isinstance(b, Block)]
    assert shape.tensor_numels() == [[p.numel() for p in root]] + [[p.numel() for p in b] for b in blocks]
    assert shape.params == sum(p.numel() for p in model.parameters()) == GPT2.get(name, shape.params)


def test_mlp_shape_is_the_books_mlp():
    model = MLP(PRESETS["mlp"].dims)
    assert PRESETS["mlp"].tensor_numels() == [[m.weight.numel(), m.bias.numel()] for m in model.net
                                              if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("name", list(LLAMA))
def test_llama_presets_are_hugging_faces_model(name):
    transformers = pytest.importorskip("transformers")
    shape = preset(name)
    cfg = transformers.LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn,
                                   num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                                   num_key_value_heads=shape.kv_heads or shape.heads, vocab_size=shape.vocab,
                                   max_position_embeddings=shape.seq)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    layer = [p.numel() for p in model.model.layers[0].parameters()]
    assert sorted(shape.tensor_numels()[1]) == sorted(layer)
    assert shape.params == sum(p.numel() for p in model.parameters()) == LLAMA[name]


def test_a_shape_from_a_parameter_count():
    shape = shape_from_args(layers=32, hidden=4096, vocab=32000, params=6.74e9)
    assert abs(shape.params / 6.74e9 - 1) < 1e-3 and shape.heads == 32
    with pytest.raises(ValueError, match="do not fit"):
        shape_from_args(layers=32, hidden=4096, params=1e8)
    with pytest.raises(ValueError, match="heads do not divide"):
        ModelShape("x", "gpt", hidden=10, layers=1, heads=3, vocab=5, seq=4)


# ---- activations: what autograd saves ---------------------------------------------------------------------


def _saved_bytes(model, run_forward) -> int:
    """Bytes of every storage autograd saves in ``run_forward()``, each once, the model's own tensors left out."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run_forward()
    return sum(seen.values()), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [GPTConfig.tiny(), GPTConfig(vocab_size=50, block_size=24, n_layer=3, n_head=4,
                                                              n_embd=48)], ids=["tiny", "odd"])
def test_gpt_activations_are_what_autograd_saves(cfg, dtype):
    model = TinyGPT(cfg, seed=0).to(dtype)
    batch, seq = 3, cfg.block_size
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    got, _ = _saved_bytes(model, lambda: model(x, x.clone()))
    shape = ModelShape("g", "gpt", hidden=cfg.n_embd, layers=cfg.n_layer, heads=cfg.n_head, vocab=cfg.vocab_size,
                       seq=cfg.block_size)
    b = torch.finfo(dtype).bits // 8
    # the CPU's layer_norm keeps a bf16 input's mean and 1/std in bf16; CUDA's (the plan's) in fp32
    cpu_stats = (2 * cfg.n_layer + 1) * 2 * batch * seq * (4 - b)
    assert got == sum(shape.saved_in_root(batch, seq, b).values()) + sum(shape.saved_per_unit(batch, seq, b)) \
        - cpu_stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_activations_are_what_hugging_faces_layers_save(dtype):
    """A small Llama with grouped-query attention, torch's fused attention (SDPA), traced on the CPU."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    batch, seq = 2, 16
    ids = torch.randint(0, 100, (batch, seq))
    got, out = _saved_bytes(model, lambda: model(input_ids=ids, labels=ids))
    shape = ModelShape("l", "llama", hidden=64, layers=2, heads=4, kv_heads=2, vocab=100, seq=seq, ffn=176)
    b = torch.finfo(dtype).bits // 8
    held = out.logits.untyped_storage().nbytes()  # alive through the output the user keeps, not saved
    assert held == batch * seq * 100 * b
    assert got + held == sum(shape.saved_in_root(batch, seq, b).values()) + sum(shape.saved_per_unit(batch, seq, b))


# ---- real scale against the formulas ----------------------------------------------------------------------


def test_llama_7b_at_64_ranks_against_the_formulas():
    """fp32 AdamW: 4 + 4 + 8 = 16 bytes per parameter (not the ZeRO paper's mixed-precision 2 + 2 + 12)."""
    shape, n = preset("llama-7b"), 64
    p, units = shape.params, shape.unit_numels()
    assert all(u % n == 0 for u in units)  # no padding at 64 ranks: the formulas hold exactly
    steps = 4 * len(units)  # AdamW's step, one per flat parameter
    full = Run(n, "FULL_SHARD")
    assert model_state(shape, full)["model_state"] == 16 * p // n + steps
    assert model_state(shape, Run(n, "NO_SHARD"))["model_state"] == 16 * p + steps
    one = 4 * p * (n - 1) // n  # one all-gather or reduce-scatter of the model, per rank
    root = 4 * units[0] * (n - 1) // n  # the root unit is gathered once: not freed after its forward
    assert bytes_sent(shape, full) == 3 * one - root
    assert bytes_sent(shape, Run(n, "SHARD_GRAD_OP")) == bytes_sent(shape, Run(n, "NO_SHARD")) == 2 * one
    kinds = [c.kind for c in collectives(shape, full)]
    assert kinds.count("all-gather") == 2 * len(units) - 1 and kinds.count("reduce-scatter") == len(units)
    # bf16 MixedPrecision keeps the fp32 shard as its master: the same 16P/N at rest, half the bytes on the wire
    half = Run(n, "FULL_SHARD", precision="bf16")
    assert model_state(shape, half) == model_state(shape, full)
    assert bytes_sent(shape, half) * 2 == bytes_sent(shape, full)


@pytest.mark.parametrize("n", [3, 6, 96])
def test_padding_where_no_world_size_divides(n):
    """The exercise's reference (``zero_formulas``) counts padding and the step tensors its own way."""
    shape = preset("llama-13b")
    units = shape.unit_numels()
    assert any(u % n for u in units)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        assert model_state(shape, Run(n, strategy))["model_state"] == zero_formulas.fsdp_model_state_bytes(units, n)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for rank in (0, n - 1):
            assert bytes_sent(shape, Run(n, strategy), rank) == \
                zero_formulas.bytes_sent_per_step(units, n, strategy, rank=rank)
    assert model_state(shape, Run(n, "FULL_SHARD"))["model_state"] > 16 * shape.params / n  # padding costs


def test_the_peak_and_its_moments():
    shape = preset("llama-7b")
    big = Run(8, "FULL_SHARD", precision="bf16", batch=1)
    top, where, parts = peak(shape, big)
    assert top == max(sum(m.values()) for _, m in moments(shape, big)) and where.startswith("backward")
    assert parts["activations"] > parts["parameters"]  # 4,096 tokens: the activations dominate
    ckpt = peak(shape, Run(8, "FULL_SHARD", precision="bf16", activation_checkpointing=True))[2]
    assert ckpt["activations"] < parts["activations"] / 4
    # with one token per rank the model state dominates; the optimizer step (AdamW's sqrt(v)) is the peak
    assert peak(shape, Run(8, "NO_SHARD", seq=1))[1] == "optimizer step"
    # fewer ranks, more memory; SHARD_GRAD_OP holds every unit through the backward, FULL_SHARD one or two
    assert peak(shape, Run(64, "FULL_SHARD"))[0] < peak(shape, Run(8, "FULL_SHARD"))[0]
    assert peak(shape, Run(8, "SHARD_GRAD_OP"))[0] > peak(shape, Run(8, "FULL_SHARD"))[0]


def test_time_bound_and_hybrid_shard_on_the_network():
    shape, gpu = preset("llama-7b"), GPUS["h100"]
    inside = step_time(shape, Run(8, "FULL_SHARD", precision="bf16"), gpu)
    across = step_time(shape, Run(64, "FULL_SHARD", precision="bf16"), gpu)
    hybrid = step_time(shape, Run(64, "HYBRID_SHARD", precision="bf16"), gpu)
    assert inside["compute_s"] == across["compute_s"]  # the same tokens per GPU
    assert across["network_s"] > 5 * inside["network_s"]  # NVLink against InfiniBand
    assert hybrid["network_s"] < across["network_s"] / 3  # only the shard's all-reduce leaves the node
    # compute: 6 FLOPs per weight per token, at the published dense bf16 peak
    assert inside["compute_s"] == pytest.approx(6 * 4096 * shape.params / 989e12, rel=0.15)


# ---- the command ------------------------------------------------------------------------------------------


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_has_the_numbers(capsys):
    code, out, _ = _cli(capsys, "--model", "llama-7b", "--world-size", "64", "--json")
    r = json.loads(out)
    assert code == 0
    for key in ("params", "model_state_bytes_per_rank", "peak_bytes_per_rank", "bytes_sent_per_rank_per_step",
                "step_time_lower_bound_s", "peak_where", "advice"):
        assert key in r
    assert r["model_state_bytes_per_rank"] == 16 * r["params"] // 64 + 4 * 33
    assert "published" in r["gpu"]["source"] and "datasheet" in r["gpu"]["source"]


def test_plan_table_text_and_plot(capsys, tmp_path):
    png = tmp_path / "plan.png"
    code, out, _ = _cli(capsys, "--model", "llama-70b", "--world-size", "8,64,512", "--strategy", "all",
                        "--precision", "bf16", "--activation-checkpointing", "--plot", str(png))
    assert code == 0 and png.stat().st_size > 10_000
    rows = [line.split()[1] for line in out.splitlines() if line[:6].strip().isdigit()]
    assert rows.count("FULL_SHARD") == 3 and rows.count("HYBRID_SHARD") == 2  # HYBRID: several whole nodes only
    assert "N = 8: does not fit" in out and "the smallest world size that fits is 20" in out
    code, out, _ = _cli(capsys, "--model", "tiny", "--world-size", "2", "--gpu", "a100")
    assert code == 0 and "peak" in out and "advice:" in out and "A100" in out


@pytest.mark.parametrize("argv, says", [
    (["--model", "llama-7b", "--world-size", "12", "--strategy", "HYBRID_SHARD"], "not a multiple of 8"),
    (["--model", "llama-8b"], "known presets: tiny"),
    (["--model", "llama-70b", "--world-size", "8", "--precision", "bf16", "--activation-checkpointing", "--json"],
     "the smallest world size that fits is 20"),
    (["--model", "llama-70b", "--batch", "64", "--json"], "does not fit at any world size"),
    (["--layers", "32"], "--layers and --hidden"),
    (["--model", "gpt2", "--world-size", "8,x"], "--world-size takes whole numbers"),
    (["--model", "gpt2", "--strategy", "ZERO_4"], "unknown --strategy"),
    (["--model", "gpt2", "--gpu", "tpu"], "unknown --gpu"),
    (["--model", "gpt2", "--link-gbps", "400"], "two speeds"),
    (["--model", "gpt2", "--seq", "2048"], "positions for 1024 tokens"),
])
def test_bad_input_gets_one_clear_line(capsys, argv, says):
    code, out, err = _cli(capsys, *argv)
    if "fit" in says:  # not an error: the plan is printed, its advice says so
        assert code == 0 and says in json.loads(out)["advice"]
        return
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_report_of_a_run_on_one_rank_sends_nothing():
    r = report(PRESETS["tiny"], Run(1, "FULL_SHARD"), GPUS["h100"])
    assert r["bytes_sent_per_rank_per_step"] == 0 and r["overlap"] == {}
    assert math.isclose(r["step_time_lower_bound_s"], r["compute_s"])
