"""Chapter 2.3, at real scale: the shape of a model, and what that shape says about memory and compute.

A memory plan (:mod:`minifsdp.memory.plan`) needs four things from a model, all of them functions of
its shape alone (no weights, no GPU):

    unit_numels()        elements of each FSDP unit's flat parameter, the root unit first
                         (``wrap="layer"``: one unit per transformer block or Linear, the root holds the rest)
    saved_per_block()    bytes one block saves for its backward (its activations), by name
    saved_in_root()      the same for the root's layers: embeddings, final norm, the loss, the batch
    matmul_flops()       floating-point operations of one training step (forward + backward)

Three architectures, each counted from the code that runs it:

    "gpt"    minifsdp.models.TinyGPT: pre-LN blocks, GELU MLP 4x wide, learned positions, head tied to the
             token embedding, attention written out (softmax of a B x H x T x T matrix), no dropout
    "llama"  Hugging Face transformers' LlamaForCausalLM (RMSNorm, rotary positions, SwiGLU MLP, untied
             head, grouped-query attention) with torch's fused attention (SDPA: no T x T matrix is kept)
    "mlp"    minifsdp.models.MLP: Linear layers with ReLU between, mean-squared-error loss

Note (what "saved" means): the tensors autograd keeps from the forward for the backward, each storage
once (a view shares its base's bytes), as ``MemoryTracker`` counts them ("activations"). Every count
below is what the code above saves, op by op; ``tests/test_plan_real_scale.py`` traces TinyGPT and Hugging
Face's LlamaDecoderLayer with a ``saved_tensors_hooks`` and checks the counts to the byte.

Presets (``PRESETS``) are public configurations, each with its source. "llama-7b", "llama-13b" and
"llama-70b" are Llama 2's (Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models",
Table 1 and the Hugging Face configs meta-llama/Llama-2-{7b,13b,70b}-hf); "gpt2" and "gpt2-xl" are GPT-2's
shapes (Radford et al. 2019; Hugging Face configs openai-community/gpt2 and gpt2-xl) trained as TinyGPT's
architecture (GPT-2's, without dropout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["ModelShape", "PRESETS", "preset", "shape_from_args"]

INT64 = 8  # token ids and targets
FP32 = 4  # norms' statistics (CUDA's layer_norm keeps them in fp32 for bf16 input), the upcast loss


@dataclass(frozen=True)
class ModelShape:
    """A model described by its shape.  ``seq`` is the context length (GPT: the position table's size)."""

    name: str
    arch: str  # "gpt" | "llama" | "mlp"
    hidden: int = 0
    layers: int = 0
    heads: int = 1
    vocab: int = 0
    seq: int = 0
    ffn: int = 0  # the MLP's inner width (gpt: 4 x hidden)
    kv_heads: int = 0  # llama's grouped-query attention (0: as many as heads)
    tied: bool = False  # llama: the head shares the embedding's weight (Llama 3.2 1B, Qwen2 0.5B); gpt: always
    qkv_bias: bool = False  # llama: biases on q, k, v (Qwen2's)
    dims: tuple[int, ...] = ()  # mlp: (in, hidden..., out)
    source: str = ""

    def __post_init__(self):
        if self.arch not in ("gpt", "llama", "mlp"):
            raise ValueError(f"unknown architecture {self.arch!r}; use gpt, llama or mlp.")
        if self.arch == "mlp":
            if len(self.dims) < 2 or min(self.dims) < 1:
                raise ValueError(f"an MLP needs dims (in, ..., out) of at least two positive widths, got {self.dims}.")
            return
        if min(self.hidden, self.layers, self.heads, self.vocab, self.seq) < 1:
            raise ValueError(f"{self.name}: hidden, layers, heads, vocab and seq must be positive.")
        if self.hidden % self.heads:
            raise ValueError(f"{self.name}: {self.heads} heads do not divide the hidden size {self.hidden}; "
                             f"choose --heads that divides --hidden.")
        if self.heads % self.kv_groups_of():
            raise ValueError(f"{self.name}: {self.kv_heads} key/value heads do not divide {self.heads} heads.")

    # ---- parameters ------------------------------------------------------------------------------
    def kv_groups_of(self) -> int:
        return self.kv_heads or self.heads

    @property
    def kv_width(self) -> int:
        """Width of the key (and the value) projection: kv_heads x head size."""
        return self.kv_groups_of() * (self.hidden // self.heads)

    @property
    def inner(self) -> int:
        return self.ffn or 4 * self.hidden

    def _block_tensors(self) -> list[tuple[int, int]]:
        """(rows, elements per row) of each parameter of one block: a Linear's weight is (out, in)."""
        h, f, kv = self.hidden, self.inner, self.kv_width
        if self.arch == "gpt":  # ln1, qkv, proj, ln2, fc1, fc2: weight and bias each
            return [(h, 1), (h, 1), (3 * h, h), (3 * h, 1), (h, h), (h, 1), (h, 1), (h, 1), (f, h), (f, 1),
                    (h, f), (h, 1)]
        if self.qkv_bias:  # Qwen2: each of q, k, v followed by its bias
            return [(h, h), (h, 1), (kv, h), (kv, 1), (kv, h), (kv, 1), (h, h), (f, h), (f, h), (h, f), (h, 1),
                    (h, 1)]
        # llama: q, k, v, o, gate, up, down (no biases), the two RMSNorm weights
        return [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h, 1), (h, 1)]

    def _root_tensors(self) -> list[tuple[int, int]]:
        h = self.hidden
        if self.arch == "gpt":  # tok_emb, pos_emb, ln_f weight and bias; the head is tied to tok_emb
            return [(self.vocab, h), (self.seq, h), (h, 1), (h, 1)]
        if self.tied:  # llama with tie_word_embeddings: lm_head is embed_tokens, counted once
            return [(self.vocab, h), (h, 1)]
        return [(self.vocab, h), (h, 1), (self.vocab, h)]  # llama: embed_tokens, norm, lm_head (untied)

    def block_numel(self) -> int:
        """Parameters of one block (one FSDP unit under ``wrap="layer"``)."""
        return sum(r * c for r, c in self._block_tensors())

    def root_numel(self) -> int:
        """Parameters the root unit holds: embeddings, final norm, an untied head."""
        return sum(r * c for r, c in self._root_tensors())

    def tensor_shapes(self, wrap: str = "layer") -> list[list[tuple[int, int]]]:
        """Each unit's parameter tensors as (rows, elements per row), in ``model.parameters()`` order (a tied
        weight once), the root first; ``wrap`` "layer" (one unit per block, or per Linear of an MLP) or "none"
        (one unit).  FSDP2 shards each tensor by rows (:mod:`minifsdp.memory.plan_fsdp2`)."""
        if wrap not in ("layer", "none"):
            raise ValueError(f"unknown wrap {wrap!r}; use 'layer' (one unit per block) or 'none' (one unit).")
        if self.arch == "mlp":
            units = [[(b, a), (b, 1)] for a, b in zip(self.dims[:-1], self.dims[1:])]
        else:
            units = [self._root_tensors()] + [self._block_tensors() for _ in range(self.layers)]
        return units if wrap == "layer" else [[t for unit in units for t in unit]]

    def tensor_numels(self, wrap: str = "layer") -> list[list[int]]:
        """Each unit's parameter tensors' elements (as :meth:`tensor_shapes`).  An MLP's root holds no parameter
        (each Linear is a unit).  DDP's buckets are cut from these tensors; AdamW keeps a 4-byte ``step`` per
        tensor it optimizes (DDP's and FSDP2's: per tensor; FSDP1's: per flat parameter)."""
        return [[r * c for r, c in unit] for unit in self.tensor_shapes(wrap)]

    def unit_numels(self, wrap: str = "layer") -> list[int]:
        """Each FSDP unit's flat-parameter elements (unpadded), the root unit first."""
        return [sum(unit) for unit in self.tensor_numels(wrap)]

    def root_is_a_unit(self, wrap: str = "layer") -> bool:
        """Whether ``unit_numels(wrap)[0]`` is the root's own unit (an MLP wrapped per Linear has none)."""
        return self.arch != "mlp" or wrap == "none"

    @property
    def params(self) -> int:
        return sum(self.unit_numels())

    # ---- activations ------------------------------------------------------------------------------
    def saved_per_block(self, batch: int, seq: int, act_bytes: int) -> dict[str, int]:
        """Bytes one block saves for its backward, by what saves them; ``act_bytes``: 4 (fp32) or 2 (bf16)."""
        b, h, f = act_bytes, self.hidden, self.inner
        e, s = batch * seq * h, batch * seq  # elements of one hidden-sized activation; tokens
        if self.arch == "mlp":
            return {}
        if self.arch == "gpt":
            return {
                "layer norms: inputs, mean and 1/std": 2 * (e * b + 2 * s * FP32),
                "inputs of qkv, proj, fc1": 3 * e * b,
                "q, k, v (contiguous copies for the matmuls)": 3 * e * b,
                "softmax output (B x H x T x T)": batch * self.heads * seq * seq * b,
                "the inverted causal mask (bool, T x T) masked_fill keeps": seq * seq,
                "GELU input, fc2 input (4 x wide)": 2 * batch * seq * f * b,
            }
        kv = batch * seq * self.kv_width
        return {
            "RMSNorms: fp32 input, normalized, 1/rms": 2 * (e * FP32 + e * b + s * FP32),
            "inputs of q/k/v, o (the attention's output) and gate/up": 3 * e * b,
            "attention: rotated q and k, v, log-sum-exp": (e + 2 * kv) * b + batch * self.heads * seq * FP32,
            "SwiGLU: gate, SiLU(gate), up, their product": 4 * batch * seq * f * b,
        }

    def saved_in_root(self, batch: int, seq: int, act_bytes: int) -> dict[str, int]:
        """Bytes saved outside the blocks: the batch, embeddings, final norm, head and loss (or the MLP's)."""
        b, s = act_bytes, batch * seq
        if self.arch == "mlp":  # the loss's: the output and the target (the Linears' inputs: saved_per_unit)
            return {"output and target (for the loss)": batch * self.dims[-1] * (b + FP32)}
        e = s * self.hidden
        out = {"input ids and targets (int64)": 2 * s * INT64,
               "the loss's total weight (one number)": b if self.arch == "gpt" else FP32}
        if self.arch == "gpt":
            out["position ids (int64)"] = seq * INT64
            out["final norm: input, mean and 1/std; head input"] = e * b + 2 * s * FP32 + e * b
            out["log-softmax of the logits (the loss)"] = s * self.vocab * b
        else:  # HF: the head's output is kept by the model's output; the loss upcasts it to fp32
            head_dim = self.hidden // self.heads
            out["rotary cos and sin (one copy for every sequence)"] = 2 * seq * head_dim * b
            out["final norm: fp32 input, normalized, 1/rms; head input"] = e * FP32 + e * b + s * FP32 + e * b
            out["logits (held by the output) and their fp32 log-softmax"] = s * self.vocab * (b + FP32)
        return out

    def saved_per_unit(self, batch: int, seq: int, act_bytes: int) -> list[int]:
        """Bytes each non-root unit saves for its backward, in forward order (a block's; a Linear's input)."""
        if self.arch != "mlp":
            return [sum(self.saved_per_block(batch, seq, act_bytes).values())] * self.layers
        # Linear l saves its input: the batch (fp32) for the first, the ReLU before it for the others (ReLU
        # saves that same output)
        return [batch * d * (FP32 if i == 0 else act_bytes) for i, d in enumerate(self.dims[:-1])]

    def flow_bytes(self, batch: int, seq: int, act_bytes: int) -> int:
        """One gradient flowing back between units: B x T x hidden (an MLP: its widest layer)."""
        if self.arch == "mlp":
            return batch * max(self.dims) * act_bytes
        return batch * seq * self.hidden * act_bytes

    def loss_backward_bytes(self, batch: int, seq: int, act_bytes: int) -> int:
        """Gradients alive at the first step of the backward, through the loss: two B x T x V tensors
        (of the log-softmax output and of the logits), in the dtype the loss is computed in."""
        if self.arch == "mlp":
            return 2 * batch * self.dims[-1] * act_bytes
        loss_bytes = act_bytes if self.arch == "gpt" else FP32
        return 2 * batch * seq * self.vocab * loss_bytes

    # ---- compute ---------------------------------------------------------------------------------
    def unit_flops(self, batch: int, seq: int, wrap: str = "layer") -> list[float]:
        """Floating-point operations of one forward + backward, per unit (as ``unit_numels``): 6 per matmul
        weight per token (2 forward, 4 backward; Kaplan et al. 2020), plus attention's scores and weighted sum,
        12 x hidden x seq per token and layer (PaLM, Chowdhery et al. 2022, appendix B).  Embedding lookups,
        norms and activations are left out (a few percent)."""
        if self.arch == "mlp":
            units = [6.0 * a * b * batch for a, b in zip(self.dims[:-1], self.dims[1:])]
        else:
            h, tokens = self.hidden, batch * seq
            block = 6.0 * self._block_matmul_weights() * tokens + 12.0 * h * seq * tokens
            units = [6.0 * self.vocab * h * tokens] + [block] * self.layers  # the root: its head
        return units if wrap == "layer" else [sum(units)]

    def _block_matmul_weights(self) -> int:
        h, f = self.hidden, self.inner
        return 4 * h * h + 2 * h * f if self.arch == "gpt" else 2 * h * h + 2 * h * self.kv_width + 3 * h * f

    def matmul_params(self) -> int:
        """Weights that multiply every token (the blocks' matrices and the head; an MLP: its Linears): the
        parameters the 6-FLOPs-per-token rule counts.  Embeddings, norms and biases are left out."""
        if self.arch == "mlp":
            return sum(a * b for a, b in zip(self.dims[:-1], self.dims[1:]))
        return self.layers * self._block_matmul_weights() + self.vocab * self.hidden

    def matmul_flops(self, batch: int, seq: int) -> float:
        """Floating-point operations of one training step (forward + backward) on ``batch`` sequences."""
        return sum(self.unit_flops(batch, seq))


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape("tiny", "gpt", hidden=32, layers=2, heads=2, vocab=96, seq=32,
                       source="minifsdp.models.GPTConfig.tiny(): the book's tiny GPT"),
    "mini": ModelShape("mini", "gpt", hidden=64, layers=4, heads=4, vocab=96, seq=64,
                       source="minifsdp.models.GPTConfig.mini()"),
    "bench": ModelShape("bench", "gpt", hidden=512, layers=6, heads=8, vocab=96, seq=128,
                        source="minifsdp.models.GPTConfig.bench()"),
    "mlp": ModelShape("mlp", "mlp", dims=(16, 32, 32, 8), source="minifsdp.models.MLP(): the book's MLP"),
    "gpt2": ModelShape("gpt2", "gpt", hidden=768, layers=12, heads=12, vocab=50257, seq=1024,
                       source="GPT-2 small (Radford et al. 2019); Hugging Face config openai-community/gpt2"),
    "gpt2-xl": ModelShape("gpt2-xl", "gpt", hidden=1600, layers=48, heads=25, vocab=50257, seq=1024,
                          source="GPT-2 XL (Radford et al. 2019); Hugging Face config openai-community/gpt2-xl"),
    "llama-7b": ModelShape("llama-7b", "llama", hidden=4096, layers=32, heads=32, vocab=32000, seq=4096, ffn=11008,
                           source="Llama 2 7B (Touvron et al. 2023, Table 1); Hugging Face config "
                                  "meta-llama/Llama-2-7b-hf"),
    "llama-13b": ModelShape("llama-13b", "llama", hidden=5120, layers=40, heads=40, vocab=32000, seq=4096,
                            ffn=13824, source="Llama 2 13B (Touvron et al. 2023, Table 1); Hugging Face config "
                                              "meta-llama/Llama-2-13b-hf"),
    "llama-70b": ModelShape("llama-70b", "llama", hidden=8192, layers=80, heads=64, kv_heads=8, vocab=32000,
                            seq=4096, ffn=28672,
                            source="Llama 2 70B (Touvron et al. 2023, Table 1: grouped-query attention); Hugging "
                                   "Face config meta-llama/Llama-2-70b-hf"),
}


def preset(name: str) -> ModelShape:
    """A preset by name, case ignored ("LLAMA-7B"); an unknown one is an error that lists the known ones."""
    if str(name).lower() not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known presets: {', '.join(PRESETS)} (or give a shape: "
                         f"--layers, --hidden, --vocab, --heads)")
    return PRESETS[str(name).lower()]


def shape_from_args(layers: int, hidden: int, vocab: int = 32000, heads: int | None = None, seq: int = 4096,
                    params: float | None = None, arch: str = "llama", ffn: int | None = None,
                    kv_heads: int | None = None, tied: bool = False) -> ModelShape:
    """A model from its shape.  ``heads``: default one per 128 of width.  ``ffn``: llama's 8/3 x hidden
    rounded up to 256 (as Llama's), gpt's 4 x hidden.  ``kv_heads``: grouped-query attention (llama; default
    as many as ``heads``).  With ``params`` (and no ``ffn``), the MLP's width is set so that the whole model has
    about that many parameters (the shape fixes everything else)."""
    if params is not None and ffn is not None:
        raise ValueError("give --params or --ffn, not both: --params sets the MLP's width (--ffn)")
    if kv_heads and arch != "llama":
        raise ValueError("--kv-heads is grouped-query attention, a llama shape's; gpt has one key and value per head")
    heads = heads or max(1, hidden // 128)
    if arch == "llama" and ffn is None:
        ffn = -(-int(8 * hidden / 3) // 256) * 256
    shape = ModelShape("custom", arch, hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq=seq,
                       ffn=ffn or 0, kv_heads=kv_heads or 0, tied=tied and arch == "llama",
                       source="a shape given on the command line")
    if params is None:
        return shape
    per_block = (params - shape.root_numel()) / layers
    mlp_width_of = 3 * hidden if arch == "llama" else 2 * hidden + 1  # parameters per unit of inner width
    rest = shape.block_numel() - mlp_width_of * shape.inner
    inner = round((per_block - rest) / mlp_width_of)
    if inner < 1:
        raise ValueError(f"{params:.3g} parameters do not fit {layers} layers of width {hidden} with a "
                         f"{vocab}-token vocabulary: the embeddings and attention alone hold "
                         f"{shape.root_numel() + layers * rest:.3g}; give fewer layers or a smaller width.")
    return dataclasses.replace(shape, ffn=inner)
