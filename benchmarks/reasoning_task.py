"""The bundled reasoning-gym task (training/recipes/reasoning_gym.yaml) scored in a fresh process with plain
reasoning-gym, transformers and peft, without the trainer: the held-out prompts made again by
reasoning_gym.create_dataset from the recipe's task, config, eval_size and eval_seed (seed + size when not set),
less the questions its training prompts also have; each answered greedily with the recipe's system prompt (and
its worked example as an earlier turn, data.reasoning_gym.example), and scored by the task's own score_answer.
A prompt passes on a score of 1.0 (the answer alone); "right" also counts a reply that is the answer once case,
surrounding spaces and a final . or ! are set aside (what the recipe's exact_match reward accepts, written again
here).

    python -m benchmarks.reasoning_task                        # SmolLM2-135M-Instruct as bundled
    python -m benchmarks.reasoning_task runs/reasoning_gym     # after the recipe (its final/ adapter)
"""

from __future__ import annotations

import reasoning_gym
import torch
import yaml

from benchmarks.common import ROOT, bundled_policy, policy_parser

RECIPE = ROOT / "training/recipes/reasoning_gym.yaml"


def held_out(recipe: dict) -> tuple[list[dict], object]:
    """(the held-out entries, the dataset whose score_answer scores them)."""
    data = recipe["data"]
    task, rg = data["train"].split(":", 1)[1], data["reasoning_gym"]
    size, seed = rg["size"], rg.get("seed", 0)
    eval_size, eval_seed = rg.get("eval_size", size), rg.get("eval_seed", seed + size)
    train = reasoning_gym.create_dataset(task, size=size, seed=seed, **rg.get("config", {}))
    seen = {train[i]["question"] for i in range(size)}
    ds = reasoning_gym.create_dataset(task, size=eval_size, seed=eval_seed, **rg.get("config", {}))
    return [ds[i] for i in range(eval_size) if ds[i]["question"] not in seen], ds


def main(argv=None) -> None:
    args = policy_parser(__doc__, 16).parse_args(argv)
    model, tokenizer = bundled_policy(args.run)
    recipe = yaml.safe_load(RECIPE.read_text())
    entries, ds = held_out(recipe)
    system = recipe["data"]["system_prompt"]
    example = recipe["data"]["reasoning_gym"].get("example")
    turn = (
        [
            {"role": "user", "content": example["question"]},
            {"role": "assistant", "content": example["answer"]},
        ]
        if example
        else []
    )
    passed, right, total = 0, 0, 0.0
    for e in entries:
        messages = [{"role": "system", "content": system}, *turn, {"role": "user", "content": e["question"]}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        score = float(ds.score_answer(reply, e))
        passed, total = passed + int(score == 1.0), total + score
        right += int(reply.strip().rstrip(".!").strip().lower() == e["answer"].strip().lower())
        print(f"{e['question'][:40]!r:44} -> {reply!r}  ({score:.2f})")
    n = len(entries)
    print(
        f"{args.run or 'bundled SmolLM2-135M-Instruct'}: {n} held-out prompts, mean score {total / n:.3f}, "
        f"pass rate (the answer alone) {passed / n:.3f} ({passed}/{n}), right (a final . or ! aside) {right}/{n}"
    )


if __name__ == "__main__":
    main()
