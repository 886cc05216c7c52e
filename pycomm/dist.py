"""Process-group setup: ``init`` / ``shutdown`` and the ``DistInfo`` ``init`` returns.

``init`` reads the launcher's environment (torchrun, else SLURM, else a single process),
validates every value before any socket is opened, and calls
``torch.distributed.init_process_group``. Running ranks is :mod:`pycomm.launcher`'s job.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import inspect
import logging
import math
import operator
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from pycomm._validate import check_int
from pycomm.topology import set_nodes

__all__ = [
    "DistInfo",
    "all_gather_objects",
    "init",
    "resolve_backend",
    "settle_at_exit",
    "shutdown",
    "to_timedelta",
]

logger = logging.getLogger(__name__)

VALID_BACKENDS = ("auto", "gloo", "nccl", "mpi", "tcp", "ib")
DEFAULT_MASTER_PORT = 29500

_TORCHRUN = "torchrun environment"
_SLURM = "SLURM environment"
_ARGUMENT = "argument"
_DEFAULT = "default"

_TCP_WARNING = (
    "backend 'tcp' was removed from torch.distributed (torch 1.0); pycomm uses 'gloo' over a "
    "tcp:// rendezvous instead. Pass backend='gloo' (or 'auto') to silence this warning."
)
_tcp_warned = False


Timeout = Union[float, int, datetime.timedelta, None]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the default process group.

    Example:
        >>> info = pycomm.init()
        >>> info.rank, info.world_size, info.device
        (0, 1, device(type='cpu'))
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


# --------------------------------------------------------------------------- resolution


def resolve_backend(backend: Optional[str]) -> tuple[str, bool]:
    """Map a user backend name to a torch backend; returns (name, was_tcp_alias)."""
    if backend is None:
        name = "auto"
    elif isinstance(backend, str):
        name = backend.strip().lower()
    else:
        raise ValueError(
            f"backend must be a string or None, got {backend!r}; valid: {', '.join(VALID_BACKENDS)}"
        )
    if name not in VALID_BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; valid backends: {', '.join(VALID_BACKENDS)}"
        )
    is_tcp = name == "tcp"
    if name == "auto":
        name = "nccl" if torch.cuda.is_available() else "gloo"
    elif is_tcp:
        global _tcp_warned
        if not _tcp_warned:
            _tcp_warned = True
            warnings.warn(_TCP_WARNING, UserWarning, stacklevel=3)
        name = "gloo"
    elif name == "ib":
        name = "nccl"
    if name == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            f"backend {backend!r} needs NCCL on CUDA, but CUDA is not available "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
            "use backend='gloo' or 'auto'"
        )
    if name == "mpi" and not dist.is_mpi_available():
        raise RuntimeError("backend 'mpi' requested, but this torch was built without MPI")
    return name, is_tcp


def _bad(name: str, value: Any, source: str, expected: str) -> ValueError:
    if value is None:
        return ValueError(f"{name} is not set ({source}); expected {expected}")
    return ValueError(f"{name}={value!r} ({source}) is invalid; expected {expected}")


def _to_int(name: str, value: Any, source: str, expected: str) -> int:
    if value is None:
        raise _bad(name, value, source, expected)
    if isinstance(value, str) and source != _ARGUMENT:
        try:
            return int(value.strip(), 10)
        except ValueError:
            raise _bad(name, value, source, expected) from None
    if isinstance(value, (bool, str)):
        raise _bad(name, value, source, expected)
    try:
        return operator.index(value)
    except TypeError:
        raise _bad(name, value, source, expected) from None


def parse_slurm_nodelist(nodelist: str) -> str:
    """First host of a SLURM hostlist expression.

    Example:
        >>> parse_slurm_nodelist("node[01-03,07],gpu5")
        'node01'
    """
    text = nodelist.strip()
    if not text:
        raise _bad("SLURM_NODELIST", nodelist, _SLURM, "a non-empty hostlist")
    depth = 0
    first = text
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            first = text[:i]
            break
        if depth < 0 or depth > 1:
            raise _bad("SLURM_NODELIST", nodelist, _SLURM, "a hostlist like 'node[01-03],gpu5'")

    def _first_of(match: re.Match) -> str:
        item = match.group(1).split(",")[0].strip()
        return item.split("-")[0].strip()

    host = re.sub(r"\[([^\[\]]*)\]", _first_of, first).strip()
    if not host or "[" in host or "]" in host:
        raise _bad("SLURM_NODELIST", nodelist, _SLURM, "a hostlist like 'node[01-03],gpu5'")
    return host


@dataclass(frozen=True)
class _Resolved:
    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]
    source: str
    agent_store: bool


def _env(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value if value is not None and value.strip() != "" else None


def _resolve(
    backend: str,
    rank: Optional[int],
    world_size: Optional[int],
    have_init_method: bool,
) -> _Resolved:
    """Resolve rank/world_size/local_rank/master and validate them; opens nothing."""
    if _env("RANK") is not None or _env("WORLD_SIZE") is not None:
        source = _TORCHRUN
        env_rank, env_world, env_local = "RANK", "WORLD_SIZE", "LOCAL_RANK"
    elif _env("SLURM_PROCID") is not None:
        source = _SLURM
        env_rank, env_world, env_local = "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"
    else:
        source = "single process"
        env_rank = env_world = env_local = None

    if world_size is not None:
        ws_name, ws_raw, ws_src = "world_size", world_size, _ARGUMENT
    elif env_world is not None:
        ws_name, ws_raw, ws_src = env_world, _env(env_world), source
    elif rank is not None:
        raise ValueError(
            f"rank={rank!r} ({_ARGUMENT}) was given but no world size is known: pass "
            "world_size=..., or run under torchrun (WORLD_SIZE) or SLURM (SLURM_NTASKS)"
        )
    else:
        ws_name, ws_raw, ws_src = "world_size", 1, _DEFAULT
    ws = _to_int(ws_name, ws_raw, ws_src, "an integer world size >= 1")
    if ws < 1:
        raise _bad(ws_name, ws_raw, ws_src, "an integer world size >= 1")
    ws_desc = f"{ws_name}={ws}"

    if rank is not None:
        r_name, r_raw, r_src = "rank", rank, _ARGUMENT
    elif env_rank is not None:
        r_name, r_raw, r_src = env_rank, _env(env_rank), source
    elif ws == 1:
        r_name, r_raw, r_src = "rank", 0, _DEFAULT
    else:
        raise ValueError(
            f"world_size={ws} but no rank is known: pass rank=..., or run under torchrun "
            "(RANK) or SLURM (SLURM_PROCID)"
        )
    r_expected = f"an integer rank in [0, {ws}) ({ws_desc})"
    r = _to_int(r_name, r_raw, r_src, r_expected)
    if not 0 <= r < ws:
        raise _bad(r_name, r_raw, r_src, r_expected)

    local_world = None
    if source == _TORCHRUN and _env("LOCAL_WORLD_SIZE") is not None:
        raw = _env("LOCAL_WORLD_SIZE")
        exp = f"an integer in [1, {ws}] ({ws_desc})"
        local_world = _to_int("LOCAL_WORLD_SIZE", raw, source, exp)
        if not 1 <= local_world <= ws:
            raise _bad("LOCAL_WORLD_SIZE", raw, source, exp)
    lr_raw = _env(env_local) if env_local is not None else None
    if lr_raw is not None:
        lr_max = local_world if local_world is not None else ws
        exp = f"an integer local rank in [0, {lr_max})"
        lr = _to_int(env_local, lr_raw, source, exp)
        if not 0 <= lr < lr_max:
            raise _bad(env_local, lr_raw, source, exp)
    else:
        # No launcher told us: assume ranks are packed onto nodes in order.
        if local_world is not None:
            per_node = local_world
        elif backend == "nccl":
            per_node = max(torch.cuda.device_count(), 1)
        else:
            per_node = ws
        lr = r % per_node
        if env_local is not None:
            logger.info("%s is not set; using local rank %d (rank %% %d)", env_local, lr, per_node)
    if backend == "nccl" and lr >= torch.cuda.device_count():
        name = env_local if lr_raw is not None else "local rank"
        raise ValueError(
            f"{name}={lr} ({source if lr_raw is not None else 'derived'}) has no GPU: this node "
            f"sees {torch.cuda.device_count()} CUDA device(s); expected a local rank below that"
        )

    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    port_raw = _env("MASTER_PORT")
    port: Optional[int] = None
    if port_raw is not None:
        port_src = _TORCHRUN if source == _TORCHRUN else "environment"
        port = _to_int("MASTER_PORT", port_raw, port_src, "an integer port in [1, 65535]")
        if not 1 <= port <= 65535:
            raise _bad("MASTER_PORT", port_raw, port_src, "an integer port in [1, 65535]")
    addr = _env("MASTER_ADDR")
    if not have_init_method and (ws > 1 or agent_store):
        if addr is None:
            if source == _SLURM:
                nodelist = _env("SLURM_NODELIST") or _env("SLURM_JOB_NODELIST")
                if nodelist is None:
                    raise _bad(
                        "MASTER_ADDR", None, _SLURM, "MASTER_ADDR or SLURM_NODELIST to be set"
                    )
                addr = parse_slurm_nodelist(nodelist)
            elif source == _TORCHRUN:
                raise _bad("MASTER_ADDR", None, _TORCHRUN, "the address of rank 0's host")
            else:
                addr = "127.0.0.1"
        if port is None:
            if source == _TORCHRUN:
                raise _bad("MASTER_PORT", None, _TORCHRUN, "an integer port in [1, 65535]")
            job = _env("SLURM_JOB_ID") if source == _SLURM else None
            # Two SLURM jobs sharing a node must not pick the same port.
            port = 10000 + int(job) % 20000 if job is not None and job.isdigit() else None
            port = port if port is not None else DEFAULT_MASTER_PORT
    return _Resolved(r, ws, lr, addr, port, source, agent_store)


def to_timedelta(timeout: Timeout, name: str = "timeout") -> Optional[datetime.timedelta]:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if not math.isfinite(timeout) or timeout > 10**9:
            raise ValueError(
                f"{name}={timeout!r} ({_ARGUMENT}) is invalid; expected a finite number of "
                "seconds (at most 1e9), or None for torch's default"
            )
        td = datetime.timedelta(seconds=float(timeout))
    else:
        raise ValueError(
            f"{name}={timeout!r} ({_ARGUMENT}) is invalid; expected seconds or a timedelta"
        )
    if td.total_seconds() <= 0:
        raise ValueError(f"{name}={timeout!r} ({_ARGUMENT}) is invalid; expected > 0 seconds")
    return td


def _existing_info(backend: Optional[str], rank: Optional[int], world_size: Optional[int]):
    current_backend = str(dist.get_backend())
    current_rank, current_world = dist.get_rank(), dist.get_world_size()
    differences = []
    is_auto = isinstance(backend, str) and backend.strip().lower() == "auto"
    if backend is not None and not is_auto:
        wanted, _ = resolve_backend(backend)
        # A mixed backend string looks like "cpu:gloo,cuda:nccl".
        names = {part.split(":")[-1] for part in current_backend.split(",")}
        if wanted not in names:
            differences.append(f"backend {wanted!r} requested, group uses {current_backend!r}")
    if rank is not None and rank != current_rank:
        differences.append(f"rank={rank!r} requested, group has rank {current_rank}")
    if world_size is not None and world_size != current_world:
        differences.append(f"world_size={world_size!r} requested, group has {current_world}")
    if differences:
        raise RuntimeError(
            "the default process group is already initialized and differs: "
            + "; ".join(differences)
            + ". Call pycomm.shutdown() first to re-initialize."
        )
    local = _env("LOCAL_RANK") or _env("SLURM_LOCALID")
    local_rank = int(local) if local is not None and local.strip().isdigit() else None
    if "nccl" in current_backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        local_rank = device.index if local_rank is None else local_rank
    else:
        device = torch.device("cpu")
    if local_rank is None:
        local_rank = 0
    return DistInfo(current_rank, current_world, local_rank, current_backend, device)


def init(
    backend: Optional[str] = None,
    *,
    init_method: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    timeout: Timeout = None,
    nodes: Optional[int] = None,
) -> DistInfo:
    """Initialize the default process group from the launcher's environment.

    Rank, world size and local rank come from the arguments, else torchrun's variables
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), else SLURM's
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, master from ``SLURM_NODELIST``),
    else a single process (rank 0 of 1, no socket). Every value is validated before any
    socket is opened; a bad one raises ValueError naming the variable, value and source.

    Args:
        backend: None/"auto" (nccl with CUDA, else gloo), "gloo", "nccl", "mpi"; the aliases
            "tcp" (-> gloo, warns) and "ib" (-> nccl). Case-insensitive.
        init_method: a torch init URL; default: torchrun's agent store via ``env://``, else
            ``tcp://MASTER_ADDR:MASTER_PORT``.
        rank, world_size: override the environment, value by value.
        timeout: seconds or a timedelta for the rendezvous and collectives; None: torch's.
        nodes: the node count where no launcher variable names it (ranks packed onto equal
            nodes in rank order): what ``pycomm.topology()`` and the hooks' ``hierarchy``
            see. Also accepted on an initialized group; ``pycomm.shutdown()`` forgets it.

    Returns:
        DistInfo of this process. If the group is already initialized and compatible, its info.

    Raises:
        ValueError: a bad or missing launcher value, before any socket is opened.
        RuntimeError: (torch's DistError types) the group could not form (port in use, ranks that
            disagree on the world size, a rank that never started), within ``timeout`` + 1 s
            on every rank, naming this rank, the rendezvous address and its port.

    Example:
        >>> info = pycomm.init()          # under torchrun, SLURM, or alone
        >>> model = model.to(info.device)
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    settle_at_exit()
    if dist.is_initialized():
        info = _existing_info(backend, rank, world_size)
        if nodes is not None:
            _set_nodes(nodes, info.world_size)
        return info
    if nodes is not None:  # its type; that it divides the world once the world is known
        check_int("pycomm.init", "nodes", nodes, source="argument")

    name, _ = resolve_backend(backend)
    td = to_timedelta(timeout)
    if init_method is not None and not isinstance(init_method, str):
        raise ValueError(
            f"init_method={init_method!r} ({_ARGUMENT}) is invalid; expected a torch init URL "
            "string (tcp://host:port, file:///path, env://) or None"
        )
    if init_method is not None and init_method.startswith("file://"):
        _check_file_url(init_method)
    kwargs: dict[str, Any] = {}
    if td is not None:
        kwargs["timeout"] = td

    if name == "mpi":
        # MPI's own launcher assigns ranks; torch reads them from the MPI runtime.
        dist.init_process_group("mpi", **kwargs)
        r, ws = dist.get_rank(), dist.get_world_size()
        local = _env("OMPI_COMM_WORLD_LOCAL_RANK") or _env("MPI_LOCALRANKID") or _env("LOCAL_RANK")
        lr = int(local) if local is not None and local.isdigit() else 0
        logger.info("initialized mpi process group: rank %d of %d", r, ws)
        if nodes is not None:
            _set_nodes(nodes, ws)
        return DistInfo(r, ws, lr, "mpi", torch.device("cpu"))

    info = _resolve(name, rank, world_size, have_init_method=init_method is not None)
    if nodes is not None:  # checked before any socket opens
        _set_nodes(nodes, info.world_size)

    if init_method is not None:
        kwargs.update(init_method=init_method, rank=info.rank, world_size=info.world_size)
        how = init_method
    elif info.agent_store:
        # torchrun's agent already hosts the store on MASTER_PORT; env:// connects as a client.
        os.environ["MASTER_ADDR"] = str(info.master_addr)
        os.environ["MASTER_PORT"] = str(info.master_port)
        kwargs.update(init_method="env://", rank=info.rank, world_size=info.world_size)
        how = f"env:// (agent store {info.master_addr}:{info.master_port})"
    elif info.world_size > 1:
        url = f"tcp://{_url_host(info.master_addr)}:{info.master_port}"
        kwargs.update(init_method=url, rank=info.rank, world_size=info.world_size)
        how = url
    else:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        how = "in-process store"

    device = torch.device("cpu")
    if name == "nccl":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        if _supports_device_id():
            kwargs["device_id"] = device
    logger.info(
        "initializing %s process group: rank %d of %d (local rank %d) from %s via %s",
        name,
        info.rank,
        info.world_size,
        info.local_rank,
        info.source,
        how,
    )
    restart = _env("TORCHELASTIC_RESTART_COUNT")
    if info.agent_store and restart is not None and restart != "0":
        logger.warning("pycomm.init: %s", _SHARED_STORE_HINT.format(restart=restart))
    if info.world_size == 1 and init_method is None:
        dist.init_process_group(name, **kwargs)
    else:
        _join_group(name, kwargs, info, how, td, device)
    return DistInfo(info.rank, info.world_size, info.local_rank, name, device)


# torchrun (torch 2.13) keeps one rendezvous store for all restarts when it shares it with the
# workers, so a restarted rank can read a peer's address from the failed attempt before the
# peer rewrites it: gloo then connects to a dead port (measured here: "Connection refused").
# torch keys nothing by attempt because TORCHELASTIC_RESTART_COUNT differs between nodes.
_SHARED_STORE_HINT = (
    "torchrun restarted these workers (TORCHELASTIC_RESTART_COUNT={restart}) and shares one "
    "rendezvous store across restarts, where a restarted rank can read a peer's address from "
    "the failed attempt (pytorch/pytorch#135712); run torchrun with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment for a fresh store per restart"
)

# Past the timeout: torch's own waits end by then (its "waiting for clients" rounds the timeout
# up to whole seconds), so a rendezvous still running is one that can no longer succeed.
_JOIN_GRACE_S = 1.0


def _join_group(
    name: str,
    kwargs: dict[str, Any],
    info: _Resolved,
    how: str,
    td: Optional[datetime.timedelta],
    device: torch.device,
) -> None:
    """``init_process_group`` with a deadline of the timeout (+ grace), and errors that say
    which rank, which rendezvous address and which port.

    torch bounds most of the rendezvous by the timeout, but not all of it: a rank that is not
    rank 0 connects to ``MASTER_ADDR:MASTER_PORT``, and when some other program holds that
    port (it accepts the connection and never answers), torch's store client waits forever,
    timeout or not (measured with torch 2.13). So the call runs in a helper thread, and the
    caller gives up at the deadline. The abandoned thread stays blocked in C++ (it holds no
    GIL and does not keep the process alive).
    """
    limit = td if td is not None else dist.default_pg_timeout
    seconds = limit.total_seconds()
    port = info.master_port
    where = f"rank {info.rank} of {info.world_size} ({info.source})"
    box: dict[str, Any] = {}

    def join() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            dist.init_process_group(name, **kwargs)
            box["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=join, name="pycomm-init", daemon=True)
    thread.start()
    thread.join(seconds + _JOIN_GRACE_S)
    agree = (
        f"every rank must have the same world size (this rank: {info.world_size}) and "
        f"rendezvous address, and all {info.world_size} ranks must start within the timeout "
        f"({seconds:g} s)"
    )
    if thread.is_alive():
        hint = agree
        if info.rank != 0 and port is not None:
            hint = (
                f"nothing may answer as a torch.distributed store there (another program may "
                f"hold port {port}, or rank 0 never started), or {agree}"
            )
        raise dist.DistStoreError(
            f"pycomm.init: {where} could not join the {name} process group via {how} within "
            f"{seconds:g} s (timeout) + {_JOIN_GRACE_S:g} s: {hint}. The rendezvous is "
            "abandoned."
        )
    exc = box.get("error")
    if exc is None:
        return
    text = str(exc)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        hint = (
            f"port {port} is already in use on this host: another job or program holds it; "
            "pick a free MASTER_PORT"
        )
    else:
        hint = agree
    restart = _env("TORCHELASTIC_RESTART_COUNT")
    if info.agent_store and restart is not None and restart != "0":
        hint += f". {_SHARED_STORE_HINT.format(restart=restart)}"
    message = f"pycomm.init: {where} could not join the {name} process group via {how}: {hint}"
    if not isinstance(exc, Exception):
        raise exc
    try:
        error = type(exc)(f"{message}. torch said: {text}")
    except Exception:  # noqa: BLE001 - an exception type without a (message) constructor
        error = RuntimeError(f"{message}. torch said: {text}")
    raise error from exc


def _url_host(addr: Optional[str]) -> str:
    addr = str(addr)
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def _supports_device_id() -> bool:
    try:
        return "device_id" in inspect.signature(dist.init_process_group).parameters
    except (TypeError, ValueError):
        return False


# torch's gloo worker threads free a finished collective after they have woken its waiter.
# When the waiter has already dropped the collective's tensors (dist.all_gather_object does),
# that free takes the GIL. A process that exits right after such a collective can reach
# interpreter finalization first; Python then ends the worker thread inside torch's noexcept
# code, and the process aborts after its work is done ("terminate called without an active
# exception", SIGABRT), so its launcher reports the rank failed. benchmarks/bench_exit.py
# (torch 2.13, 2 gloo ranks that exit right after all_gather_object, 2 spinning processes
# beside them): 6 of 40 launches aborted with torch alone, 0 of 40 with this pause.
SETTLE_S = 0.05
_settle = {"armed": False}


def settle_at_exit() -> None:
    """Have this process release the GIL for ``SETTLE_S`` seconds just before the interpreter
    finalizes, so that torch's communication threads can finish freeing collectives first.

    pycomm arms it wherever it uses a process group (``init``, ``wrap``/``register``,
    ``pycomm.checkpoint``, ``pycomm.fsdp``, :func:`all_gather_objects`); a process with a
    process group still initialized at exit gets the pause as well. Calling it again does
    nothing.

    Example:
        >>> pycomm.dist.settle_at_exit()
    """
    _settle["armed"] = True


def _settle_now() -> None:
    if _settle["armed"] or (dist.is_available() and dist.is_initialized()):
        time.sleep(SETTLE_S)


_CALL_MARK = "pycomm collective call"


def all_gather_objects(
    obj: Any, group: Optional[dist.ProcessGroup] = None, call: Optional[str] = None
) -> list[Any]:
    """Every rank's ``obj`` in ``group``'s rank order (``torch.distributed.all_gather_object``
    into a new list), with ``settle_at_exit`` armed: the gather frees its tensors in the way
    that needs the pause when the process exits right after it.

    ``call``: the pycomm call this gather belongs to (``"pycomm.wrap"``), sent beside ``obj``.
    A rank whose gather met another call's (a rank in ``checkpoint.load`` while another is in
    ``TrainLoop``: the ranks' calls are out of step) raises a RuntimeError naming each rank's
    call, on every rank, rather than reading the other call's object as its own.

    Example:
        >>> pycomm.dist.all_gather_objects({"rank": 0})
        [{'rank': 0}]
    """
    settle_at_exit()
    payload = obj if call is None else (_CALL_MARK, call, obj)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    if call is None:
        return gathered
    calls = [_call_of(g) for g in gathered]
    if any(c != call for c in calls):
        where: dict[str, list[int]] = {}
        for rank, c in enumerate(calls):
            where.setdefault(c, []).append(rank)
        listed = "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {_ranks(r)} in {c}" for c, r in where.items()
        )
        raise RuntimeError(
            f"pycomm: the ranks are in different collective calls ({listed}); expected every "
            "rank of the group to make the same pycomm calls in the same order"
        )
    return [g[2] for g in gathered]


def _call_of(payload: Any) -> str:
    """The pycomm call a gathered object came from (another collective's: named so)."""
    if isinstance(payload, tuple) and len(payload) == 3 and payload[0] == _CALL_MARK:
        return str(payload[1])
    return "another all_gather_object (not a pycomm call that names itself)"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


# Registered at import, before the handlers of most libraries imported later: atexit runs
# handlers last-registered first, so this pause comes after theirs, just before finalization.
atexit.register(_settle_now)


def shutdown() -> None:
    """Destroy the default process group if there is one; safe to call more than once.

    Example:
        >>> pycomm.init()
        >>> pycomm.shutdown()
        >>> pycomm.shutdown()  # no-op
    """
    set_nodes(None)
    if dist.is_available() and dist.is_initialized():
        # DDP models in reference cycles would otherwise keep the group's worker threads alive
        # into interpreter finalization, where gloo can abort the process ("terminate called
        # without an active exception").
        gc.collect()
        dist.destroy_process_group()
        logger.debug("process group destroyed")


def _check_file_url(url: str) -> None:
    """A ``file://`` init URL whose folder exists: torch's FileStore waits for a missing one
    holding the GIL, past any timeout."""
    path = url[len("file://") :].split("?", 1)[0]
    folder = os.path.dirname(path) or "."
    if not path or os.path.isdir(path) or not os.path.isdir(folder):
        raise ValueError(
            f"init_method={url!r} ({_ARGUMENT}) is invalid; expected file:///path with a file "
            f"path in an existing folder ({path or '(empty)'!r}: "
            + ("a folder" if path and os.path.isdir(path) else f"no folder {folder!r}")
            + ")"
        )


def _set_nodes(nodes: Any, world_size: int) -> None:
    set_nodes(nodes)  # checks the type
    if world_size % nodes:
        set_nodes(None)
        raise ValueError(
            f"pycomm.init: nodes={nodes} (argument) cannot split world_size={world_size} into "
            f"equal nodes; expected a divisor of {world_size}"
        )
