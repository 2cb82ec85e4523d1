"""The learning-rate schedules (training.model.optim.build_scheduler) equal transformers' get_scheduler
step for step: they are written out only to keep transformers.optimization (and through it peft,
bitsandbytes and inductor) out of every run's start-up."""

import pytest
import torch
from transformers import get_scheduler

from training.config import TrainSection
from training.model.optim import build_scheduler

HF_NAME = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}


def lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("name", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup, total", [(0, 7), (3, 10), (5, 5), (2, 1)])
def test_schedules_equal_transformers(name, warmup, total):
    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    ours = build_scheduler(optimizer(), TrainSection(scheduler=name, warmup_steps=warmup), total)
    theirs = get_scheduler(HF_NAME[name], optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    assert lrs(ours, total + 2) == lrs(theirs, total + 2)  # bitwise, past the end too


def test_warmup_ratio_sets_the_warmup_steps():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = build_scheduler(opt, TrainSection(scheduler="constant", warmup_ratio=0.5), 8)
    assert lrs(s, 6) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
