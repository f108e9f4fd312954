"""``geosched export``: a checkpoint's stage shards merged into one whole-model weights file, whatever layout.

Checkpoints of the same weights written by a 2-stage and a 4-stage layout
(the second resharded from the first, as a resumed job would) export to the
same whole weights, those of the trained stages, with the model's record in
the file. Bad, missing and incomplete folders, a shard or weights of another
model given where whole weights are expected: one line, exit 2.
(The tensor-parallel layout is exported in tests/test_tp_pipeline.py.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_checkpoint_reshard import NEW, OLD, SEED, SHAPE, pipeline, train

from agents.checkpoint.export import export_weights, load_whole_model, resolve_step
from agents.checkpoint.load import load_resharded
from agents.checkpoint.store import CheckpointWriter, job_fingerprint, model_fingerprint
from geosched.cli import main
from geosched.errors import CheckpointError
from geosched.model import ModelShape
from geosched.weights import FORMAT, ModelRecord

RECORD = ModelRecord(SHAPE, SEED, "fp32")


def save(folder: Path, step: int, cuts, stages, optimizers, record: ModelRecord | None = RECORD) -> None:
    """Every stage's shard of ``step``, as agents write them (with the model's record unless None)."""
    for i, (stage, opt) in enumerate(zip(stages, optimizers, strict=True)):
        fp = job_fingerprint(SHAPE, cuts[i], first=i == 0, last=i == len(cuts) - 1, seed=SEED, num_stages=len(cuts))
        writer = CheckpointWriter(
            folder, i, len(cuts), fp, model_fingerprint(SHAPE, seed=SEED), record and record.to_dict()
        )
        writer.save(step, stage, opt, extra={"next_step": step})


@pytest.fixture(scope="module")
def two_layouts(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(2-stage folder, 4-stage folder, the trained weights): step 2 of one training run in both layouts."""
    root = tmp_path_factory.mktemp("layouts")
    stages, optimizers = pipeline(OLD)
    train(stages, optimizers, range(2))
    save(root / "two", 2, OLD, stages, optimizers)
    resumed, resumed_optimizers = pipeline(NEW, seed=SEED + 1)  # other initial weights: all are overwritten
    for i, (stage, opt) in enumerate(zip(resumed, resumed_optimizers, strict=True)):
        load_resharded(root / "two", 2, i, stage, opt, model_fingerprint=model_fingerprint(SHAPE, seed=SEED))
    save(root / "four", 2, NEW, resumed, resumed_optimizers)
    weights = {name: p.detach().clone() for stage in stages for name, p in stage.state_dict().items()}
    return root / "two", root / "four", weights


def test_two_layouts_export_the_same_whole_weights(two_layouts, tmp_path: Path, capsys) -> None:
    two, four, trained = two_layouts
    assert main(["export", str(two), "-o", str(tmp_path / "two.safetensors")]) == 0
    text = capsys.readouterr().out
    assert "exported checkpoint step 2 (2 stages)" in text and "layers=6 hidden=32 heads=4" in text, text
    assert main(["export", str(four), "-o", str(tmp_path / "four.safetensors"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["step"], summary["stages"], summary["model"]) == (2, 4, RECORD.to_dict())
    a, b = load_file(tmp_path / "two.safetensors"), load_file(tmp_path / "four.safetensors")
    assert a.keys() == b.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(a[name], value) and torch.equal(b[name], value), name
    assert summary["parameters"] == sum(t.numel() for t in trained.values())
    with safe_open(tmp_path / "four.safetensors", framework="pt") as fh:
        meta = fh.metadata()
    assert meta["format"] == FORMAT and meta["step"] == "2" and meta["source_stages"] == "4"
    assert json.loads(meta["model"]) == RECORD.to_dict()
    assert meta["model_fingerprint"] == model_fingerprint(SHAPE, seed=SEED)


def test_exporting_a_checkpoint_again_gives_the_same_bytes(two_layouts, tmp_path: Path, capsys) -> None:
    """The sha256 export prints changed from run to run (safetensors writes its metadata in any order), so a
    user could not pin weights by their hash; the metadata is now in key order."""
    two, _, _ = two_layouts
    sums = set()
    for i in range(4):
        assert main(["export", str(two), "-o", str(tmp_path / f"{i}.safetensors"), "--json"]) == 0
        sums.add(json.loads(capsys.readouterr().out)["sha256"])
    assert len(sums) == 1 and len({(tmp_path / f"{i}.safetensors").read_bytes() for i in range(4)}) == 1
    with safe_open(tmp_path / "0.safetensors", framework="pt") as fh:
        assert fh.metadata()["step"] == "2" and fh.metadata()["source_stages"] == "2"  # still read back


def test_a_checkpoint_without_a_record_exports_with_its_config(tmp_path: Path) -> None:
    stages, optimizers = pipeline(OLD)
    save(tmp_path / "old", 1, OLD, stages, optimizers, record=None)  # written before shards recorded the model
    with pytest.raises(CheckpointError, match="records no model shape.*--config"):
        export_weights(tmp_path / "old", tmp_path / "w.safetensors")
    bigger = ModelRecord(ModelShape(layers=600, hidden=32, heads=4, seq_len=16), SEED, "fp32")
    with pytest.raises(CheckpointError, match="needs .* bytes of weights, the step's shards hold"):
        export_weights(tmp_path / "old", tmp_path / "w.safetensors", config=bigger)  # refused before allocating
    done = export_weights(tmp_path / "old", tmp_path / "w.safetensors", config=RECORD)
    model, record = load_whole_model(tmp_path / "old", resolve_step(tmp_path / "old"), RECORD)
    assert done["step"] == 1 and record == RECORD
    assert all(torch.equal(v, load_file(tmp_path / "w.safetensors")[k]) for k, v in model.state_dict().items())


def _one_line_exit_2(argv: list[str], needle: str, capsys) -> None:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err


def test_bad_folders_and_files_are_one_line_exit_2(two_layouts, tmp_path: Path, capsys) -> None:
    two, _, _ = two_layouts
    out = str(tmp_path / "w.safetensors")
    _one_line_exit_2(["export", str(tmp_path / "missing"), "-o", out], "not a checkpoint folder", capsys)
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(["export", str(tmp_path / "empty"), "-o", out], "holds no checkpoint", capsys)
    _one_line_exit_2(["export", str(two), "--step", "9", "-o", out], "no checkpoint step 9", capsys)
    one_step = f"is one step of the checkpoint folder {str(two)!r}: pass that folder"
    _one_line_exit_2(["export", str(two / "step-000002"), "-o", out], one_step, capsys)
    _one_line_exit_2(["prefill", "--local", "--weights", str(two / "step-000002"), "hi"], one_step, capsys)
    _one_line_exit_2(["export", str(two), "-o", str(tmp_path / "no" / "w.safetensors")], "make it first", capsys)
    shutil.copytree(two, tmp_path / "partial")
    (tmp_path / "partial" / "step-000002" / "stage-01.json").unlink()  # a stage never finished writing
    _one_line_exit_2(["export", str(tmp_path / "partial"), "-o", out], "never completely written", capsys)
    shard = two / "step-000002" / "stage-00.safetensors"
    config = Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml"  # another model
    local = ["prefill", "--local", "--config", str(config), "--weights"]
    _one_line_exit_2([*local, str(shard), "hi"], "one stage's checkpoint shard", capsys)
    assert main(["export", str(two), "-o", out]) == 0
    capsys.readouterr()
    _one_line_exit_2([*local, out, "hi"], "hold hidden=32 seq_len=16 where the model has hidden=64 seq_len=64", capsys)
    _one_line_exit_2([*local, str(two), "hi"], "do not fit the model shape", capsys)
    _one_line_exit_2(["prefill", "hi"], "--endpoint tcp://HOST:PORT", capsys)
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, plain)
    _one_line_exit_2(["prefill", "--local", "--weights", str(plain), "hi"], "records no model (a plain", capsys)
    _one_line_exit_2(["prefill", "--local", "hi"], "pass --weights (a file from 'geosched export'", capsys)
    assert not (tmp_path / "w.safetensors.tmp").exists() and not list(tmp_path.glob(".w.safetensors.tmp*"))


def test_a_corrupt_newest_step_is_refused_not_passed_over(two_layouts, tmp_path: Path, capsys) -> None:
    """A trial flipped a byte of the newest step's shard: export wrote the step before it and exited 0, with a
    log line (so did prefill --local and launch --resume). A step marked complete that does not verify is now one
    line naming it and the newest that verifies, exit 2; that one is taken when asked for (--step). A newer
    step still being written (no manifest) is passed over, as a running job's is."""
    two, _, _ = two_layouts
    folder = tmp_path / "ckpt"
    shutil.copytree(two, folder)
    shutil.copytree(folder / "step-000002", folder / "step-000005")
    shard = folder / "step-000005" / "stage-01.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated
    out = str(tmp_path / "w.safetensors")
    needle = f"checkpoint step 5 in '{folder}' is marked complete but does not verify"
    _one_line_exit_2(["export", str(folder), "-o", out], needle, capsys)
    away = f"the newest that verifies is step 2: to use it, move or delete '{folder / 'step-000005'}'"
    _one_line_exit_2(["export", str(folder), "-o", out], away, capsys)  # how to get past it (a trial's had no fix)
    _one_line_exit_2(["prefill", "--local", "--weights", str(folder), "hi"], needle, capsys)
    config = str(Path(__file__).resolve().parent.parent / "configs" / "demo-3dc.yaml")
    resume = ["launch", config, "--resume", "--checkpoint-dir", str(folder), "--run-dir", str(tmp_path / "run")]
    _one_line_exit_2(resume, f"step 2: to resume from it, move or delete '{folder / 'step-000005'}'", capsys)
    assert main(["export", str(folder), "--step", "2", "-o", out]) == 0
    (folder / "step-000005" / "manifest.json").unlink()  # as if stage 1 were still writing it
    assert resolve_step(folder) == 2


def test_an_output_folder_that_refuses_the_write_is_one_line(two_layouts, tmp_path: Path, capsys) -> None:
    """A full (here: 64 KiB) or read-only file system under -o: one line, exit 2, nothing half-written."""
    two, _, _ = two_layouts
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        _one_line_exit_2(
            ["export", str(two), "-o", str(tiny / "w.safetensors")], "cannot write the weights there", capsys
        )
        assert list(tiny.iterdir()) == []
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


def test_a_checkpoint_that_fills_the_disk_is_a_checkpoint_error(tmp_path: Path) -> None:
    """safetensors reports a full disk as its own error, not OSError: it must still be the job's storage
    (CheckpointError: an elastic job does not re-plan around it), not a lost rank."""
    import torch

    from agents.checkpoint.store import CheckpointWriter
    from geosched.errors import CheckpointError

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(tiny)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        with pytest.raises(CheckpointError, match="No space left on device"):
            CheckpointWriter(tiny / "ckpt", 0, 1, "fingerprint").save(1, torch.nn.Linear(300, 300), None)
    finally:
        subprocess.run(["umount", str(tiny)], check=True)


def test_weights_that_diverged_are_exported_with_a_warning(tmp_path: Path, capsys) -> None:
    """A checkpoint whose weights are NaN exported silently (exit 0), and prefill then decoded zeros."""
    stages, optimizers = pipeline(OLD)
    with torch.no_grad():
        next(stages[0].parameters()).fill_(float("nan"))
    save(tmp_path / "nan", 1, OLD, stages, optimizers)
    assert main(["export", str(tmp_path / "nan"), "-o", str(tmp_path / "w.safetensors"), "--json"]) == 0
    captured = capsys.readouterr()
    nonfinite = json.loads(captured.out)["nonfinite"]
    assert nonfinite == next(stages[0].parameters()).numel() > 0
    assert f"warning: {nonfinite:,} of the weights are NaN or inf" in captured.err


def test_a_shard_with_a_tensor_its_record_does_not_name_is_refused(two_layouts, tmp_path: Path, capsys) -> None:
    """Export took from each shard only the names the model holds: an extra tensor (its checksum fixed up) was
    dropped unseen (a trial). The shard names its parameters: anything else is refused, in one line."""
    import hashlib

    two, _, _ = two_layouts
    altered = tmp_path / "altered"
    shutil.copytree(two, altered)
    tensor_path = altered / "step-000002" / "stage-01.safetensors"
    tensors = load_file(tensor_path)
    save_file({**tensors, "model/blocks.9.attn.backdoor": torch.zeros(4)}, tensor_path)
    meta_path = tensor_path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    data = tensor_path.read_bytes()
    meta.update(sha256=hashlib.sha256(data).hexdigest(), tensor_bytes=len(data))
    meta_path.write_text(json.dumps(meta))
    out = str(tmp_path / "w.safetensors")
    _one_line_exit_2(["export", str(altered), "-o", out], "unexpected tensors ['model/blocks.9.attn.backdoor']", capsys)
    assert not Path(out).exists()
