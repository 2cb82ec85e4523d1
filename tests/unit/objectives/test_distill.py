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
from training.core.batch import IGNORE, TEACHER_TOPK
from training.core.errors import RecipeError
from training.data.tokenizer import load_tokenizer
from training.objectives.distill import (
    ChunkedDistillLoss,
    HeadRows,
    TopkRows,
    batch_topk,
    check_same_vocabulary,
    check_topk,
    distill_loss,
    generalized_jsd,
    on_policy_step,
    prompt_of,
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
    chunked = ChunkedDistillLoss.apply(x, w, b, HeadRows(tx, tw, None), targets, cfg, 3, sums)  # 4 chunks
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


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_top_k_over_the_whole_vocabulary_is_the_whole_divergence_and_a_smaller_k_has_a_bucket_for_the_rest(
    beta,
):
    """The chunked loss from precomputed top-k log-probabilities (at the temperature): with k = the
    vocabulary it equals the loss from the teacher's logits, gradients too; with a smaller k it is the
    divergence of the two distributions on those k tokens plus one bucket holding the rest of each one's
    mass, written out by hand."""
    g = torch.Generator().manual_seed(2)
    n, h, temperature = 9, 6, 2.0
    cfg = DistillSection(teacher="t", ce_weight=0.3, beta=beta, temperature=temperature)
    x = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, h, generator=g, dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (n,), generator=g)
    ce, kd = row_losses(x @ w.T, t_logits, targets, cfg)
    whole = 0.3 * ce.sum() + 0.7 * kd.sum()
    whole_grads = torch.autograd.grad(whole, [x, w])
    for k in (V, 4):
        top = (t_logits / temperature).log_softmax(-1).topk(k, dim=-1)
        sums = [0.0, 0.0]
        got = ChunkedDistillLoss.apply(x, w, None, TopkRows(top.indices, top.values), targets, cfg, 4, sums)
        grads = torch.autograd.grad(got, [x, w])
        assert sums[0] == pytest.approx(ce.sum().item(), rel=1e-6)  # the cross-entropy is the whole one
        if k == V:
            assert got.item() == pytest.approx(whole.item(), rel=1e-6)  # the divergence is taken in fp32
            for a, b in zip(grads, whole_grads):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
            continue
        # by hand, in probabilities: the k tokens' and the rest's
        ps = ((x @ w.T).detach() / temperature).softmax(-1)
        qs = ps.gather(-1, top.indices)
        qs = torch.cat([qs, 1 - qs.sum(-1, keepdim=True)], -1)
        pt = top.values.exp()
        pt = torch.cat([pt, 1 - pt.sum(-1, keepdim=True)], -1)
        mix = beta * pt + (1 - beta) * qs

        def kl(a, b):
            return (a * (a / b).log()).sum(-1)

        want = {0.0: kl(pt, qs), 1.0: kl(qs, pt)}.get(beta)
        if want is None:
            want = beta * kl(pt, mix) + (1 - beta) * kl(qs, mix)
        assert sums[1] == pytest.approx(want.sum().item(), rel=1e-5)
        assert want.sum().item() > 0


def test_a_models_top_k_is_that_of_its_logits_and_trains_like_them(tiny_model_dir):
    """batch_topk of a teacher gives torch's top-k of its log-softmax at the labelled positions (zeros
    elsewhere); the loss from those batches equals the loss from the teacher's logits when k is the
    vocabulary."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    teacher.eval().requires_grad_(False)
    ids = torch.randint(0, 500, (2, 5))
    labels = ids.clone()
    labels[0, :3] = IGNORE
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    keep = targets_of(batch) != IGNORE
    top_ids, top_lps = batch_topk(teacher, batch, 8)
    want = teacher(ids).logits.log_softmax(-1).topk(8, dim=-1)
    torch.testing.assert_close(top_lps[keep], want.values[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(top_ids[keep].long(), want.indices[keep])
    assert not top_ids[~keep].any() and not top_lps[~keep].any()
    vocab = teacher.config.vocab_size
    cfg = DistillSection(teacher="t", ce_weight=0.3, beta=0.5)
    everything = dict(zip(TEACHER_TOPK, batch_topk(teacher, batch, vocab)))
    on_the_fly, precomputed = [0.0, 0.0], [0.0, 0.0]
    a = distill_loss(student, teacher, batch, cfg, on_the_fly)
    b = distill_loss(student, None, batch | everything, cfg, precomputed)
    assert b.item() == pytest.approx(a.item(), rel=1e-5)
    assert precomputed == pytest.approx(on_the_fly, rel=1e-5)
    with pytest.raises(RecipeError, match=f"distill.top_k: {vocab + 1} is more than the {vocab} tokens"):
        check_topk(vocab + 1, vocab)


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
        ({"distill": {"teacher": "t", "top_k": 0}}, "top_k"),
        ({"distill": {"teacher": "t", "lmbda": 1.5}}, "lmbda"),
        (
            {"distill": {"teacher": "t", "lmbda": 0.5}, "data": {"train": "d.txt", "format": "text"}},
            "distill.lmbda: on-policy steps complete the data's prompts, and data.format=text has none",
        ),
        (
            {"distill": {"teacher": "t", "lmbda": 0.5, "top_k": 8}},
            "distill.lmbda with distill.top_k: the top-k is precomputed on the data's completions",
        ),
    ],
)
def test_recipe_refuses_distillation_nonsense(extra, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({**BASE, **extra})


def test_on_policy_steps_are_a_keyed_coin_and_complete_the_last_turns_prompt():
    """on_policy_step draws by (seed, step) alone, as often as lmbda says; prompt_of keeps the tokens
    before a row's last labelled span (an earlier assistant turn stays in the prompt)."""
    draws = [on_policy_step(0, step, 0.3) for step in range(1, 2001)]
    assert draws == [on_policy_step(0, step, 0.3) for step in range(1, 2001)]
    assert 0.27 < sum(draws) / len(draws) < 0.33
    assert all(on_policy_step(0, s, 1.0) for s in range(1, 50)) and not any(
        on_policy_step(0, s, 0.0) for s in range(1, 50)
    )
    assert draws != [on_policy_step(1, step, 0.3) for step in range(1, 2001)]
    n = IGNORE
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    labels = [n, n, 3, 4, n, n, 7, 8, 9]  # two assistant turns
    assert prompt_of(ids, labels) == [1, 2, 3, 4, 5, 6]
    assert prompt_of(ids[:4], labels[:4]) == [1, 2]
