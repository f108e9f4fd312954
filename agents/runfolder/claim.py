"""Taking a run folder for one run: made the owner's alone, checked, locked, and cleared of an earlier run.

Both ``geosched launch`` and ``geosched job start --run-dir`` write a run folder, and both take it the same way
(:func:`claim_run_dir`): a new or empty folder, or an earlier run's (its ``plan.yaml`` says so), made with mode
0700; refused in one line when it holds other files, when other users may write it or a folder above it
(:func:`unsafe_ancestor`), or while another run holds its :data:`LOCK_NAME` locked. The run then removes what the
earlier run left that could pass for its own (:func:`clear_previous_run`) and says what it did::

    with claim_run_dir("runs/demo", foreign=FOREIGN) as run:
        said = clear_previous_run(Path(run))  # "an earlier run's: ..." or None
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from geosched.errors import InputError

LOCK_NAME = ".launch.lock"
"""The file in a run folder that the run using it (a launch or a job start) holds locked while it runs."""

PREVIOUS_RUN = (
    "report.json",
    "timeline.png",
    "predicted.png",
    "timelines.png",
    "trace.json",
    "loss.png",
    "calibration.json",
    "endpoints.json",
)
"""What a run folder holds of the run that wrote it, besides its rank files: removed when a run reuses the folder."""


@contextmanager
def claim_run_dir(run_dir: str | None, *, foreign: str) -> Iterator[str]:
    """Make and hold the run folder ``run_dir`` (None: a new ``runs/launch-<time>[-N]``) and yield it, locked from
    before the first file is written. Refused (InputError, one line) when it holds files and no ``plan.yaml`` (no
    earlier run's folder: ``foreign``, with ``{files}`` for their names, says so and what to pick), when it or a
    folder above it is unsafe, or while another run holds it. A folder made here is removed again if the run is
    refused (an InputError) before it wrote anything."""
    others: list[str] = []
    above = _absent(Path("runs") if run_dir is None else Path(run_dir).parent)  # made here too; removed with it
    if run_dir is None:
        run, made = new_run_dir(), True
    else:
        run = Path(run_dir)
        try:
            made = not run.is_dir()
            run.mkdir(mode=0o700, parents=True, exist_ok=True)  # its logs, plan, endpoints: the owner's alone
            others = sorted(p.name for p in run.iterdir() if p.name != LOCK_NAME)
            mode = run.stat().st_mode
        except OSError as exc:  # a file there, a path under a file, no permission, a name too long
            raise InputError(f"--run-dir {run}: cannot make or read a folder there ({exc.strerror or exc})") from None
        if mode & 0o022:  # another user could plant links (the lock, a key) or swap files under the run
            raise InputError(f"--run-dir {run}: writable by others (mode {mode & 0o7777:04o}); run chmod go-w {run}")
    unsafe = unsafe_ancestor(run)
    if unsafe:
        if made:
            _unmake([run, *above])
        raise InputError(
            f"--run-dir {run}: {unsafe}"
            if run_dir is not None
            else f"run folder {run}: {unsafe}; or pass --run-dir DIR"
        )
    if others and not (run / "plan.yaml").is_file():
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise InputError(f"--run-dir {run}: " + foreign.format(files=shown))
    try:  # held open, and locked, for the whole run; never through a link someone planted
        fd = os.open(run / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise InputError(f"--run-dir {run}: cannot open its {LOCK_NAME} ({exc.strerror or exc}; a link?)") from None
    with open(fd, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                f"--run-dir {run}: another launch or job start is using it; wait, or pick another folder"
            ) from None
        try:
            yield str(run)
        except InputError:
            if made and [p.name for p in run.iterdir()] == [LOCK_NAME]:  # refused before it wrote anything
                shutil.rmtree(run, ignore_errors=True)
                _unmake(above)
            raise


def _absent(folder: Path) -> list[Path]:
    """``folder`` and the folders above it that do not exist yet, deepest first."""
    return [p for p in (folder, *folder.parents) if p != Path(".") and not p.exists()]


def _unmake(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) where they are empty: what a refused run made and left nothing in."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def clear_previous_run(run: Path) -> str | None:
    """Remove what ``run`` holds of an earlier run that could pass for this one's (its report, pictures, trace,
    calibration, endpoints, rank files, ``attempt-*``) and set its ``metrics.jsonl`` aside as ``metrics-<N>.jsonl``
    (N: one more than the highest there). Its keys, plan, logs and checkpoints stay. Returns what was done, in
    words for a line the run prints (``an earlier run's: removed report.json, ...``), or None when the folder held
    nothing of an earlier run."""
    old = [*run.glob("rank*.jsonl"), *run.glob("prefill-rank*.json"), *run.glob("stage-rank*.json")]
    old += [path for name in PREVIOUS_RUN if (path := run / name).exists()]
    for path in old:
        path.unlink()
    attempts = sorted(run.glob("attempt-*"))
    for folder in attempts:
        shutil.rmtree(folder, ignore_errors=True)
    done = []
    if old or attempts:
        names = sorted(p.name for p in old + attempts)
        done.append(f"removed {', '.join(names[:4])}{', ...' if len(names) > 4 else ''} ({len(names)} in all)")
    if (run / "metrics.jsonl").exists():
        numbers = [int(p.stem[8:]) for p in run.glob("metrics-*.jsonl") if p.stem[8:].isdigit()]
        kept = f"metrics-{1 + max(numbers, default=0)}.jsonl"
        (run / "metrics.jsonl").rename(run / kept)
        done.append(f"kept its metrics.jsonl as {kept}")
    if not done:
        return None
    left = sorted(p.name for p in run.iterdir() if p.name not in (LOCK_NAME, "plan.yaml"))
    left = [name for name in left if not name.startswith("metrics-")]
    if left:
        done.append(f"left {', '.join(left[:4])}{', ...' if len(left) > 4 else ''} as they are")
    return "an earlier run's: " + "; ".join(done)


def new_run_dir() -> Path:
    """A folder of its own under ``runs/``, named for the time to the second (``-2``, ``-3``, ... when another
    launch took that name in the same second): made here, so no two launches share it."""
    base = Path("runs") / time.strftime("launch-%Y%m%d-%H%M%S")
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            run = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                run.mkdir(mode=0o700)  # its logs, plan, endpoints: the owner's alone
                return run
            except FileExistsError:
                continue
    except OSError as exc:
        raise InputError(f"runs/: cannot make a run folder there ({exc.strerror or exc}); pass --run-dir DIR") from None
    raise InputError(f"{base}: 999 run folders of this second exist already; pass --run-dir DIR")


def unsafe_ancestor(run: Path) -> str | None:
    """Why a folder above ``run`` lets another user swap the run folder (its keys, plan and lock) for their own,
    or None: one owned by another user (root aside), or writable by group or others without the sticky bit
    (``/tmp``'s 1777 is safe). Both the path as given and its resolved form are walked, as OpenSSH does for
    ``authorized_keys``."""
    me, seen = os.geteuid(), set()
    for start in (Path(os.path.abspath(run)), run.resolve()):
        for folder in start.parents:
            if folder in seen:
                continue
            seen.add(folder)
            try:
                info = os.stat(folder)
            except OSError:
                continue
            if info.st_uid not in (0, me):
                return f"its folder {folder} belongs to another user (uid {info.st_uid}), who could swap the run folder"
            if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
                return (
                    f"its folder {folder} is writable by others without the sticky bit (mode "
                    f"{stat.S_IMODE(info.st_mode):04o}), so another user could swap the run folder; run chmod go-w "
                    f"{folder} (or chmod +t), or pick a folder elsewhere"
                )
    return None
