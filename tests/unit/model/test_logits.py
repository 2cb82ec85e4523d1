"""The logits a loss reads (training/model/logits.py): the vocabulary head runs on the scored positions only,
and what they give equals the same positions of every position's logits, for a model that takes
`logits_to_keep` and for one that does not."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_ARCH
from training.model.logits import last_logits, scored_width
from training.rl.loss import token_logps


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, **TINY_ARCH)).eval()


class NoKeep(torch.nn.Module):
    """A causal LM whose forward has no logits_to_keep keyword (as some remote-code models)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_the_scored_width_starts_at_the_first_scored_column_of_any_row():
    scored = torch.zeros(3, 10, dtype=torch.bool)
    scored[0, 6:8] = True
    scored[1, 4] = True  # the earliest
    scored[2, 9] = True
    assert scored_width(scored) == 6
    assert scored_width(torch.zeros(2, 5, dtype=torch.bool)) == 1  # nothing scored: one position, a loss of 0


def test_the_head_runs_on_the_scored_positions_and_gives_their_logits():
    model = tiny_model()
    ids = torch.randint(0, 97, (3, 12))
    attention = torch.ones_like(ids)
    attention[2, 9:] = 0  # a right-padded row
    rows = []
    model.lm_head.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[1]))
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attention).logits
        for m in (model, NoKeep(model)):
            got = last_logits(m, 4, input_ids=ids, attention_mask=attention)
            assert got.shape == (3, 4, 97)
            torch.testing.assert_close(got, full[:, -5:-1], rtol=1e-5, atol=1e-5)
    assert rows == [12, 5, 12]  # the head ran on 4 + 1 positions where the model takes logits_to_keep
    # the RL log-probabilities of the last 4 tokens: those of the whole sequence's, cut
    logps, entropy = token_logps(model, ids, attention, 0.7, torch.ones(3, 4))
    whole = torch.log_softmax(full[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(logps, whole[:, -4:], rtol=1e-5, atol=1e-5)
    assert entropy.shape == (3, 4)


def test_rl_log_probabilities_at_a_mask_are_those_of_every_position_there_gradients_too():
    """token_logps runs the vocabulary's log-softmax at the mask's positions only: the values there, and the
    gradients they give, are those computed at every position (an all-ones mask); 0 elsewhere."""
    model = tiny_model().train()
    ids = torch.randint(0, 97, (3, 12))
    attention = torch.ones_like(ids)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.float32)
    got = []
    for m in (torch.ones_like(mask), mask):
        model.zero_grad()
        logps, entropy = token_logps(model, ids, attention, 1.0, m)
        ((logps * mask).sum() * 0.37).backward()
        got.append((logps.detach() * mask, entropy * mask, [p.grad.clone() for p in model.parameters()]))
    assert not logps[mask == 0].any() and not entropy[mask == 0].any()
    (a, ea, ga), (b, eb, gb) = got
    assert torch.equal(a, b) and torch.equal(ea, eb)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
