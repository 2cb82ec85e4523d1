"""Knowledge distillation, piece by piece: the divergence (and its gradient) equals TRL's GKD
`generalized_jsd_loss` for beta 0, 1 and in between; the chunked loss equals the whole-logits one, with its
gradients; through a tiny model the heads' interception gives the loss of plain logits; a teacher with
another vocabulary is refused, naming both; the recipe refuses what distillation does not combine with."""

from __future__ import annotations

import copy

import pytest
import torch
from trl.experimental.gkd.gkd_trainer import GKDTrainer  # noqa: E402 (test-only reference)

from conftest import TOKENIZER
from training.config import DistillSection, ModelSection, parse_recipe
from training.core.batch import IGNORE
from training.core.errors import RecipeError
from training.data.tokenizer import load_tokenizer
from training.objectives.distill import (
    ChunkedDistillLoss,
    check_same_vocabulary,
    distill_loss,
    generalized_jsd,
    row_losses,
    targets_of,
)

V = 11


@pytest.fixture(scope="module")
def logits():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, V, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(2, 5, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (2, 5), generator=g)
    labels[0, :2] = IGNORE
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_divergence_and_gradient_equal_trl_gkd(logits, beta, temperature):
    student, teacher, labels = logits
    ours_in, trl_in = student.clone().requires_grad_(True), student.clone().requires_grad_(True)
    keep = labels != IGNORE
    ours = generalized_jsd(ours_in[keep], teacher[keep], beta, temperature).sum()
    theirs = GKDTrainer.generalized_jsd_loss(trl_in, teacher, labels, beta, temperature, reduction="sum")
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    torch.testing.assert_close(ours_in.grad, trl_in.grad, atol=1e-6, rtol=1e-6)
    assert ours.item() > 0


def test_forward_and_reverse_kl_are_the_two_ends():
    s, t = torch.randn(3, V, dtype=torch.float64), torch.randn(3, V, dtype=torch.float64)
    ps, pt = s.softmax(-1), t.softmax(-1)
    forward = (pt * (pt.log() - ps.log())).sum(-1)
    reverse = (ps * (ps.log() - pt.log())).sum(-1)
    torch.testing.assert_close(generalized_jsd(s, t, 0.0, 1.0).double(), forward, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(generalized_jsd(s, t, 1.0, 1.0).double(), reverse, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("ce_weight, beta", [(0.5, 0.0), (0.0, 0.5), (0.2, 1.0)])
def test_chunked_loss_equals_whole_logits_with_gradients(ce_weight, beta):
    g = torch.Generator().manual_seed(1)
    n, h = 10, 6
    cfg = DistillSection(teacher="t", ce_weight=ce_weight, beta=beta, temperature=1.5)
    x = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, h, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    tx, tw = (
        torch.randn(n, h, generator=g, dtype=torch.float64),
        torch.randn(V, h, generator=g, dtype=torch.float64),
    )
    targets = torch.randint(0, V, (n,), generator=g)
    ce, kd = row_losses(x @ w.T + b, tx @ tw.T, targets, cfg)
    whole = ce_weight * ce.sum() + (1 - ce_weight) * kd.sum()
    whole_grads = torch.autograd.grad(whole, [x, w, b])
    sums = [0.0, 0.0]
    chunked = ChunkedDistillLoss.apply(x, w, b, tx, tw, None, targets, cfg, 3, sums)  # 4 chunks
    chunked_grads = torch.autograd.grad(chunked * 2.0, [x, w, b])  # backward scales by the incoming grad
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    assert sums == pytest.approx([ce.sum().item(), kd.sum().item()], rel=1e-6)
    for got, want in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(got, 2.0 * want)


def test_through_a_model_the_heads_give_the_loss_of_plain_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # another model, the same vocabulary
    teacher.eval().requires_grad_(False)
    ids = torch.randint(0, 500, (2, 7))
    labels = ids.clone()
    labels[0, :3] = IGNORE
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    cfg = DistillSection(teacher="t", ce_weight=0.3, beta=0.5)
    sums = [0.0, 0.0]
    got = distill_loss(student, teacher, batch, cfg, sums)
    grads = torch.autograd.grad(got, list(student.parameters()))
    targets = targets_of(batch)
    keep = targets != IGNORE
    ce, kd = row_losses(student(ids).logits[keep], teacher(ids).logits[keep], targets[keep], cfg)
    want = 0.3 * ce.sum() + 0.7 * kd.sum()
    want_grads = torch.autograd.grad(want, list(student.parameters()))
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert sums == pytest.approx([ce.sum().item(), kd.sum().item()], rel=1e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # fp32 sums in another order


def test_a_teacher_with_another_vocabulary_is_refused_naming_both():
    student = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    teacher = copy.deepcopy(student)
    teacher.add_tokens(["<tool_call_x>"])
    check_same_vocabulary(student, copy.deepcopy(student), "student-tok", "teacher-model")  # same: fine
    with pytest.raises(
        RecipeError,
        match=r"distill.teacher: teacher-model has another vocabulary than the student's tokenizer student-tok",
    ):
        check_same_vocabulary(student, teacher, "student-tok", "teacher-model")


BASE = {"output_dir": "/tmp/x", "model": {"name_or_path": "some/model"}, "data": {"train": "d.jsonl"}}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"distill": {"teacher": "t", "beta": 1.5}}, "beta"),
        ({"distill": {"teacher": "t"}, "preference": {"objective": "dpo"}}, "distill and preference are two"),
        ({"distill": {"teacher": "t"}, "data": {"train": "d.jsonl", "packing": True}}, "packed data"),
        (
            {"distill": {"teacher": "t"}, "data": {"train": "d.jsonl", "format": "pairwise"}},
            "not data.format=pairwise",
        ),
    ],
)
def test_recipe_refuses_distillation_nonsense(extra, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({**BASE, **extra})
