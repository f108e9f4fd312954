"""The learning rate's curve (geosched.lr_schedule): warm-up, constant, linear and cosine decay, held after the
job's last step; a warm-up as long as the job is refused in one line. That the stages apply it is checked by
tests/test_equivalence.py (a pipeline against one process) and tests/test_agent_resume.py (a resumed job)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import yaml

from geosched.cli import main
from geosched.config import JobSpec, ModelSpec
from geosched.lr_schedule import apply_settings, learning_rate_at, optimizer_settings

JOB = JobSpec(model=ModelSpec(layers=2, hidden=8, heads=2, seq_len=8), global_batch=4, learning_rate=1e-3, steps=102)


def test_the_default_is_the_constant_learning_rate() -> None:
    assert {learning_rate_at(JOB, s) for s in (0, 50, 100, 10_000)} == {1e-3}


def test_the_warmup_rises_linearly_to_the_peak() -> None:
    job = replace(JOB, lr_warmup_steps=4)
    assert [learning_rate_at(job, s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_a_decay_ends_at_the_minimum_on_the_last_step_and_holds_it(decay: str) -> None:
    job = replace(JOB, lr_warmup_steps=1, lr_decay=decay, lr_min_ratio=0.1)
    rates = [learning_rate_at(job, s) for s in range(job.steps + 20)]
    assert rates[0] == pytest.approx(1e-3) and rates[job.steps - 1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(rates, rates[1:])) and set(rates[job.steps - 1 :]) == {rates[-1]}
    middle = learning_rate_at(job, 1 + (job.steps - 2) // 2)  # half-way through the decay
    assert middle == pytest.approx(5.5e-4)  # both curves pass through the mean of peak and minimum there
    quarter = learning_rate_at(job, 1 + (job.steps - 2) // 4)
    expected = 1e-3 - 0.9e-3 * 0.25 if decay == "linear" else 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 4))
    assert quarter == pytest.approx(expected)


def test_the_settings_reach_every_parameter_group() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5.0}], lr=1.0)
    apply_settings(optimizer, optimizer_settings(replace(JOB, lr_warmup_steps=2, weight_decay=0.1), 0))
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(5e-4, 0.1), (5e-4, 0.1)]


def test_a_warmup_as_long_as_the_job_is_refused_in_one_line(tmp_path, capsys) -> None:
    from agent_helpers import TINY_CONFIG

    raw = {**TINY_CONFIG, "job": {**TINY_CONFIG["job"], "steps": 10, "lr_warmup_steps": 10}}
    path = tmp_path / "warm.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate-config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "job.lr_warmup_steps: 10 is not below job.steps (10)" in err, err


def test_a_run_of_other_steps_than_the_decay_spans_is_said():
    """launch --steps past job.steps trained its last steps at the floor without a word (a researcher's run of
    12 steps on steps: 10); short of it, the rate never reaches the floor. The launcher prints this line."""
    from geosched.lr_schedule import decay_mismatch

    job = replace(JOB, steps=10, lr_decay="cosine", lr_min_ratio=0.1)
    assert decay_mismatch(job, 10) is None and decay_mismatch(replace(job, lr_decay="none"), 12) is None
    past = decay_mismatch(job, 12)
    assert past is not None and "steps 10-11 train at its floor" in past and "set job.steps: 12" in past
    assert f"{0.1 * JOB.learning_rate:.3g}" in past
    short = decay_mismatch(job, 5)
    assert short is not None and "stops at step 4, before job.steps (10)" in short
    assert f"{learning_rate_at(job, 4):.3g}" in short
