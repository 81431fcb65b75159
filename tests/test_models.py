"""The shared models and corpus: deterministic from a seed, tied weights, sizes as documented."""

import torch

from minifsdp.models import MLP, CharCorpus, GPTConfig, TinyGPT


def test_same_seed_same_numbers_other_seed_other_numbers():
    a, b, c = TinyGPT(seed=0), TinyGPT(seed=0), TinyGPT(seed=1)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)
    assert torch.equal(MLP(seed=3).net[0].weight, MLP(seed=3).net[0].weight)


def test_building_a_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    TinyGPT(seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_gpt_has_a_tied_head_and_a_buffer():
    m = TinyGPT()
    assert m.lm_head.weight is m.tok_emb.weight
    names = [n for n, _ in m.named_parameters()]
    assert "lm_head.weight" not in names  # named_parameters() lists a shared tensor once
    assert any(n.endswith("causal_mask") for n, _ in m.named_buffers())


def test_sizes_span_tests_to_benchmarks():
    count = lambda cfg: sum(p.numel() for p in TinyGPT(cfg).parameters())
    assert count(GPTConfig.tiny()) < 100_000
    assert 15e6 < count(GPTConfig.bench()) < 30e6


def test_loss_and_a_training_step():
    corpus = CharCorpus()
    m = TinyGPT()
    x, y = corpus.batch(step=0, batch_size=4, block_size=m.cfg.block_size)
    assert x.shape == y.shape == (4, m.cfg.block_size) and torch.equal(x[:, 1:], y[:, :-1])
    loss = m(x, y)
    assert abs(loss.item() - torch.log(torch.tensor(96.0)).item()) < 0.5  # near-uniform at init
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_rank_batches_split_the_global_batch():
    corpus = CharCorpus()
    full, _ = corpus.batch(step=7, batch_size=6, block_size=8)
    parts = [corpus.batch(step=7, batch_size=3, block_size=8, rank=r, world_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), full)
    mlp = MLP()
    xs = [mlp.batch(2, 4, r, 2)[0] for r in range(2)]
    assert not torch.equal(xs[0], xs[1])
