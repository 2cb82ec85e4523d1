"""LoRA layers take their input as it comes under a bf16 autocast on a fp32 base (training/model/adapters.py
inputs_left_to_autocast): peft's cast of a bf16 input up to the adapter's fp32, which autocast casts straight
back, is skipped, and the loss and every gradient are the same bit for bit. Where the cast could matter (no
autocast, a half-precision base) it stays."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_ARCH
from training.model.adapters import inputs_left_to_autocast


def lora_model(dtype=torch.float32):
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=97, **TINY_ARCH)).to(dtype)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config)


def recipe(precision: str, method: str = "lora"):
    return SimpleNamespace(precision=precision, method=SimpleNamespace(type=method))


def casting(model) -> set[bool]:
    return {m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")}


def loss_and_grads(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_under_bf16_autocast_the_adapters_take_bf16_inputs_and_train_the_same():
    before = loss_and_grads(lora_model())
    model = inputs_left_to_autocast(lora_model(), recipe("bf16"))
    assert casting(model) == {False}
    after = loss_and_grads(model)
    assert torch.equal(before[0], after[0])
    assert before[1].keys() == after[1].keys() and all(
        torch.equal(before[1][k], after[1][k]) for k in before[1]
    )


@pytest.mark.parametrize(
    "why", ["fp32 run", "half-precision base", "not plain LoRA"], ids=["no", "bf16 base", "qlora"]
)
def test_the_cast_stays_where_it_can_matter(why):
    model, r = lora_model(), recipe("bf16")
    if why == "fp32 run":
        r = recipe("no")
    elif why == "half-precision base":
        model = lora_model(torch.bfloat16)
    else:
        r = recipe("bf16", "qlora")
    assert casting(inputs_left_to_autocast(model, r)) == {True}
