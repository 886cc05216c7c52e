"""``python -m pycomm.bench.ft``: training that survives a lost node, under torchft.

``--replicas`` replica groups (default 3, one rank each, each an OS process of its own) train
the character-level GPT of the quality suite (``charlm``: Python's documentation text, 2 x 64,
110K parameters) under a torchft lighthouse that runs in this process, each replica group
with a ``torchft.manager.Manager`` of its own (``use_async_quorum=False``, gloo). The inner
steps are AdamW at lr 3e-3 with gradients clipped at 1; every ``--sync-every`` steps (H)
``pycomm.DiLoCo`` (``--outer localsgd``: ``pycomm.LocalSGD``) starts a quorum, exchanges the
pseudo-gradient through int4 with error feedback and commits or rolls back. Every replica
group starts from the same weights and draws its own random windows of the text, seeded by
its id and its step, so a restarted one trains on the stream it would have had.

``--kill`` kills one replica group (``--victim``) twice with SIGKILL and starts it again at
once, a fresh process with the same replica id: once in the middle of a window (when it
reports the step halfway between two syncs, a quarter of the way in), and once during a sync
(past half way, once its restarted process has healed: at the sync, as soon as its quorum
has formed, the victim reports and waits for a word from this process, and is killed there,
so that the survivors are inside the sync's collective with a dead peer). A restarted replica
group trains H steps from the initial weights, then heals at its first quorum from a live
peer (the model, AdamW's state and the outer loop's state) and ends bitwise equal.

The runs, one after the other: ``clean`` (no kill), ``kill`` (with ``--kill``), ``torchft``:
torchft's own ``torchft.local_sgd.DiLoCo`` (``LocalSGD`` with ``--outer localsgd``), exact
fp32 all-reduces, the same model, H, steps and outer optimizer (Nesterov SGD, lr 0.7,
momentum 0.9), no kill, and, when named in ``--runs``, ``exact``: pycomm's outer loop with
the exact all-reduce (``codec="allreduce"``), which tells int4's part of a difference from
torchft's from the loops'. torchft's bytes are what its fp32 ring all-reduce sends, 2(N-1)/N
x 4 bytes per parameter per sync per replica group.

The report: the survivors' median step time away from the outages (the first window, with
the start, left out) and through them (from a kill to the restarted replica group's first
committed sync), the slowest survivor step against the manager's timeout (``--timeout``)
plus a healthy step, each kill's time to heal (from the restart to the restarted replica
group's first committed sync: its process start, its first window, its wait for the quorum),
bytes sent per replica group, whether every replica group's final outer parameters are the
same bits (a sha256 of them), and the held-out loss (nats per character, after the last
sync) of each run: the kill run's against the clean run's, int4's against torchft's exact
syncs.

    python -m pycomm.bench.ft                          # clean and torchft's
    python -m pycomm.bench.ft --kill --json out.json   # clean, kill and torchft's
    python -m pycomm.bench.ft --kill --runs clean,kill,torchft,exact
    python -m pycomm.bench.ft --kill --runs kill --steps 400 --sync-every 20 --d-model 32

``--ddp`` trains without an outer loop: per-step fault-tolerant DDP across the replica groups,
the gradients of every step averaged across them before AdamW steps. The runs are then
``clean``: ``pycomm.wrap(model, hook=..., manager=manager)`` (``--codec``, default int8, with
error feedback), ``kill``: the same with one replica group (``--victim``) SIGKILLed once and
started again at once, and ``torchft``: torchft's own ``torchft.ddp.DistributedDataParallel``,
exact fp32 (``exact``: pycomm's with ``hook="allreduce"``). Each step is torchft's
``OptimizerWrapper``: ``zero_grad()`` starts the step's quorum (``use_async_quorum=True``,
torchft's default: the quorum forms beside the forward), ``step()`` asks the manager's
``should_commit()`` and steps AdamW only on its yes; a rejoining replica group heals from a
live peer there (the model and AdamW's state), so its first step already ends on the others'
bits. The kill comes ``--steps`` / 3 steps in, in the middle of a step: the victim reports
after its forward and waits, and is killed before its backward, while the survivors wait for
its gradients in the step's all-reduce. Time to heal is from the restart to the restarted
replica group's first committed step; bytes are the pycomm hook's own count
(``pycomm.hook_state(ddp).stats``) and, for torchft's DDP, its fp32 ring all-reduce: 2(N-1)/N
x 4 bytes per parameter per step per replica group. A DDP step syncs, so the runs are shorter
(``--steps`` 400 by default):

    python -m pycomm.bench.ft --ddp --kill --json out.json   # clean, kill and torchft's
    python -m pycomm.bench.ft --ddp --kill --runs kill --steps 60 --d-model 32 --layers 1

The lighthouse waits for a replica group that is alive but has not joined a quorum for as
long as the manager's timeout (``--join-timeout-ms``), and counts one dead after 2 s without
a heartbeat (``--heartbeat-timeout-ms``): the survivors wait at a quorum for a restarted
replica group that is up until it joins, and for a dead one until its heartbeat is over.
The processes fork from a server that imported torch once (``--start-method spawn``: each
imports everything itself, seconds more per restart). They share this machine's cores, so a
step's time depends on what else runs: one replica group fewer leaves more CPU to the
others, and runs measured one after the other compare only where the machine's load was the
same. Each process's output (torchft's logs) goes to a file of its own (``--log-dir`` keeps
them), printed when it fails; every process started is killed when its run ends, fails or
times out (``--run-timeout``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch

from pycomm.bench.args import check_output_paths, positive_int
from pycomm.bench.quality_tasks import TASKS, Task, build_model, docs_text, evaluate, loss_of
from pycomm.codec.engine import ring_bytes
from pycomm.exchange import Exchange
from pycomm.exchange.managed import FT_EXTRA
from pycomm.launcher import FORKSERVER_PRELOAD

RUNS = ("clean", "kill", "torchft", "exact")
OUTERS = ("diloco", "localsgd")
DDP = "ddp"  # a Plan's outer with --ddp: per-step DDP across the replica groups, no outer loop
DDP_STEPS = 400  # --ddp's default --steps
DDP_WARMUP = 5  # --ddp: the first steps (the first quorum, the group's connections) left out
START_METHODS = ("spawn", "forkserver")
# The targets of the report: (limit, what).
TARGETS: dict[str, tuple[float, str]] = {
    "slowest_survivor_step": (0.0, "slowest survivor step <= manager timeout + a healthy step"),
    "outage_step_ratio": (1.2, "survivors' median step through the outages / healthy <= 1.2"),
    "restarted_bitwise_equal": (1.0, "every replica group's final outer parameters the same bits"),
    "kill_loss_vs_clean": (0.01, "kill run's held-out loss within 1% of the clean run's"),
    "bytes_vs_torchft": (7.0, "torchft's exact bytes / int4's >= 7"),
    "loss_vs_torchft": (0.005, "int4's held-out loss within 0.5% of torchft's exact"),
}
# --ddp's targets: no outer loop, so the bytes are int8's against torchft's fp32 DDP, and the
# survivors' steps through the outage are the few around the heal (reported, no target).
DDP_TARGETS: dict[str, tuple[float, str]] = {
    "slowest_survivor_step": TARGETS["slowest_survivor_step"],
    "restarted_bitwise_equal": (1.0, "every replica group's final parameters the same bits"),
    "kill_loss_vs_clean": TARGETS["kill_loss_vs_clean"],
    "bytes_vs_torchft": (3.5, "torchft's fp32 DDP bytes / int8's >= 3.5"),
    "loss_vs_torchft": (0.005, "int8's held-out loss within 0.5% of torchft's fp32 DDP"),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One run's settings, as every replica group gets them."""

    run: str  # one of RUNS
    outer: str  # "diloco", "localsgd" or DDP
    codec: str
    replicas: int
    steps: int
    sync_every: int
    seed: int
    d_model: int
    layers: int
    lr: float
    timeout_s: float
    quorum_timeout_s: float
    lighthouse: str = ""

    def task(self) -> Task:
        """The quality suite's charlm task at this plan's model size."""
        return dataclasses.replace(
            TASKS["charlm"], steps=self.steps, d_model=self.d_model, layers=self.layers
        )

    @property
    def ddp(self) -> bool:
        """Per-step DDP across the replica groups (``--ddp``), not an outer loop."""
        return self.outer == DDP

    def warmup(self) -> int:
        """The first steps, the start, that the survivors' step times leave out: the first
        window (DDP: :data:`DDP_WARMUP` steps)."""
        return DDP_WARMUP if self.ddp else self.sync_every


# --- one replica group (a process of its own) -------------------------------------------------

# messages to the parent, each a tuple: (kind, ...)
READY, STEP, IN_SYNC, DONE, ERROR = "ready", "step", "in_sync", "done", "error"
GO = "go"  # the parent's word: start training, or go on with the sync


def batch_at(train: torch.Tensor, task: Task, seed: int, replica: int, step: int) -> tuple:
    """Replica group ``replica``'s batch of random windows at ``step``: the same whichever
    process of it draws it."""
    g = torch.Generator().manual_seed((seed * 1009 + replica) * 1_000_003 + step)
    starts = torch.randint(len(train) - task.seq_len - 1, (task.batch,), generator=g)
    seq = train[starts[:, None] + torch.arange(task.seq_len + 1)]
    return seq[:, :-1], seq[:, 1:]


def digest(tensors: list[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def replica_main(
    conn: Any, plan: Plan, replica: int, attempt: int, pause_from: Optional[int], log_path: str
) -> None:
    """A replica group's process: train ``plan`` to its last step and send the result.
    ``pause_from``: from that step on, at each sync once its quorum has formed, report
    :data:`IN_SYNC` and wait for :data:`GO` (the parent kills it there instead, once)."""
    if log_path:  # torchft's logs (Python's and its Rust side's) go to the replica's file
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        (_train_ddp if plan.ddp else _train)(conn, plan, replica, attempt, pause_from)
    except BaseException:
        try:
            conn.send((ERROR, traceback.format_exc()))
        finally:
            os._exit(1)


def _manager(
    plan: Plan, replica: int, model: torch.nn.Module, opt: Any, loaded: list, *,
    async_quorum: bool,
) -> tuple[Any, Any]:  # fmt: skip
    """The replica group's ``torchft.manager.Manager`` (one rank, gloo, on this machine) and
    the store it keeps its group's keys in (alive as long as the manager). A heal loads the
    model and ``opt``'s state from a peer and appends to ``loaded``."""
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=plan.timeout_s)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda s: (
            model.load_state_dict(s["model"]),
            opt.load_state_dict(s["opt"]),
            loaded.append(1),
        ),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        min_replica_size=1,
        replica_id=str(replica),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=plan.lighthouse,
        hostname="localhost",
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=plan.quorum_timeout_s),
        use_async_quorum=async_quorum,
        init_sync=False,
    )
    return manager, store


def _train(conn: Any, plan: Plan, replica: int, attempt: int, pause_from: Optional[int]) -> None:
    import pycomm

    torch.set_num_threads(1)
    logging.getLogger("torchft").setLevel(logging.WARNING)
    task = plan.task()
    train, held, vocab = docs_text()
    torch.manual_seed(plan.seed)  # every replica group starts from the same weights
    model = build_model(task, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.01)
    loaded: list[int] = []  # one entry per heal: the manager loaded a peer's state
    manager, store = _manager(plan, replica, model, opt, loaded, async_quorum=False)
    h = plan.sync_every
    loop: _Loop
    if plan.run == "torchft":
        loop = _TorchftLoop(plan, manager, model, opt, loaded)
    else:
        cls = pycomm.DiLoCo if plan.outer == "diloco" else pycomm.LocalSGD
        codec = "allreduce" if plan.run == "exact" else plan.codec
        outer = cls(model, sync_every=h, codec=codec, manager=manager)
        if pause_from is not None:  # report each sync past pause_from once its quorum formed
            start_quorum = manager.start_quorum

            def paused_quorum(*args: Any, **kwargs: Any) -> Any:
                out = start_quorum(*args, **kwargs)
                if outer.step_count >= pause_from:
                    conn.send((IN_SYNC, outer.step_count, time.monotonic()))
                    conn.recv()  # GO, or killed meanwhile
                return out

            manager.start_quorum = paused_quorum  # type: ignore[method-assign]
        loop = _PycommLoop(outer)
    conn.send((READY, time.monotonic(), os.getpid()))
    conn.recv()  # GO
    heals = 0
    while loop.step < plan.steps:
        step = loop.step
        t0 = time.monotonic()
        loss = loss_of(task, model, batch_at(train, task, plan.seed, replica, step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loop.after_step()
        t1 = time.monotonic()
        c = loop.counters()
        if loop.step % h == 0:  # a sync (a heal moves the step to a sync's)
            heals = loop.heals()
        conn.send((STEP, loop.step, manager.current_step(), t0, t1, c["syncs"],
                   c["rollbacks"], heals, c["bytes_sent"]))  # fmt: skip
    result = {
        "loss": evaluate(task, model, (train, held)),
        "digest": digest(loop.outer()),
        "manager_step": manager.current_step(),
        "params": sum(p.numel() for p in model.parameters()),
        "heals": loop.heals(),
        **loop.counters(),
    }
    conn.send((DONE, result))
    manager.shutdown(wait=False)
    conn.close()
    os._exit(0)  # torchft's threads would hold the exit


def _train_ddp(conn: Any, plan: Plan, replica: int, attempt: int, pause_at: Optional[int]) -> None:
    """:func:`replica_main` with ``--ddp``: per-step DDP across the replica groups, pycomm's
    (``pycomm.wrap(..., manager=)``) or torchft's own, each step committed or not by the
    manager. ``pause_at``: at that step, between the forward and the backward, report
    :data:`IN_SYNC` and wait for :data:`GO` (the parent kills it there instead)."""
    from torchft.ddp import DistributedDataParallel as TorchftDDP
    from torchft.optim import OptimizerWrapper

    import pycomm

    torch.set_num_threads(1)
    logging.getLogger("torchft").setLevel(logging.WARNING)
    task = plan.task()
    train, held, vocab = docs_text()
    torch.manual_seed(plan.seed)  # every replica group starts from the same weights
    model = build_model(task, vocab)
    inner = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.01)
    loaded: list[int] = []  # one entry per heal: the manager loaded a peer's state
    manager, store = _manager(plan, replica, model, inner, loaded, async_quorum=True)
    ddp: torch.nn.Module
    if plan.run == "torchft":
        ddp = TorchftDDP(manager, model)
    else:
        hook = "allreduce" if plan.run == "exact" else plan.codec
        ddp = pycomm.wrap(model, hook=hook, manager=manager)
    opt = OptimizerWrapper(manager, inner)  # zero_grad: the quorum; step: the commit
    verdicts = {True: 0, False: 0}  # the manager's should_commit answers
    should_commit = manager.should_commit

    def counted(*args: Any, **kwargs: Any) -> bool:
        ok = bool(should_commit(*args, **kwargs))
        verdicts[ok] += 1
        return ok

    manager.should_commit = counted  # type: ignore[method-assign]
    params = sum(p.numel() for p in model.parameters())
    per_step = ring_bytes(params * 4, plan.replicas)  # torchft's fp32 ring all-reduce

    def counters() -> dict[str, Any]:
        if plan.run == "torchft":  # its bytes: what its ring sends, committed or not
            sent = (verdicts[True] + verdicts[False]) * per_step
            fp32, heals = sent, len(loaded)
        else:
            s = pycomm.hook_state(ddp).stats
            sent, fp32, heals = s["bytes_sent"], s["bytes_fp32"], s["heals"]
        return {"syncs": verdicts[True], "rollbacks": verdicts[False], "heals": heals,
                "bytes_sent": sent, "bytes_fp32": fp32}  # fmt: skip

    conn.send((READY, time.monotonic(), os.getpid()))
    conn.recv()  # GO
    while manager.current_step() < plan.steps:
        step = manager.current_step()  # the step's batch: the same again after a rollback
        t0 = time.monotonic()
        batch = batch_at(train, task, plan.seed, replica, step)
        opt.zero_grad()
        loss = loss_of(task, ddp, batch)
        if pause_at is not None and step >= pause_at:
            conn.send((IN_SYNC, step, time.monotonic()))
            conn.recv()  # GO, or killed meanwhile
            pause_at = None
        loss.backward()  # the gradients' all-reduce across the replica groups
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t1 = time.monotonic()
        c = counters()
        now = manager.current_step()
        conn.send((STEP, now, now, t0, t1, c["syncs"], c["rollbacks"], c["heals"],
                   c["bytes_sent"]))  # fmt: skip
    result = {
        "loss": evaluate(task, model, (train, held)),
        "digest": digest([p.detach() for p in model.parameters()]),
        "manager_step": manager.current_step(),
        "params": params,
        **counters(),
    }
    conn.send((DONE, result))
    manager.shutdown(wait=False)
    conn.close()
    os._exit(0)  # torchft's threads would hold the exit


class _Loop:
    """An outer loop as the replica's training loop drives it."""

    step: int

    def after_step(self) -> None:
        """Call after each inner ``optimizer.step()``."""
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """``syncs`` (committed), ``rollbacks``, ``bytes_sent``, ``bytes_fp32``."""
        raise NotImplementedError

    def heals(self) -> int:
        """How often this process healed from a peer."""
        raise NotImplementedError

    def outer(self) -> list[torch.Tensor]:
        """The outer parameters, the same bits on every replica group after a sync."""
        raise NotImplementedError


class _PycommLoop(_Loop):
    """``pycomm.DiLoCo`` or ``pycomm.LocalSGD`` under the manager: ``outer.step()`` after
    each inner step."""

    def __init__(self, outer: Any) -> None:
        self.loop = outer

    @property  # type: ignore[override]
    def step(self) -> int:
        return self.loop.step_count

    def after_step(self) -> None:
        self.loop.step()

    def counters(self) -> dict[str, int]:
        s = self.loop.stats
        return {k: s[k] for k in ("syncs", "rollbacks", "bytes_sent", "bytes_fp32")}

    def heals(self) -> int:
        return self.loop.exchange.stats["heals"]

    def outer(self) -> list[torch.Tensor]:
        return self.loop.state_dict()["outer"]


class _TorchftLoop(_Loop):
    """torchft's own ``DiLoCo`` (or ``LocalSGD``) on the inner optimizer, exact fp32: it
    syncs in the optimizer's step post-hook. Its bytes: what its fp32 ring all-reduce sends
    per sync, 2(N-1)/N of the parameters' bytes."""

    def __init__(
        self, plan: Plan, manager: Any, model: torch.nn.Module, opt: Any, loaded: list
    ) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        self.model, self.loaded = model, loaded
        self.commits = self.rollbacks = 0
        should_commit = manager.should_commit

        def counted(*args: Any, **kwargs: Any) -> bool:  # torchft's loops count nothing
            ok = bool(should_commit(*args, **kwargs))
            self.commits += ok
            self.rollbacks += not ok
            return ok

        manager.should_commit = counted
        if plan.outer == "diloco":
            outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            self.loop: Any = DiLoCo(manager, [model], opt, outer_opt, sync_every=plan.sync_every)
        else:
            self.loop = LocalSGD(manager, model, opt, sync_every=plan.sync_every)
        self.loop.__enter__()  # its hooks on the optimizer, for the whole process
        numel = sum(p.numel() for p in model.parameters())
        self.per_sync = ring_bytes(numel * 4, plan.replicas)
        self.step = 0

    def after_step(self) -> None:
        self.step += 1

    def counters(self) -> dict[str, int]:
        sent = (self.commits + self.rollbacks) * self.per_sync
        return {"syncs": self.commits, "rollbacks": self.rollbacks, "bytes_sent": sent,
                "bytes_fp32": sent}  # fmt: skip

    def heals(self) -> int:
        return len(self.loaded)

    def outer(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]


# --- the parent: start, kill, restart, collect ---------------------------------------------------


def kill_steps(steps: int, h: int) -> tuple[int, int]:
    """(the step of the kill in the middle of a window, about a quarter of the way in; the
    first sync past 55% of ``steps``, from which the kill during a sync is armed).

    Example:
        >>> kill_steps(1000, 50)
        (275, 550)
    """
    return max(1, steps // 4 // h) * h + h // 2, math.ceil(0.55 * steps / h) * h


def ddp_kill_step(steps: int) -> int:
    """``--ddp``: the step in whose middle the victim is killed, a third of the way in.

    Example:
        >>> ddp_kill_step(400)
        133
    """
    return max(DDP_WARMUP + 1, steps // 3)


@dataclasses.dataclass
class _Proc:
    """One process of a replica group, as the parent sees it."""

    replica: int
    attempt: int
    process: Any
    conn: Any
    log: str
    started: float
    ready: Optional[float] = None
    killed: Optional[float] = None
    healed: Optional[float] = None  # a restart's first committed sync (its step's end)
    heal_step: Optional[int] = None
    steps: list = dataclasses.field(default_factory=list)
    result: Optional[dict] = None
    closed: bool = False


class RunError(RuntimeError):
    """A run that failed: a replica group's error, an exit without a result, a timeout."""


class _Run:
    """One run of ``plan``: the lighthouse, the replica groups' processes, the kills."""

    def __init__(
        self, plan: Plan, ctx: Any, log_dir: str, kill: bool, victim: int, run_timeout: float,
        join_timeout_ms: int, heartbeat_timeout_ms: int, trace: bool = False,
    ) -> None:  # fmt: skip
        self.plan, self.ctx, self.log_dir = plan, ctx, log_dir
        self.kill, self.victim, self.run_timeout = kill, victim, run_timeout
        self.join_timeout_ms, self.heartbeat_timeout_ms = join_timeout_ms, heartbeat_timeout_ms
        if plan.ddp:  # one kill, in the middle of a step
            self.k1, self.k2, self.planned = ddp_kill_step(plan.steps), 0, 1
        else:  # in the middle of a window, then during a sync
            (self.k1, self.k2), self.planned = kill_steps(plan.steps, plan.sync_every), 2
        self.procs: list[_Proc] = []
        self.kills: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.t0 = 0.0
        self.trace = trace

    def start(self, replica: int, attempt: int) -> _Proc:
        """A fresh process of replica group ``replica``."""
        pause_from = self.k2 if self.kill and replica == self.victim and attempt < 2 else None
        if self.plan.ddp:  # the first process of the victim pauses at its kill's step
            pause_from = self.k1 if self.kill and replica == self.victim and attempt == 0 else None
        log = os.path.join(self.log_dir, f"{self.plan.run}-replica{replica}-{attempt}.log")
        parent, child = self.ctx.Pipe()
        target = _replica_entry()
        process = self.ctx.Process(
            target=target,
            args=(child, dataclasses.asdict(self.plan), replica, attempt, pause_from, log),
            daemon=True,
        )
        proc = _Proc(replica, attempt, process, parent, log, time.monotonic())
        process.start()
        child.close()
        self.procs.append(proc)
        return proc

    def latest(self, replica: int) -> _Proc:
        return [p for p in self.procs if p.replica == replica][-1]

    def run(self) -> dict[str, Any]:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=1,
            join_timeout_ms=self.join_timeout_ms,
            heartbeat_timeout_ms=self.heartbeat_timeout_ms,
        )
        self.plan = dataclasses.replace(self.plan, lighthouse=lighthouse.address())
        self.t0 = time.monotonic()
        deadline = self.t0 + self.run_timeout
        try:
            for r in range(self.plan.replicas):
                self.start(r, 0)
            while not all(self.latest(r).result for r in range(self.plan.replicas)):
                if time.monotonic() > deadline:
                    raise RunError(self._timeout_message())
                live = {p.conn: p for p in self.procs if not p.closed}
                for conn in multiprocessing.connection.wait(list(live), timeout=0.5):
                    proc = live[conn]
                    if proc.closed:  # killed while handling another message
                        continue
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        self._closed(proc)
                        continue
                    self._handle(proc, message)
            t_end = time.monotonic()
        finally:
            self.stop()
            lighthouse.shutdown()
        return self._summary(t_end)

    def stop(self) -> None:
        """Kill every process of the run still alive, and wait for it."""
        for p in self.procs:
            if p.process.is_alive():
                try:
                    os.kill(p.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.process.join(10)
            if not p.closed:
                p.conn.close()
                p.closed = True

    def _timeout_message(self) -> str:
        where = ", ".join(
            f"replica {p.replica} (process {p.attempt}) at step {p.steps[-1][0] if p.steps else 0}"
            for p in self.procs
            if not p.closed and p.result is None
        )
        tail = "".join(f"\n--- {p.log}:\n{_tail(p.log)}" for p in self.procs if not p.closed)
        return f"{self.plan.run} run: no end after {self.run_timeout:.0f} s: {where}{tail}"

    def _closed(self, proc: _Proc) -> None:
        proc.closed = True
        proc.conn.close()
        if proc.result is None and proc.killed is None:
            proc.process.join(10)
            raise RunError(
                f"{self.plan.run} run: replica {proc.replica} (process {proc.attempt}) exited "
                f"without a result (exit code {proc.process.exitcode}); its log "
                f"{proc.log}:\n{_tail(proc.log)}"
            )

    def _kill(self, proc: _Proc, kind: str, step: int) -> None:
        """SIGKILL ``proc`` and start its replica group again at once."""
        os.kill(proc.process.pid, signal.SIGKILL)
        proc.killed = time.monotonic()
        proc.process.join(10)
        proc.conn.close()
        proc.closed = True
        restarted = self.start(proc.replica, proc.attempt + 1)
        self.kills.append({"kind": kind, "replica": proc.replica, "step": step,
                           "killed": proc.killed, "process": restarted})  # fmt: skip

    def _handle(self, proc: _Proc, message: tuple) -> None:
        kind = message[0]
        h = self.plan.sync_every
        if kind == READY:
            proc.ready = message[1]
            first = [p for p in self.procs if p.attempt == 0]
            if proc.attempt > 0:  # a restart trains at once
                proc.conn.send(GO)
            elif all(p.ready is not None for p in first) and len(first) == self.plan.replicas:
                for p in first:  # the first processes start together
                    p.conn.send(GO)
        elif kind == STEP:
            step, syncs = message[1], message[5]
            proc.steps.append(message[1:])
            if proc.attempt > 0 and proc.healed is None and syncs >= 1:
                proc.healed, proc.heal_step = message[4], step
            if (
                self.kill and proc.replica == self.victim and proc.attempt == 0 and not self.kills
                and step >= self.k1 and step % h and not self.plan.ddp
            ):  # fmt: skip
                self._kill(proc, "mid-window", step)
        elif kind == IN_SYNC:
            step = message[1]
            armed = (
                self.kill and len(self.kills) == 1 and proc.attempt == 1
                and proc.healed is not None and step <= self.plan.steps - 3 * h
            )  # fmt: skip
            if self.plan.ddp:  # after its forward, before its backward's all-reduce
                armed = self.kill and not self.kills and proc.attempt == 0
            if armed:
                self._kill(proc, "in-step" if self.plan.ddp else "in-sync", step)
            else:
                proc.conn.send(GO)
        elif kind == DONE:
            proc.result = message[1]
        elif kind == ERROR:
            raise RunError(
                f"{self.plan.run} run: replica {proc.replica} (process {proc.attempt}) "
                f"failed:\n{message[1]}\nits log {proc.log}:\n{_tail(proc.log)}"
            )

    # --- the run's figures ------------------------------------------------------------------

    def _summary(self, t_end: float) -> dict[str, Any]:
        plan, warmup = self.plan, self.plan.warmup()
        finals = [self.latest(r) for r in range(plan.replicas)]
        results = [p.result or {} for p in finals]
        kills = []
        windows = []
        for k in self.kills:
            p: _Proc = k["process"]
            end = p.healed if p.healed is not None else t_end
            windows.append((k["killed"], end))
            kills.append({
                "kind": k["kind"],
                "replica": k["replica"],
                "step": k["step"],
                "at_s": k["killed"] - self.t0,
                "ready_after_s": None if p.ready is None else p.ready - p.started,
                "time_to_heal_s": None if p.healed is None else p.healed - p.started,
                "heal_step": p.heal_step,
                "healed": p.healed is not None,
            })  # fmt: skip
        if self.kill and len(self.kills) < self.planned:
            self.notes.append(
                f"{len(self.kills)} kill(s) of {self.planned}: the run ended before the next "
                "was armed"
            )
        killed = {k["replica"] for k in self.kills}
        survivors = [r for r in range(plan.replicas) if r not in killed]
        healthy, outage, slowest = [], [], (0.0, 0, 0)
        for p in self.procs:
            if p.replica not in survivors:
                continue
            for step, _, t0, t1, *_ in p.steps:
                if step <= warmup:  # the first window (DDP: steps): the start
                    continue
                dt = t1 - t0
                inside = any(t1 > a and t0 < b for a, b in windows)
                (outage if inside else healthy).append(dt)
                if dt > slowest[0]:
                    slowest = (dt, step, p.replica)
        med_h = statistics.median(healthy) if healthy else None
        med_o = statistics.median(outage) if outage else None
        replicas = []
        for r in range(plan.replicas):
            procs = [p for p in self.procs if p.replica == r]
            sent = sum(
                (p.result["bytes_sent"] if p.result else (p.steps[-1][7] if p.steps else 0))
                for p in procs
            )
            res = results[r]
            replicas.append({
                "replica": r, "processes": len(procs), "bytes_sent": sent,
                "bytes_fp32": res.get("bytes_fp32"), "heals": res.get("heals"),
                "syncs": res.get("syncs"), "rollbacks": res.get("rollbacks"),
                "manager_step": res.get("manager_step"), "loss": res.get("loss"),
                "digest": res.get("digest"),
            })  # fmt: skip
        digests = {r["digest"] for r in replicas}
        first = [p for p in self.procs if p.attempt == 0 and p.ready is not None]
        return {
            "run": plan.run,
            "wall_s": t_end - self.t0,
            "startup_s": max((p.ready - p.started for p in first), default=None),
            "params": results[0].get("params"),
            "loss": results[0].get("loss"),
            "digests_equal": len(digests) == 1,
            "bytes_sent_per_replica": statistics.mean(r["bytes_sent"] for r in replicas),
            "replicas": replicas,
            "survivors": survivors,
            "kills": kills,
            "steps": {
                "median_healthy_s": med_h,
                "median_outage_s": med_o,
                "outage_ratio": med_o / med_h if med_o and med_h else None,
                "slowest_s": slowest[0],
                "slowest_step": slowest[1],
                "slowest_replica": slowest[2],
                "healthy": len(healthy),
                "outage": len(outage),
            },
            "notes": self.notes,
            **({"trace": self._trace()} if self.trace else {}),
        }

    def _trace(self) -> list[dict[str, Any]]:
        """Every process's steps: (step, manager step, start and end in seconds from the run's
        start, syncs, rollbacks, heals, bytes sent)."""
        return [
            {
                "replica": p.replica, "process": p.attempt,
                "started_s": p.started - self.t0,
                "ready_s": None if p.ready is None else p.ready - self.t0,
                "killed_s": None if p.killed is None else p.killed - self.t0,
                "steps": [(s, m, round(a - self.t0, 4), round(b - self.t0, 4), *rest)
                          for s, m, a, b, *rest in p.steps],
            }
            for p in self.procs
        ]  # fmt: skip


def _replica_entry() -> Callable[..., None]:
    """:func:`replica_main` under its module's own name (a child process imports it so,
    also when this module runs as ``__main__``)."""
    import importlib

    return importlib.import_module("pycomm.bench.ft").replica_entry


def replica_entry(
    conn: Any, plan: dict, replica: int, attempt: int, pause_from: Optional[int], log: str
) -> None:
    """A child process's entry: :func:`replica_main` with the plan rebuilt."""
    replica_main(conn, Plan(**plan), replica, attempt, pause_from, log)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return "(no log)"


# --- the bench ----------------------------------------------------------------------------------


def run_bench(
    plan: Plan, runs: list[str], *, victim: int = 1, run_timeout: float = 600.0,
    start_method: str = "forkserver", join_timeout_ms: Optional[int] = None,
    heartbeat_timeout_ms: int = 2000,
    log_dir: Optional[str] = None, progress: Optional[Callable[[str], None]] = None,
    trace: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Each of ``runs`` (of :data:`RUNS`) of ``plan``, one after the other: their figures by
    name (``{"runs": {name: figures}, "targets": ...}``), and the targets of the runs there
    are (:func:`targets`). ``join_timeout_ms`` None: the manager's timeout.

    Example:
        >>> plan = Plan("clean", "diloco", "int4", 3, 400, 20, 0, 32, 1, 3e-3, 5.0, 60.0)
        >>> run_bench(plan, ["clean", "kill"])["targets"]["restarted_bitwise_equal"]["ok"]
        True
    """
    if join_timeout_ms is None:  # a straggler waited for as long as a collective
        join_timeout_ms = int(plan.timeout_s * 1000)
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse's log, read at torchft's import
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        preload = [*FORKSERVER_PRELOAD, "torchft.manager", "pycomm.bench.quality_tasks"]
        if plan.ddp:
            preload += ["torchft.ddp", "torchft.optim"]
        ctx.set_forkserver_preload(preload)  # a process up in a fraction of a second
    own_dir = log_dir is None
    log_dir = log_dir or tempfile.mkdtemp(prefix="pycomm-ft-")
    out: dict[str, Any] = {"runs": {}}
    for name in runs:
        if progress:
            progress(name)
        run = _Run(
            dataclasses.replace(plan, run=name), ctx, log_dir, name == "kill", victim,
            run_timeout, join_timeout_ms, heartbeat_timeout_ms, trace,
        )  # fmt: skip
        out["runs"][name] = run.run()  # a failure leaves the logs in log_dir
    out["targets"] = targets(out["runs"], plan.timeout_s, ddp=plan.ddp)
    out["compare"] = compare(out["runs"], plan.codec)
    if own_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return out


def targets(
    runs: dict[str, Any], timeout_s: float, *, ddp: bool = False
) -> dict[str, dict[str, Any]]:
    """The report's targets that the runs given measure: value, limit, ok (``ddp``: those of
    ``--ddp``, :data:`DDP_TARGETS`).

    Example:
        >>> runs = {"clean": {"loss": 2.0, "digests_equal": True, "bytes_sent_per_replica": 1},
        ...         "torchft": {"loss": 2.005, "bytes_sent_per_replica": 8}}
        >>> targets(runs, 5.0)["bytes_vs_torchft"]
        {'value': 8.0, 'limit': 7.0, 'ok': True, 'what': "torchft's exact bytes / int4's >= 7"}
    """
    out: dict[str, dict[str, Any]] = {}
    table = DDP_TARGETS if ddp else TARGETS

    def put(name: str, value: Any, ok: bool, limit: Optional[float] = None) -> None:
        if name not in table:
            return
        lim = table[name][0] if limit is None else limit
        out[name] = {"value": value, "limit": lim, "ok": bool(ok), "what": table[name][1]}

    clean, kill, ft = runs.get("clean"), runs.get("kill"), runs.get("torchft")
    if kill:
        st = kill["steps"]
        if st["median_healthy_s"] is not None:
            limit = timeout_s + st["median_healthy_s"]
            put("slowest_survivor_step", st["slowest_s"], st["slowest_s"] <= limit, limit)
        if st["outage_ratio"] is not None:
            put("outage_step_ratio", st["outage_ratio"], st["outage_ratio"] <= 1.2)
        put("restarted_bitwise_equal", kill["digests_equal"], kill["digests_equal"])
        if clean:
            rel = kill["loss"] / clean["loss"] - 1
            put("kill_loss_vs_clean", rel, abs(rel) <= 0.01)
    if clean and ft:
        ratio = ft["bytes_sent_per_replica"] / max(clean["bytes_sent_per_replica"], 1)
        put("bytes_vs_torchft", ratio, ratio >= table["bytes_vs_torchft"][0])
        rel = clean["loss"] / ft["loss"] - 1
        put("loss_vs_torchft", rel, abs(rel) <= 0.005)
    return out


def compare(runs: dict[str, Any], codec: str = "int4") -> dict[str, float]:
    """Relative differences of held-out loss between the runs given, beside the targets:
    ``exact_vs_torchft`` (pycomm's outer loop, or DDP, exact against torchft's: the loops
    alone) and ``<codec>_vs_exact`` (the clean run against pycomm's exact: the codec alone).

    Example:
        >>> compare({"clean": {"loss": 2.02}, "exact": {"loss": 2.0}})
        {'int4_vs_exact': 0.010000000000000009}
    """
    out = {}
    pairs = {"exact_vs_torchft": ("exact", "torchft"), f"{codec}_vs_exact": ("clean", "exact")}
    for name, (a, b) in pairs.items():
        if a in runs and b in runs:
            out[name] = runs[a]["loss"] / runs[b]["loss"] - 1
    return out


def report_lines(doc: dict[str, Any]) -> list[str]:
    """The printed report of :func:`run_bench`'s result ``doc`` (with its ``config``)."""
    c, runs = doc["config"], doc["runs"]
    any_run = next(iter(runs.values()))
    ddp = c["outer"] == DDP
    outer = {"diloco": "DiLoCo", "localsgd": "LocalSGD"}.get(c["outer"], "")
    how = (
        "DDP across the replica groups, every step (asynchronous quorum)" if ddp
        else f"{outer} H={c['sync_every']}"
    )  # fmt: skip
    lines = [
        f"charlm {c['layers']} x {c['d_model']} ({any_run['params']:,} params), "
        f"{c['replicas']} replica groups (1 rank each, gloo), {c['steps']} steps, AdamW "
        f"{c['lr']:g}, {how}; manager timeout {c['timeout_s']:g} s",
        f"{'run':<15}{'held-out loss':>14}{'bytes/replica':>15}"
        f"{'commits' if ddp else 'syncs':>{8 if ddp else 7}}{'rollbacks':>10}"
        f"{'heals':>7}{'same bits':>11}{'median step':>13}{'wall':>8}",
    ]
    for name, r in runs.items():
        reps = r["replicas"]
        what = name if name in ("torchft", "exact") else f"{name} ({c['codec']})"
        lines.append(
            f"{what:<15}{r['loss']:>14.4f}{r['bytes_sent_per_replica'] / 1e6:>13.2f}MB"
            f"{reps[0]['syncs']:>{8 if ddp else 7}}{sum(x['rollbacks'] for x in reps):>10}"
            f"{sum(x['heals'] for x in reps):>7}{'yes' if r['digests_equal'] else 'NO':>11}"
            f"{_ms(r['steps']['median_healthy_s']):>13}{r['wall_s']:>7.0f}s"
        )
    if ddp:  # the hook's own count of what torchft's fp32 ring sends for the same buckets
        for name in ("clean", "exact"):  # (no kill: a killed process's count is its last step's)
            if name in runs:
                sent = sum(x["bytes_sent"] for x in runs[name]["replicas"])
                fp32 = sum(x["bytes_fp32"] or 0 for x in runs[name]["replicas"])
                lines.append(
                    f"{name}: the hook counts {fp32 / len(runs[name]['replicas']) / 1e6:.2f} MB "
                    f"per replica group for an fp32 ring all-reduce of its buckets, "
                    f"{fp32 / max(sent, 1):.2f}x what it sent"
                )
    kill = runs.get("kill")
    if kill:
        st = kill["steps"]
        lines.append(
            f"kill run, survivors (replicas {', '.join(map(str, kill['survivors']))}): median "
            f"step {_ms(st['median_healthy_s'])} healthy ({st['healthy']} steps), "
            f"{_ms(st['median_outage_s'])} through the outages ({st['outage']} steps); "
            f"slowest {_ms(st['slowest_s'])} (replica {st['slowest_replica']}, step "
            f"{st['slowest_step']})"
        )
        for k in kill["kills"]:
            healed = (
                f"healed {k['time_to_heal_s']:.1f} s after its restart (process up after "
                f"{k['ready_after_s']:.1f} s), at step {k['heal_step']}"
                if k["healed"] else "did NOT heal"
            )  # fmt: skip
            lines.append(
                f"  killed replica {k['replica']} {k['kind']} at step {k['step']} "
                f"({k['at_s']:.1f} s in), restarted at once: {healed}"
            )
        for note in kill["notes"]:
            lines.append(f"  note: {note}")
    codec = c["codec"]
    what_compared = {
        "exact_vs_torchft": "pycomm exact vs torchft's held-out loss (the loops alone)",
        f"{codec}_vs_exact": f"{codec} vs pycomm exact held-out loss ({codec} alone)",
    }
    for name, rel in doc.get("compare", {}).items():
        lines.append(f"{what_compared[name]}: {rel * 100:+.2f}%")
    for name, t in doc["targets"].items():
        value = t["value"]
        if name in ("kill_loss_vs_clean", "loss_vs_torchft"):
            shown = f"{value * 100:+.2f}%"
        elif name == "slowest_survivor_step":
            shown = f"{value:.2f} s (limit {t['limit']:.2f} s)"
        elif isinstance(value, bool):
            shown = "yes" if value else "no"
        else:
            shown = f"{value:.2f}x"
        lines.append(f"{'ok    ' if t['ok'] else 'MISSED'} {t['what']}: {shown}")
    return lines


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="python -m pycomm.bench.ft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--kill", action="store_true", help="add the run with two kills (--ddp: one)")
    ap.add_argument(
        "--ddp",
        action="store_true",
        help="per-step DDP across the replica groups (pycomm's int8, torchft's fp32), no "
        "outer loop",
    )
    ap.add_argument(
        "--runs",
        default=None,
        help="comma-separated runs of clean, kill, torchft (default: clean,torchft; with "
        "--kill clean,kill,torchft)",
    )
    ap.add_argument("--outer", choices=OUTERS, default=None, help="default diloco")
    ap.add_argument(
        "--codec",
        default=None,
        help="pycomm's codec of the outer syncs (default int4), or with --ddp of the "
        "gradients (default int8)",
    )
    ap.add_argument("--replicas", type=positive_int, default=3)
    ap.add_argument("--victim", type=int, default=1, help="the replica group killed")
    ap.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"inner steps in all (default 1000; --ddp: {DDP_STEPS})",
    )
    ap.add_argument("--sync-every", type=positive_int, default=None, help="H (default 50)")
    ap.add_argument("--d-model", type=positive_int, default=TASKS["charlm"].d_model)
    ap.add_argument("--layers", type=positive_int, default=TASKS["charlm"].layers)
    ap.add_argument("--lr", type=float, default=TASKS["charlm"].lr["adamw"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="the manager's timeout (s)")
    ap.add_argument("--quorum-timeout", type=float, default=60.0, help="seconds")
    ap.add_argument(
        "--join-timeout-ms",
        type=positive_int,
        default=None,
        help="the lighthouse's wait for a straggler (default: the manager's timeout)",
    )
    ap.add_argument("--heartbeat-timeout-ms", type=positive_int, default=2000)
    ap.add_argument("--run-timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--start-method", choices=START_METHODS, default="forkserver")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", action="store_true", help="every step of every process in --json")
    ap.add_argument("--log-dir", default=None, help="keep each process's log there")
    args = ap.parse_args(argv)
    if args.ddp:
        for given, name in ((args.outer, "--outer"), (args.sync_every, "--sync-every")):
            if given is not None:
                ap.error(f"{name} with --ddp: expected none (DDP syncs every step)")
        args.outer, args.sync_every = DDP, 1
    args.outer = args.outer or "diloco"
    args.sync_every = args.sync_every or 50
    args.steps = args.steps or (DDP_STEPS if args.ddp else 1000)
    args.codec = args.codec or ("int8" if args.ddp else "int4")
    runs = (args.runs or ("clean,kill,torchft" if args.kill else "clean,torchft")).split(",")
    bad = [r for r in runs if r not in RUNS]
    if bad or not runs:
        ap.error(f"--runs {args.runs}: expected some of {', '.join(RUNS)}")
    if "kill" in runs:
        if not args.kill:
            ap.error("--runs kill: give --kill too")
        if not 0 <= args.victim < args.replicas:
            ap.error(f"--victim {args.victim}: expected 0 <= victim < --replicas {args.replicas}")
        if args.replicas < 3:
            ap.error("--kill: expected --replicas >= 3 (two survivors hold the quorum)")
        if args.ddp and args.steps < 4 * DDP_WARMUP:
            ap.error(f"--kill: expected --steps >= {4 * DDP_WARMUP} with --ddp, got {args.steps}")
        if not args.ddp and (args.sync_every < 2 or args.steps < 8 * args.sync_every):
            ap.error(
                f"--kill: expected --sync-every >= 2 and --steps >= 8 x --sync-every, got "
                f"{args.steps} and {args.sync_every}"
            )
    if args.steps % args.sync_every:
        ap.error(f"--steps {args.steps}: expected a multiple of --sync-every {args.sync_every}")
    codecs = Exchange.codecs()
    if args.codec not in codecs:
        ap.error(f"--codec {args.codec}: expected one of {', '.join(codecs)}")
    check_output_paths(ap, args.json)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust log, read when it is imported
    try:
        import torchft.manager  # noqa: F401
    except ImportError:
        ap.error(f"needs torchft: {FT_EXTRA}")
    plan = Plan(
        run=runs[0], outer=args.outer, codec=args.codec, replicas=args.replicas,
        steps=args.steps, sync_every=args.sync_every, seed=args.seed, d_model=args.d_model,
        layers=args.layers, lr=args.lr, timeout_s=args.timeout,
        quorum_timeout_s=args.quorum_timeout,
    )  # fmt: skip

    def term(signum: int, frame: Any) -> None:  # SIGTERM: the children are killed on the way
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, term)
    try:
        doc = run_bench(
            plan, runs, victim=args.victim, run_timeout=args.run_timeout,
            start_method=args.start_method, join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms, trace=args.trace,
            log_dir=args.log_dir,
            progress=lambda name: print(f"running: {name}", file=sys.stderr, flush=True),
        )  # fmt: skip
    except RunError as e:
        print(f"python -m pycomm.bench.ft: {e}", file=sys.stderr)
        return 1
    config = {k: v for k, v in dataclasses.asdict(plan).items() if k not in ("run", "lighthouse")}
    join_ms = args.join_timeout_ms or int(args.timeout * 1000)
    config.update(runs=runs, victim=args.victim, join_timeout_ms=join_ms,
                  heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                  start_method=args.start_method)  # fmt: skip
    if args.ddp:
        config.update(use_async_quorum=True, kill_step=ddp_kill_step(args.steps))
    doc = {"command": " ".join(["python -m pycomm.bench.ft", *argv]), "config": config, **doc}
    for line in report_lines(doc):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
