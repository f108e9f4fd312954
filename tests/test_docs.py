"""Generated docs are current, and the docs' Mosquitto files are the ones the docs show.

docs/config.md is a fixed header plus the output of ``geosched validate-config --reference``;
``.venv/bin/python tests/test_docs.py`` writes it again. The Mosquitto files are started for
real in tests/test_mosquitto_docs.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from agents.control.broker import DEFAULT_MAX_PACKET_BYTES
from agents.control.messages import Topics
from geosched.processes import REPO_ROOT, child_env

DOCS = Path(REPO_ROOT) / "docs"
CONFIG_MD = DOCS / "config.md"
CONFIG_HEADER = (
    "# Config reference\n\n"
    "<!-- Generated from `geosched validate-config --reference` by `.venv/bin/python tests/test_docs.py`;"
    " do not edit by hand. -->\n\n"
)
REGENERATE = ".venv/bin/python tests/test_docs.py"
MOSQUITTO_CONF = DOCS / "mosquitto" / "geosched.conf"
MOSQUITTO_ACL = DOCS / "mosquitto" / "geosched.acl"
DOC_JOB = "gpt-demo"


def config_reference() -> str:
    """What docs/config.md must hold: the header, then the CLI's reference table."""
    table = subprocess.run(
        [sys.executable, "-m", "geosched.cli", "validate-config", "--reference"],
        check=True,
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO_ROOT,
        timeout=120,
    ).stdout
    return CONFIG_HEADER + table


def fenced_blocks(markdown: str) -> list[str]:
    """The contents of every fenced code block of ``markdown``."""
    return re.findall(r"^```[a-z]*\n(.*?)^```$", markdown, flags=re.M | re.S)


def test_config_reference_is_current() -> None:
    assert CONFIG_MD.read_text() == config_reference(), f"docs/config.md is stale; regenerate it with: {REGENERATE}"


def test_mosquitto_files_have_no_comment_on_a_value_line() -> None:
    # mosquitto reads a trailing "# ..." as part of the value (a password_file path, an ACL topic)
    for path in (MOSQUITTO_CONF, MOSQUITTO_ACL):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip() and not line.startswith("#"):
                assert "#" not in line.replace("/#", ""), f"{path.name}:{number}: comment on a value line: {line!r}"


def test_mosquitto_packet_limit_is_geosched_s() -> None:
    assert f"\nmax_packet_size {DEFAULT_MAX_PACKET_BYTES}\n" in MOSQUITTO_CONF.read_text()


def test_acl_names_only_the_job_s_topics() -> None:
    """Every topic of the ACL is one geosched uses (agents/control/messages.py), for the documented job."""
    topics = Topics(DOC_JOB)
    known = {topics.plan, topics.command, topics.events, topics.filter("status"), f"{topics.root}/#"}
    users: dict[str, list[str]] = {}
    for line in MOSQUITTO_ACL.read_text().splitlines():
        if line.startswith("user "):
            user = line.split(" ", 1)[1]
            users[user] = []
        elif line.startswith("topic "):
            access, topic = line.split(" ")[1:]
            users[user].append(f"{access} {topic}")
            own = re.fullmatch(rf"{re.escape(topics.root)}/agents/(\d+)/\w+", topic)
            assert topic in known or (
                own
                and topic in (topics.status(int(own[1])), topics.metrics(int(own[1])), topics.heartbeat(int(own[1])))
            ), f"geosched.acl: {topic!r} is not a topic of job {DOC_JOB!r}"
    assert users["coordinator"] == [
        f"write {topics.plan}",
        f"write {topics.command}",
        f"write {topics.events}",
        f"read {topics.root}/#",
    ]
    agents = sorted(u for u in users if u != "coordinator")
    assert agents == [f"agent-{r}" for r in range(len(agents))] and agents
    for rank, user in enumerate(agents):
        assert users[user] == [
            f"write {topics.status(rank)}",
            f"write {topics.metrics(rank)}",
            f"write {topics.heartbeat(rank)}",
            f"write {topics.events}",
            f"read {topics.plan}",
            f"read {topics.command}",
            f"read {topics.filter('status')}",
            f"read {topics.heartbeat(rank)}",
        ]


def test_multi_host_doc_shows_the_shipped_mosquitto_files() -> None:
    blocks = fenced_blocks((DOCS / "multi-host.md").read_text())
    assert MOSQUITTO_CONF.read_text() in blocks, "docs/multi-host.md must show docs/mosquitto/geosched.conf verbatim"
    acl = MOSQUITTO_ACL.read_text()
    shown = [b for b in blocks if b.startswith("user coordinator\n")]
    assert shown and all(b in acl for b in shown), "the ACL excerpt in docs/multi-host.md must be cut from geosched.acl"


if __name__ == "__main__":
    CONFIG_MD.write_text(config_reference())
    print(f"wrote {CONFIG_MD}")
