"""Corrupt or foreign checkpoints are refused with a clear CheckpointError, and nothing is overwritten."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from agents.checkpoint.load import load_shard
from agents.checkpoint.store import CheckpointWriter, job_fingerprint, latest_complete, shard_paths
from geosched.errors import CheckpointError
from geosched.model import ModelShape, build_stage

SHAPE = ModelShape(layers=2, hidden=16, heads=2, seq_len=8)
FP = job_fingerprint(SHAPE, (0, 2), first=True, last=True, seed=3, num_stages=1)


def trained(seed: int = 3, shape: ModelShape = SHAPE):
    """A one-stage model and AdamW after two steps (so the optimizer has state)."""
    model = build_stage(shape, 0, shape.layers, first=True, last=True, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, shape.vocab, (2, shape.seq_len + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint folder holding one good one-stage shard at step 2."""
    model, opt = trained()
    CheckpointWriter(tmp_path, 0, 1, FP).save(2, model, opt, extra={"next_step": 2})
    assert latest_complete(tmp_path, 1) == 2
    return tmp_path


def snapshot(model, opt) -> tuple[dict, dict, torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        for i, st in opt.state_dict()["state"].items()
    }
    return state, opt_state, torch.get_rng_state()


def assert_unchanged(model, opt, before) -> None:
    state, opt_state, rng = before
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    after = opt.state_dict()["state"]
    assert after.keys() == opt_state.keys()
    for i, st in after.items():
        assert all(
            torch.equal(v, opt_state[i][k]) if isinstance(v, torch.Tensor) else v == opt_state[i][k]
            for k, v in st.items()
        )
    assert torch.equal(torch.get_rng_state(), rng)


def resign(ckpt, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrite the shard's tensors and fix up its checksum: well-formed, but with the wrong contents."""
    tensor_path, meta_path = shard_paths(ckpt, 2, 0)
    save_file(tensors, tensor_path)
    data = open(tensor_path, "rb").read()
    meta = json.loads(open(meta_path).read())
    meta.update(sha256=hashlib.sha256(data).hexdigest(), tensor_bytes=len(data))
    open(meta_path, "w").write(json.dumps(meta))


def truncate(ckpt) -> None:
    path = shard_paths(ckpt, 2, 0)[0]
    os.truncate(path, os.path.getsize(path) - 100)


def flip_a_byte(ckpt) -> None:
    path = shard_paths(ckpt, 2, 0)[0]
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0xFF
    open(path, "wb").write(bytes(data))


def drop_a_tensor(ckpt) -> None:
    tensors = load_file(shard_paths(ckpt, 2, 0)[0])
    del tensors["optim/blocks.1.mlp.fc.weight/exp_avg_sq"]
    resign(ckpt, tensors)


def reshape_a_tensor(ckpt) -> None:
    tensors = load_file(shard_paths(ckpt, 2, 0)[0])
    tensors["model/head.weight"] = tensors["model/head.weight"][:, :8].contiguous()
    resign(ckpt, tensors)


def garbage_json(ckpt) -> None:
    open(shard_paths(ckpt, 2, 0)[1], "w").write('{"format": "geosched-checkpoint/1", "step": ')


def deeply_nested_json(ckpt) -> None:
    open(shard_paths(ckpt, 2, 0)[1], "w").write("[" * 100_000)  # json's decoder recurses per bracket


def not_safetensors(ckpt) -> None:
    path = shard_paths(ckpt, 2, 0)[0]
    resign_bytes = b"\xff" * 64
    open(path, "wb").write(resign_bytes)
    meta_path = shard_paths(ckpt, 2, 0)[1]
    meta = json.loads(open(meta_path).read())
    meta.update(sha256=hashlib.sha256(resign_bytes).hexdigest(), tensor_bytes=len(resign_bytes))
    open(meta_path, "w").write(json.dumps(meta))


def _replace_with(ckpt, make) -> None:  # the tensor file becomes ``make(path)``; its JSON says 0 bytes, as a trial's
    path, meta_path = shard_paths(ckpt, 2, 0)
    os.unlink(path)
    make(path)
    meta = json.loads(open(meta_path).read())
    meta.update(sha256=hashlib.sha256(b"").hexdigest(), tensor_bytes=0)
    open(meta_path, "w").write(json.dumps(meta))


def linked_to_dev_zero(ckpt) -> None:  # getsize said 0, then read() filled memory
    _replace_with(ckpt, lambda path: os.symlink("/dev/zero", path))


def a_fifo(ckpt) -> None:  # read() blocked forever
    _replace_with(ckpt, lambda path: os.mkfifo(path, 0o600))


# checksum_fails: the damage is visible to latest_complete (size/sha256/JSON); the others were
# written consistently (checksum fixed up) but hold the wrong tensors, which only a load can see
@pytest.mark.parametrize(
    "corrupt, message, checksum_fails",
    [
        (truncate, r"stage-00\.safetensors: \d+ bytes on disk but \d+ recorded", True),
        (flip_a_byte, r"stage-00\.safetensors: sha256 does not match", True),
        (garbage_json, r"stage-00\.json: not valid JSON", True),
        (deeply_nested_json, r"stage-00\.json: not valid JSON \(maximum recursion depth", True),
        (drop_a_tensor, r"missing tensor optim/blocks\.1\.mlp\.fc\.weight/exp_avg_sq", False),
        (reshape_a_tensor, r"tensor model/head\.weight is \(256, 8\).*expects \(256, 16\)", False),
        (not_safetensors, r"stage-00\.safetensors: not a readable safetensors file", False),
        (linked_to_dev_zero, r"stage-00\.safetensors: cannot read \(a character device, not a regular file\)", True),
        (a_fifo, r"stage-00\.safetensors: cannot read \(a FIFO, not a regular file\)", True),
    ],
)
def test_each_corruption_is_refused_and_leaves_the_model_untouched(ckpt, corrupt, message, checksum_fails) -> None:
    corrupt(ckpt)
    model, opt = trained(seed=9)  # different weights from the checkpoint's
    torch.manual_seed(1234)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=message):
        load_shard(ckpt, 2, 0, model, opt)
    assert_unchanged(model, opt, before)
    assert latest_complete(ckpt, 1) == (None if checksum_fails else 2)


def test_a_checkpoint_of_another_model_or_job_is_refused(ckpt) -> None:
    model, opt = trained(seed=9)
    wider = ModelShape(layers=2, hidden=32, heads=2, seq_len=8)
    big, big_opt = trained(shape=wider)
    cut = build_stage(SHAPE, 1, 2, first=False, last=True, seed=3)  # building modules draws from the RNG
    before = snapshot(model, opt)
    other_fp = job_fingerprint(SHAPE, (0, 2), first=True, last=True, seed=4, num_stages=1)
    with pytest.raises(CheckpointError, match="written for a different job"):
        load_shard(ckpt, 2, 0, model, opt, job_fingerprint=other_fp)
    with pytest.raises(CheckpointError, match="does not match this model"):
        load_shard(ckpt, 2, 0, big, big_opt)  # no fingerprint given: the shapes still catch it
    with pytest.raises(CheckpointError, match="lacks"):
        load_shard(ckpt, 2, 0, cut, None)
    with pytest.raises(CheckpointError, match="stage-00.json: missing"):
        load_shard(ckpt, 7, 0, model, opt)
    assert_unchanged(model, opt, before)
    extra = load_shard(ckpt, 2, 0, model, opt, job_fingerprint=FP)  # the good one still loads
    assert extra == {"next_step": 2}


def test_a_moved_shard_is_refused(ckpt) -> None:
    os.rename(os.path.join(ckpt, "step-000002"), os.path.join(ckpt, "step-000003"))
    model, opt = trained()
    with pytest.raises(CheckpointError, match="records step 2 stage 0, but sits at step 3"):
        load_shard(ckpt, 3, 0, model, opt)


def test_a_folder_that_refuses_the_write_is_a_checkpoint_error_naming_it(tmp_path) -> None:
    """The file system's refusal (full, read-only, a file where the step folder goes) is the job's storage, named
    as such (CheckpointError: an elastic job stops instead of re-planning around a healthy rank)."""
    model, opt = trained()
    writer = CheckpointWriter(tmp_path, 0, 1, FP)
    (tmp_path / "step-000004").write_text("not a folder")
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint step 4 into {tmp_path}: .*--checkpoint-dir"):
        writer.save(4, model, opt)
    assert latest_complete(tmp_path, 1) is None


def test_a_writer_removes_what_its_stage_left_half_written(ckpt) -> None:
    """kill -9 mid-write leaves a hidden temporary file; the stage's next writer removes its own, no other's."""
    step = ckpt / "step-000002"
    mine, other = step / ".stage-00.safetensors.tmp-123-abcd", step / ".stage-01.safetensors.tmp-456-ef01"
    mine.write_bytes(b"half")
    other.write_bytes(b"half")
    CheckpointWriter(ckpt, 0, 1, FP)
    assert not mine.exists() and other.exists() and latest_complete(ckpt, 1) == 2
