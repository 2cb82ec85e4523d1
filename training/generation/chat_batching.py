"""Chat completions drawn together: a non-streamed /v1/chat/completions request without stop strings or top
log-probabilities joins the served model's `Batcher` (training.generation.completions_api), so requests that
arrive together (the episodes of a verifiers environment, an evaluation's prompts) are drawn in one batch
instead of one after another. Choice i of seed s is still drawn from sample_seed(s, 0, 0, i), as `draw` draws it
alone, and a keyed draw does not depend on what shares its batch: the same reply either way
(tests/integration/test_serve.py). The chosen tokens' log-probabilities, when asked, are read from one forward
pass over prompt and completion at the request's temperature (what `draw` records token by token)."""

from __future__ import annotations

import secrets

import torch

from training.generation.completions_api import Draw
from training.generation.keyed import Request, sample_seed
from training.generation.openai_api import Prepared
from training.generation.served import Choice, TokenLogprob


def batchable(prepared: Prepared) -> bool:
    """Whether the request can be drawn in a batch: not streamed, no stop strings, no top log-probabilities."""
    s = prepared.sampling
    return not prepared.request.stream and not s.stop and not s.top_logprobs


def chat_draw(prepared: Prepared) -> Draw:
    """The request's choices as keyed requests: choice i from sample_seed(seed, 0, 0, i), greedy at temperature 0."""
    s, ids = prepared.sampling, prepared.prompt_ids
    seeds: list[int | None] = [None] * s.n
    if s.temperature > 0:
        seed = secrets.randbits(63) if s.seed is None else s.seed
        seeds = [sample_seed(seed, 0, 0, i) for i in range(s.n)]
    requests = [Request(ids, k, s.max_tokens) for k in seeds]
    return Draw(prepared.served, ids, requests, s.temperature, s.top_p)


def batched_choices(prepared: Prepared, ids: torch.Tensor, mask: torch.Tensor) -> list[Choice]:
    """The choices of a batched draw, as `draw` would have them (its end token kept apart, the text decoded, the
    log-probabilities when asked)."""
    served, eos = prepared.served, set(prepared.served.eos_token_ids)
    out = []
    for i in range(ids.shape[0]):
        drawn = ids[i, : int(mask[i].sum())].tolist()
        ended = drawn[-1] if drawn and drawn[-1] in eos else None
        tokens = drawn[:-1] if ended is not None else drawn
        c = Choice(i, tokens, served.tokenizer.decode(tokens, skip_special_tokens=True), generated=len(drawn))
        c.finish_reason, c.ended = ("stop" if ended is not None else "length"), ended
        if prepared.sampling.top_logprobs is not None:
            c.logprobs = chosen_logprobs(prepared, tokens)
        out.append(c)
    return out


@torch.no_grad()
def chosen_logprobs(prepared: Prepared, tokens: list[int]) -> list[TokenLogprob]:
    """Each token's log-probability under log_softmax(logits / temperature) (1 when greedy) after the prompt."""
    if not tokens:
        return []
    served, n = prepared.served, len(prepared.prompt_ids)
    seq = torch.tensor([prepared.prompt_ids + tokens], device=served.model.device)
    with served.lock, served.active():
        logits = served.model(input_ids=seq, use_cache=False).logits[0, n - 1 : -1]
    logp = torch.log_softmax(logits.float() / (prepared.sampling.temperature or 1.0), dim=-1)
    picked = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    decode = served.tokenizer.decode
    return [TokenLogprob(decode([t]), v, []) for t, v in zip(tokens, picked)]
