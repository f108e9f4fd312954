"""What one variant's search leaves (:class:`VariantResult`), and its JSON form.

A search run in a forked child (:mod:`planner.parallel`) sends its result back as JSON: the variant, every
plan it simulated in order (later searches start from them), the memoised proposals, the best plan and the
search's stats. The parent rebuilds the problem from the variant and an evaluator that knows those verdicts;
what else an evaluator memoises (bounds, costs, CP-SAT answers) is a function of its key and is recomputed
when asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from geosched.config import Config
from planner.evaluate import Evaluation, Evaluator
from planner.parallel import Codec
from planner.search import SearchStats
from planner.space import Candidate, Problem, Variant


@dataclass
class VariantResult:
    """One variant's problem, evaluator and best simulated plan (None: nothing fits)."""

    problem: Problem
    evaluator: Evaluator
    best: Evaluation | None
    skipped: bool = False
    """Not screened: the deadline had passed and another variant had a plan."""
    bounded: bool = False
    """Not screened: its floors (:func:`planner.floors.job_floors`) were no faster than a plan already found."""
    stats: SearchStats | None = None
    """How its last search went (None: it was not searched, e.g. derived from a twin under another schedule)."""

    def adopt(self, other: VariantResult) -> None:
        """Take what a search of this variant in a forked child left (``other``; a no-op when it is this one)."""
        self.problem, self.evaluator, self.best, self.stats = other.problem, other.evaluator, other.best, other.stats


Searcher = Callable[[Problem, Evaluator, float], "tuple[Evaluation | None, SearchStats]"]
"""Runs one variant's search: (problem, evaluator, share) -> (best plan or None, stats). ``share`` 0 is a
screening search; otherwise the share of a full search's budgets this search may spend."""


def candidate_json(cand: Candidate) -> list[Any]:
    return [cand.dp, cand.microbatches, cand.stage_dcs, cand.stage_layers, cand.extra_paths]


def candidate_from_json(data: list[Any]) -> Candidate:
    dp, m, dcs, layers, extra = data
    return Candidate(dp, m, tuple(dcs), tuple((a, b) for a, b in layers), tuple(tuple(path) for path in extra))


def evaluation_json(ev: Evaluation) -> list[Any]:
    return [
        candidate_json(ev.candidate),
        ev.iteration_s,
        ev.bubble_fraction,
        ev.wan_bytes,
        ev.wan_cost_usd,
        ev.busy_s,
        ev.warmup,
        ev.codecs,
    ]


def evaluation_from_json(data: list[Any]) -> Evaluation:
    cand, iteration, bubble, wan, cost, busy, warmup, codecs = data
    return Evaluation(
        candidate_from_json(cand),
        iteration,
        bubble,
        tuple(((a, b), n) for (a, b), n in wan),
        cost,
        busy,
        None if warmup is None else tuple(warmup),
        tuple(((a, b), name) for (a, b), name in codecs),
    )


EVALUATION: Codec[Evaluation] = Codec(evaluation_json, evaluation_from_json)
"""An :class:`~planner.evaluate.Evaluation` as JSON values and back."""


def result_codec(cfg: Config, dp: int | None) -> Codec[VariantResult]:
    """A :class:`VariantResult` of ``cfg`` (``dp``: the pinned degree) as JSON values and back."""
    return Codec(result_json, lambda data: result_from_json(data, cfg, dp))


def result_json(result: VariantResult) -> dict[str, Any]:
    """``result`` as JSON values (see the module docstring)."""
    ev = result.evaluator
    return {
        "variant": dataclasses.asdict(result.problem.variant),
        "evaluated": [evaluation_json(e) for e in ev.evaluated],
        "simulations": ev.simulations,
        "proposals": None if ev.proposals is None else [candidate_json(c) for c in ev.proposals],
        "best": None if result.best is None else evaluation_json(result.best),
        "skipped": result.skipped,
        "bounded": result.bounded,
        "stats": None if result.stats is None else dataclasses.asdict(result.stats),
    }


def result_from_json(data: dict[str, Any], cfg: Config, dp: int | None) -> VariantResult:
    """The :class:`VariantResult` :func:`result_json` describes, for ``cfg`` (``dp``: the pinned degree)."""
    problem = Problem(cfg, Variant(**data["variant"]), dp=dp)
    evaluator = Evaluator(problem)
    for item in data["evaluated"]:
        evaluator.remember(evaluation_from_json(item))
    evaluator.simulations = data["simulations"]
    if data["proposals"] is not None:
        evaluator.proposals = [candidate_from_json(c) for c in data["proposals"]]
    best = None if data["best"] is None else evaluation_from_json(data["best"])
    stats = None if data["stats"] is None else SearchStats(**data["stats"])
    return VariantResult(problem, evaluator, best, data["skipped"], data["bounded"], stats)
