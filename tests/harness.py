"""Shared harness for multi-rank tests: run a module-level function on N gloo ranks.

Per-rank functions must be defined at module level in the test module (spawn pickles them by
name). Every run has a deadline, so a hang fails the test instead of stalling the suite.

Spawning ranks and joining a process group costs seconds per test, far more than most tests'
own work, so :func:`run_ranks` keeps a pool of ranks per (ranks, backend) alive across tests:
one :func:`pycomm.launch` whose ranks run jobs until the session ends. A job that fails, or
misses its deadline, stops its pool (a rank may be left inside a collective) and the next job
starts a fresh one. Tests of launching itself, of dying or stalling ranks, or of the process
group's own timeout use :func:`pycomm.launch` directly (``fresh=True`` here).
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable

import pycomm

# This folder (tests/: the helpers and scripts/) and the repository's root, for the test modules
# in its subfolders.
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# The pool's process group timeout: above any job's deadline, so that a deadline, not gloo,
# ends a hung job.
_GROUP_TIMEOUT_S = 600.0


def _serve(inboxes: list, outbox) -> None:
    """A pool rank: run jobs from this rank's inbox until it sends None."""
    import torch
    import torch.distributed as dist

    # ranks share this machine's cores: one thread each, not each rank one per core
    torch.set_num_threads(1)
    rank = dist.get_rank()
    outbox.put((rank, "pid", os.getpid()))
    inbox = inboxes[rank]
    while True:
        job = inbox.get()
        if job is None:
            return
        number, fn, args = job
        try:
            message = ("ok", fn(*args))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails
            message = ("error", f"{traceback.format_exc()}\n{exc!r}")
        # The job's garbage (DDP models in reference cycles keep their groups' threads) goes
        # now; what survives it (torch, the modules jobs imported) is frozen out of every
        # later collection. Without the freeze each collection walks torch's ~300K objects:
        # 0.13 s of CPU per rank per job (0.17 s a job on 2 ranks, 0.6 s on 4, on 2 cores),
        # more than most jobs' own work. Frozen objects are still freed by their reference
        # counts; only a cycle among them that becomes garbage later stays in memory.
        gc.collect()
        gc.freeze()
        try:  # plain pickle: torch's would share tensors through this process's memory
            payload = pickle.dumps(message)
        except Exception as exc:  # noqa: BLE001
            payload = pickle.dumps(("error", f"result not picklable: {exc!r}"))
        outbox.put((rank, number, payload))


class _Pool:
    def __init__(self, nprocs: int, backend: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.nprocs = nprocs
        self.inboxes = [ctx.Queue() for _ in range(nprocs)]
        self.outbox = ctx.Queue()
        self.failure: list = []
        self.jobs = 0
        self.thread = threading.Thread(
            target=self._run, args=(backend,), daemon=True, name=f"rank-pool-{nprocs}"
        )
        self.thread.start()
        self.pids = {}
        deadline = time.monotonic() + 120
        while len(self.pids) < nprocs:
            rank, _, pid = self._get(deadline, "starting the pool")
            self.pids[rank] = pid

    def _run(self, backend: str) -> None:
        try:
            pycomm.launch(
                _serve, self.nprocs, self.inboxes, self.outbox, backend=backend,
                timeout=_GROUP_TIMEOUT_S,
            )  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - read by the waiting job
            self.failure.append(exc)

    def _get(self, deadline: float, what: str):
        while True:
            if self.failure:
                raise RuntimeError(f"the rank pool died while {what}: {self.failure[0]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: no answer within the deadline")
            try:
                return self.outbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list:
        self.jobs += 1
        number = self.jobs
        for box in self.inboxes:
            box.put((number, fn, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        what = f"{fn.__name__} on {self.nprocs} ranks"
        while len(results) < self.nprocs:
            rank, got, payload = self._get(deadline, what)
            if got != number:
                continue
            status, value = pickle.loads(payload)
            if status != "ok":
                raise RuntimeError(f"rank {rank} of {what} raised:\n{value}")
            results[rank] = value
        return [results[r] for r in range(self.nprocs)]

    def stop(self, kill: bool) -> None:
        if kill:
            for pid in self.pids.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        else:
            for box in self.inboxes:
                box.put(None)
        self.thread.join(timeout=30)


_POOLS: dict[tuple, _Pool] = {}


def _stop_all() -> None:
    for pool in _POOLS.values():
        pool.stop(kill=False)
    _POOLS.clear()


atexit.register(_stop_all)


def launched_children() -> list:
    """``multiprocessing.active_children()`` but the pools' ranks: what a launch left behind."""
    pooled = {pid for pool in _POOLS.values() for pid in pool.pids.values()}
    return [p for p in multiprocessing.active_children() if p.pid not in pooled]


def error_message(fn: Callable[[], Any]) -> Any:
    """The message of what ``fn()`` raises, with its type; None if it returns. For per-rank
    functions that report errors to the test instead of raising them.

    Example:
        >>> error_message(lambda: int("x"))
        "ValueError: invalid literal for int() with base 10: 'x'"
    """
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__}: {e}"
    return None


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    fresh: bool = False,
) -> list:
    """Run ``fn(*args)`` on ``nprocs`` ranks; results in rank order. A rank's exception fails
    the call with its traceback; ``timeout`` seconds without every result fail it too.

    ``fresh=True``: a new :func:`pycomm.launch` (its own processes, its process group's
    timeout ``timeout``, :class:`pycomm.LaunchError` on failure) instead of the pool.

    Example:
        >>> run_ranks(_sum_ranks, 2)   # _sum_ranks defined at module level
        [1.0, 1.0]
    """
    if fresh:
        return pycomm.launch(fn, nprocs, *args, backend=backend, timeout=timeout)
    key = (nprocs, backend)
    pool = _POOLS.get(key)
    if pool is None or pool.failure:
        pool = _POOLS[key] = _Pool(nprocs, backend)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        _POOLS.pop(key, None)
        pool.stop(kill=True)
        raise


def error_text(call: Callable[[], Any]) -> str | None:
    """``"Type: message"`` of the ValueError, TypeError or RuntimeError ``call()`` raises, or
    None: what a rank returns so that every rank's refusal can be compared.

    Example:
        >>> error_text(lambda: int("x"))
        "ValueError: invalid literal for int() with base 10: 'x'"
    """
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def errors_of(calls: dict[str, Callable[[], Any]]) -> dict[str, tuple[str, str] | None]:
    """What each call raises, as (type name, message), or None: a rank's answers for a table
    of bad inputs.

    Example:
        >>> errors_of({"int": lambda: int("x")})["int"][0]
        'ValueError'
    """
    out: dict[str, tuple[str, str] | None] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test inspects type and message
            out[name] = (type(e).__name__, str(e))
    return out
