"""Paths and addresses a verb cannot use are one line and exit code 2, never a traceback (rule 4)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from geosched.cli import main


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["keys", "{file}/sub", "--ranks", "2"], "cannot make a folder there (Not a directory)"),
        (["keys", "{file}", "--ranks", "2"], "cannot make a folder there (File exists)"),
        (["launch", "configs/demo-3dc.yaml", "--run-dir", "{file}", "--steps", "1"], "--run-dir"),
        (["launch", "configs/demo-3dc.yaml", "--mqtt", "foo", "--steps", "1"], "broker URL 'foo'"),
        (["launch", "configs/demo-3dc.yaml", "--wan-scale", "inf"], "--wan-scale: must be a finite number"),
        (["profile", "configs/demo-3dc.yaml", "--threads", "2147483648"], "at most 1024"),
        (["prefill", "--endpoint", "tcp://127.0.0.1:9", "--priority", "10", "hi"], "--priority: must be <= 9"),
        (["prefill", "--endpoint", "tcp://127.0.0.1:9", "--timeout", "nan", "hi"], "--timeout: must be > 0"),
        (["simulate", "configs/demo-3dc.yaml", "--step-ms", "5"], "--step-ms: sets the synthetic pipeline's costs"),
        (["profile", "configs/demo-3dc.yaml", "-o", "/dev/null"], "-o /dev/null: a character device"),
        (["launch", "configs/demo-3dc.yaml", "--wan-scale", "1e308"], "--wan-scale: must be <= 1000"),
        (["launch", "configs/demo-3dc.yaml", "--wan-scale", "1e-300"], "--wan-scale: must be >= 0.001"),
        (["plan", "configs/demo-3dc.yaml", "--dp", "5", "--cross-dc-dp"], "--dp 5: global_batch(16) / microbatch"),
        (["prefill", "--local", "--config", "configs/demo-3dc.yaml", "--seed", "-1", "hi"], "--seed: must be >= 0"),
        (["launch", "configs/demo-3dc.yaml", "--wan-reset-every", "1e-9"], "--wan-reset-every: must be >= 0.1"),
        (["launch", "configs/demo-3dc.yaml", "--checkpoint-keep", "2"], "--checkpoint-keep needs --checkpoint-dir"),
        (["launch", "configs/demo-3dc.yaml", "--elastic", "--checkpoint-keep", "-2"], "--checkpoint-keep: must be >="),
        (["launch", "configs/demo-3dc.yaml", "--elastic", "--checkpoint-every", "0"], "a recovery would start over"),
        (["profile", "configs/demo-3dc.yaml", "--gpu-name", "x" * 300], "--gpu-name: 1-256 characters on one line"),
        (
            ["wanem", "configs/demo-3dc.yaml", "--route", "us-eu=127.0.0.1:9", "--route", "us-eu=127.0.0.1:8"],
            "the link us-eu has a route already",
        ),
        (["launch", "configs/demo-3dc.yaml", "--steps", "1000000000000"], "--steps: must be <= 1000000000"),
        (["wanem", "configs/demo-3dc.yaml", "--scale", "1e308", "--route", "us-eu:0=127.0.0.1:9"], "--scale: must be"),
        (["simulate", "--stages", "2", "--microbatches", "9", "--forward-ms", "1e308"], "from 0 to 8.64e+07 ms"),
        (["simulate", "--stages", "1000000", "--microbatches", "1"], "--stages must be at most 4096"),
        (["profile", "configs/demo-3dc.yaml", "--repeats", "1000000000"], "--repeats: must be <= 10000"),
        (["export", "{file}", "-o", "/dev/null"], "-o /dev/null: a character device, not a regular file"),
        (["plan", "configs/demo-3dc.yaml", "-o", "/dev/null"], "-o /dev/null: a character device"),
        (["validate-config", "configs/demo-3dc.yaml", "--json", "--dump"], "--json and --dump each print one form"),
        (["plan", "configs/demo-3dc.yaml", "-o", "{file}.d/p.yaml"], "does not exist; make it first"),
        (["launch", "configs/demo-3dc.yaml", "--checkpoint-dir", "{file}/c"], "--checkpoint-dir {file}/c: cannot make"),
        (
            ["agent", "--rank", "0", "--checkpoint-dir", "{file}/c", "--mqtt", "mqtt://127.0.0.1:9", "--job", "j"],
            "cannot make the folder",
        ),
        (["simulate", "--stages", "2", "--microbatches", "2", "--trace", "/dev/null"], "--trace /dev/null: a char"),
        (["launch", "configs/demo-3dc.yaml", "--data", "{file}.txt"], "data pattern '{file}.txt' matches no files"),
        (["launch", "configs/demo-3dc.yaml", "--checkpoint-dir", "{others}"], "holds files that are no checkpoint's"),
        (
            ["agent", "--rank", "0", "--checkpoint-dir", "{others}", "--mqtt", "mqtt://127.0.0.1:9", "--job", "j"],
            "{others}: holds files that are no checkpoint's (agent-0.key, notes.txt)",
        ),
        (["launch", "configs/demo-3dc.yaml", "--data", "{file}"], "data has 13 bytes in 1 non-empty files, fewer"),
        (["launch", "configs/demo-3dc.yaml", "--data", str(Path(__file__).parent)], "is a directory; pass a glob"),
    ],
)
def test_unusable_paths_and_values_are_one_line(tmp_path: Path, capsys, argv: list[str], needle: str) -> None:
    file, others = tmp_path / "a-file", tmp_path / "keys"  # others: a folder of another tool's files
    file.write_text("not a folder")
    others.mkdir()
    for name in ("agent-0.key", "notes.txt", "step-000001"):
        (others / name).write_text("x")
    assert main([arg.format(file=file, others=others) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle.format(file=file, others=others) in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["validate-config", "{path}"],
        ["plan", "{path}"],
        ["simulate", "{path}"],
        ["launch", "configs/demo-3dc.yaml", "--plan", "{path}", "--run-dir", "{run}"],
    ],
)
def test_a_fifo_device_or_folder_for_a_file_is_refused_at_once(tmp_path: Path, capsys, argv: list[str]) -> None:
    """A FIFO nobody writes would block a reader forever: refused without opening it for a blocking read."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device"), (tmp_path, "a directory")):
        assert main([arg.format(path=path, run=tmp_path / "run") for arg in argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path}: cannot read" in err and f"({kind}, not a regular file)" in err, err
    assert not (tmp_path / "run").exists()


def test_a_plan_made_for_another_config_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    from agents.layout import layout_plan_text
    from geosched.config import load_config

    plan = tmp_path / "demo-plan.yaml"
    plan.write_text(layout_plan_text(load_config("configs/demo-3dc.yaml"), ["us", "eu"]))
    run = tmp_path / "run"
    argv = ["launch", "configs/gpt3-3dc.yaml", "--plan", str(plan), "--run-dir", str(run), "--no-calibrate"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "was made for cluster 'demo-3dc' and a model of 6 layers" in err and err.count("\n") == 1, err
    assert not run.exists()
    edited = tmp_path / "demo.yaml"  # the same cluster by name, one link's value changed: the field is named
    text = Path("configs/demo-3dc.yaml").read_text()
    edited.write_text(text.replace("per_connection_gbps: 0.05,", "per_connection_gbps: 0.06,", 1))
    assert main(["launch", str(edited), "--plan", str(plan), "--run-dir", str(run), "--no-calibrate"]) == 2
    err = capsys.readouterr().err
    assert "as it was then (cluster.links[0].per_connection_gbps 0.05 (the config has 0.06))" in err, err
    # profile names the model fields that differ, in words (a trial's line was two ModelSpec(...) reprs)
    edited.write_text(text.replace("{layers: 6, hidden: 64,", "{layers: 4, hidden: 32,", 1))
    assert main(["profile", str(edited), "--plan", str(plan), "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    said = "made for a model of 6 layers x 64 hidden, not the config's (model.layers 6 (the config has 4), model.hidden"
    assert said in err, err
    assert "ModelSpec" not in err and err.count("\n") == 1, err


def test_an_output_is_never_one_of_the_files_the_command_reads_nor_an_empty_name(tmp_path: Path, capsys) -> None:
    """simulate --trace over its plan, profile -o over its config or plan, plan -o '' (which wrote nothing)."""
    config = tmp_path / "c.yaml"
    config.write_text(Path("configs/demo-3dc.yaml").read_text())
    plan = tmp_path / "p.yaml"
    assert main(["plan", str(config), "-o", str(plan), "--no-explain"]) == 0
    before = config.read_bytes(), plan.read_bytes()
    profile = ["profile", str(config), "--no-link", "--repeats", "1", "--warmup", "0"]
    for argv, says in (
        (["simulate", str(plan), "--trace", str(plan)], "the file simulated"),
        (["simulate", str(plan), "--timeline", str(plan)], "the file simulated"),
        ([*profile, "-o", str(config)], "the config measured"),
        ([*profile, "--plan", str(plan), "-o", str(plan)], "the plan"),
        (["plan", str(config), "-o", ""], "an empty file name"),
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, (argv, err)
    assert (config.read_bytes(), plan.read_bytes()) == before


def test_a_plan_trains_only_the_learning_settings_it_was_made_with(tmp_path: Path, capsys) -> None:
    """The agents train with the plan's job: a config whose learning rate, seed or precision differ is refused,
    each field named; the planner's choices (here ZeRO and the microbatch size, pinned by the config) and the
    steps may differ."""
    import dataclasses

    from agents.layout import layout_plan_text
    from agents.runnable import check_plan_config
    from geosched.config import load_config

    config = load_config("configs/demo-3dc.yaml")
    plan = tmp_path / "demo-plan.yaml"
    plan.write_text(layout_plan_text(config, ["us", "eu"]))
    text = Path("configs/demo-3dc.yaml").read_text()
    other = tmp_path / "other.yaml"
    other.write_text(text.replace("learning_rate: 0.003", "learning_rate: 0.03\n  seed: 7").replace("fp32", "bf16"))
    run = tmp_path / "run"
    argv = ["launch", str(other), "--plan", str(plan), "--run-dir", str(run), "--no-calibrate"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for field in ("job.precision fp32 (the config has bf16)", "job.seed 0 (the config has 7)", "learning_rate 0.003"):
        assert field in err, err
    assert not run.exists()
    chosen = dataclasses.replace(config.job, zero=1, microbatch_size=1, steps=5)  # as plan --zero 1 ... sets them
    check_plan_config(dataclasses.replace(config, job=chosen), config, str(plan), "configs/demo-3dc.yaml")
    # with a decaying learning rate the steps may not differ: the agents end the decay at the plan's job.steps
    from geosched.errors import InputError

    decaying = dataclasses.replace(config, job=dataclasses.replace(config.job, lr_decay="cosine"))
    made_for = dataclasses.replace(decaying, job=dataclasses.replace(decaying.job, steps=12))
    with pytest.raises(InputError, match="job.steps 12, where its learning-rate decay ends .the config has"):
        check_plan_config(made_for, decaying, str(plan), "configs/demo-3dc.yaml")


def test_export_writes_neither_through_a_link_nor_into_the_checkpoint_it_reads(tmp_path: Path, capsys) -> None:
    """Its output is written whole and renamed into place: a rename would replace a link (or a device) itself,
    and a file inside the checkpoint folder could be one of its shards."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-000003").mkdir(parents=True)
    link = tmp_path / "latest.safetensors"
    link.symlink_to(tmp_path / "elsewhere.safetensors")
    for out, needle in (
        (link, "a symbolic link; give the file it points to"),
        (ckpt / "step-000003" / "stage-00.safetensors", "inside " + str(ckpt) + ", the folder it is made from"),
    ):
        assert main(["export", str(ckpt), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
    assert link.is_symlink() and not (ckpt / "step-000003" / "stage-00.safetensors").exists()


def test_a_new_run_into_a_folder_of_checkpoints_needs_resume(tmp_path: Path, capsys) -> None:
    """Without --resume a run would overwrite some of the folder's steps and leave the rest, mixed."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-000001").mkdir(parents=True)
    (ckpt / "step-000003").mkdir()
    run = tmp_path / "run"
    argv = ["launch", "configs/demo-3dc.yaml", "--checkpoint-dir", str(ckpt), "--run-dir", str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints already (steps 1-3); add --resume" in err and err.count("\n") == 1, err
    assert not run.exists() and sorted(p.name for p in ckpt.iterdir()) == ["step-000001", "step-000003"]


def test_a_run_folder_of_other_files_or_in_use_is_refused(tmp_path: Path, capsys) -> None:
    """A launch rewrites its run folder's keys, rank files and checkpoints: a folder of the user's own files, or
    one another launch is running in, is refused before anything is touched."""
    import fcntl

    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "important.txt").write_text("precious")
    assert main(["launch", "configs/demo-3dc.yaml", "--run-dir", str(project), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "holds files that are no launch's run folder (checkpoints)" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in project.iterdir()) == ["checkpoints"]  # untouched, no lock file left
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "plan.yaml").write_text("a previous launch's plan\n")
    with open(busy / ".launch.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running launch holds it
        assert main(["launch", "configs/demo-3dc.yaml", "--run-dir", str(busy), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "another launch or job start is using it" in err and err.count("\n") == 1, err
    assert (busy / "plan.yaml").read_text() == "a previous launch's plan\n"


def test_a_run_folder_others_can_write_or_a_planted_lock_link_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    """An attacker's trial: launch took a 0777 folder and followed a .launch.lock symlink (creating its target);
    the run folder it made was 0755, its logs, plan and endpoints readable by every user."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert main(["launch", "configs/demo-3dc.yaml", "--run-dir", str(shared), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"--run-dir {shared}: writable by others (mode 0777); run chmod go-w" in err and err.count("\n") == 1, err
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "plan.yaml").write_text("a previous launch's plan\n")
    (planted / ".launch.lock").symlink_to(tmp_path / "victim.txt")
    assert main(["launch", "configs/demo-3dc.yaml", "--run-dir", str(planted), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "cannot open its .launch.lock" in err and err.count("\n") == 1, err
    assert not (tmp_path / "victim.txt").exists()
    from agents.runfolder.claim import claim_run_dir, new_run_dir
    from geosched.commands.launch import FOREIGN

    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # no sticky bit: another user could rename the run folder away and make their own
    assert main(["launch", "configs/demo-3dc.yaml", "--run-dir", str(open_parent / "a" / "run"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--run-dir {open_parent}/a/run: its folder {open_parent} is writable by others without the sticky bit" in err
    )
    assert err.count("\n") == 1 and not (open_parent / "a" / "run").exists(), err
    open_parent.chmod(0o1777)  # as /tmp: others cannot rename what is not theirs
    with claim_run_dir(str(open_parent / "a" / "run"), foreign=FOREIGN):
        pass
    with claim_run_dir(str(tmp_path / "fresh"), foreign=FOREIGN) as run:
        assert Path(run).stat().st_mode & 0o077 == 0  # the owner's alone
    monkeypatch.chdir(tmp_path)  # new_run_dir makes runs/launch-<time> here
    assert new_run_dir().stat().st_mode & 0o077 == 0


def test_plan_writes_neither_over_its_config_nor_into_a_fifo(tmp_path: Path, capsys) -> None:
    config = tmp_path / "mine.yaml"
    config.write_text(Path("configs/demo-3dc.yaml").read_text() + "# my notes\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for out, needle in ((config, "the config being planned"), (fifo, "a FIFO, not a regular file")):
        assert main(["plan", str(config), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert config.read_text().endswith("# my notes\n")


def test_a_model_the_agents_cannot_feed_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    """The agents train on bytes (ids 0-255): a vocabulary below 256 plans fine but crashed the first forward.
    validate-config and plan (which said "ok" to it, a trial) warn that the agents will refuse it."""
    text = Path("configs/demo-3dc.yaml").read_text()
    assert "seq_len: 64, vocab: 256}" in text
    config = tmp_path / "tiny-vocab.yaml"
    config.write_text(text.replace("seq_len: 64, vocab: 256}", "seq_len: 64, vocab: 2}"))
    run = tmp_path / "run"
    assert main(["launch", str(config), "--run-dir", str(run), "--no-calibrate", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "job.model.vocab 2 is below the 256 byte values" in err and err.count("\n") == 1, err
    assert not run.exists()
    for verb, what in (("validate-config", "job"), ("plan", "plan")):
        assert main([verb, str(config)]) == 0
        err = capsys.readouterr().err
        assert f"warning: the agents will refuse this {what}: job.model.vocab 2 is below" in err, (verb, err)


def test_a_model_larger_than_this_hosts_memory_is_refused_before_torch_allocates(tmp_path: Path, capsys) -> None:
    """A valid config of 137B parameters (a trial's 18.8B one gave a 31-line torch allocation traceback)."""
    text = Path("configs/demo-3dc.yaml").read_text()
    small = "model: {layers: 6, hidden: 64, heads: 4, seq_len: 64, vocab: 256}"
    assert small in text
    big = tmp_path / "big.yaml"
    big.write_text(text.replace(small, "model: {layers: 2, hidden: 65536, heads: 64, seq_len: 64, vocab: 1048576}"))
    for argv in (
        ["profile", str(big), "--repeats", "1", "--warmup", "0", "--no-link"],
        ["prefill", "--local", "--config", str(big), "--seed", "0", "hi"],
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "GiB available" in err and "Traceback" not in err, err


def test_a_plan_whose_ranks_this_host_cannot_hold_is_not_launched(tmp_path: Path, capsys) -> None:
    """launch runs every rank as a process here: configs/unequal-5dc.yaml's 96 ranks of a 13B model (a trial's
    launch of configs/gpt3-3dc.yaml started 2,880 ranks' calibration processes until the host swapped)."""
    from agents.layout import parse_layout
    from agents.rehearsal.processes import AGENT_PROCESS_BYTES, HOST_SHARE, fleet_memory_refusal
    from agents.runnable import plan_for_config
    from geosched.config import load_config

    run, config = tmp_path / "run", tmp_path / "unequal-5dc.yaml"
    config.write_text(Path("configs/unequal-5dc.yaml").read_text().replace("recompute: full", "recompute: none"))
    assert main(["launch", str(config), "--run-dir", str(run), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "launch runs each of its 96 ranks as a process on this host" in err, err
    assert "GiB this host has available; rehearse a smaller config" in err and not run.exists()
    demo = parse_layout(plan_for_config(load_config("configs/demo-3dc.yaml")), "demo")
    assert fleet_memory_refusal(demo, "cpu", 2**40) is None and fleet_memory_refusal(demo, "cpu", None) is None
    available = int(len(demo.roles) * AGENT_PROCESS_BYTES / HOST_SHARE) + 1
    assert fleet_memory_refusal(demo, "cuda", available) is None  # the stages are in GPU memory
    assert "ranks as a process" in (fleet_memory_refusal(demo, "cpu", available) or "")
    assert "more than 80% of the" in (fleet_memory_refusal(demo, "cuda", available - 2) or "")  # the rest's share


def test_a_config_where_a_plan_goes_is_named_as_such(capsys) -> None:
    """It was 'version: this geosched reads plan versions 1, 2 (got None)', for every verb taking a plan."""
    config = "configs/demo-3dc.yaml"
    for argv in (
        ["job", "start", config, "--mqtt", "mqtt://127.0.0.1:1"],
        ["agent", "--plan", config, "--rank", "0", "--mqtt", "mqtt://127.0.0.1:1"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is a config, not a plan: make one with 'geosched plan" in err, err
    assert main(["job", "start", config, "--mqtt", "mqtt://127.0.0.1:1", "--ready-timeout", "-1"]) == 2
    assert "--ready-timeout: must be > 0" in capsys.readouterr().err


def test_a_job_name_that_cannot_name_topics_is_refused_before_anything_starts(tmp_path: Path, capsys) -> None:
    """launch --job a/b named an internal client id, after starting 4 agents and writing a report."""
    run = tmp_path / "run"
    for argv in (
        ["launch", "configs/demo-3dc.yaml", "--job", "a/b", "--run-dir", str(run), "--no-calibrate"],
        ["job", "status", "--mqtt", "mqtt://127.0.0.1:1", "--job", "a/b"],
        ["agent", "--rank", "0", "--mqtt", "mqtt://127.0.0.1:1", "--job", "a#"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--job 'a" in err and "use 1-64 characters" in err, err
    assert not run.exists()


def test_simulating_a_layout_that_does_not_fit_says_so(tmp_path: Path, capsys) -> None:
    """`simulate CONFIG --stages P` timed a 70B model on one 40 GiB GPU without a word (a trial)."""
    config = tmp_path / "small.yaml"
    config.write_text(Path("configs/demo-3dc.yaml").read_text().replace("memory_gib: 0.007", "memory_gib: 0.0001"))
    assert main(["simulate", str(config), "--stages", "2"]) == 0
    err = capsys.readouterr().err
    assert "stage 0 (blocks 0-2)" in err and "this layout does not fit" in err, err


def test_output_that_cannot_be_written_is_one_line_and_exit_1() -> None:
    """stdout on a full disk (/dev/full) printed an OSError traceback (a trial)."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "geosched.cli", "validate-config", "configs/demo-3dc.yaml"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1 and done.stderr == "geosched validate-config: error: No space left on device\n", (
        done.stderr
    )


def test_pictures_without_a_writable_home_print_no_matplotlib_warnings(tmp_path: Path) -> None:
    """With no writable HOME, matplotlib warned twice in several lines about its config folder (a trial)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME")}
    (tmp_path / "a-file").write_text("a HOME under a file can never be made")
    env["HOME"] = str(tmp_path / "a-file" / "home")
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")
    picture = tmp_path / "t.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "geosched.cli",
            "simulate",
            "--stages",
            "2",
            "--microbatches",
            "4",
            "--timeline",
            str(picture),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and picture.stat().st_size > 0, done.stderr
    assert "matplotlib" not in done.stderr.lower(), done.stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # the private config folder went with the process


def test_a_plan_counting_on_recomputation_is_planned_for_agents_that_recompute(tmp_path: Path, capsys) -> None:
    """job.recompute: full was priced by the planner and refused by the agents (they kept every activation:
    a trial's plan measured 2.47 times its predicted peak). The stages recompute now (tests/test_equivalence.py
    trains with it, test_model_stages.py measures what a forward keeps): plan and validate-config say nothing."""
    import yaml

    from agents.layout import load_plan_file, parse_layout
    from agents.runnable import runtime_refusal

    data = yaml.safe_load(Path("configs/demo-3dc.yaml").read_text())
    data["job"]["recompute"] = "full"
    config = tmp_path / "full.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["plan", str(config), "-o", str(tmp_path / "plan.yaml"), "--no-explain"]) == 0
    assert main(["validate-config", str(config)]) == 0
    assert "refuse" not in capsys.readouterr().err
    layout = parse_layout(load_plan_file(tmp_path / "plan.yaml"), "plan.yaml")
    assert layout.job.recompute == "full" and runtime_refusal(layout) is None


def test_an_unknown_flag_is_named_by_its_verb(capsys) -> None:
    """'geosched plan CONFIG --bogus' said 'geosched: error: ... (see 'geosched --help')', the top level's."""
    with pytest.raises(SystemExit) as ended:
        main(["plan", "configs/demo-3dc.yaml", "--bogus"])
    assert ended.value.code == 2
    line = "geosched plan: error: unrecognized arguments: --bogus (see 'geosched plan --help')\n"
    assert capsys.readouterr().err == line


def test_version_is_one_line(capsys) -> None:
    """There was no --version (a user's trial)."""
    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0 and re.fullmatch(r"geosched \d+\.\d+\.\d+\n", capsys.readouterr().out)


def test_a_launch_interrupted_while_it_plans_reports_so_in_place_of_the_last_runs_report(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """A signal while launch planned wrote no report.json: a reused --run-dir kept the earlier launch's, which a
    script read as this launch's outcome (and --json printed nothing)."""
    import json

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "plan.yaml").write_text("an earlier launch's plan\n")
    (run / "report.json").write_text('{"outcome": "finished", "steps": [0, 1, 2]}')
    (run / "rank0.jsonl").write_text('{"step": 0}\n')

    def ctrl_c(*_args: object, **_kwargs: object) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr("agents.runnable.plan_for_config", ctrl_c)  # Ctrl-C while CP-SAT searches
    assert main(["launch", "configs/demo-3dc.yaml", "--run-dir", str(run), "--json"]) == 130
    out, err = capsys.readouterr()
    report = json.loads((run / "report.json").read_text())
    assert report["outcome"] == "interrupted" and report["steps"] == [], report
    assert json.loads(out.strip().splitlines()[-1]) == report and "interrupted" in err
    assert not (run / "rank0.jsonl").exists()  # the earlier run's steps are not this one's
