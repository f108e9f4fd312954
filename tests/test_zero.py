"""ZeRO stages 1 and 2 (agents.dp.zero) train exactly like plain AdamW on averaged gradients.

Two parts. The optimizers alone, in a real 2-process gloo group: every level
steps a real stage to the same parameters as plain AdamW on the averaged
gradients, holds about 1/dp of the optimizer state per rank, gathers the whole
state on replica 0 and takes its share of a whole state. Then whole jobs: two
pipeline stages x dp 2 (4 rank processes, real links, gloo groups) train 10
steps at zero 0, 1 and 2, and one stage x dp 2 x tp 2 at zero 1 and 2 (each tp
rank's optimizer state sharded over its "dp" sub-group: half of its shards'),
with losses equal to one process; and a chain of checkpoints resumes across
data-parallel degrees, ZeRO levels, stage splits and tensor parallelism
(dp 2 zero 2 -> dp 1 zero 0 -> dp 2 zero 1 -> dp 2 zero 2 -> dp 2 x tp 2 zero 1, 8 ranks: TP x PP x DP with ZeRO
-> one stage x dp 2 x tp 2 zero 2), its 14 losses and gradient norms equal to one process's.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import queue
import subprocess
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from agents.dp.group import DataParallelGroup, local_tensor
from agents.dp.local_group import run_local_group
from agents.dp.zero import ShardedGradAdamW, build_stage_optimizer, optimizer_state_bytes
from agents.dp.zero1 import ShardedStateAdamW
from agents.layout import RankRole, layout_roles
from agents.stage.report import StepReport, global_loss
from agents.stage.session import RankSession
from agents.stage.transport import StoreAddressBook
from agents.worker import RankCheckpoints
from geosched.config import JobSpec, ModelSpec
from geosched.data import TextDataset, default_corpus_paths
from geosched.errors import ConfigError
from geosched.model import build_model, build_stage
from geosched.optim import KERNEL_OPTIONS, MasterAdamW
from geosched.reference import train_one_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 10
STAGE_DCS = ["us", "eu"]
STAGE_LAYERS = [(0, 1), (1, 2)]
SLOTS = 8  # rank processes: 2 stages x dp 2 x tp 2 (phases with fewer ranks leave some idle)
JOB = JobSpec(
    model=ModelSpec(layers=2, hidden=32, heads=4, seq_len=32),
    global_batch=8,
    microbatch_size=2,
    precision="fp32",
    seed=5,
    learning_rate=3e-3,
)


# ---------------------------------------------------------------- the optimizers alone ---


def _stage() -> torch.nn.Module:
    return build_stage(JOB.model, 0, 2, first=True, last=True, seed=JOB.seed)


def _set_gradients(model: torch.nn.Module, step: int, rank: int) -> None:
    """Rank ``rank``'s gradients at ``step``: random, reproducible anywhere."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _reference(group_size: int, steps: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """Plain AdamW stepping on the mean of every rank's gradients."""
    model = _stage()
    optimizer = torch.optim.AdamW(model.parameters(), lr=JOB.learning_rate)
    for step in range(steps):
        grads = []
        for rank in range(group_size):
            _set_gradients(model, step, rank)
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = sum(per_rank) / group_size
        optimizer.step()
    return model, optimizer


def _hyper(state_dict: dict[str, Any]) -> list[dict[str, Any]]:
    """A state dict's param groups without the options that choose a kernel (geosched.optim.KERNEL_OPTIONS)."""
    return [{k: v for k, v in g.items() if k not in KERNEL_OPTIONS} for g in state_dict["param_groups"]]


def _train(model: torch.nn.Module, zero: int, group: DataParallelGroup, steps: range) -> torch.optim.Optimizer:
    built = build_stage_optimizer(model, lr=JOB.learning_rate, zero=zero, group=group)
    for step in steps:
        _set_gradients(model, step, group.rank)
        assert built.grad_sync is not None
        built.grad_sync.allreduce_gradients(model)
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=False)
    return built.optimizer


def _max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _optimizer_checks(group: DataParallelGroup) -> dict[str, Any]:
    """Per level: distance to plain AdamW, state bytes, the gathered whole state, a resume from a whole state."""
    reference, reference_optimizer = _reference(group.size, 3)
    out: dict[str, Any] = {"kinds": {}, "bytes": {}, "difference": {}, "whole": {}, "resumed": {}}
    for zero in (0, 1, 2):
        model = _stage()
        optimizer = _train(model, zero, group, range(3))
        out["kinds"][zero] = type(optimizer).__name__
        out["bytes"][zero] = optimizer_state_bytes(optimizer)
        out["difference"][zero] = _max_difference(model, reference)
        if zero > 0:  # gather on replica 0: exactly plain AdamW's state_dict
            assert isinstance(optimizer, ShardedStateAdamW | ShardedGradAdamW)
            optimizer.consolidate_state_dict(to=0)
            if group.rank == 0:
                whole, expected = optimizer.whole_state_dict(), reference_optimizer.state_dict()
                same_tensors = all(
                    torch.equal(whole["state"][i][key], value)
                    for i, entry in expected["state"].items()
                    for key, value in entry.items()
                )
                # the same hyperparameters; how each computes (fused, foreach) is the optimizer's own
                out["whole"][zero] = same_tensors and _hyper(whole) == _hyper(expected)
            # take a share of plain AdamW's whole state, step on: as plain AdamW would
            resumed = _stage()
            resumed.load_state_dict(reference.state_dict())
            sharded = build_stage_optimizer(resumed, lr=JOB.learning_rate, zero=zero, group=group).optimizer
            assert isinstance(sharded, ShardedStateAdamW | ShardedGradAdamW)
            sharded.load_whole_state_dict(copy.deepcopy(reference_optimizer.state_dict()))  # no aliasing
            _train_on(resumed, sharded, zero, group)
            out["resumed"][zero] = resumed
    continued, _ = _reference(group.size, 4)
    out["resumed"] = {zero: _max_difference(model, continued) for zero, model in out["resumed"].items()}
    return out


def _train_on(model: torch.nn.Module, optimizer: torch.optim.Optimizer, zero: int, group: DataParallelGroup) -> None:
    """Step 3 (the fourth) with an optimizer already built."""
    _set_gradients(model, 3, group.rank)
    sync = optimizer if isinstance(optimizer, ShardedGradAdamW) else group
    sync.allreduce_gradients(model)
    optimizer.step()


def test_sharded_optimizers_step_like_adamw_on_averaged_gradients():
    results = run_local_group(_optimizer_checks, 2, timeout_s=60.0, deadline_s=240.0)
    for result in results:
        assert result.error is None, f"rank {result.rank}: {result.error}"
    whole_bytes = results[0].value["bytes"][0]
    for result in results:
        checks = result.value
        assert checks["kinds"] == {0: "MasterAdamW", 1: "ShardedStateAdamW", 2: "ShardedGradAdamW"}
        assert all(d < 1e-6 for d in checks["difference"].values()), checks["difference"]
        assert all(d < 1e-6 for d in checks["resumed"].values()), checks["resumed"]
        assert checks["bytes"][0] == whole_bytes  # every replica holds the whole state
        # sharded: about half each (ZeRO-1 splits whole parameters, balanced by size; ZeRO-2 exact slices)
        assert abs(checks["bytes"][1] - whole_bytes / 2) < 0.1 * whole_bytes, checks["bytes"]
        assert abs(checks["bytes"][2] - whole_bytes / 2) < 0.01 * whole_bytes, checks["bytes"]
    assert results[0].value["whole"] == {1: True, 2: True}
    assert sum(r.value["bytes"][1] for r in results) == pytest.approx(whole_bytes, rel=0.01)


def _activations(step: int, mb: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A middle stage's input activation and output gradient (b, T, C) for one microbatch of one rank."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * mb + rank)
    shape = (JOB.batch, JOB.model.seq_len, JOB.model.hidden)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _zero2_backward_checks(group: DataParallelGroup) -> dict[str, Any]:
    """ZeRO 2 in real backwards (fused, and a zero-bubble I for every microbatch before their Ws), small
    buckets: the parameters' gradients never outlive a backward, the staging peak, the distance to plain
    AdamW on the replicas' averaged sums over their microbatches."""
    from agents.dp.zero2 import ShardedGradAdamW, linear_parameters
    from geosched.wgrad import SplitBackward

    def stage() -> torch.nn.Module:
        return build_stage(JOB.model, 0, 2, first=False, last=False, seed=JOB.seed)

    steps, microbatches = range(2), range(3)
    reference = stage()
    adamw = torch.optim.AdamW(reference.parameters(), lr=JOB.learning_rate)
    averaged = []  # per step: the whole averaged gradient, flat
    for step in steps:
        for rank in range(group.size):
            for mb in microbatches:
                x, dy = _activations(step, mb, rank)
                torch.autograd.backward(reference(x), dy)
        for p in reference.parameters():
            p.grad.div_(group.size)
        averaged.append(torch.cat([p.grad.reshape(-1) for p in reference.parameters()]))
        adamw.step()
        adamw.zero_grad()
    out: dict[str, Any] = {}
    for split in (False, True):
        model = stage()
        params = list(model.parameters())
        optimizer = ShardedGradAdamW(
            params, group, lr=JOB.learning_rate, linear=linear_parameters(model, params), bucket_bytes=4096
        )
        staged, peak, left, gradient_error = [0], [0], [], 0.0

        def count(nbytes: int, staged: list[int] = staged, peak: list[int] = peak) -> None:
            staged[0] += nbytes
            peak[0] = max(peak[0], staged[0])

        optimizer.on_staging = count
        splitter = SplitBackward(model) if split else None
        if splitter is not None:
            assert splitter.store is not None
            splitter.store.after_grad = optimizer.grad_ready
        for step in steps:
            works = []
            for mb in microbatches:
                x, dy = _activations(step, mb, group.rank)
                x.requires_grad_(True)
                if splitter is not None:
                    works.append(splitter.input([model(x)], [dy], x)[1])  # I: LayerNorms now, linear layers at W
                else:
                    torch.autograd.backward(model(x), dy)
                    optimizer.backward_done()
                    left.append(sum(p.grad is not None for p in params))
            for work in works:
                assert splitter is not None
                splitter.weight(work)
                optimizer.backward_done()
                left.append(sum(p.grad is not None for p in params))
            optimizer.allreduce_gradients(model)
            gradient_error = max(gradient_error, float((_whole_gradient(optimizer) - averaged[step]).abs().max()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        out["split" if split else "fused"] = {
            "gradient_error": gradient_error,
            "difference": _max_difference(model, reference),
            "grads_left": max(left),
            "staging_peak": peak[0],
            "staged_after": staged[0],
            "buckets": len(optimizer.buckets),
            "slice_bytes": optimizer.gradient_bytes(),
        }
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in reference.parameters())
    out["largest_bytes"] = max(p.numel() * p.element_size() for p in reference.parameters())
    return out


def _whole_gradient(optimizer: Any) -> torch.Tensor:
    """Every replica's slices of a ZeRO 2 optimizer's averaged gradient, gathered, in parameter order (flat)."""
    from agents.dp.group import all_gather_flat

    whole = torch.zeros_like(optimizer.flat_params)
    for bucket, shard in zip(optimizer.buckets, optimizer.shards):
        span = slice(bucket.start, bucket.start + bucket.shard_numel * optimizer.size)
        all_gather_flat(whole[span], shard.grad.clone())
    return torch.cat(
        [whole[offset : offset + shape.numel()] for shape, (_, offset) in zip(optimizer.shapes, optimizer.where)]
    )


def test_zero_2_reduces_each_backward_in_buckets_and_keeps_a_slice():
    """Real ZeRO 2: gradients leave as backward makes them, so a replica holds its 1/dp slice plus a few
    buckets, never the stage's whole gradient, and trains as plain AdamW does."""
    results = run_local_group(_zero2_backward_checks, 2, timeout_s=60.0, deadline_s=240.0)
    for result in results:
        assert result.error is None, f"rank {result.rank}: {result.error}"
        checks = result.value
        whole, largest = checks["grad_bytes"], checks["largest_bytes"]
        for mode in ("fused", "split"):
            got = checks[mode]
            print(mode, got, "whole gradient", whole, "largest parameter", largest)
            assert got["gradient_error"] < 1e-5, (mode, got)  # fp32 sums in another order (gradients up to ~20)
            # AdamW turns a gradient near 0 into a step of about lr whatever its last bits: a looser bound
            assert got["difference"] < JOB.learning_rate / 10, (mode, got)
            assert got["grads_left"] == 0, (mode, got)  # no parameter keeps a gradient past its backward
            assert got["staged_after"] == 0, (mode, got)
            assert got["buckets"] > 4, (mode, got)
            assert got["staging_peak"] <= 3 * max(4096, largest) + 64, (mode, got)  # 2 buckets + one parameter
            assert got["staging_peak"] < whole / 2, (mode, got)
            assert abs(got["slice_bytes"] - whole / 2) < 0.01 * whole, (mode, got)


def test_bad_zero_level_is_named():
    with pytest.raises(ConfigError, match=r"job.zero: must be 0, 1 or 2 \(got 3\)"):
        build_stage_optimizer(_stage(), lr=1e-3, zero=3, group=None)


def test_zero_without_a_group_is_plain_adamw():
    built = build_stage_optimizer(_stage(), lr=1e-3, zero=2, group=None)
    assert type(built.optimizer) is MasterAdamW and built.grad_sync is None  # plain AdamW, fp32 masters for bf16


def test_a_stage_at_zero_0_or_2_never_imports_torch_distributed_optim():
    """A fresh process: the stage runtime and a ZeRO 0 or 2 optimizer leave torch.distributed.optim (half a
    second of every such rank's start-up) unimported; ZeRO 1's module imports it."""
    probe = (
        "import sys\n"
        "import torch\n"
        "import agents.stage.session, agents.worker\n"
        "from agents.dp.zero import build_stage_optimizer\n"
        "for zero in (0, 2):\n"
        "    build_stage_optimizer(torch.nn.Linear(4, 4), lr=1e-3, zero=zero, group=None)\n"
        "print('torch.distributed.optim' in sys.modules)\n"
        "import agents.dp.zero1\n"
        "print('torch.distributed.optim' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "True"]


# ----------------------------------------------------------------------- whole jobs ---


@dataclass(frozen=True)
class Phase:
    """One run of the job: its ZeRO level, dp and tp, on 2 stages (or one); with checkpoints, it resumes and
    saves at the end."""

    name: str
    zero: int
    dp: int
    steps: int
    checkpoints: bool = False
    tp: int = 1
    stages: int = 2

    def roles(self) -> list[RankRole]:
        """The phase's ranks: 2 stages us -> eu, or one stage in eu with every block."""
        dcs, layers = (STAGE_DCS, STAGE_LAYERS) if self.stages == 2 else (["eu"], [(0, 2)])
        return layout_roles(dcs, layers, self.dp, tp=self.tp)


EQUIVALENCE = [Phase(f"zero{zero}", zero, 2, STEPS) for zero in (0, 1, 2)] + [
    # tensor parallelism: each tp rank's shards' state sharded over its "dp" sub-group
    Phase(f"tp2-zero{zero}", zero, 2, STEPS, tp=2, stages=1)
    for zero in (1, 2)
]
RESUME_CHAIN = [  # 4 + 2 + 2 + 2 + 2 + 2 = STEPS + 4, each resuming from the one before
    Phase("chain-a", 2, 2, 4, True),
    Phase("chain-b", 0, 1, 2, True),
    Phase("chain-c", 1, 2, 2, True),
    Phase("chain-d", 2, 2, 2, True),
    Phase("chain-e", 1, 2, 2, True, tp=2),  # TP x PP x DP x ZeRO: 2 stages x dp 2 x tp 2 at ZeRO 1 (8 ranks)
    Phase("chain-f", 2, 2, 2, True, tp=2, stages=1),  # its tp shards, whole in the file, into 1 stage at ZeRO 2
]
CHAIN_STEPS = sum(phase.steps for phase in RESUME_CHAIN)


def _run_phase(phase: Phase, slot: int, store_port: int, ckpt_dir: str) -> tuple[list[dict[str, Any]], int, int] | None:
    """Slot ``slot``'s rank in ``phase`` (None when the phase has fewer ranks): step reports, state bytes,
    elements of the parameters this rank holds (its shards with tp)."""
    roles = phase.roles()
    if slot >= len(roles):
        return None
    role, job = roles[slot], replace(JOB, zero=phase.zero, tensor_parallel=phase.tp)
    layout = SimpleNamespace(num_stages=phase.stages, job=job)
    checkpoints = RankCheckpoints(ckpt_dir, layout, role, every=0, resume=True) if phase.checkpoints else None
    book = StoreAddressBook.connect("127.0.0.1", store_port, prefix=phase.name)
    with RankSession(
        job,
        role,
        data=default_corpus_paths(),
        addresses=book,
        start_step=checkpoints.start_step if checkpoints is not None else 0,
        connect_timeout_s=40,
        recv_timeout_s=40,
    ) as session:
        assert session.optimizer is not None
        if checkpoints is not None:
            checkpoints.restore(session.module, session.optimizer)
        reports = [r.to_dict() for r in session.train(phase.steps)]
        state_bytes = optimizer_state_bytes(session.optimizer)
        assert session.module is not None
        held = sum(local_tensor(p).numel() for p in session.module.parameters())
        if checkpoints is not None:  # every replica takes part: ZeRO gathers the state on replica 0
            checkpoints.save_now(session.next_step, session.module, session.optimizer)
    return reports, state_bytes, held


def _slot_main(slot: int, phases: list[Phase], store_port: int, ckpt_dir: str, results: Any) -> None:
    """One rank process: every phase in turn; all slots meet between phases (a resume needs the last save)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=120))
    try:
        for phase in phases:
            results.put((phase.name, slot, _run_phase(phase, slot, store_port, ckpt_dir)))
            store.set(f"{phase.name}/done/{slot}", "1")
            store.wait([f"{phase.name}/done/{s}" for s in range(SLOTS)])
    except BaseException:  # noqa: BLE001 - handed to the test
        results.put(("error", slot, traceback.format_exc()))


@pytest.fixture(scope="module")
def job_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    """Every phase on 4 rank processes: {phase: {slot: (reports, state bytes) or None}}."""
    phases = EQUIVALENCE + RESUME_CHAIN
    ckpt_dir = str(tmp_path_factory.mktemp("zero-ckpt"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "agents.stage.session", "agents.dp.zero"])
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_slot_main, args=(slot, phases, store.port, ckpt_dir, results), daemon=True)
        for slot in range(SLOTS)
    ]
    runs: dict[str, dict[int, Any]] = {phase.name: {} for phase in phases}
    try:
        for p in procs:
            p.start()
        for _ in range(SLOTS * len(phases)):
            try:
                name, slot, payload = results.get(timeout=180)
            except queue.Empty:
                pytest.fail("rank processes did not report within 180 s")
            assert name != "error", f"slot {slot} failed:\n{payload}"
            runs[name][slot] = payload
        yield runs
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()
        del store


@pytest.fixture(scope="module")
def reference_run() -> tuple[list[float], list[float]]:
    """One process's losses and gradient norms (before clipping) of every step of the chain."""
    dataset, norms = TextDataset(default_corpus_paths(), seq_len=JOB.model.seq_len, seed=JOB.seed), []
    return train_one_process(JOB, dataset, CHAIN_STEPS, grad_norms=norms), norms


def _losses(runs: dict[str, dict[int, Any]], phase: Phase) -> list[float]:
    """The phase's global loss per step (mean over the last stage's replicas; one tp rank of each)."""
    last = [role.rank for role in phase.roles() if role.last and role.tp_rank == 0]
    reports = [[StepReport.from_dict(d) for d in runs[phase.name][rank][0]] for rank in last]
    return [global_loss(per_step) for per_step in zip(*reports)]


def _assert_norms(runs: dict[str, dict[int, Any]], phase: Phase, expected: list[float]) -> None:
    """Every rank clipped with the whole model's norm (Adam hides a wrong clip factor in the losses)."""
    for role in phase.roles():
        assert [d["grad_norm"] for d in runs[phase.name][role.rank][0]] == pytest.approx(expected, rel=1e-4), role


@pytest.mark.parametrize("phase", EQUIVALENCE, ids=lambda p: p.name)
def test_pipeline_at_every_zero_level_equals_one_process(job_runs, reference_run, phase):
    reference_losses, reference_norms = reference_run
    assert _losses(job_runs, phase) == pytest.approx(reference_losses[:STEPS], rel=1e-4)
    assert reference_losses[STEPS - 1] < reference_losses[0]  # it trains, not just agrees
    assert max(reference_norms[:STEPS]) > JOB.max_grad_norm  # the clipping acted
    _assert_norms(job_runs, phase, reference_norms[:STEPS])
    if phase.tp > 1:  # the tp ranks of a replica compute the same loss
        last = [r for r in phase.roles() if r.last]
        for role in last:
            twin = next(r for r in last if r.replica == role.replica and r.tp_rank == 0)
            mine, theirs = (job_runs[phase.name][r.rank][0] for r in (role, twin))
            assert [d["loss"] for d in mine] == pytest.approx([d["loss"] for d in theirs], rel=1e-5)


def test_optimizer_state_per_rank_is_a_dp_share(job_runs):
    """Measured bytes per rank: zero 0 holds the stage's whole AdamW state, zero 1 and 2 about half (dp 2);
    with tp 2, half of AdamW's state of the shards and replicated parameters the rank holds."""
    state = {p.name: {slot: run[1] for slot, run in job_runs[p.name].items() if run} for p in EQUIVALENCE}
    print("optimizer state bytes per rank (slot = rank):", state)
    for slot in range(len(EQUIVALENCE[0].roles())):  # 4 ranks in every equivalence phase
        whole = state["zero0"][slot]
        assert whole > 0
        assert abs(state["zero1"][slot] - whole / 2) < 0.15 * whole, (slot, state)
        assert abs(state["zero2"][slot] - whole / 2) < 0.01 * whole, (slot, state)
        held = job_runs["tp2-zero1"][slot][2]  # elements of this tp rank's shards and replicated parameters
        assert held < sum(p.numel() for p in build_model(JOB.model, seed=JOB.seed).parameters())
        local = 2 * 4 * held  # AdamW: two fp32 moments per element this rank holds
        assert abs(state["tp2-zero1"][slot] - local / 2) < 0.15 * local, (slot, state)
        assert abs(state["tp2-zero2"][slot] - local / 2) < 0.01 * local, (slot, state)


def test_resume_across_dp_degrees_and_zero_levels(job_runs, reference_run):
    reference_losses, reference_norms = reference_run
    losses, step = [], 0
    for phase in RESUME_CHAIN:
        first_rank = job_runs[phase.name][0][0]
        assert [r["step"] for r in first_rank] == list(range(step, step + phase.steps))  # resumed where it stopped
        losses += _losses(job_runs, phase)
        _assert_norms(job_runs, phase, reference_norms[step : step + phase.steps])  # chain-e: TP x PP x DP x ZeRO
        step += phase.steps
    assert losses == pytest.approx(reference_losses, rel=1e-4)
    assert step == CHAIN_STEPS
    assert all(job_runs["chain-e"][slot] is not None for slot in range(SLOTS))  # 2 stages x dp 2 x tp 2 ranks
