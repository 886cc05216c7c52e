"""pycomm for Hugging Face Accelerate: register a pycomm hook on the model Accelerate prepared,
and checkpoint every rank's hook state through ``register_for_checkpointing``.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's own hooks (an
enum) and silently drops anything else; ``accelerator.prepare()`` of a model that
``pycomm.wrap`` already wrapped builds a second DDP around it (every gradient reduced twice,
refused by pycomm at the first forward); and ``register_for_checkpointing`` writes from the
main process only, so a hook state registered directly would hand rank 0's residuals to every
rank (refused by the rank check of ``load_state_dict``). Instead:

Example:
    >>> accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    >>> model, opt, loader = accelerator.prepare(model, opt, loader)   # the plain module
    >>> pycomm.accelerate.register(accelerator, model, hook="int8")
    >>> accelerator.register_for_checkpointing(pycomm.accelerate.HookStateCheckpoint(model))
"""

from __future__ import annotations

from typing import Any, Optional

from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm._validate import check_int, hook_options_of
from pycomm.checkpoint import gather_hook_state, load_hook_state
from pycomm.codec.agree import checked_everywhere
from pycomm.hooks import HookState
from pycomm.train import follow_loss_scale
from pycomm.wrap import STATE_ATTR, HookArg
from pycomm.wrap import register as _register

__all__ = ["HookStateCheckpoint", "register"]


def register(
    accelerator: Any,
    model: Any,
    hook: HookArg = "allreduce",
    accumulate_steps: int = 1,
    hook_options: Optional[dict[str, Any]] = None,
    **options: Any,
) -> HookState:
    """Register a pycomm hook on ``model``, the DDP model ``accelerator.prepare()`` returned,
    before the first training step. Every rank calls it; the hook, options and model are
    compared across ranks (:func:`pycomm.register`, which takes the same ``hook``: a
    registered name, a HookState instance or a ``(state, hook_function)`` pair, and the same
    ``hook_options`` dict).

    Refused with a ValueError or TypeError naming the problem: a model Accelerate did not wrap
    in DDP, a ``comm_hook`` in Accelerate's ``DistributedDataParallelKwargs`` (it already
    registered torch's hook, or dropped a pycomm one), and ``accumulate_steps`` > 1 together
    with Accelerate's ``gradient_accumulation_steps`` > 1 (two accumulators).

    Example:
        >>> model, opt = accelerator.prepare(model, opt)
        >>> state = pycomm.accelerate.register(accelerator, model, hook="int8",
        ...                                    hook_options={"block": 128})
    """
    # a refusal on one rank is raised on every rank (the others would wait for it in
    # pycomm.register's comparison)
    hook_options = checked_everywhere(
        "pycomm.accelerate.register",
        lambda: _checked(accelerator, model, accumulate_steps, hook_options, options),
        model.process_group if isinstance(model, DDP) else None,
    )
    state = _register(
        model, hook=hook, accumulate_steps=accumulate_steps, hook_options=hook_options
    )
    # fp16 on a GPU: Accelerate's GradScaler changes the loss scale in optimizer.step()
    follow_loss_scale(
        getattr(accelerator, "scaler", None), lambda: getattr(model, STATE_ATTR, None)
    )
    return state


def _checked(
    accelerator: Any,
    model: Any,
    accumulate_steps: int,
    hook_options: Optional[dict[str, Any]],
    options: dict[str, Any],
) -> dict[str, Any]:
    """:func:`register`'s own checks on this rank; the hook's options as one dict."""
    hook_options = hook_options_of("pycomm.accelerate.register", hook_options, options)
    if not isinstance(model, DDP):
        raise TypeError(
            f"pycomm.accelerate.register: model is a {type(model).__name__}, expected the "
            "DistributedDataParallel that accelerator.prepare(model) returns on several "
            f"processes (this accelerator has num_processes={accelerator.num_processes})"
        )
    handler = getattr(accelerator, "ddp_handler", None)
    comm_hook = getattr(handler, "comm_hook", None)
    if comm_hook is not None and getattr(comm_hook, "value", comm_hook) != "no":
        raise ValueError(
            f"pycomm.accelerate.register: DistributedDataParallelKwargs(comm_hook={comm_hook!r})"
            ", expected none: Accelerate registers only torch's own hooks there (and silently "
            "drops others); leave comm_hook unset and pass hook= here"
        )
    check_int("pycomm.accelerate.register", "accumulate_steps", accumulate_steps)
    k = getattr(accelerator, "gradient_accumulation_steps", 1)
    if accumulate_steps != 1 and k > 1:
        raise ValueError(
            f"pycomm.accelerate.register: accumulate_steps={accumulate_steps!r} with the "
            f"accelerator's gradient_accumulation_steps={k}: two accumulators. Pass "
            "accumulate_steps=1 and let accelerator.accumulate() accumulate (it skips DDP's "
            "synchronization until its k-th batch, the end of the dataloader included)"
        )
    return hook_options


class HookStateCheckpoint:
    """Every rank's hook state of ``model`` as one object for
    ``accelerator.register_for_checkpointing``: ``state_dict()`` gathers all ranks' states
    (Accelerate calls it on every rank and writes from the main process), ``load_state_dict``
    hands each rank its own.

    Example:
        >>> accelerator.register_for_checkpointing(HookStateCheckpoint(model))
        >>> accelerator.save_state("ckpt")   # ... later: accelerator.load_state("ckpt")
    """

    def __init__(self, model: Any) -> None:
        if not isinstance(model, (DDP, HookState)):
            raise TypeError(
                f"pycomm.accelerate.HookStateCheckpoint: model is a {type(model).__name__}, "
                "expected the DDP model with a pycomm hook (pycomm.accelerate.register)"
            )
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return gather_hook_state(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_hook_state(self.model, state)
