"""pycomm for PyTorch Lightning: a DDP strategy that registers a pycomm hook on any device and
keeps every rank's hook state in Lightning's checkpoints.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers the hook only on CUDA (on the CPU
it silently registers nothing), and its checkpoints hold no hook state, so a resume starts the
error-feedback residuals from zero. This strategy registers through :func:`pycomm.register`
(the cross-rank checks included) on every device, adds every rank's hook state to each
checkpoint (gathered: Lightning writes the checkpoint from rank 0 only) and hands each rank
its own on resume, so that a resume is bitwise an uninterrupted run.

Accumulate with Lightning (``Trainer(accumulate_grad_batches=k)``): it decides when the
optimizer steps and skips DDP's synchronization on the first k - 1 batches, so pycomm's own
accumulate stage would be a second accumulator. ``accumulate_steps`` other than 1 is refused.

Example:
    >>> from pycomm.lightning import DDPStrategy
    >>> trainer = lightning.Trainer(accelerator="cpu", devices=2,
    ...                             strategy=DDPStrategy(hook="int8"), accumulate_grad_batches=4)
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

try:
    from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
except ImportError:  # the standalone package
    try:
        from pytorch_lightning.strategies import DDPStrategy as _LightningDDPStrategy
    except ImportError as e:
        raise ImportError("pycomm.lightning needs PyTorch Lightning: pip install lightning") from e

from pycomm.checkpoint import gather_hook_state, load_hook_state
from pycomm.train import loss_scale, rescale_residuals
from pycomm.wrap import STATE_ATTR, HookArg, check_args, register

__all__ = ["CHECKPOINT_KEY", "DDPStrategy"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "pycomm_hook_state"  # where the gathered hook states go in the checkpoint


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's DDPStrategy with a pycomm hook (``hook``, ``hook_options``), registered on
    every device, its state saved in and restored from Lightning's checkpoints. ``hook`` takes
    what :func:`pycomm.register` takes: a registered name, a HookState instance or a ``(state,
    hook_function)`` pair (docs/custom_hooks.md).

    Other keyword arguments go to Lightning's DDPStrategy (``process_group_backend``,
    ``timeout``, and DDP's own: ``bucket_cap_mb``, ``find_unused_parameters``,
    ``static_graph``, ``gradient_as_bucket_view``...). ``ddp_comm_hook``, ``ddp_comm_state``
    and ``ddp_comm_wrapper`` are refused: pass ``hook`` instead.

    Example:
        >>> strategy = DDPStrategy(hook="onebit", hook_options={"block": 64})
        >>> lightning.Trainer(accelerator="cpu", devices=2, strategy=strategy).fit(model, data)
    """

    def __init__(
        self,
        hook: HookArg = "allreduce",
        *,
        accumulate_steps: int = 1,
        hook_options: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"pycomm.lightning.DDPStrategy: {name}={kwargs[name]!r}, expected None: this "
                    "strategy registers pycomm's hook itself; pass hook= and hook_options="
                )
        check_args(hook, accumulate_steps)
        if accumulate_steps != 1:
            raise ValueError(
                f"pycomm.lightning.DDPStrategy: accumulate_steps={accumulate_steps}, expected "
                "1: under Lightning, Lightning decides when the optimizer steps; accumulate "
                "with Trainer(accumulate_grad_batches=k), which skips DDP's synchronization on "
                "the first k - 1 batches (two accumulators would drift apart)"
            )
        if hook_options is not None and not isinstance(hook_options, dict):
            raise ValueError(
                f"pycomm.lightning.DDPStrategy: hook_options={hook_options!r}, expected a dict"
            )
        super().__init__(**kwargs)
        self.pycomm_hook = hook
        self.pycomm_hook_options = dict(hook_options or {})
        self.pycomm_state: Optional[Any] = None  # kept past teardown (which unwraps the DDP)

    def _register_ddp_hooks(self) -> None:
        # Lightning's registers only on CUDA; pycomm's hooks work on every device.
        self.pycomm_state = register(
            self.model, hook=self.pycomm_hook, hook_options=self.pycomm_hook_options
        )

    def _hook_state(self) -> Any:
        return getattr(self.model, STATE_ATTR, None) or self.pycomm_state

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        # A mixed-precision plugin's GradScaler changes its scale here (growth, or backoff after
        # an overflow): the hook's residuals follow it, in the units of the next gradients.
        scaler = getattr(self.precision_plugin, "scaler", None)
        before = loss_scale(scaler)
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        rescale_residuals(self._hook_state(), before, loss_scale(scaler))
        return result

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        # Every rank runs this (Trainer.save_checkpoint); only rank 0 writes the file, so the
        # per-rank states are gathered into it first.
        state = self._hook_state()
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = gather_hook_state(state)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # Runs on resume, after setup() registered the hook: the point where Lightning
        # restores the rest of the training state.
        super().load_optimizer_state_dict(checkpoint)
        state = self._hook_state()
        if state is None:
            return
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            logger.warning(
                "pycomm.lightning: the checkpoint holds no pycomm hook state; the %s hook "
                "starts afresh (warm-up, zero residuals)",
                state.hook_name,
            )
            return
        load_hook_state(state, saved)
