"""Checkpoints of real pipeline stages: exact resume, completeness, atomicity, pruning."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from agents.checkpoint.load import load_shard
from agents.checkpoint.store import (
    CheckpointWriter,
    job_fingerprint,
    latest_complete,
    list_steps,
    prune,
    shard_paths,
    step_dir,
)
from geosched.errors import CheckpointError
from geosched.model import ModelShape, build_stage

SHAPE = ModelShape(layers=3, hidden=32, heads=4, seq_len=16)
CUTS = [(0, 1), (1, 3)]
SEED = 11


def fingerprint(stage: int, cuts: list[tuple[int, int]] = CUTS, seed: int = SEED) -> str:
    return job_fingerprint(
        SHAPE, cuts[stage], first=stage == 0, last=stage == len(cuts) - 1, seed=seed, num_stages=len(cuts)
    )


def build_pipeline() -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """The two stages of SHAPE with their own AdamW, as two ranks would hold them."""
    stages = [
        build_stage(SHAPE, a, b, first=i == 0, last=i == len(CUTS) - 1, seed=SEED) for i, (a, b) in enumerate(CUTS)
    ]
    return stages, [torch.optim.AdamW(s.parameters(), lr=3e-3, weight_decay=0.1) for s in stages]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (4, T): a pure function of the step, like the real data loader."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, SHAPE.vocab, (4, SHAPE.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train(stages, optimizers, steps: range) -> list[float]:
    """Pipeline steps (two microbatches each) through the chain of stages; the loss of each step."""
    losses = []
    for step in steps:
        inputs, targets = batch(step)
        total = 0.0
        for mb in (slice(0, 2), slice(2, 4)):
            hidden = stages[0](inputs[mb])  # (2, T, C)
            loss = stages[1].loss(stages[1](hidden), targets[mb]) / 2
            loss.backward()
            total += float(loss.detach())
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def save_all(ckpt, step, stages, optimizers) -> None:
    for i, (stage, opt) in enumerate(zip(stages, optimizers)):
        CheckpointWriter(ckpt, i, len(CUTS), fingerprint(i)).save(step, stage, opt, extra={"next_step": step})


def test_resume_from_a_checkpoint_continues_bit_identically(tmp_path) -> None:
    stages, optimizers = build_pipeline()
    train(stages, optimizers, range(0, 3))
    save_all(tmp_path, 3, stages, optimizers)
    uninterrupted = train(stages, optimizers, range(3, 6))

    assert latest_complete(tmp_path, len(CUTS)) == 3
    fresh, fresh_opts = build_pipeline()
    extras = [
        load_shard(tmp_path, 3, i, s, o, job_fingerprint=fingerprint(i))
        for i, (s, o) in enumerate(zip(fresh, fresh_opts))
    ]
    assert extras == [{"next_step": 3}] * 2
    resumed = train(fresh, fresh_opts, range(extras[0]["next_step"], 6))
    assert resumed == uninterrupted  # exact float equality, not approximate
    for a, b in zip(stages, fresh):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name
    restored = fresh_opts[1].state_dict()
    assert restored["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples come back as tuples
    assert restored["param_groups"][0]["weight_decay"] == 0.1
    assert all(float(st["step"]) == 6.0 for st in restored["state"].values())


def test_a_resume_trains_with_the_jobs_learning_rate_not_the_checkpoints(tmp_path, caplog) -> None:
    """A trial lowered the config's learning rate and resumed: the agents went on with the checkpoint's, silently.
    The job's settings win (its moments and step come from the checkpoint), and the change is logged."""
    stages, optimizers = build_pipeline()
    train(stages, optimizers, range(0, 2))
    save_all(tmp_path, 2, stages, optimizers)
    fresh, _ = build_pipeline()
    lowered = [torch.optim.AdamW(s.parameters(), lr=3e-4, weight_decay=0.1) for s in fresh]
    for i, (stage, opt) in enumerate(zip(fresh, lowered)):
        load_shard(tmp_path, 2, i, stage, opt, job_fingerprint=fingerprint(i))
    assert all(opt.param_groups[0]["lr"] == 3e-4 for opt in lowered)
    assert "trained with lr 0.003; the job's settings give 0.0003" in caplog.text
    saved = optimizers[1].state_dict()["state"]
    restored = lowered[1].state_dict()["state"]
    assert all(torch.equal(saved[k]["exp_avg"], restored[k]["exp_avg"]) for k in saved)  # the moments are kept
    reference = [torch.optim.AdamW(s.parameters(), lr=3e-4, weight_decay=0.1) for s in stages]
    for ref, opt in zip(reference, optimizers):
        ref.load_state_dict({**opt.state_dict(), "param_groups": ref.state_dict()["param_groups"]})
    assert train(fresh, lowered, range(2, 4)) == train(stages, reference, range(2, 4))  # lr 3e-4 from step 2


def test_layout_and_manifest(tmp_path) -> None:
    stages, optimizers = build_pipeline()
    train(stages, optimizers, range(0, 1))
    save_all(tmp_path, 1, stages, optimizers)
    folder = step_dir(tmp_path, 1)
    assert sorted(os.listdir(folder)) == [
        "manifest.json",
        "stage-00.json",
        "stage-00.safetensors",
        "stage-01.json",
        "stage-01.safetensors",
    ]
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    meta = json.loads(open(shard_paths(tmp_path, 1, 1)[1]).read())
    assert manifest["num_stages"] == 2 and manifest["shards_sha256"]["01"] == meta["sha256"]
    assert meta["optimizer"]["class"] == "AdamW"
    assert "blocks.2.mlp.fc.weight" in meta["model"]  # global parameter names
    weights_only, _ = build_pipeline()  # e.g. for inference: no optimizer
    load_shard(tmp_path, 1, 1, weights_only[1], None, restore_rng=False)
    assert torch.equal(weights_only[1].head.weight, stages[1].head.weight)
    bare = build_stage(SHAPE, 1, 3, first=False, last=True, seed=SEED)
    CheckpointWriter(tmp_path, 1, 2, fingerprint(1)).save(7, bare, None)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_shard(tmp_path, 7, 1, bare, torch.optim.AdamW(bare.parameters()))


def test_a_step_counts_only_when_every_stage_has_written_it(tmp_path) -> None:
    stages, optimizers = build_pipeline()
    train(stages, optimizers, range(0, 1))
    save_all(tmp_path, 2, stages, optimizers)
    CheckpointWriter(tmp_path, 0, 2, fingerprint(0)).save(4, stages[0], optimizers[0])  # stage 1 never wrote 4
    assert list_steps(tmp_path) == [2, 4]
    assert latest_complete(tmp_path, 2) == 2
    assert not os.path.exists(os.path.join(step_dir(tmp_path, 4), "manifest.json"))
    assert latest_complete(tmp_path, 3) is None  # a 3-stage job never finds a 2-stage checkpoint
    assert latest_complete(tmp_path / "nothing-here", 2) is None


def test_a_crash_mid_write_leaves_no_checkpoint(tmp_path) -> None:
    stages, optimizers = build_pipeline()
    save_all(tmp_path, 1, stages, optimizers)
    CheckpointWriter(tmp_path, 0, 2, fingerprint(0)).save(2, stages[0], optimizers[0])
    tensor_path, meta_path = shard_paths(tmp_path, 2, 1)
    # stage 1 died after writing part of its temporary file: no rename ever happened
    good = open(shard_paths(tmp_path, 1, 1)[0], "rb").read()
    with open(os.path.join(step_dir(tmp_path, 2), f".{os.path.basename(tensor_path)}.tmp-999-dead"), "wb") as fh:
        fh.write(good[: len(good) // 2])
    assert latest_complete(tmp_path, 2) == 1
    # died after the tensor file landed but before its JSON: still not a shard
    shutil.copyfile(shard_paths(tmp_path, 1, 1)[0], tensor_path)
    assert not os.path.exists(meta_path)
    assert latest_complete(tmp_path, 2) == 1
    with pytest.raises(CheckpointError, match="stage-01.json: missing"):
        load_shard(tmp_path, 2, 1, stages[1], optimizers[1])


def test_prune_keeps_the_newest_complete_and_anything_newer(tmp_path) -> None:
    stages, optimizers = build_pipeline()
    for step in (1, 2, 3):
        save_all(tmp_path, step, stages, optimizers)
    CheckpointWriter(tmp_path, 0, 2, fingerprint(0)).save(4, stages[0], optimizers[0])  # in progress
    assert prune(tmp_path, 2, keep=2) == [1]
    assert list_steps(tmp_path) == [2, 3, 4]
    assert CheckpointWriter(tmp_path, 0, 2, fingerprint(0)).prune(keep=1) == [2]
    assert list_steps(tmp_path) == [3, 4]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".deleting")]
    with pytest.raises(CheckpointError, match="keep must be >= 1"):
        prune(tmp_path, 2, keep=0)


def test_a_folder_of_another_job_is_refused_not_mixed(tmp_path) -> None:
    stages, optimizers = build_pipeline()
    save_all(tmp_path, 1, stages, optimizers)
    with pytest.raises(CheckpointError, match="different job"):
        CheckpointWriter(tmp_path, 0, 2, fingerprint(0, seed=SEED + 1))
    with pytest.raises(CheckpointError, match="different job"):
        CheckpointWriter(tmp_path, 1, 2, fingerprint(1, cuts=[(0, 2), (2, 3)]))
    assert latest_complete(tmp_path, 2) == 1
