"""The ranks that read training data must read the same corpus: stage 0 takes a sample's inputs, the last stage
its targets. Agents on hosts with different data (a different Python's standard library is the default corpus)
trained without a word and learned nothing; the coordinator now refuses the start in one line, naming them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from agent_helpers import agent_subprocess_env, cli, log_tail, spawn_agent, stop_processes, tiny_plan

pytestmark = pytest.mark.slow


def test_a_start_whose_first_and_last_stage_read_different_data_is_refused(embedded_broker, tmp_path: Path):
    url, job = embedded_broker.url_for("geosched"), "twodata"
    plan = tiny_plan(tmp_path)
    corpora = []
    for name, lines in (("a.txt", 400), ("b.txt", 500)):
        corpora.append(tmp_path / name)
        corpora[-1].write_text("the quick brown fox jumps over the lazy dog\n" * lines)
    agents = [
        spawn_agent(url, job, rank, dc, tmp_path, "--data", str(corpora[rank])) for rank, dc in enumerate(["us", "eu"])
    ]
    try:
        done = subprocess.run(
            cli("job", "start", str(plan), "--mqtt", url, "--job", job, "--ready-timeout", "60"),
            capture_output=True,
            text=True,
            timeout=120,
            env=agent_subprocess_env(),
        )
    finally:
        stop_processes(agents)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:] + log_tail(tmp_path)
    assert "read different corpora: rank 0 on" in lines[0] and "reads 1 file of 17,600 bytes" in lines[0], lines[0]
    assert "rank 1 on" in lines[0] and "reads 1 file of 22,000 bytes" in lines[0] and "same --data" in lines[0]
    assert "step" not in done.stdout  # nothing trained
