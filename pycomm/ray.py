"""pycomm for Ray Train: prepare a model with Ray and register a pycomm hook on its DDP, and
carry every rank's hook state in Ray's checkpoints.

Inside ``train_loop_per_worker``, :func:`prepare_model` calls
``ray.train.torch.prepare_model`` (which moves the model to the worker's device and wraps it
in DistributedDataParallel) and then :func:`pycomm.register` on that DDP, the cross-rank checks
included. With one worker Ray returns the bare module: there is nothing to communicate, no hook
is registered (logged once) and the module is returned as Ray returned it.

Ray merges the folders every worker reports with ``ray.train.report(checkpoint=...)`` into one
checkpoint, so :func:`save_state` writes this rank's hook state into the folder under a name of
its own (``pycomm_hook_state_<rank>.pt``) and every worker reports that folder (rank 0 adds the
model and optimizer). :func:`load_state` hands each rank its own back on resume: error
feedback, warm-up and ``auto``'s decision carry over, and the resumed run is bitwise the
uninterrupted one.

Example:
    >>> def train_loop_per_worker(config):
    ...     model = pycomm.ray.prepare_model(Net(), hook="int8")
    ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     if (ckpt := ray.train.get_checkpoint()) is not None:
    ...         pycomm.ray.load_state(model, ckpt)           # and the model, optimizer
    ...     for epoch in range(4):
    ...         ...  # train an epoch
    ...         with tempfile.TemporaryDirectory() as d:
    ...             pycomm.ray.save_state(model, d)           # every rank
    ...             ray.train.report({"epoch": epoch}, checkpoint=Checkpoint.from_directory(d))
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Union

try:
    import ray.train
    import ray.train.torch
except ImportError as e:
    raise ImportError('pycomm.ray needs Ray Train: pip install "ray[train]"') from e

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm._validate import check_hook_args
from pycomm.checkpoint import load_rank_state, save_rank_state
from pycomm.codec.agree import checked_everywhere

__all__ = ["load_state", "prepare_model", "save_state"]

logger = logging.getLogger(__name__)

_said_single = False  # the one-worker message is logged once per process


def _one_worker(what: str) -> None:
    global _said_single
    if not _said_single:
        logger.warning(
            "pycomm.ray: one worker (world_size=1): Ray returns the bare module, there are no "
            "gradients to communicate, so %s",
            what,
        )
        _said_single = True


def prepare_model(
    model: torch.nn.Module,
    hook: str = "allreduce",
    hook_options: Optional[dict[str, Any]] = None,
    **prepare_kwargs: Any,
) -> torch.nn.Module:
    """``ray.train.torch.prepare_model(model, **prepare_kwargs)``, then :func:`pycomm.register`
    of ``hook`` (with ``hook_options``, e.g. ``{"block": 64}`` or ``{"accumulate_steps": 4}``
    for pycomm's accumulate stage) on the DDP it returns. Call it on every worker, in
    ``train_loop_per_worker``. Returns the DDP model, or with one worker the module Ray returns,
    unhooked (a warning, once).

    Refused with a ValueError naming the argument: ``hook_options`` not a dict, and
    ``parallel_strategy`` other than ``"ddp"`` (FSDP and no wrapping have no DDP to take a
    communication hook). A bad hook name or option is refused by :func:`pycomm.register` on
    every worker (with two or more workers: one worker registers nothing).

    Example:
        >>> model = pycomm.ray.prepare_model(Net(), hook="int8", hook_options={"block": 64},
        ...                                  parallel_strategy_kwargs={"bucket_cap_mb": 8})
    """
    # Ray's workers share a process group by now: a refusal on one worker is raised on every
    # worker, before Ray's DDP waits for it
    options = checked_everywhere(
        "pycomm.ray.prepare_model", lambda: _checked(hook, hook_options, prepare_kwargs)
    )
    prepared = ray.train.torch.prepare_model(model, **prepare_kwargs)
    if not isinstance(prepared, DDP):
        world = ray.train.get_context().get_world_size()
        if world > 1:
            raise RuntimeError(
                f"pycomm.ray.prepare_model: Ray returned a {type(prepared).__name__} on "
                f"world_size={world} workers, expected a DistributedDataParallel"
            )
        _one_worker(f"no {hook} hook is registered")
        return prepared
    steps = options.pop("accumulate_steps", 1)  # register's own argument, not the hook's
    pycomm.register(prepared, hook=hook, accumulate_steps=steps, hook_options=options)
    return prepared


def _checked(hook: Any, hook_options: Any, prepare_kwargs: dict[str, Any]) -> dict[str, Any]:
    """:func:`prepare_model`'s own checks on this worker; the hook's options."""
    options = check_hook_args("pycomm.ray.prepare_model", hook, hook_options)
    strategy = prepare_kwargs.get("parallel_strategy", "ddp")
    if strategy != "ddp":
        raise ValueError(
            f"pycomm.ray.prepare_model: parallel_strategy={strategy!r}, expected 'ddp': "
            "pycomm's hooks are DistributedDataParallel communication hooks ('fsdp' shards and "
            "reduce-scatters by itself, None wraps nothing). Pass parallel_strategy='ddp' (the "
            "default), or call ray.train.torch.prepare_model without pycomm"
        )
    return options


def save_state(model: torch.nn.Module, directory: Union[str, os.PathLike]) -> Optional[str]:
    """Write this worker's hook state of ``model`` (what :func:`prepare_model` returned) into
    ``directory``, the folder this worker reports with ``ray.train.report(checkpoint=
    Checkpoint.from_directory(directory))``; returns the file's path. Every worker calls it and
    reports its folder: Ray merges them into one checkpoint. Local (no collective). With one
    worker (the bare module) there is no hook state: returns None.

    Example:
        >>> with tempfile.TemporaryDirectory() as d:
        ...     pycomm.ray.save_state(model, d)
        ...     ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
    """
    if not isinstance(model, DDP):
        _one_worker("there is no hook state to save")
        return None
    return save_rank_state(pycomm.hook_state(model), directory)


def load_state(
    model: torch.nn.Module, checkpoint: Union[ray.train.Checkpoint, str, os.PathLike]
) -> bool:
    """Load this worker's hook state from ``checkpoint`` (a ``ray.train.Checkpoint``, e.g.
    ``ray.train.get_checkpoint()``, or its folder) into ``model``'s hook. A collective: every
    worker calls it. A checkpoint without every rank's state, of another world size, or of
    another hook or options is a ValueError or FileNotFoundError on every worker, and nothing
    changes. One worker (the bare module): nothing to load, returns False.

    Example:
        >>> if (ckpt := ray.train.get_checkpoint()) is not None:
        ...     pycomm.ray.load_state(model, ckpt)
    """
    if not isinstance(model, DDP):
        _one_worker("there is no hook state to load")
        return False
    if isinstance(checkpoint, ray.train.Checkpoint):
        with checkpoint.as_directory() as folder:
            return load_rank_state(pycomm.hook_state(model), folder)
    if isinstance(checkpoint, (str, os.PathLike)):
        return load_rank_state(pycomm.hook_state(model), checkpoint)
    raise TypeError(
        f"pycomm.ray.load_state: checkpoint is a {type(checkpoint).__name__}, expected a "
        "ray.train.Checkpoint or a folder path"
    )
