"""The loop's plug-in points, held to their contracts: an objective added from outside (a toy one registered
here) trains through training.train without a line of training/loop knowing it, its data pass runs once
before the model loads, and both step executors satisfy the StepExecutor protocol."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

import pytest

import training.rl  # noqa: F401 (registers online RL, as the set-up does)
from conftest import train_inprocess
from training.loop.run import StepExecutor
from training.loop.step import DataParallelStep, PipelineStep
from training.objectives.next_token import NextToken
from training.objectives.registry import ObjectiveKind, kind_of, kinds, register, unregister


@dataclass
class Doubled(NextToken):
    """Next-token cross-entropy times two, counting its own calls: a toy objective."""

    calls: int = 0

    def loss(self, model, batch: dict, i: int):
        self.calls += 1
        s, n, outputs = super().loss(model, batch, i)
        return 2 * s, n, outputs

    def step_metrics(self) -> dict:
        return {"toy_loss_calls": self.calls}


def rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def toy():
    seen = {}

    def prepare_data(p):
        seen["train"] = len(p.train)
        return p.train, p.evals

    register(
        ObjectiveKind(
            "toy",
            applies=lambda recipe: recipe.output_dir.endswith("toy"),
            build=lambda c: Doubled(c.accelerator, c.mask_rows),
            priority=100,
            prepare_data=prepare_data,
        )
    )
    try:
        yield seen
    finally:
        unregister("toy")


def test_a_registered_objective_trains_through_the_loop_untouched(make_recipe, tmp_path, toy):
    train = {"max_steps": 2, "batch_size": 2, "warmup_steps": 0}
    plain = make_recipe("plain.yaml", output_dir=str(tmp_path / "plain"), train=train)
    doubled = make_recipe("toy.yaml", output_dir=str(tmp_path / "toy"), train=train)
    assert train_inprocess(plain) == 0
    assert train_inprocess(doubled) == 0
    ours, theirs = rows(tmp_path / "toy"), rows(tmp_path / "plain")
    # step 1 is taken on the same initial weights: the toy's loss is twice next-token's
    assert ours[0]["loss"] == pytest.approx(2 * theirs[0]["loss"], rel=1e-6)
    assert [r["toy_loss_calls"] for r in ours] == [1, 2]  # its own metrics reach the metrics file
    assert toy["train"] == 394  # its data pass saw the built training split (200 stories in 32-token blocks)
    assert "toy_loss_calls" not in theirs[0]


def test_kinds_are_asked_by_priority(make_recipe, toy):
    from training.config import load_recipe

    assert [k.name for k in kinds()] == ["toy", "rl", "distill", "preference", "next_token"]
    assert kind_of(load_recipe(make_recipe(output_dir="x/toy"))).name == "toy"
    assert kind_of(load_recipe(make_recipe(output_dir="x/other"))).name == "next_token"


def protocol_members() -> dict[str, object]:
    return {
        name: member
        for name, member in vars(StepExecutor).items()
        if not name.startswith("_") and (callable(member) or isinstance(member, property))
    } | {name: None for name in StepExecutor.__annotations__}


def broken(executor: type) -> list[str]:
    """What `executor` lacks of the protocol, or offers with other parameters."""
    fields = getattr(executor, "__dataclass_fields__", {})
    out = [f"lacks {n}" for n in protocol_members() if not hasattr(executor, n) and n not in fields]
    for name, member in protocol_members().items():
        if not callable(member) or isinstance(member, property) or not hasattr(executor, name):
            continue
        want = list(inspect.signature(member).parameters)[1:]  # without self
        got = list(inspect.signature(getattr(executor, name)).parameters)
        got = got[1:] if got and got[0] == "self" else got  # a staticmethod has no self
        if got != want:
            out.append(f"{name}{got} is not StepExecutor.{name}{want}")
    return out


@pytest.mark.parametrize("executor", [DataParallelStep, PipelineStep])
def test_both_step_executors_satisfy_the_protocol(executor):
    assert {"model", "forward_backward", "checkpoint_pairs", "padding_free"} <= set(protocol_members())
    assert broken(executor) == []


def test_the_protocol_check_fails_on_an_executor_that_lacks_or_changes_an_operation():
    class Partial:
        padding_free = True

        def clip(self, norm):
            return 0.0

    found = broken(Partial)
    assert "lacks forward_backward" in found and "clip['norm'] is not StepExecutor.clip['max_norm']" in found
