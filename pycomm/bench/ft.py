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

The runs, one after the other: ``clean`` (no kill), ``kill`` (with ``--kill``) and
``torchft``: torchft's own ``torchft.local_sgd.DiLoCo`` (``LocalSGD`` with ``--outer
localsgd``), exact fp32 all-reduces, the same model, H, steps and outer optimizer (Nesterov
SGD, lr 0.7, momentum 0.9), no kill. Its bytes are what its fp32 ring all-reduce sends,
2(N-1)/N x 4 bytes per parameter per sync per replica group.

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
    python -m pycomm.bench.ft --kill --runs kill --steps 400 --sync-every 20 --d-model 32

Each replica group's output (torchft's logs) goes to a file of its own, printed when it
fails. Every process started is killed when the run ends, fails or times out
(``--run-timeout``).
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

RUNS = ("clean", "kill", "torchft")
OUTERS = ("diloco", "localsgd")
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """One run's settings, as every replica group gets them."""

    run: str  # "clean", "kill" or "torchft"
    outer: str  # "diloco" or "localsgd"
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
        _train(conn, plan, replica, attempt, pause_from)
    except BaseException:
        try:
            conn.send((ERROR, traceback.format_exc()))
        finally:
            os._exit(1)


def _train(conn: Any, plan: Plan, replica: int, attempt: int, pause_from: Optional[int]) -> None:
    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    import pycomm

    torch.set_num_threads(1)
    logging.getLogger("torchft").setLevel(logging.WARNING)
    task = plan.task()
    train, held, vocab = docs_text()
    torch.manual_seed(plan.seed)  # every replica group starts from the same weights
    model = build_model(task, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.01)
    timeout = datetime.timedelta(seconds=plan.timeout_s)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
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
        use_async_quorum=False,
        init_sync=False,
    )
    h = plan.sync_every
    loop: _Loop
    if plan.run == "torchft":
        loop = _TorchftLoop(plan, manager, model, opt)
    else:
        cls = pycomm.DiLoCo if plan.outer == "diloco" else pycomm.LocalSGD
        outer = cls(model, sync_every=h, codec=plan.codec, manager=manager)
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

    def __init__(self, plan: Plan, manager: Any, model: torch.nn.Module, opt: Any) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        self.model, self.manager, self.h = model, manager, plan.sync_every
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
        syncs = self.step // self.h
        committed = self.manager.current_step()
        sent = syncs * self.per_sync
        return {"syncs": committed, "rollbacks": syncs - committed, "bytes_sent": sent,
                "bytes_fp32": sent}  # fmt: skip

    def heals(self) -> int:
        return 0

    def outer(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]
