"""A LoRA policy's merged generation copy (training/generation/merged.py): it computes what the adapter on its base
computes, follows every training step, never writes into the policy, and stands in for the policy only where it
can (a plain LoRA adapter under mixed precision, on the main thread, a whole model, with room for it on a GPU). Under bf16 the
engine's draws through it are exactly those of peft's own merge (merge_and_unload)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_ARCH
from training.generation import Request, TransformersEngine, sample_seed
from training.generation.merged import MergedCopy, why_not

EOS, PAD = 2, 0
CONTEXTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 32, 33]]


def lora_policy(**lora) -> torch.nn.Module:
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=300, tie_word_embeddings=True, **TINY_ARCH))
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora))
    for name, p in policy.named_parameters():
        if "lora_B" in name:  # an adapter that has learnt something (peft starts B at zero)
            torch.nn.init.normal_(p, std=0.2)
    return policy


def train_a_step(policy) -> None:
    x = torch.tensor([CONTEXTS[1]])
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    policy(input_ids=x, labels=x).loss.backward()
    opt.step()


def peft_merged(policy) -> torch.nn.Module:
    """peft's own merge of a copy of the policy: the reference."""
    return copy.deepcopy(policy).merge_and_unload().eval()


def drawn(engine, model) -> list[list[int]]:
    requests = [Request(ids, sample_seed(3, 1, row, 0), 16) for row, ids in enumerate(CONTEXTS)]
    c = engine.batch(model, requests, "cpu")
    return [c.ids[k, : int(c.mask[k].sum())].tolist() for k in range(len(CONTEXTS))]


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_the_copy_computes_what_the_adapter_computes_and_follows_training():
    policy = lora_policy()
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    merged = MergedCopy(policy)
    x = torch.tensor([CONTEXTS[1], CONTEXTS[1][::-1]])
    for _ in range(2):
        with torch.no_grad():
            want, got = policy(input_ids=x).logits, merged.model(input_ids=x).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        train_a_step(policy)
        assert merged.refresh() and not merged.refresh()  # merged again once per change, not at every call
    assert type(merged.model) is LlamaForCausalLM and not any(
        p.requires_grad for p in merged.model.parameters()
    )
    assert merged.model.lm_head.weight is merged.model.model.embed_tokens.weight  # the tie kept
    assert all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if not p.requires_grad)


def test_under_bf16_the_engine_draws_what_peft_merged_draws_before_and_after_a_step():
    policy = lora_policy()
    engine = TransformersEngine(3, 16, 1.0, 1.0, [EOS], PAD, autocast=bf16)
    plain = TransformersEngine(3, 16, 1.0, 1.0, [EOS], PAD, autocast=bf16, merge_lora=False)
    rounds = []
    for _ in range(2):
        rounds.append(drawn(engine, policy))
        assert engine._copy is not None and engine._copy.source is policy
        reference = peft_merged(policy)
        # merged in float32 even though the draw runs under autocast (a bf16 B @ A would round the adapter), the
        # linear layers then kept rounded to bf16 as autocast would cast them at each call; the rest in float32
        want, copied = reference.state_dict(), engine._copy.model
        assert all(torch.equal(w, want[n].to(w.dtype)) for n, w in copied.state_dict().items())
        assert (
            copied.lm_head.weight.dtype == copied.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
        )
        assert copied.model.embed_tokens.weight.dtype == copied.model.norm.weight.dtype == torch.float32
        assert rounds[-1] == drawn(plain, reference)
        train_a_step(policy)
    # the step changed the draws: a copy left as it was would fail the second round
    assert rounds[0] != rounds[1]


def test_the_engine_generates_through_the_policy_itself_where_a_copy_cannot_stand_for_it():
    policy = lora_policy()
    fp32 = TransformersEngine(3, 16, 1.0, 1.0, [EOS], PAD)
    drawn(fp32, policy)  # no mixed precision: fp32 draws are the policy's own, token for token
    background = TransformersEngine(3, 16, 1.0, 1.0, [EOS], PAD, autocast=bf16)
    worker = threading.Thread(
        target=drawn, args=(background, policy)
    )  # rl.async's thread: the copy is the main's
    worker.start()
    worker.join()
    synced = TransformersEngine(3, 16, 1.0, 1.0, [EOS], PAD, synced=True, autocast=bf16)  # ZeRO-3/FSDP shards
    with bf16():
        assert synced._generating(policy, "cpu") is policy
    dora = TransformersEngine(3, 16, 1.0, 1.0, [EOS], PAD, autocast=bf16)
    drawn(dora, lora_policy(use_dora=True))
    assert fp32._copy is None and background._copy is None and synced._copy is None and dora._copy is None


def test_without_room_for_the_copy_the_engine_generates_through_the_adapter_and_says_why(monkeypatch, caplog):
    """On a GPU the copy is made only where it takes at most half of the memory left (merged.no_room, which reads
    CUDA's allocator): without room the draws are the adapter's own and the log says why, once."""
    import training.generation.transformers_engine as te

    reason = "the merged copy (0.50 GiB) would take over half of the GPU's free 0.60 GiB"
    monkeypatch.setattr(te, "no_room", lambda model: reason)
    policy = lora_policy()
    engine = TransformersEngine(3, 16, 1.0, 1.0, [EOS], PAD, autocast=bf16)
    plain = TransformersEngine(3, 16, 1.0, 1.0, [EOS], PAD, autocast=bf16, merge_lora=False)
    with caplog.at_level("WARNING", logger=te.__name__):
        assert drawn(engine, policy) == drawn(plain, policy) and drawn(engine, policy)
    assert engine._copy is None and engine._unmerged == (policy, reason)
    assert [r.getMessage() for r in caplog.records] == [
        f"the LoRA policy generates through its adapter, slower: {reason}"
    ]


@pytest.mark.parametrize(
    "lora, reason",
    [
        ({}, None),
        ({"use_dora": True}, "DoRA (model.layers.0.self_attn.q_proj)"),
        (
            {"modules_to_save": ["lm_head"]},
            "trains more than the adapter's matrices (base_model.model.lm_head",
        ),
    ],
)
def test_why_a_copy_cannot_stand_for_a_policy(lora, reason):
    said = why_not(lora_policy(**lora))
    assert said == reason or (reason and said.startswith(reason))


def test_a_model_that_is_not_a_lora_adapter_is_not_copied():
    torch.manual_seed(0)
    assert why_not(LlamaForCausalLM(LlamaConfig(vocab_size=300, **TINY_ARCH))) == "not a LoRA adapter"
