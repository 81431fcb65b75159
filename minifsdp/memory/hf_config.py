"""A model for ``python -m minifsdp plan --hf-config FILE``: the shape a Hugging Face ``config.json`` describes.

Users describe their model by the ``config.json`` that ships with its weights, so the plan reads one.  It knows
the decoder-only families whose layers :class:`~minifsdp.memory.plan_shapes.ModelShape` counts op by op:

* Llama and Mistral (``model_type`` "llama", "mistral"): RMSNorm, SwiGLU, rotary attention with grouped-query
  key/value heads (``num_key_value_heads``), the head tied to the embedding if ``tie_word_embeddings``;
* Qwen2 (``model_type`` "qwen2"): Llama's layer with biases on q, k and v;
* GPT-2 (``model_type`` "gpt2"): learned positions, LayerNorm, GELU MLP (``n_inner``, default 4 x width), tied
  head; trained as TinyGPT's architecture (GPT-2's, without dropout).

Anything else is refused with one line that says why, rather than planned as a model it is not: an encoder
such as BERT (``model_type`` "bert", e.g. all-MiniLM-L6-v2: no causal language-model head, another layer), a
head size other than width / heads (``head_dim``), biases where the counted layer has none.
"""

from __future__ import annotations

import json
from pathlib import Path

from minifsdp.memory.plan_shapes import ModelShape

__all__ = ["FAMILIES", "shape_from_hf_config"]

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")


def _read(path) -> dict:
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--hf-config {path}: cannot read it ({e.strerror}); give the path of a config.json") \
            from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-config {path}: not JSON ({e.msg}, line {e.lineno}); give a config.json") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--hf-config {path}: a config.json holds one JSON object; this one does not")
    return cfg


def _need(cfg: dict, path, *keys: str) -> list[int]:
    missing = [k for k in keys if not isinstance(cfg.get(k), int) or cfg[k] < 1]
    if missing:
        raise ValueError(f"--hf-config {path}: {', '.join(missing)} missing or not a positive whole number "
                         f"(a {cfg.get('model_type')} config has them)")
    return [cfg[k] for k in keys]


def shape_from_hf_config(path) -> ModelShape:
    """The :class:`ModelShape` of the model ``path`` (a ``config.json``) describes; ValueError (one line) when the
    family is not one the plan counts."""
    cfg = _read(path)
    kind = str(cfg.get("model_type", "")).lower()
    name = str(cfg.get("_name_or_path") or Path(path).resolve().parent.name or kind)
    source = f"Hugging Face config {path} (model_type {kind!r})"
    if kind not in FAMILIES:
        what = (" an encoder (no causal language-model head, post-norm layers with biases)"
                if kind in ("bert", "roberta", "distilbert", "xlm-roberta") else "")
        raise ValueError(f"--hf-config {path}: model_type {kind or None!r} is{what or ' not a family plan counts'}; "
                         f"plan counts decoder-only language models: {', '.join(FAMILIES)} (or give its shape: "
                         f"--layers, --hidden, ...)")
    if kind == "gpt2":
        hidden, layers, heads, vocab, seq = _need(cfg, path, "n_embd", "n_layer", "n_head", "vocab_size",
                                                  "n_positions")
        return ModelShape(name, "gpt", hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq,
                          ffn=cfg.get("n_inner") or 4 * hidden, source=source)
    hidden, layers, heads, vocab, ffn, seq = _need(cfg, path, "hidden_size", "num_hidden_layers",
                                                   "num_attention_heads", "vocab_size", "intermediate_size",
                                                   "max_position_embeddings")
    head_dim = cfg.get("head_dim")
    if head_dim and head_dim * heads != hidden:
        raise ValueError(f"--hf-config {path}: head_dim {head_dim} x {heads} heads is not hidden_size {hidden}; "
                         f"plan counts heads of width hidden / heads only")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"--hf-config {path}: attention_bias / mlp_bias set; plan counts a {kind} layer "
                         f"without those biases")
    act = str(cfg.get("hidden_act", "silu"))
    if act != "silu":
        raise ValueError(f"--hf-config {path}: hidden_act {act!r}; plan counts a {kind} MLP with SiLU (SwiGLU)")
    return ModelShape(name, "llama", hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq, ffn=ffn,
                      kv_heads=cfg.get("num_key_value_heads") or heads, tied=bool(cfg.get("tie_word_embeddings")),
                      qkv_bias=kind == "qwen2", source=source)
