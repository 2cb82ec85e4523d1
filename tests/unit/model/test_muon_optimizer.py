"""train.optimizer=muon (training.model.optim.MuonWithAdamW): the parameter split its authors prescribe,
the composite stepping exactly as torch's Muon + AdamW stepped by hand under one LR schedule, an exact
state_dict round trip, and the planner counting one momentum buffer per hidden matrix."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

from conftest import TINY_ARCH
from training.config import TrainSection, parse_recipe
from training.launch.backend import Backend
from training.model.optim import MUON_ADJUST_LR, MUON_MOMENTUM, MuonWithAdamW, build_optimizer, muon_split
from training.planning.inventory import inventory
from training.planning.memory import replica_states

TRAIN = TrainSection(optimizer="muon", lr=2e-2, weight_decay=0.1, max_steps=4)
HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_ARCH, vocab_size=128, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def train_step(model, optimizers, schedulers, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    for o in optimizers:
        o.step()
    for s in schedulers:
        s.step()
    for o in optimizers:
        o.zero_grad()


@pytest.mark.parametrize("tied", [False, True])
def test_hidden_matrices_go_to_muon_the_rest_to_adamw(tied):
    model = tiny(tied)
    hidden, rest = muon_split(model)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in hidden}
    assert muon_names == {
        f"model.layers.{i}.{m}.{k}.weight"
        for i in range(2)
        for m, k in [*(("self_attn", k) for k in HIDDEN[:4]), *(("mlp", k) for k in HIDDEN[4:])]
    }
    rest_names = {n for n, _ in rest}
    assert "model.embed_tokens.weight" in rest_names and "model.norm.weight" in rest_names
    assert ("lm_head.weight" in rest_names) == (not tied)  # tied: the head is the embedding, once
    assert all("norm" in n or "embed" in n or "lm_head" in n for n in rest_names)
    optimizer = build_optimizer(model, TRAIN)
    assert isinstance(optimizer, MuonWithAdamW)
    assert {id(p) for g in optimizer.muon.param_groups for p in g["params"]} == {id(p) for p in hidden}
    adamw = {id(p): g["weight_decay"] for g in optimizer.adamw.param_groups for p in g["params"]}
    assert adamw[id(model.get_input_embeddings().weight)] == 0.1  # decay on matrices only
    assert adamw[id(model.model.norm.weight)] == 0.0
    assert optimizer.param_groups == optimizer.muon.param_groups + optimizer.adamw.param_groups


def test_composite_steps_exactly_as_muon_and_adamw_by_hand():
    model = tiny(tied=False)
    ref = copy.deepcopy(model)
    optimizer = build_optimizer(model, TRAIN)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=4)

    hidden, rest = muon_split(ref)
    decay = [p for n, p in rest if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in rest if not (p.ndim >= 2 and "norm" not in n)]
    muon = torch.optim.Muon(
        hidden,
        lr=TRAIN.lr,
        weight_decay=0.1,
        momentum=MUON_MOMENTUM,
        nesterov=True,
        adjust_lr_fn=MUON_ADJUST_LR,
    )
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=TRAIN.lr,
        betas=TRAIN.betas,
    )
    by_hand = [get_scheduler("cosine", o, num_warmup_steps=1, num_training_steps=4) for o in (muon, adamw)]
    for ids in batches(3):
        train_step(model, [optimizer], [scheduler], ids)
        train_step(ref, [muon, adamw], by_hand, ids)
        assert [g["lr"] for g in optimizer.param_groups] == [
            g["lr"] for o in (muon, adamw) for g in o.param_groups
        ]
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    embed = model.get_input_embeddings().weight
    assert set(optimizer.state[embed]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(optimizer.state[hidden_of(model)]) == {"momentum_buffer"}


def hidden_of(model) -> torch.Tensor:
    return model.model.layers[0].self_attn.q_proj.weight


def test_state_dict_round_trips_exactly():
    model = tiny(tied=True)
    optimizer = build_optimizer(model, TRAIN)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=4)
    data = batches(3)
    for ids in data[:2]:
        train_step(model, [optimizer], [scheduler], ids)
    saved_model = copy.deepcopy(model)
    saved, saved_sched = copy.deepcopy(optimizer.state_dict()), scheduler.state_dict()

    resumed_opt = build_optimizer(saved_model, TRAIN)
    resumed_sched = get_scheduler("linear", resumed_opt, num_warmup_steps=1, num_training_steps=4)
    resumed_opt.load_state_dict(copy.deepcopy(saved))
    resumed_sched.load_state_dict(saved_sched)
    assert resumed_opt.param_groups[0] is resumed_opt.muon.param_groups[0]  # the loaded groups, joined again
    again = resumed_opt.state_dict()
    for part in ("muon", "adamw"):
        assert again[part]["param_groups"] == saved[part]["param_groups"]
        for i, state in saved[part]["state"].items():
            for k, v in state.items():
                assert torch.equal(again[part]["state"][i][k], v), (part, i, k)
    assert torch.equal(
        resumed_opt.state[hidden_of(saved_model)]["momentum_buffer"],
        optimizer.state[hidden_of(model)]["momentum_buffer"],
    )
    train_step(model, [optimizer], [scheduler], data[2])
    train_step(saved_model, [resumed_opt], [resumed_sched], data[2])
    for (name, p), q in zip(model.named_parameters(), saved_model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_planner_counts_one_momentum_buffer_per_hidden_matrix():
    raw = {
        "output_dir": "unused",
        "model": {"name_or_path": "tiny"},
        "data": {"train": ["unused.jsonl"]},
    }
    config = LlamaConfig(**TINY_ARCH, vocab_size=128)
    model = tiny(tied=False)
    hidden, rest = muon_split(model)
    adam = parse_recipe(raw)
    muon = parse_recipe({**raw, "train": {"optimizer": "muon"}})
    inv_adam, inv_muon = inventory(adam, config), inventory(muon, config)
    assert inv_muon.muon_numel == sum(p.numel() for p in hidden) and inv_muon.muon_tensors == len(hidden)
    assert inv_adam.muon_numel == 0
    b = replica_states(muon, inv_muon, Backend("single", "", "single"))
    expected = 4 * sum(p.numel() for p in hidden) + 2 * 4 * sum(p.numel() for _, p in rest) + 4 * len(rest)
    assert b.optim == expected
