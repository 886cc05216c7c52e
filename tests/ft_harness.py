"""Replica groups of one rank each, run as threads of the test's process under an in-process
torchft lighthouse, as torchft's own integration tests run them."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torchft._torchft import LighthouseServer
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

logging.getLogger("torchft").setLevel(logging.WARNING)


class Replica:
    """One replica group's manager, built on the caller's thread."""

    def __init__(
        self, lighthouse: str, replica_id: int, attempt: int = 0, **manager_args: Any
    ) -> None:
        self.replica_id, self.attempt = replica_id, attempt
        self.store = dist.TCPStore(
            "localhost", 0, is_master=True, wait_for_workers=False, use_libuv=False
        )
        self.state: dict[str, Callable] = {}
        args = {
            "min_replica_size": 1,
            "timeout": timedelta(seconds=15),
            "quorum_timeout": timedelta(seconds=20),
            "use_async_quorum": False,
            "init_sync": False,
        }
        args.update(manager_args)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=args["timeout"]),
            load_state_dict=lambda s: self.state["load"](s),
            state_dict=lambda: self.state["save"](),
            replica_id=str(replica_id),
            store_addr="localhost",
            store_port=self.store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            **args,
        )

    def user_state(self, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """The replica's own model and optimizer state, as torchft heals it."""
        self.state["save"], self.state["load"] = save, load


class Injected(Exception):
    """A replica group's failure, injected by a test: the group is built again (a restart)."""


def run_replicas(
    fn: Callable[[Replica], Any], n: int, min_replicas: int = 1, timeout: float = 90,
    start_when: dict = None, **manager_args: Any,
) -> list:  # fmt: skip
    """``fn(replica)`` on ``n`` replica groups at once, each restarted (a new manager, a new
    ``fn`` call with ``replica.attempt`` one more) when it raises :class:`Injected`; their
    results in order (any other exception raised again). ``start_when``: replica id -> a
    ``threading.Event`` it waits for before it starts (it joins a running job)."""
    # a replica group that is alive is waited for (up to 5 s: a loaded machine runs one late,
    # and one left out of a quorum for it would heal instead of taking part); one that is gone
    # stops heartbeating and is not waited for after 1 s
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=5000, heartbeat_timeout_ms=1000
    )
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:

            def one(i: int) -> Any:
                if i in (start_when or {}):
                    start_when[i].wait(timeout)
                for attempt in range(3):
                    replica = Replica(lighthouse.address(), i, attempt, **manager_args)
                    try:
                        return fn(replica)
                    except Injected:
                        continue
                    finally:
                        replica.manager.shutdown(wait=False)
                raise RuntimeError(f"replica {i} failed three times")

            futures = [pool.submit(one, i) for i in range(n)]
            return [f.result(timeout=timeout) for f in futures]
    finally:
        lighthouse.shutdown()
