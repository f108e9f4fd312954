"""Bounds on numeric flags, shared by the subcommands: one InputError line naming the flag, the bound and the value.

    at_least(args, "steps", 1)                       # --steps: must be >= 1 (got 0)
    above(args, "wan_scale", 0, "e.g. 0.05")         # --wan-scale: must be > 0 (got -1.0); e.g. 0.05

A flag left at None (not given, no default) passes; infinity and NaN never do. ``colon=False`` keeps the
form some older subcommands print, ``--repeats must be >= 1 (got 0)``.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from geosched.errors import InputError

if TYPE_CHECKING:
    from geosched.model_counts import ShapeLike


def at_least(args: argparse.Namespace, name: str, minimum: float, hint: str = "", *, colon: bool = True) -> None:
    """InputError unless ``args.<name>`` is None or >= ``minimum``."""
    value = getattr(args, name)
    if value is not None and not value >= minimum:
        raise InputError(_message(name, f">= {minimum}", value, hint, colon))
    _finite(name, value, hint, colon)


def above(args: argparse.Namespace, name: str, bound: float, hint: str = "") -> None:
    """InputError unless ``args.<name>`` is None or > ``bound``."""
    value = getattr(args, name)
    if value is not None and not value > bound:
        raise InputError(_message(name, f"> {bound}", value, hint, True))
    _finite(name, value, hint, True)


def at_most(args: argparse.Namespace, name: str, maximum: float, hint: str = "") -> None:
    """InputError unless ``args.<name>`` is None or <= ``maximum``."""
    value = getattr(args, name)
    if value is not None and not value <= maximum:
        bound = str(int(maximum)) if float(maximum).is_integer() and abs(maximum) < 1e15 else f"{maximum:g}"
        raise InputError(_message(name, f"<= {bound}", value, hint, True))


def folder(path: str | Path, flag: str) -> Path:
    """``path`` made a folder (with its parents) if it is none yet; InputError naming the flag when it cannot
    be (a file there, a path under a file, a read-only or virtual file system)."""
    made = Path(path)
    try:
        made.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"{flag} {path}: cannot make a folder there ({exc.strerror or exc}); pass a folder you can write"
        ) from None
    return made


def output_file(
    path: str, flag: str, *, not_inside: str | None = None, inputs: Iterable[tuple[str | None, str]] = ()
) -> str:
    """``path`` as a file a command may write whole and rename into place: InputError naming ``flag`` if it is
    empty, a device, FIFO, folder or symbolic link (a rename would replace that, not write into it), lies inside
    the folder ``not_inside`` (the input it is made from), or is one of the ``inputs`` (file, what it is) the
    command reads."""
    from geosched.yamlload import file_kind

    if not path:
        raise InputError(f"{flag}: an empty file name; give the file to write")
    for source, what in inputs:
        if source and os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
            raise InputError(f"{flag} {path}: {what}, which this command reads; write to another file")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot use it ({exc.strerror or exc}); pass a file you can write") from None
    if mode is not None and stat.S_ISLNK(mode):
        raise InputError(f"{flag} {path}: a symbolic link; give the file it points to, or a new name")
    if mode is not None and file_kind(mode) != "file":
        raise InputError(f"{flag} {path}: a {file_kind(mode)}, not a regular file; give a file name")
    if not_inside is not None and Path(os.path.realpath(path)).is_relative_to(os.path.realpath(not_inside)):
        raise InputError(f"{flag} {path}: inside {not_inside}, the folder it is made from; write it elsewhere")
    folder = os.path.dirname(path) or "."  # checked now, not after the work (a plan's search, a profile)
    if not os.path.isdir(folder):
        raise InputError(f"{flag} {path}: the folder {folder} does not exist; make it first, or write elsewhere")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: the folder {folder} is not writable here; write elsewhere")
    if len(os.path.basename(path).encode()) > 255:
        raise InputError(f"{flag}: a file name longer than 255 bytes; give a shorter one")
    return path


def writable_folder(path: str, flag: str) -> str:
    """``path`` made if missing (mode 0700: the owner's alone) and writable by this process, checked when a command
    starts: InputError naming ``flag`` otherwise (a read-only checkpoint folder was found only at the first
    checkpoint, hours in)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"{flag} {path}: cannot make the folder ({exc.strerror or exc}); pick a writable one"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):  # also a read-only file system (EROFS)
        raise InputError(f"{flag} {path}: not writable here (read-only, or another user's); pick a writable one")
    return path


def checkpoint_folder(args: argparse.Namespace) -> None:
    """``--checkpoint-dir`` usable when the command starts (:func:`usable_checkpoint_folder`); under ``--resume`` a
    folder that does not exist is left to the resume check, which names it (there is no checkpoint to resume)."""
    if args.checkpoint_dir and (not args.resume or os.path.isdir(args.checkpoint_dir)):
        usable_checkpoint_folder(args.checkpoint_dir)


def usable_checkpoint_folder(path: str) -> None:
    """``--checkpoint-dir`` made (0700) if it is none yet and writable (:func:`writable_folder`), and holding
    nothing but checkpoints: InputError in one line otherwise."""
    writable_folder(path, "--checkpoint-dir")
    from agents.checkpoint.folder import foreign_entries

    if others := foreign_entries(path):
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise InputError(
            f"--checkpoint-dir {path}: holds files that are no checkpoint's ({shown}); pick a new "
            "or empty folder (the agents write step-NNNNNN folders there, and prune old ones)"
        )


def job_name(args: argparse.Namespace) -> str:
    """``--job``, checked before anything starts: it names the job's topics and clients (InputError naming it)."""
    from agents.control.messages import check_name

    return check_name("--job", args.job)


def fits_host_memory(shape: ShapeLike, bytes_per_param: float, what: str, fix: str) -> None:
    """InputError when the whole model of ``shape`` (a config's ``job.model``, a weights file's record) at
    ``bytes_per_param`` needs more than this host's available memory (Linux's MemAvailable; unchecked where that
    is unknown): torch would fail to allocate with a traceback, or the host would swap for minutes first."""
    from geosched.model_counts import total_params
    from geosched.processes import available_memory_bytes

    available = available_memory_bytes()
    if available is None:
        return
    params = total_params(shape)
    if params * bytes_per_param > available:
        raise InputError(
            f"{what}: its {params / 1e9:.3g}B parameters need about {params * bytes_per_param / 2**30:.3g} GiB "
            f"here, and this host has {available / 2**30:.3g} GiB available; {fix}"
        )


def _finite(name: str, value: object, hint: str, colon: bool) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(_message(name, "a finite number", value, hint, colon))


def _message(name: str, bound: str, value: object, hint: str, colon: bool) -> str:
    """``--flag: must be <bound> (got value); hint``, or without the colon ``--flag must be ... (got value): hint``."""
    flag = "--" + name.replace("_", "-")
    if colon:
        return f"{flag}: must be {bound} (got {value})" + (f"; {hint}" if hint else "")
    return f"{flag} must be {bound} (got {value})" + (f": {hint}" if hint else "")
