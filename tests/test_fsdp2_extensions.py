"""Chapter 5: all-gather extensions beyond torch's own test file: an int8 all-gather with a scale, bitwise vs torch.

torch's ``test_fully_shard_extensions.py`` (ported in ``tests/torch_suite/fsdp2/test_extensions.py``) passes no
metadata and never looks at the collective.  Here every weight's local tensor gets hooks (patched on, as torch's
monkey-patch test does) that quantize its rows to int8 with a per-row fp32 scale: two all-gather inputs of two
dtypes, beside the plain fp32 biases of the same group, so the group is gathered as bytes.  The metadata is a
fresh object per call that the post hook checks is the one its pre hook made.  Oracle: torch's ``fully_shard`` in
the same spawn, same seeds (the port's runner); ours must return exactly what torch's returns: losses and local
shards (bitwise), how often each hook ran and with ``out=`` or not, the dtype and size of every all-gather, and
the storage sizes of the post hook's inner tensors after a forward (0 bytes: freed at reshard, or kept).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.torch_suite.fsdp2 import _side as S


def _int8_hooks(calls: list, inner_seen: list):
    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = -(-outer_size[0] // mesh.size())  # the padded shard: every rank sends as many rows
        scale = torch.ones(rows, 1)
        scale[: self.shape[0]] = self.detach().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        data = torch.zeros(rows, *outer_size[1:], dtype=torch.int8)
        data[: self.shape[0]] = torch.round(self.detach() / scale[: self.shape[0]]).to(torch.int8)
        meta = {"rows": self.shape[0], "token": object()}
        self._last_meta = meta
        calls.append("pre")
        return (data, scale), meta

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        assert metadata is self._last_meta, "the post hook got another call's metadata"
        data, scale = outputs
        assert data.dtype == torch.int8 and scale.dtype == torch.float32, (data.dtype, scale.dtype)
        full = data.to(param_dtype) * scale.to(param_dtype)
        if out is not None:
            calls.append("post_out")
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full[: out.shape[0]])  # the gathered rows hold padding below the weight's
            return None
        calls.append("post")
        inner_seen.append(full)
        return full, (full,)
    return pre, post


@contextlib.contextmanager
def _record_all_gathers(gathers: list):
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    orig = getattr(dist, name)

    def record(output, input, *args, **kwargs):
        gathers.append((str(output.dtype), output.numel()))
        return orig(output, input, *args, **kwargs)
    with mock.patch.object(dist, name, record):
        yield


def case_int8_rowwise(api, raf):
    calls, inner, gathers = [], [], []
    torch.manual_seed(0)
    # even rows: torch requires every input of an unevenly sharded weight to have its padded shape, a scale too
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    api.fully_shard(model[0], reshard_after_forward=raf)
    api.fully_shard(model, reshard_after_forward=raf)
    pre, post = _int8_hooks(calls, inner)
    for name, p in model.named_parameters():
        if "weight" in name:
            local = p._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = post.__get__(local)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    inp = torch.randn(4, 6)
    losses, freed = [], []
    with _record_all_gathers(gathers):
        for _ in range(3):
            loss = model(inp).sum()
            freed.append([t.untyped_storage().size() for t in inner])  # after the forward's reshards
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach().clone())
    return {"losses": losses, "shards": [p.detach().to_local().clone() for p in model.parameters()],
            "calls": calls, "gathers": gathers, "inner_storage_after_forward": freed}


CASES = S.Cases2()
for _raf in (True, False):
    CASES.add(case_int8_rowwise, raf=_raf, vs_torch=(0, 0))


@pytest.mark.parametrize("cid", list(CASES))
def test_int8_all_gather_extension_as_torch(cid):
    S.check(__name__, cid)
