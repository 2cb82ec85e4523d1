"""What one rollout draw gives the RL objective: per completion (single-turn) or episode, the token rows and the
mask of the policy's tokens, what the rewards see, and the rewards; groups of `num_generations` in a row."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from training.model.logits import scored_width
from training.rl.episode import Episode


def as_completions(texts: list[str], prompts: list) -> list:
    """Completions as the rewards get them: strings, or assistant messages after a conversational prompt."""
    return [
        [{"role": "assistant", "content": t}] if isinstance(p, list) else t for t, p in zip(texts, prompts)
    ]


# the per-completion lists a Drawn holds, in its order (replace and groups take them all)
PER_COMPLETION = (
    "seqs",
    "marks",
    "rows",
    "completions",
    "completion_ids",
    "texts",
    "lengths",
    "ended",
    "key_rows",
)


@dataclass
class Drawn:
    seqs: list[list[int]]  # prompt + everything after it
    marks: list[list[int]]  # 1 on the policy's tokens
    rows: list[int]  # the prompt record of each completion
    completions: list  # as the rewards see them
    completion_ids: list[list[int]]  # the tokens after the prompt
    texts: list[str]  # the final reply's text
    lengths: list[int]  # the policy's tokens
    ended: list[bool]  # closed by an end-of-sequence token (else cut at the budget)
    episodes: list[Episode] | None = None
    envs: list | None = None  # the episodes' environments (for rewards that read them)
    key_rows: list = field(default_factory=list)
    rewards: torch.Tensor | None = None

    @classmethod
    def of_completions(cls, made, prompts: list[list[int]], rows: list[int], tokenizer, engine, shown):
        """Single-turn completions (`made`: Completions whose rows follow one another), each after its prompt in
        `prompts` (one per completion); `shown`: the prompts of the records, as the rewards see them."""
        seqs, marks, ids_of, lengths, ended = [], [], [], [], []
        at = 0
        for c in made:
            for k in range(c.ids.shape[0]):
                n, prompt = int(c.mask[k].sum()), prompts[at]
                at += 1
                ids = c.ids[k, :n].cpu().tolist()
                seqs.append(prompt + ids)
                marks.append([0] * len(prompt) + [1] * n)
                ids_of.append(ids)
                lengths.append(n)
                ended.append(any(t in engine.eos_token_ids for t in ids))
        texts = tokenizer.batch_decode(ids_of, skip_special_tokens=True)
        return cls(seqs, marks, rows, as_completions(texts, shown), ids_of, texts, lengths, ended)

    @classmethod
    def of_episodes(cls, episodes: list[Episode], rows: list[int]):
        def text(e):
            replies = [m for m in e.completion if m["role"] == "assistant"]
            return (replies[-1].get("content") or "") if replies else ""

        return cls(
            seqs=[e.prompt_ids + e.tokens for e in episodes],
            marks=[[0] * len(e.prompt_ids) + e.policy for e in episodes],
            rows=rows,
            completions=[e.completion for e in episodes],
            completion_ids=[e.tokens for e in episodes],
            texts=[text(e) for e in episodes],
            lengths=[e.policy_tokens for e in episodes],
            ended=[e.ended for e in episodes],
            episodes=episodes,
            envs=[e.env for e in episodes] if any(e.env is not None for e in episodes) else None,
        )

    def tensors(self, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, mask of the predicted policy tokens [N, W]), right-padded: the mask's W
        columns are the last predicted positions, from the first policy token of any row on (what the loss
        reads: the logits of the prompt's positions before it are never made)."""
        width = max(len(r) for r in self.seqs)
        input_ids = torch.full((len(self.seqs), width), pad, dtype=torch.long)
        attention = torch.zeros(len(self.seqs), width, dtype=torch.long)
        mask = torch.zeros(len(self.seqs), width, dtype=torch.float32)
        for k, (r, m) in enumerate(zip(self.seqs, self.marks)):
            input_ids[k, : len(r)] = torch.tensor(r)
            attention[k, : len(r)] = 1
            mask[k, : len(m)] = torch.tensor(m, dtype=torch.float32)
        mask = mask[:, 1:]
        return input_ids, attention, mask[:, -scored_width(mask > 0) :]

    def flat_groups(self, w: torch.Tensor, g: int) -> list[int]:
        """The groups whose total rewards are all equal (no signal for the advantages)."""
        totals = (self.rewards @ w).view(-1, g)
        return [k for k in range(totals.shape[0]) if float(totals[k].max() - totals[k].min()) < 1e-9]

    def replace(self, k: int, other: Drawn, n: int, g: int) -> None:
        """Group k takes group n of `other` (dynamic sampling)."""
        mine, theirs = slice(k * g, (k + 1) * g), slice(n * g, (n + 1) * g)
        for name in PER_COMPLETION:
            getattr(self, name)[mine] = getattr(other, name)[theirs]
        if self.episodes is not None:
            self.episodes[mine] = other.episodes[theirs]
        self.rewards = self.rewards.clone()
        self.rewards[mine] = other.rewards[theirs]

    def groups(self, start: int, stop: int, g: int) -> Drawn:
        """Groups start .. stop - 1 (of g completions each) as a Drawn of their own."""
        part = slice(start * g, stop * g)
        return Drawn(
            **{name: getattr(self, name)[part] for name in PER_COMPLETION},
            episodes=None if self.episodes is None else self.episodes[part],
            envs=None if self.envs is None else self.envs[part],
            rewards=self.rewards[part],
        )

    def samples(self, total, adv, rewards, limit: int) -> list[dict]:
        """The first `limit` completions as samples.jsonl shows them (an episode with its messages)."""
        out = []
        for k in range(min(len(self.texts), limit)):
            one = {
                "row": self.rows[k],
                "completion": self.texts[k],
                "reward": float(total[k]),
                "advantage": float(adv[k]),
            } | {f.name: float(self.rewards[k, j]) for j, f in enumerate(rewards)}
            if self.episodes is not None:
                one["messages"] = self.episodes[k].completion
            out.append(one)
        return out

    def episode_sums(self) -> dict:
        """Turns, tool calls, tool errors and tool-output tokens summed over the episodes ({} single-turn)."""
        if self.episodes is None:
            return {}
        es = self.episodes
        return {
            "turns": sum(e.turns for e in es),
            "tool_calls": sum(e.tool_calls for e in es),
            "tool_errors": sum(e.tool_errors for e in es),
            "tool_tokens": sum(len(e.tokens) - e.policy_tokens for e in es),
        }
