"""Resuming a checkpoint into another stage split: every tensor lands where the new layout holds it."""

from __future__ import annotations

import pytest
import torch

from agents.checkpoint.load import load_resharded, written_by
from agents.checkpoint.store import (
    CheckpointWriter,
    job_fingerprint,
    latest_complete,
    model_fingerprint,
)
from geosched.errors import CheckpointError
from geosched.model import ModelShape, build_stage

SHAPE = ModelShape(layers=6, hidden=32, heads=4, seq_len=16)
SEED = 5
OLD = [(0, 3), (3, 6)]
NEW = [(0, 2), (2, 3), (3, 5), (5, 6)]


def pipeline(
    cuts: list[tuple[int, int]], seed: int = SEED
) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    stages = [
        build_stage(SHAPE, a, b, first=i == 0, last=i == len(cuts) - 1, seed=seed) for i, (a, b) in enumerate(cuts)
    ]
    return stages, [torch.optim.AdamW(s.parameters(), lr=3e-3, weight_decay=0.1) for s in stages]


def train(stages, optimizers, steps: range) -> list[float]:
    """Whole-batch steps through the chain of stages (autograd flows from the last into the first)."""
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        data = torch.randint(0, SHAPE.vocab, (4, SHAPE.seq_len + 1), generator=g)
        hidden = data[:, :-1]
        for stage in stages[:-1]:
            hidden = stage(hidden)
        loss = stages[-1].loss(stages[-1](hidden), data[:, 1:])
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def save(ckpt, step: int, cuts, stages, optimizers, seed: int = SEED) -> None:
    model_fp = model_fingerprint(SHAPE, seed=seed)
    for i, (stage, opt) in enumerate(zip(stages, optimizers, strict=True)):
        job_fp = job_fingerprint(SHAPE, cuts[i], first=i == 0, last=i == len(cuts) - 1, seed=seed, num_stages=len(cuts))
        CheckpointWriter(ckpt, i, len(cuts), job_fp, model_fp).save(step, stage, opt, extra={"next_step": step})


def test_a_two_stage_checkpoint_resumes_as_four_stages_and_trains_on_identically(tmp_path) -> None:
    stages, optimizers = pipeline(OLD)
    train(stages, optimizers, range(3))
    save(tmp_path, 3, OLD, stages, optimizers)
    assert latest_complete(tmp_path) == 3  # counted with the stage count that wrote it
    assert latest_complete(tmp_path, len(NEW)) is None

    new_stages, new_optimizers = pipeline(NEW, seed=SEED + 1)  # other initial weights: all must be overwritten
    for i, (stage, opt) in enumerate(zip(new_stages, new_optimizers, strict=True)):
        job_fp = job_fingerprint(SHAPE, NEW[i], first=i == 0, last=i == len(NEW) - 1, seed=SEED, num_stages=4)
        assert not written_by(tmp_path, 3, i, len(NEW), job_fp)
        extra = load_resharded(tmp_path, 3, i, stage, opt, model_fingerprint=model_fingerprint(SHAPE, seed=SEED))
        assert extra == {"next_step": 3}

    old_params = {n: p for s in stages for n, p in s.named_parameters()}
    new_params = {n: p for s in new_stages for n, p in s.named_parameters()}
    assert old_params.keys() == new_params.keys()
    old_state = {n: o.state[p] for s, o in zip(stages, optimizers) for n, p in s.named_parameters()}
    new_state = {n: o.state[p] for s, o in zip(new_stages, new_optimizers) for n, p in s.named_parameters()}
    for name, param in old_params.items():
        assert torch.equal(param, new_params[name]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(old_state[name][key], new_state[name][key]), (name, key)
    # the same three steps more from both: exactly the same losses (weights and Adam moments moved intact)
    assert train(new_stages, new_optimizers, range(3, 6)) == train(stages, optimizers, range(3, 6))


def test_resharding_refuses_another_model_naming_the_fingerprint(tmp_path) -> None:
    stages, optimizers = pipeline(OLD)
    train(stages, optimizers, range(1))
    save(tmp_path, 1, OLD, stages, optimizers)
    new_stages, new_optimizers = pipeline(NEW)
    before = {n: p.clone() for n, p in new_stages[1].named_parameters()}
    other = model_fingerprint(SHAPE, seed=SEED + 1)
    with pytest.raises(CheckpointError, match="written for another model .*seed or precision differ"):
        load_resharded(tmp_path, 1, 1, new_stages[1], new_optimizers[1], model_fingerprint=other)
    assert all(torch.equal(p, before[n]) for n, p in new_stages[1].named_parameters())  # untouched


def test_a_new_layout_may_write_into_the_same_folder(tmp_path) -> None:
    stages, optimizers = pipeline(OLD)
    save(tmp_path, 1, OLD, stages, optimizers)
    new_stages, new_optimizers = pipeline(NEW)
    save(tmp_path, 2, NEW, new_stages, new_optimizers)  # same model: no "different job" refusal
    assert latest_complete(tmp_path) == 2
    with pytest.raises(CheckpointError, match="different job"):  # another model still is refused
        job_fp = job_fingerprint(SHAPE, NEW[0], first=True, last=False, seed=SEED + 1, num_stages=4)
        CheckpointWriter(tmp_path, 0, 4, job_fp, model_fingerprint(SHAPE, seed=SEED + 1))


def test_an_agent_rank_resumes_a_checkpoint_of_another_plan(tmp_path) -> None:
    """RankCheckpoints (what every agent runs): two one-block stages saved, one two-block stage restored."""
    from agent_helpers import TINY_CONFIG

    from agents.layout import layout_plan_text, parse_layout
    from agents.worker import RankCheckpoints
    from geosched.config import config_from_dict

    cfg = config_from_dict(TINY_CONFIG)
    job = cfg.job
    old = parse_layout(layout_plan_text(cfg, ["us", "eu"], dp=1))
    cuts = list(old.stage_layers)
    stages = [
        build_stage(job.model, a, b, first=i == 0, last=i == len(cuts) - 1, seed=job.seed)
        for i, (a, b) in enumerate(cuts)
    ]
    optimizers = [torch.optim.AdamW(s.parameters(), lr=job.learning_rate) for s in stages]
    hidden = stages[0](torch.randint(0, 256, (2, 8)))
    stages[1].loss(stages[1](hidden), torch.randint(0, 256, (2, 8))).backward()
    for opt in optimizers:
        opt.step()
    for role, stage, opt in zip(old.roles, stages, optimizers, strict=True):
        assert RankCheckpoints(str(tmp_path), old, role, every=1, resume=False).save_now(1, stage, opt)

    new = parse_layout(layout_plan_text(cfg, ["eu"], dp=1))
    (role,) = new.roles
    restorer = RankCheckpoints(str(tmp_path), new, role, every=1, resume=True)
    assert restorer.start_step == 1
    whole = build_stage(job.model, *role.layers, first=True, last=True, seed=job.seed + 1)
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=job.learning_rate)
    restorer.restore(whole, whole_opt)
    saved = {n: (p, o.state[p]) for s, o in zip(stages, optimizers) for n, p in s.named_parameters()}
    assert saved.keys() == dict(whole.named_parameters()).keys()
    for name, param in whole.named_parameters():
        value, moments = saved[name]
        assert torch.equal(param, value), name
        assert torch.equal(whole_opt.state[param]["exp_avg"], moments["exp_avg"]), name


def test_an_agent_keeps_only_the_newest_complete_checkpoints(tmp_path) -> None:
    """--checkpoint-keep N: stage 0's writer deletes the steps older than the N newest complete ones after each of
    its saves (an elastic launch checkpoints every step: 600 demo steps wrote 2.4 GB). A step still being written
    by a later stage stays, and so does everything while fewer than N are complete."""
    from agent_helpers import TINY_CONFIG

    from agents.checkpoint.store import latest_complete, list_steps
    from agents.layout import layout_plan_text, parse_layout
    from agents.worker import RankCheckpoints
    from geosched.config import config_from_dict

    cfg = config_from_dict(TINY_CONFIG)
    job, layout = cfg.job, parse_layout(layout_plan_text(cfg, ["us", "eu"], dp=1))
    ranks = []
    for role in layout.roles:
        stage = build_stage(job.model, *role.layers, first=role.first, last=role.last, seed=job.seed)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=job.learning_rate)
        ranks.append((RankCheckpoints(str(tmp_path), layout, role, every=1, resume=False, keep=2), stage, optimizer))
    for step in range(1, 6):
        for checkpoints, stage, optimizer in ranks:  # stage 0 first: step 5 is incomplete when it prunes
            checkpoints.save_now(step, stage, optimizer)
    assert list_steps(str(tmp_path)) == [3, 4, 5] and latest_complete(str(tmp_path)) == 5
