"""A job's key folder: everything one job needs to run with its parts authenticated (torch-free).

``geosched keys DIR --ranks N`` (:func:`write_job_keys`) writes, every file
mode 0600 in a folder of mode 0700::

    job-keys.json                 manifest: format version and number of ranks
    coordinator.sign(.pub)        Ed25519 signing key of the coordinator (signs commands and plans)
    agent-<r>.sign(.pub)          Ed25519 signing key of each rank's agent (signs its status)
    agent-<r>.key(.pub)           CURVE keypair of each rank (its WAN listeners and prefill endpoint)
    prefill.token                 shared secret a prefill client sends with every request
    mqtt/<identity>.password      MQTT password of each identity (user name = identity)

:func:`load_job_keys` reads it back as a frozen :class:`JobKeys`, naming any
missing file or any secret file group- or world-readable in one line.
Secrets are the ``.sign``, ``.key``, ``.token`` and ``.password`` files; a
machine needs only its own (an agent: its ``.sign``, ``.key``, password,
the token, and every ``.pub``), but the launcher and tests keep the whole
folder together. Signing keys are PyNaCl's (libsodium); nothing here is
hand-rolled crypto. Example::

    write_job_keys("secrets", ranks=3)
    keys = load_job_keys("secrets")
    keys.signing_key("agent-1"), keys.curve_keypair(1), keys.prefill_token()
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import nacl.exceptions
import nacl.signing

from agents.sockets import CurveServer, load_keypair, load_public_key, read_key_file, token_keypair, write_keypair
from geosched.errors import ConfigError, InputError
from geosched.yamlload import exposed_secret
from planner.plan import MAX_RANKS as PLAN_MAX_RANKS

MANIFEST = "job-keys.json"
FORMAT_VERSION = 1
COORDINATOR = "coordinator"
PREFILL_TOKEN = "prefill.token"
MQTT_DIR = "mqtt"
MAX_RANKS = PLAN_MAX_RANKS
"""The most ranks a key folder is written for: a plan's most (bounds the file count)."""


def agent_identity(rank: int) -> str:
    """The identity (signing key, MQTT user name) of rank ``rank``'s agent: ``agent-<rank>``."""
    return f"agent-{rank}"


def _write_secret(path: Path, data: str, force: bool) -> None:
    if path.exists() and not force:
        raise InputError(f"{path} already exists: pick another folder or pass --force to overwrite")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(data)


def write_job_keys(directory: str | os.PathLike[str], ranks: int, *, force: bool = False) -> dict[str, list[Path]]:
    """Write a job's key folder for ``ranks`` agents (see the module docstring); file class -> paths written.

    Creates the folder (mode 0700) if needed. InputError for a bad rank count, an empty name, a folder holding
    other files (not a key folder: its mode would change), or, without ``force``, a file that already exists
    (checked before anything is written).
    """
    if not 1 <= ranks <= MAX_RANKS:
        raise InputError(f"--ranks: must be between 1 and {MAX_RANKS} (got {ranks})")
    if not os.fspath(directory):
        raise InputError("the key folder: an empty name; give a new folder for the job's keys, e.g. secrets")
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{str(folder)!r} exists and is not a folder: pick another path for the keys")
    try:
        foreign = folder.is_dir() and not (folder / MANIFEST).exists() and any(folder.iterdir())
    except OSError as exc:  # a folder this user may not read
        raise InputError(f"{str(folder)!r}: cannot read the key folder ({exc.strerror or exc}); pick another") from None
    if foreign:
        raise InputError(  # its mode becomes 0700: never a shared folder (/tmp), never other files among the keys
            f"{str(folder)!r} holds other files: a job's keys go into a folder of their own (made mode 0700); "
            "pick a new or empty folder"
        )
    identities = [COORDINATOR, *(agent_identity(r) for r in range(ranks))]
    planned = [folder / MANIFEST, folder / PREFILL_TOKEN]
    planned += [folder / f"{i}.sign" for i in identities] + [folder / f"agent-{r}.key" for r in range(ranks)]
    planned += [folder / MQTT_DIR / f"{i}.password" for i in identities]
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise InputError(f"{str(folder)!r}: cannot make the key folder ({exc.strerror or exc}); pick another") from None
    try:
        try:  # two writers at once would pair one's secret keys with the other's public ones
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                f"{str(folder)!r}: another 'geosched keys' is writing into it; wait, or pick another"
            ) from None
        for path in [] if force else planned:
            if path.exists():
                raise InputError(f"{path} already exists: pick another folder or pass --force to overwrite")
        try:
            return _write_keys(folder, identities, ranks)
        except OSError as exc:  # no permission, a full disk: one line naming the file
            raise InputError(f"{exc.filename or str(folder)!r}: cannot write a key ({exc.strerror or exc})") from None
    finally:
        os.close(lock)


def _write_keys(folder: Path, identities: list[str], ranks: int) -> dict[str, list[Path]]:
    """Every file of a key folder whose writer holds its lock; file class -> paths written."""
    (folder / MQTT_DIR).mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    os.chmod(folder / MQTT_DIR, 0o700)
    written: dict[str, list[Path]] = {"signing": [], "curve": [], "prefill": [], "mqtt": [], "manifest": []}
    for identity in identities:
        key = nacl.signing.SigningKey.generate()
        sign_path = folder / f"{identity}.sign"
        _write_secret(sign_path, base64.b64encode(bytes(key)).decode() + "\n", True)
        _write_secret(Path(f"{sign_path}.pub"), base64.b64encode(bytes(key.verify_key)).decode() + "\n", True)
        written["signing"] += [sign_path, Path(f"{sign_path}.pub")]
    for rank in range(ranks):
        secret_path, public_path = write_keypair(folder, agent_identity(rank), force=True)
        os.chmod(public_path, 0o600)
        written["curve"] += [secret_path, public_path]
    _write_secret(folder / PREFILL_TOKEN, secrets.token_urlsafe(32) + "\n", True)
    written["prefill"].append(folder / PREFILL_TOKEN)
    for identity in identities:
        path = folder / MQTT_DIR / f"{identity}.password"
        _write_secret(path, secrets.token_urlsafe(24) + "\n", True)
        written["mqtt"].append(path)
    manifest = {"format": FORMAT_VERSION, "ranks": ranks, "identities": identities}
    _write_secret(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n", True)
    written["manifest"].append(folder / MANIFEST)
    return written


@dataclass(frozen=True)
class JobKeys:
    """A job's keys as loaded by :func:`load_job_keys` (secrets of every identity in the folder)."""

    directory: Path
    """The key folder."""
    ranks: int
    """Number of agent ranks the folder was written for."""
    signing_keys: Mapping[str, nacl.signing.SigningKey]
    """identity -> its Ed25519 signing key (only the identities whose ``.sign`` file is present)."""
    verify_keys: Mapping[str, nacl.signing.VerifyKey]
    """identity -> its Ed25519 public key (every identity)."""
    curve_public_keys: Mapping[int, bytes]
    """rank -> Z85 CURVE public key (every rank)."""
    curve_secret_keys: Mapping[int, bytes]
    """rank -> Z85 CURVE secret key (only the ranks whose ``.key`` file is present)."""
    token: str | None
    """The prefill token (None when ``prefill.token`` is absent)."""
    mqtt_passwords: Mapping[str, str]
    """identity -> MQTT password (the identities whose password file is present)."""

    def signing_key(self, identity: str) -> nacl.signing.SigningKey:
        """The signing key of ``identity`` ("coordinator" or "agent-<r>"); ConfigError if its file is absent."""
        self._check_identity(identity)
        if identity not in self.signing_keys:
            raise ConfigError(f"{self.directory / (identity + '.sign')} is missing: copy it from the job's key folder")
        return self.signing_keys[identity]

    @property
    def coordinator_key(self) -> nacl.signing.VerifyKey:
        """The coordinator's public signing key."""
        return self.verify_keys[COORDINATOR]

    @property
    def agent_keys(self) -> dict[int, nacl.signing.VerifyKey]:
        """rank -> that agent's public signing key."""
        return {r: self.verify_keys[agent_identity(r)] for r in range(self.ranks)}

    def control_fields(
        self, identity: str, *, signs: bool = True
    ) -> tuple[str, nacl.signing.SigningKey | None, nacl.signing.VerifyKey, dict[int, nacl.signing.VerifyKey]]:
        """``(identity, signing key, coordinator key, agent keys)``: the fields of
        :class:`agents.control.auth.ControlKeys`, built by the callers as ``ControlKeys(*keys.control_fields(who))``
        (this module sits below agents/control). ``signs=False``: no signing key (a client that only reads and
        verifies, as ``job status``: the public files are enough)."""
        self._check_identity(identity)
        return identity, self.signing_key(identity) if signs else None, self.coordinator_key, self.agent_keys

    def curve_keypair(self, rank: int) -> tuple[bytes, bytes]:
        """(public, secret) Z85 CURVE keys of ``rank``; ConfigError if its ``.key`` file is absent."""
        self._check_rank(rank)
        if rank not in self.curve_secret_keys:
            raise ConfigError(
                f"{self.directory / (agent_identity(rank) + '.key')} is missing: copy it from the job's key folder"
            )
        return self.curve_public_keys[rank], self.curve_secret_keys[rank]

    def curve_public(self, rank: int) -> bytes:
        """The Z85 CURVE public key of ``rank``."""
        self._check_rank(rank)
        return self.curve_public_keys[rank]

    def prefill_server(self, rank: int, token: str | None = None) -> CurveServer:
        """The CURVE settings of ``rank``'s prefill endpoint: its keypair, admitting only the client key of
        ``token`` (:func:`agents.sockets.token_keypair`; default the folder's token)."""
        token = self.prefill_token() if token is None else token
        return CurveServer(*self.curve_keypair(rank), frozenset({token_keypair(token)[0]}))

    def prefill_token(self) -> str:
        """The prefill token; ConfigError if ``prefill.token`` is absent."""
        if self.token is None:
            raise ConfigError(f"{self.directory / PREFILL_TOKEN} is missing: copy it from the job's key folder")
        return self.token

    def mqtt_password(self, identity: str) -> str:
        """The MQTT password of ``identity``; ConfigError if its file is absent."""
        self._check_identity(identity)
        if identity not in self.mqtt_passwords:
            path = self.directory / MQTT_DIR / f"{identity}.password"
            raise ConfigError(f"{path} is missing: copy it from the job's key folder")
        return self.mqtt_passwords[identity]

    def mqtt_users(self) -> dict[str, str]:
        """user name -> password of every identity, for ``EmbeddedBroker(users=...)``."""
        return {identity: self.mqtt_password(identity) for identity in self.verify_keys}

    def _check_identity(self, identity: str) -> None:
        if identity not in self.verify_keys:
            raise InputError(
                f"identity {identity!r} is not in the key folder {str(self.directory)!r} "
                f"(it holds coordinator and agent-0..agent-{self.ranks - 1})"
            )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ranks:
            raise InputError(
                f"rank {rank} is not in the key folder {str(self.directory)!r} "
                f"(written for {self.ranks} ranks; make one with 'geosched keys DIR --ranks N')"
            )


def _read_secret(path: Path, required: bool) -> str | None:
    """A secret file's stripped text; None if absent and not required; ConfigError if unsafe or missing."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path} is missing: copy it from the job's key folder") from None
        return None
    text = _read_public(path)  # a regular file of a key's size first: a device or FIFO is refused as such
    exposed = exposed_secret(path, mode)
    if exposed:
        raise ConfigError(exposed)
    return text


def _read_public(path: Path) -> str:
    try:
        return read_key_file(path).decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a key file (not ASCII text); rewrite the folder") from None


def _key32(path: Path, text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"{path} holds a malformed key (expect 32 bytes in base64): rewrite the folder")
    return raw


def load_job_keys(directory: str | os.PathLike[str]) -> JobKeys:
    """Read a key folder written by :func:`write_job_keys`.

    Public files must all be there; secret files may be absent (a machine
    holds only its own), and the accessors name a missing one when asked.
    A secret file readable by group or others is refused. ConfigError, one line.
    """
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"--keys {str(folder)!r} is a file, not a key folder: give the folder that holds {MANIFEST} "
            "(a launch's is RUN_DIR/secrets)"
        )
    if not folder.is_dir():
        raise ConfigError(
            f"key folder {str(folder)!r} does not exist: make one with 'geosched keys {folder} --ranks N'"
        )
    text = _read_public(folder / MANIFEST)
    try:
        manifest = json.loads(text)
        ranks = int(manifest["ranks"])
        if manifest.get("format") != FORMAT_VERSION or not 1 <= ranks <= MAX_RANKS:
            raise ValueError
    except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: nesting too deep
        raise ConfigError(f"{folder / MANIFEST} is not a geosched key manifest: rewrite the folder") from None
    identities = [COORDINATOR, *(agent_identity(r) for r in range(ranks))]
    signing: dict[str, nacl.signing.SigningKey] = {}
    verify: dict[str, nacl.signing.VerifyKey] = {}
    passwords: dict[str, str] = {}
    for identity in identities:
        pub = folder / f"{identity}.sign.pub"
        verify[identity] = nacl.signing.VerifyKey(_key32(pub, _read_public(pub)))
        sign_path = folder / f"{identity}.sign"
        secret = _read_secret(sign_path, required=False)
        if secret is not None:
            try:
                key = nacl.signing.SigningKey(_key32(sign_path, secret))
            except nacl.exceptions.CryptoError:
                raise ConfigError(f"{sign_path} holds a malformed key: rewrite the folder") from None
            if bytes(key.verify_key) != bytes(verify[identity]):
                raise ConfigError(f"{sign_path} does not match {pub}: copy both from the same key folder")
            signing[identity] = key
        password = _read_secret(folder / MQTT_DIR / f"{identity}.password", required=False)
        if password is not None:
            passwords[identity] = password
    curve_public: dict[int, bytes] = {}
    curve_secret: dict[int, bytes] = {}
    for rank in range(ranks):
        pub_path, key_path = folder / f"agent-{rank}.key.pub", folder / f"agent-{rank}.key"
        if not pub_path.exists():
            raise ConfigError(f"{pub_path} is missing: copy it from the job's key folder")
        curve_public[rank] = load_public_key(pub_path)
        if _read_secret(key_path, required=False) is not None:
            public, secret_key = load_keypair(key_path)
            if public != curve_public[rank]:
                raise ConfigError(f"{key_path} does not match {pub_path}: copy both from the same key folder")
            curve_secret[rank] = secret_key
    token = _read_secret(folder / PREFILL_TOKEN, required=False)
    return JobKeys(folder, ranks, signing, verify, curve_public, curve_secret, token, passwords)
