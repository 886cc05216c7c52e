"""Checkpoints of a DDP model, its optimizer and its pycomm hook state, written atomically.

Layout: ``path`` is one file that rank 0 writes (model, optimizer, ``extra``, and what the
checkpoint was saved from: world size, parameter shapes and dtypes, hook fingerprint). The hook
state is per rank (error-feedback residuals differ between ranks), so each rank writes its own
next to it, ``{path}.hook{rank}.{id}``, where ``id`` is new for every save. A save commits in
this order: every rank writes its hook file (to a temporary name, then ``os.replace``), the
ranks gather each other's outcome, then rank 0 replaces ``path`` the same way, the ranks
gather again, then each rank deletes its hook files of older saves (a failure on any rank is
raised on every rank, which remove this save's hook files). ``path`` names the hook files of
its own save only, so a rank killed at any point of a save leaves either the previous
checkpoint or the new one, never a mix.

Why torch.save and one file per rank rather than gathering or torch.distributed.checkpoint:
under DDP the model and optimizer are the same on every rank, so rank 0 writing them is
torch's own DDP recipe and costs nothing extra. Gathering every rank's residuals to rank 0
would hold N of them in its memory (each as large as the model in fp32). The
torch.distributed.checkpoint planner treats a key saved by every rank as replicated and keeps
one copy, so per-rank residuals would need per-rank keys there anyway, and it writes into its
directory in place, without the atomic switch from the previous checkpoint. Every rank must see
``path``'s directory (a shared file system across nodes).

Loading checks before changing anything: the parameters' names, shapes and dtypes, the world
size (when there is hook state), and the hook and its options; a mismatch is a ValueError
naming it, and the model, optimizer and hook are left as they were.

Example:
    >>> ddp = pycomm.wrap(model, hook="int8")
    >>> opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    >>> pycomm.checkpoint.save("ckpt.pt", ddp, opt, step=100)
    >>> extra = pycomm.checkpoint.load("ckpt.pt", ddp, opt)   # after a restart
    >>> extra["step"]
    100
"""

from __future__ import annotations

import builtins
import glob
import io
import logging
import os
import uuid
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.dist import all_gather_objects
from pycomm.hooks import HookState
from pycomm.hooks import accumulate as stage
from pycomm.wrap import STATE_ATTR, params_signature

__all__ = [
    "gather_hook_state",
    "load",
    "load_hook_state",
    "load_rank_state",
    "rank_state_file",
    "save",
    "save_rank_state",
]

logger = logging.getLogger(__name__)

FORMAT = "pycomm.checkpoint/1"
GATHERED = "pycomm.hook_state/1"
RANK_STATE = "pycomm.rank_state/1"

PathLike = Union[str, "os.PathLike[str]"]


def _hook(ddp: DDP) -> Optional[HookState]:
    return getattr(ddp, STATE_ATTR, None)


def _group(ddp: DDP) -> tuple[Any, int, int]:
    group = ddp.process_group
    return group, dist.get_rank(group), dist.get_world_size(group)


def _hook_file(path: str, rank: int, save_id: str) -> str:
    return f"{path}.hook{rank}.{save_id}"


def _atomic_save(obj: Any, path: str) -> None:
    """torch.save to a temporary file in the same directory, fsync, then os.replace."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _check_arguments(what: str, path: Any, ddp: Any, optimizer: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"pycomm.checkpoint.{what}: path is a {type(path).__name__}, expected a str or "
            "os.PathLike"
        )
    if os.fspath(path) in ("", b""):
        raise ValueError(f"pycomm.checkpoint.{what}: path='' is empty, expected a file path")
    if not isinstance(ddp, DDP):
        raise TypeError(f"pycomm.checkpoint.{what}: ddp is a {type(ddp).__name__}, expected a DDP")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"pycomm.checkpoint.{what}: optimizer is a {type(optimizer).__name__}, expected a "
            "torch.optim.Optimizer or None"
        )


def _remove(name: str) -> None:
    try:
        os.remove(name)
    except OSError:
        pass


def _kind(name: str) -> type:
    """The built-in exception class a rank's failure is raised as on every rank (a class of
    a library, which the other ranks may not have imported: RuntimeError)."""
    kind = getattr(builtins, name, None)
    return kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError


def _everyone(what: str, step: Any, group: Any, differ: str = "") -> None:
    """Run ``step()`` on this rank, gather every rank's outcome, and raise the same error on
    every rank if any rank failed (naming the ranks where not all failed alike). ``differ``:
    ``step()`` returns ``(key, description)``, and ranks whose keys differ are a ValueError
    on every rank, ``differ`` saying what that means, naming each rank's description."""
    try:
        got = step()
        mine: tuple = (None, got if differ else None)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        prefix = f"pycomm.checkpoint.{what}: "
        text = str(e)[len(prefix) :] if str(e).startswith(prefix) else str(e)
        mine = ((type(e).__name__, text), None)
    single = not dist.is_initialized() or dist.get_world_size(group) == 1
    reports = [mine] if single else all_gather_objects(mine, group, f"pycomm.checkpoint.{what}")
    failed = [(r, err) for r, (err, _) in enumerate(reports) if err is not None]
    if failed:
        kind = failed[0][1][0]
        if len(failed) == len(reports) and all(err == failed[0][1] for _, err in failed):
            message = failed[0][1][1]
        else:
            message = "; ".join(f"on rank {r}: {text}" for r, (_, text) in failed)
        raise _kind(kind)(f"pycomm.checkpoint.{what}: {message}")
    if differ and len({key for _, (key, _) in reports}) > 1:
        each = "; ".join(f"rank {r}: {text}" for r, (_, (_, text)) in enumerate(reports))
        raise ValueError(f"pycomm.checkpoint.{what}: {differ} ({each})")


def _check_extra(extra: dict[str, Any]) -> None:
    """``extra`` is what ``torch.load(weights_only=True)`` reads back (a ValueError naming the
    first key that is not), so that the checkpoint written can be loaded."""
    for key, value in extra.items():
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
        except Exception as e:  # noqa: BLE001 - what torch.load would refuse at load
            raise ValueError(
                f"extra value {key}={type(value).__name__} cannot be loaded back with "
                "weights_only=True; expected tensors, numbers, strings, and lists, tuples and "
                f"dicts of them ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            ) from None


def save(
    path: PathLike, ddp: DDP, optimizer: Optional[torch.optim.Optimizer], **extra: Any
) -> None:
    """Save the model, the optimizer, the pycomm hook state and ``extra`` to ``path``.

    Every rank of ``ddp``'s process group must call it (the ranks gather each other's outcome
    twice: a rank that fails to write is named on every rank, which all raise). Rank 0 writes
    ``path``; every rank writes its own hook state next to it. The write is atomic: a rank
    killed or failing during the save leaves the previous checkpoint whole. ``extra`` holds
    what ``torch.load(weights_only=True)`` reads back: tensors, numbers, strings, and lists,
    tuples and dicts of them (the step, the epoch, an RNG state tensor); any other value is a
    ValueError naming its key, before anything is written.

    Example:
        >>> pycomm.checkpoint.save("ckpt.pt", ddp, optimizer, step=step)
    """
    _check_arguments("save", path, ddp, optimizer)
    path = os.fspath(path)
    group, rank, world = _group(ddp)
    state = _hook(ddp)
    ids = all_gather_objects(uuid.uuid4().hex[:12], group, "pycomm.checkpoint.save")
    save_id = ids[0]  # rank 0's, for the save

    def write_hook() -> None:
        _check_extra(extra)
        _check_target(path)
        if state is not None:
            _atomic_save(stage.save_state(state), _hook_file(path, rank, save_id))

    # every hook file is in place (or every rank raises) before rank 0 commits: each rank's
    # outcome is gathered, so a rank that fails is named on every rank, never waited for
    try:
        _everyone("save", write_hook, group)
    except BaseException:
        if state is not None:
            _remove(_hook_file(path, rank, save_id))
        raise

    def commit() -> None:
        if rank == 0:
            _atomic_save(
                {
                    "format": FORMAT,
                    "world_size": world,
                    "parameters": params_signature(ddp.module),
                    "hook": None if state is None else state.fingerprint(),
                    "id": save_id,
                    "model": ddp.module.state_dict(),
                    "optimizer": None if optimizer is None else optimizer.state_dict(),
                    "extra": extra,
                },
                path,
            )

    try:
        _everyone("save", commit, group)  # committed: older hook files are garbage now
    except BaseException:
        if state is not None:  # this save's hook files name a checkpoint that never was
            _remove(_hook_file(path, rank, save_id))
        raise
    stale = [f for f in glob.glob(glob.escape(path) + ".hook*.*") if not f.endswith(save_id)]
    for name in stale:
        owner = name[len(path) + len(".hook") :].split(".", 1)[0]
        # Each rank deletes its own; rank 0 also those of ranks a larger world left behind.
        if owner == str(rank) or (rank == 0 and owner.isdigit() and int(owner) >= world):
            try:
                os.remove(name)
            except OSError:
                pass
    if rank == 0:  # temporary files of saves killed before their os.replace
        for name in glob.glob(glob.escape(path) + ".tmp-*"):
            try:
                os.remove(name)
            except OSError:
                pass
    logger.info("pycomm.checkpoint: saved %s (rank %d of %d, id %s)", path, rank, world, save_id)


def _check_target(path: str) -> None:
    """``path`` names a regular file or none yet: a folder, a device or a pipe there would be
    replaced by the checkpoint (``os.replace``)."""
    if path.endswith(os.sep) or (os.path.lexists(path) and not os.path.isfile(path)):
        what = "a folder" if os.path.isdir(path) or path.endswith(os.sep) else "not a regular file"
        raise ValueError(
            f"path={path!r} is {what}; expected the path of a checkpoint file (written anew, "
            "or replacing the file there)"
        )


_SAVED_KEYS = ("world_size", "parameters", "hook", "id", "model", "optimizer", "extra")


def _check_parameters(path: str, saved: list, mine: list) -> None:
    if saved == mine:
        return
    if len(saved) != len(mine):
        raise ValueError(
            f"pycomm.checkpoint.load: {path} is of another model: it has {len(saved)} "
            f"trainable parameters, this model has {len(mine)}"
        )
    i = next(i for i, (a, b) in enumerate(zip(saved, mine)) if a != b)
    (sn, ss, sd), (mn, ms, md) = saved[i], mine[i]
    raise ValueError(
        f"pycomm.checkpoint.load: {path} is of another model: parameter {i} is {sn} "
        f"{list(ss)} {sd} in the checkpoint, {mn} {list(ms)} {md} in this model"
    )


def _check_optimizer(path: str, saved: Optional[dict], optimizer: torch.optim.Optimizer) -> None:
    if saved is None:
        raise ValueError(
            f"pycomm.checkpoint.load: {path} was saved without an optimizer; pass optimizer=None"
        )
    sizes = [len(g["params"]) for g in saved["param_groups"]]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != mine:
        raise ValueError(
            f"pycomm.checkpoint.load: {path} is of another optimizer: its parameter groups "
            f"hold {sizes} parameters, this optimizer's hold {mine}"
        )
    for i, (theirs, ours) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        # another optimizer class: its hyperparameters (SGD's momentum in an Adam) would be
        # loaded, and torch fail half-way with the model already changed
        foreign = sorted(set(theirs) - set(ours))
        if foreign:
            raise ValueError(
                f"pycomm.checkpoint.load: {path} is of another optimizer: its parameter group "
                f"{i} has options {foreign} that this {type(optimizer).__name__}'s has not "
                f"({sorted(k for k in ours if k != 'params')})"
            )


def _read(
    path: str, ddp: DDP, optimizer: Optional[torch.optim.Optimizer], rank: int, world: int
) -> dict[str, Any]:
    """This rank's part of :func:`load`, read and checked: ``{"ckpt", "hook"}``."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"pycomm.checkpoint.load: {path} does not exist") from None
    except Exception as e:  # noqa: BLE001 - a file torch cannot read as a checkpoint
        raise ValueError(
            f"pycomm.checkpoint.load: {path} cannot be read as a pycomm checkpoint "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(
            f"pycomm.checkpoint.load: {path} is not a pycomm checkpoint (format "
            f"{ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt).__name__!r}, "
            f"expected {FORMAT!r})"
        )
    missing = [key for key in _SAVED_KEYS if key not in ckpt]
    if missing:
        raise ValueError(
            f"pycomm.checkpoint.load: {path} lacks {missing} (damaged, or not written by "
            "pycomm.checkpoint.save); expected a whole checkpoint"
        )
    _check_parameters(path, ckpt["parameters"], params_signature(ddp.module))
    state, saved_hook = _hook(ddp), ckpt["hook"]
    if saved_hook is None and state is not None:
        raise ValueError(
            f"pycomm.checkpoint.load: {path} has no pycomm hook state, but this model has the "
            f"{state.hook_name} hook: its state (residuals, warm-up) would start from zero"
        )
    if saved_hook is not None and state is None:
        raise ValueError(
            f"pycomm.checkpoint.load: {path} holds the state of the {saved_hook.get('hook')!r} "
            "hook, but this model has no pycomm hook: register the same hook (pycomm.wrap) "
            "before loading"
        )
    hook_sd = None
    if state is not None:
        if ckpt["world_size"] != world:
            raise ValueError(
                f"pycomm.checkpoint.load: {path} was saved by world_size={ckpt['world_size']} "
                f"ranks, this process group has world_size={world}: the hook state is per rank "
                "and does not carry over to another world size"
            )
        state.check_fingerprint({"fingerprint": stage.upgrade_fingerprint(saved_hook)})
        hook_path = _hook_file(path, rank, ckpt["id"])
        device = next((p.device for p in ddp.module.parameters()), torch.device("cpu"))
        try:
            hook_sd = torch.load(hook_path, map_location=device, weights_only=True)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"pycomm.checkpoint.load: {path} names the hook state of rank {rank} in "
                f"{hook_path}, which is missing (deleted, or not on a file system this rank "
                "sees)"
            ) from None
        except Exception as e:  # noqa: BLE001 - a damaged hook file
            raise ValueError(
                f"pycomm.checkpoint.load: {hook_path} (the hook state of rank {rank}) cannot "
                f"be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            ) from None
        hook_sd = stage.upgrade(hook_sd)  # a state saved while the stage wrapped the hook's
        stage.check_state(state, hook_sd)
    if optimizer is not None:
        _check_optimizer(path, ckpt["optimizer"], optimizer)
    return {"ckpt": ckpt, "hook": hook_sd}


def load(path: PathLike, ddp: DDP, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """Restore what :func:`save` wrote into ``ddp``, ``optimizer`` and the hook; return the
    ``extra`` values.

    Register the same hook with the same options first (``pycomm.wrap``). Everything is
    checked before anything changes: another model (parameter names, shapes, dtypes), another
    world size when the checkpoint has hook state, another hook or options, hook state missing
    on one side: a ValueError naming the mismatch. A collective: every rank of ``ddp``'s
    group calls it, and a problem that any rank meets (its hook file missing or damaged) is
    raised on every rank, naming that rank, and no rank's state changes.

    Example:
        >>> ddp = pycomm.wrap(model, hook="int8")
        >>> extra = pycomm.checkpoint.load("ckpt.pt", ddp, optimizer)
        >>> start = extra["step"]
    """
    _check_arguments("load", path, ddp, optimizer)
    path = os.fspath(path)
    group, rank, world = _group(ddp)
    read: dict[str, Any] = {}

    # every rank reads and checks its part; a problem on any rank is raised on every rank,
    # before anything changes (a rank that loaded would otherwise train on alone, and hang)
    def read_mine() -> tuple[str, str]:
        read.update(_read(path, ddp, optimizer, rank, world))
        save_id = read["ckpt"]["id"]
        return save_id, f"{path}, save {save_id}"

    _everyone(
        "load",
        read_mine,
        group,
        differ="the ranks read different checkpoints; expected every rank to load the same save",
    )
    ckpt, hook_sd, state = read["ckpt"], read["hook"], _hook(ddp)
    ddp.module.load_state_dict(ckpt["model"])
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if state is not None:
        stage.load_state(state, hook_sd)
    logger.info("pycomm.checkpoint: loaded %s (rank %d of %d)", path, rank, world)
    return dict(ckpt["extra"])


# what a state saved one file per rank has (HookState has them; so do pycomm.LocalSGD and
# pycomm.DiLoCo): its rank, world size and group, a state_dict and its check
_RANK_STATE = ("rank", "world_size", "process_group", "state_dict", "load_state_dict",
               "check_fingerprint")  # fmt: skip


def _state_of(where: str, obj: Any) -> HookState:
    state = _hook(obj) if isinstance(obj, DDP) else obj
    if not isinstance(state, HookState) and not all(hasattr(state, a) for a in _RANK_STATE):
        raise TypeError(
            f"pycomm.checkpoint.{where}: got a {type(obj).__name__}, expected a DDP model with a "
            "pycomm hook, a pycomm hook state, or a pycomm.LocalSGD or pycomm.DiLoCo"
        )
    return state


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def gather_hook_state(obj: Any) -> dict[str, Any]:
    """Every rank's hook state, in rank order, on every rank: for checkpoints that one rank
    writes (Lightning's, Accelerate's ``register_for_checkpointing``). A collective: every rank
    of the hook's group calls it. Tensors come back on the CPU; the result holds N ranks'
    residuals, so prefer :func:`save` (one file per rank) for large models.

    Example:
        >>> blob = pycomm.checkpoint.gather_hook_state(ddp)   # on every rank
        >>> pycomm.checkpoint.load_hook_state(ddp, blob)        # each rank takes its own
    """
    state = _state_of("gather_hook_state", obj)
    mine = _to_cpu(stage.save_state(state))
    if state.world_size > 1:
        states = all_gather_objects(
            mine, state.process_group, "pycomm.checkpoint.gather_hook_state"
        )
    else:
        states = [mine]
    return {"format": GATHERED, "world_size": state.world_size, "states": states}


def load_hook_state(obj: Any, gathered: dict[str, Any]) -> None:
    """Load this rank's entry of :func:`gather_hook_state`'s result into the hook state.
    Another world size, another hook or options, or an entry of another rank is a ValueError
    naming it. Local: no collective.

    Example:
        >>> pycomm.checkpoint.load_hook_state(ddp, blob)
    """
    state = _state_of("load_hook_state", obj)
    if not isinstance(gathered, dict) or gathered.get("format") != GATHERED:
        raise ValueError(
            "pycomm.checkpoint.load_hook_state: expected what gather_hook_state returned "
            f"(format {GATHERED!r}), got a {type(gathered).__name__}"
        )
    rank, world = state.rank, state.world_size
    if gathered["world_size"] != world:
        raise ValueError(
            f"pycomm.checkpoint.load_hook_state: the hook state was saved by "
            f"world_size={gathered['world_size']} ranks, this process group has "
            f"world_size={world}: the state is per rank and does not carry over"
        )
    mine = stage.upgrade(gathered["states"][rank])
    device = _state_device(state)
    mine = mine if device is None else _to_device(mine, device)
    stage.check_state(state, mine)
    stage.load_state(state, mine)


def _state_device(state: HookState) -> Optional[torch.device]:
    device = getattr(state, "device", None)
    params = getattr(state, "params", None) or getattr(state, "_params", None)
    if params:
        device = params[0].device
    return device


# ------------------------------------------------------------- one file per rank in a folder


def rank_state_file(directory: PathLike, rank: int) -> str:
    """The file :func:`save_rank_state` writes for ``rank`` in ``directory``.

    Example:
        >>> pycomm.checkpoint.rank_state_file("out/checkpoint-10", 1)
        'out/checkpoint-10/pycomm_hook_state_1.pt'
    """
    return os.path.join(os.fspath(directory), f"pycomm_hook_state_{rank}.pt")


def save_rank_state(obj: Any, directory: PathLike) -> str:
    """Write this rank's hook state into ``directory`` (created if missing), as
    ``pycomm_hook_state_<rank>.pt``, atomically; return its path. ``obj`` is a DDP model with a
    pycomm hook, or the hook state. Local: no collective, each rank writes its own file, so a
    folder that every rank writes into (a framework's checkpoint folder) ends up holding every
    rank's state, and no rank holds another's residuals in memory.

    Example:
        >>> pycomm.checkpoint.save_rank_state(ddp, "out/checkpoint-10")   # on every rank
        'out/checkpoint-10/pycomm_hook_state_0.pt'
    """
    state = _state_of("save_rank_state", obj)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = rank_state_file(directory, state.rank)
    _atomic_save(
        {
            "format": RANK_STATE,
            "rank": state.rank,
            "world_size": state.world_size,
            "state": _to_cpu(stage.save_state(state)),
        },
        path,
    )
    return path


def _read_rank_state(state: HookState, directory: str) -> tuple[Optional[str], Any]:
    """(problem, state dict): this rank's file in ``directory`` read and checked, or why not.
    The problem is None with a None state dict when the file does not exist."""
    path = rank_state_file(directory, state.rank)
    if not os.path.exists(path):
        return None, None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        return f"{path} cannot be read: {type(e).__name__}: {e}", None
    if not isinstance(blob, dict) or blob.get("format") != RANK_STATE:
        return f"{path} is not a pycomm hook state file (expected format {RANK_STATE!r})", None
    if blob["world_size"] != state.world_size:
        return (
            f"{path} was saved by world_size={blob['world_size']} ranks, this process group "
            f"has world_size={state.world_size}: the hook state is per rank and does not carry "
            "over to another world size"
        ), None
    saved = stage.upgrade(blob["state"])
    try:
        stage.check_state(state, saved)
    except ValueError as e:
        return f"{path}: {e}", None
    return None, saved


def _steps(sd: Any) -> Optional[int]:
    """The steps a saved hook state had run (None: not a state that counts them)."""
    stats = sd.get("stats") if isinstance(sd, dict) else None
    steps = stats.get("steps") if isinstance(stats, dict) else None
    return steps if isinstance(steps, int) else None


def load_rank_state(obj: Any, directory: PathLike, *, missing: str = "error") -> bool:
    """Load this rank's hook state from ``directory``, where :func:`save_rank_state` wrote
    every rank's. A collective: every rank of the hook's group calls it. Each rank checks its
    own file (present, readable, saved by this rank for this world size, this hook and these
    options); if any rank finds a problem, every rank raises the same error naming it, and no
    rank's state changes. Returns whether the state was loaded.

    ``missing``: ``"error"`` (a FileNotFoundError when no rank finds its file) or ``"ignore"``
    (return False then: a checkpoint written without pycomm). Some ranks finding their file and
    others not is an error either way.

    Example:
        >>> pycomm.checkpoint.load_rank_state(ddp, "out/checkpoint-10")   # on every rank
        True
    """
    if missing not in ("error", "ignore"):
        raise ValueError(
            f"pycomm.checkpoint.load_rank_state: missing={missing!r}, expected 'error' or 'ignore'"
        )
    state = _state_of("load_rank_state", obj)
    directory = os.fspath(directory)
    problem, sd = _read_rank_state(state, directory)
    mine = (problem, sd is not None, _steps(sd))
    if state.world_size > 1:
        reports = all_gather_objects(mine, state.process_group, "pycomm.checkpoint.load_rank_state")
    else:
        reports = [mine]
    problems = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(reports) if p is not None]
    if problems:
        raise ValueError("pycomm.checkpoint.load_rank_state: " + "; ".join(problems))
    found = [r for r, (_, ok, _) in enumerate(reports) if ok]
    if not found:
        if missing == "ignore":
            return False
        raise FileNotFoundError(
            f"pycomm.checkpoint.load_rank_state: {directory} holds no pycomm hook state "
            f"(no {os.path.basename(rank_state_file(directory, 0))} and the like)"
        )
    if len(found) != len(reports):
        lost = [r for r in range(len(reports)) if r not in found]
        raise FileNotFoundError(
            f"pycomm.checkpoint.load_rank_state: {directory} holds the hook state of ranks "
            f"{found} but not of ranks {lost} (deleted, or not on a file system those ranks "
            "see): every rank needs its own"
        )
    steps = [s for _, _, s in reports]
    if len(set(steps)) > 1:
        each = "; ".join(f"rank {r}: step {s}" for r, s in enumerate(steps))
        raise ValueError(
            f"pycomm.checkpoint.load_rank_state: the ranks' files in {directory} were saved "
            f"after different steps ({each}): some are from another save; expected every "
            "rank's file from the same save"
        )
    device = _state_device(state)
    stage.load_state(state, sd if device is None else _to_device(sd, device))
    logger.info(
        "pycomm.checkpoint: loaded the hook state of rank %d of %d from %s",
        state.rank,
        state.world_size,
        directory,
    )
    return True
