"""pycomm for the Hugging Face Trainer: register a pycomm hook on the DDP model the Trainer
builds, and keep every rank's hook state in the Trainer's checkpoints.

``register(trainer, hook=...)`` adds a callback to the Trainer (``trainer.add_callback``). A
callback passed in ``Trainer(callbacks=[...])`` alone could not do it: the Trainer hands its
callbacks the plain module (``model=``), never the DistributedDataParallel it wraps it in, and
builds that DDP only inside ``train()``. The Trainer's documented ``trainer.model_wrapped``
is that DDP at ``on_train_begin``, after the wrap and the checkpoint's model and optimizer are
loaded, before the first forward, so the callback needs the trainer itself, which
``register`` gives it.

- Registration: at ``on_train_begin``, through :func:`pycomm.register` (the cross-rank checks
  included); a second ``train()`` on the DDP the Trainer keeps goes on with the same hook.
- Checkpoints: at ``on_save`` each rank writes its own hook state into the folder the Trainer
  just wrote, ``<output_dir>/checkpoint-<step>/pycomm_hook_state_<rank>.pt`` (as the Trainer
  writes ``rng_state_<rank>.pth``). On ``train(resume_from_checkpoint=...)`` each rank loads
  its own from ``<output_dir>/checkpoint-<step>`` of the resumed step, so error feedback,
  warm-up and ``auto``'s decision carry over and the resumed run is bitwise the uninterrupted
  one. A checkpoint without pycomm's files (written without pycomm) starts the hook afresh,
  with a warning; files missing for some ranks, of another world size or another hook or
  options are an error on every rank.
- Accumulation: ``TrainingArguments(gradient_accumulation_steps=k)``; the Trainer skips DDP's
  synchronization (Accelerate's ``no_sync``) on the first k - 1 micro-batches, so pycomm's
  own ``accumulate_steps`` stays 1 and is refused in ``hook_options``.
- Refused at ``register``: DeepSpeed and FSDP (neither is a DDP model that takes a
  communication hook). One process: nothing to communicate, a no-op that logs once.

Example:
    >>> import pycomm.transformers
    >>> trainer = Trainer(model=model, args=TrainingArguments("out", gradient_accumulation_steps=2),
    ...                   train_dataset=data)
    >>> hook = pycomm.transformers.register(trainer, hook="int8")
    >>> trainer.train()                                  # torchrun --nproc-per-node 2 train.py
    >>> hook.state.stats["compression"]
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:
    raise ImportError(
        "pycomm.transformers needs Hugging Face Transformers: pip install transformers"
    ) from e

from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm
from pycomm._validate import check_hook_args
from pycomm.checkpoint import load_rank_state, save_rank_state
from pycomm.codec.agree import checked_everywhere
from pycomm.hooks import HookState
from pycomm.train import follow_loss_scale
from pycomm.wrap import STATE_ATTR

__all__ = ["CommHookCallback", "register"]

logger = logging.getLogger(__name__)


def _refusal(trainer: Any) -> Optional[str]:
    """Why pycomm cannot serve this Trainer's setup, or None."""
    args = trainer.args
    deepspeed, fsdp = getattr(args, "deepspeed", None), getattr(args, "fsdp", None)
    if deepspeed or getattr(trainer, "is_deepspeed_enabled", False):
        setting = (
            f"TrainingArguments(deepspeed={deepspeed!r})"
            if deepspeed
            else "the accelerator's DeepSpeed plugin (accelerate config, ACCELERATE_USE_DEEPSPEED)"
        )
        return (
            f"{setting}: DeepSpeed runs its own gradient communication, which takes no DDP "
            "communication hook. Drop deepspeed= to train with DDP and the pycomm hook, or drop "
            "pycomm.transformers.register to keep DeepSpeed"
        )
    if fsdp or getattr(trainer, "is_fsdp_enabled", False):
        setting = (
            f"TrainingArguments(fsdp={fsdp!r})"
            if fsdp
            else "the accelerator's FSDP plugin (accelerate config, ACCELERATE_USE_FSDP)"
        )
        return (
            f"{setting}: FSDP shards the model and reduce-scatters its gradients itself; "
            "pycomm's hooks are DDP communication hooks and FSDP has none. Drop fsdp= (and "
            "fsdp_config=) to train with DDP and the pycomm hook, or drop "
            "pycomm.transformers.register to keep FSDP"
        )
    return None


def register(
    trainer: Trainer, hook: str = "allreduce", hook_options: Optional[dict[str, Any]] = None
) -> CommHookCallback:
    """Have ``trainer`` train with a pycomm hook: adds a :class:`CommHookCallback` to it and
    returns it (its ``state`` is the hook state once ``train()`` has begun). Call it on every
    rank, before ``trainer.train()``. ``hook_options`` go to the hook (``{"block": 64}``...).

    Refused with a ValueError naming the setting: ``hook_options`` not a dict,
    ``accumulate_steps`` in it (use the Trainer's ``gradient_accumulation_steps``), a Trainer
    set up for DeepSpeed or FSDP. A bad hook name or option is refused by
    :func:`pycomm.register` at the start of ``train()``, on every rank.

    Example:
        >>> hook = pycomm.transformers.register(trainer, hook="onebit")
        >>> trainer.train(resume_from_checkpoint=True)    # each rank resumes its hook state
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"pycomm.transformers.register: trainer is a {type(trainer).__name__}, expected a "
            "transformers.Trainer"
        )
    # where the ranks' group exists already (torchrun: the TrainingArguments made it), a
    # refusal on one rank is raised on every rank, not left to the others' first collective
    options = checked_everywhere(
        "pycomm.transformers.register", lambda: _checked(trainer, hook, hook_options)
    )
    callback = CommHookCallback(trainer, hook, options)
    trainer.add_callback(callback)
    return callback


def _checked(trainer: Trainer, hook: Any, hook_options: Any) -> dict[str, Any]:
    """:func:`register`'s own checks on this rank; the hook's options."""
    options = check_hook_args("pycomm.transformers.register", hook, hook_options)
    if "accumulate_steps" in options:
        raise ValueError(
            f"pycomm.transformers.register: hook_options has accumulate_steps="
            f"{options['accumulate_steps']!r}, expected none: the Trainer accumulates; set "
            "TrainingArguments(gradient_accumulation_steps=k), which skips DDP's "
            "synchronization on the first k - 1 micro-batches (two accumulators would drift "
            "apart)"
        )
    problem = _refusal(trainer)
    if problem is not None:
        raise ValueError(f"pycomm.transformers.register: {problem}")
    return options


class CommHookCallback(TrainerCallback):
    """The callback :func:`register` adds: registers the hook on ``trainer.model_wrapped`` at
    ``on_train_begin`` (loading each rank's saved state when the Trainer resumed), and writes
    each rank's state into every checkpoint folder at ``on_save``. Build it with
    :func:`register`, which checks the arguments and the Trainer's setup.

    Example:
        >>> hook = pycomm.transformers.register(trainer, hook="int8")
        >>> trainer.train()
        >>> hook.state.stats["bytes_sent"]
    """

    def __init__(self, trainer: Trainer, hook: str, hook_options: dict[str, Any]) -> None:
        self.trainer = trainer
        self.hook = hook
        self.hook_options = dict(hook_options)
        self.state: Optional[HookState] = None
        self.registered: Optional[HookState] = None  # the state registered by this callback
        self._said_single = False

    def _checkpoint_dir(self, args: Any, step: int) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.state = None
        model = self.trainer.model_wrapped
        if not isinstance(model, DDP):
            if args.world_size > 1:
                raise RuntimeError(
                    f"pycomm.transformers: the Trainer wrapped the model in a "
                    f"{type(model).__name__} on world_size={args.world_size} processes, "
                    "expected a DistributedDataParallel: pycomm's hooks are DDP communication "
                    "hooks (DeepSpeed, FSDP and tensor or context parallelism have none)"
                )
            if not self._said_single:
                logger.warning(
                    "pycomm.transformers: one process (world_size=1): no gradients to "
                    "communicate, so no %s hook is registered",
                    self.hook,
                )
                self._said_single = True
            return
        mine = self.registered
        if mine is not None and getattr(model, STATE_ATTR, None) is mine:
            self.state = mine  # another train() on the DDP the Trainer keeps: the same hook
        else:
            self.state = pycomm.register(model, hook=self.hook, hook_options=self.hook_options)
            self.registered = self.state
        # fp16 on a GPU: the Trainer's GradScaler (its accelerator's) changes the loss scale
        follow_loss_scale(
            getattr(getattr(self.trainer, "accelerator", None), "scaler", None),
            lambda: getattr(model, STATE_ATTR, None),
        )
        if state.global_step > 0:  # resumed: the Trainer loaded checkpoint-<global_step>
            folder = self._checkpoint_dir(args, state.global_step)
            if not load_rank_state(self.state, folder, missing="ignore"):
                logger.warning(
                    "pycomm.transformers: resumed at step %d, but %s holds no pycomm hook "
                    "state (saved without pycomm, or the checkpoint is not in output_dir): the "
                    "%s hook starts afresh (warm-up, zero residuals)",
                    state.global_step,
                    folder,
                    self.hook,
                )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.state is not None:
            save_rank_state(self.state, self._checkpoint_dir(args, state.global_step))
