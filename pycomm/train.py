"""TrainLoop: gradient accumulation, clipping, loss scaling and non-finite skipping, done right
over DDP (with or without a pycomm accumulate stage)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm._validate import check_bool, check_int
from pycomm.codec.agree import agree, error_field
from pycomm.hooks import advice
from pycomm.hooks.accumulate import Accumulate
from pycomm.wrap import STATE_ATTR, ddp_parameters

logger = logging.getLogger(__name__)


def loss_scale(scaler: Any) -> Optional[float]:
    """``scaler``'s current loss scale (a ``torch.amp.GradScaler``), or None without one or
    with one disabled (a host read of the scale on a GPU).

    Example:
        >>> loss_scale(torch.amp.GradScaler("cpu", init_scale=16.0))
        16.0
    """
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def rescale_residuals(state: Any, before: Optional[float], after: Optional[float]) -> None:
    """Bring a hook's error-feedback residuals into the units of the next step's gradients
    when the loss scale went from ``before`` to ``after`` (a power of two apart under a
    GradScaler: exact): without it each growth would weigh the residual carried over half as
    much as the new gradient. A state without residuals, or no change, is left alone.

    Example:
        >>> rescale_residuals(pycomm.hook_state(ddp), 1024.0, 2048.0)
    """
    if before and after and after != before:
        scale = getattr(state, "scale_residuals", None)
        if scale is not None:
            scale(after / before)


def follow_loss_scale(scaler: Any, state_of: Callable[[], Any]) -> None:
    """Rescale the residuals of the hook ``state_of()`` returns whenever ``scaler.update()``
    changes the loss scale: for a GradScaler that a framework steps (Accelerate's, the
    Hugging Face Trainer's), which pycomm does not call itself. Wraps this scaler's
    ``update``, once; nothing without a scaler.

    Example:
        >>> follow_loss_scale(accelerator.scaler, lambda: pycomm.hook_state(model))
    """
    if scaler is None or getattr(scaler, "_pycomm_followed", False):
        return
    update = scaler.update

    def followed(*args: Any, **kwargs: Any) -> Any:
        before = loss_scale(scaler)
        result = update(*args, **kwargs)
        rescale_residuals(state_of(), before, loss_scale(scaler))
        return result

    scaler.update = followed
    scaler._pycomm_followed = True


def sparse_sqnorm(grad: torch.Tensor) -> float:
    """The squared L2 norm of the sparse tensor ``grad`` as a dense tensor: its values summed
    per index first. A sum of sparse gradients (accumulation, a gather of every rank's) may
    repeat an index, and a tensor may be flagged coalesced while it still does, so the
    indices are summed here whatever the flag says.

    Example:
        >>> g = torch.sparse_coo_tensor([[0, 0]], [1.0, 2.0], (3,))
        >>> sparse_sqnorm(g)
        9.0
    """
    fresh = torch.sparse_coo_tensor(
        grad._indices(), grad._values(), grad.shape, check_invariants=False
    ).coalesce()
    return float(fresh._values().double().square().sum())


class TrainLoop:
    """Runs micro-batches through a DDP model and steps the optimizer on every k-th.

    ``loss = loop.step(closure)``: ``closure()`` runs the forward pass of one micro-batch and
    returns its loss (a scalar tensor). The loop scales it by 1/k (and by the GradScaler's
    scale), runs backward, and on the k-th micro-step unscales, clips to ``max_grad_norm``,
    skips the step on every rank together if the reduced gradient is not finite, steps and
    zeroes the gradients. The optimizer so sees the gradient of one step on a k times larger
    batch.

    With a pycomm accumulate stage (``pycomm.wrap(..., accumulate_steps=k)``) k is the
    stage's, every micro-step runs as usual and the stage communicates once per window, in
    fp32; on a DDP without one, the first k - 1 micro-steps run forward and backward inside
    ``ddp.no_sync()``. The clipping norm is the one the hook computed in its decode pass where
    it has one; otherwise one pass over the gradients computes it.

    Args:
        ddp: a DistributedDataParallel model.
        optimizer: its optimizer.
        accumulate_steps: k; None: the accumulate stage's, or 1. Conflicting with the stage's:
            ValueError.
        max_grad_norm: clip the total L2 norm of the gradients to this (None: no clipping).
        scaler: a ``torch.amp.GradScaler`` for mixed precision (None: none).
        batch_size: samples per micro-batch per rank, for ``samples_per_second``.
        progress: show a tqdm bar on rank 0 (one tick per optimizer step); ``total`` its
            length.

    Example:
        >>> ddp = pycomm.wrap(model, hook="int8", accumulate_steps=4)
        >>> loop = pycomm.TrainLoop(ddp, torch.optim.AdamW(ddp.parameters()), max_grad_norm=1.0)
        >>> for x, y in loader:
        ...     loss = loop.step(lambda: loss_fn(ddp(x), y))
    """

    def __init__(
        self,
        ddp: DDP,
        optimizer: torch.optim.Optimizer,
        *,
        accumulate_steps: Optional[int] = None,
        max_grad_norm: Optional[float] = None,
        scaler: Optional[Any] = None,
        batch_size: Optional[int] = None,
        progress: bool = False,
        total: Optional[int] = None,
    ) -> None:
        if not isinstance(ddp, DDP):
            raise TypeError(
                f"pycomm.TrainLoop: ddp is a {type(ddp).__name__}, expected a "
                "DistributedDataParallel (pycomm.wrap makes one)"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"pycomm.TrainLoop: optimizer is a {type(optimizer).__name__}, expected a "
                "torch.optim.Optimizer"
            )
        hook = getattr(ddp, STATE_ATTR, None)
        self._stage: Optional[Accumulate] = getattr(hook, "accumulate", None)
        k, error = 1, None
        try:
            _check_optimizer(ddp, optimizer)
            k = _check_settings(ddp, self._stage, accumulate_steps, max_grad_norm, scaler)
            if batch_size is not None:
                check_int("pycomm.TrainLoop", "batch_size", batch_size)
            check_bool("pycomm.TrainLoop", "progress", progress)
            if total is not None:
                check_int("pycomm.TrainLoop", "total", total)
        except (TypeError, ValueError) as e:
            error = e
        # every rank's settings compared (one rank clipping, or accumulating over another
        # window, trains apart or mis-pairs the all-reduces): a difference, or a bad value on
        # one rank, is an error on every rank
        agree(
            "pycomm.TrainLoop",
            {
                **error_field(error),
                "accumulate_steps": k,
                "max_grad_norm": max_grad_norm,
                "scaler": _scaler_config(scaler) if error is None else None,
            },
            ddp.process_group,
        )
        self.ddp, self.optimizer, self.scaler = ddp, optimizer, scaler
        # here, before the first step; the optimizer's first step then does not warn again
        advice.advise(hook, optimizer)
        self.accumulate_steps = k
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.batch_size = batch_size
        # where the stage is (after a resume, mid-window), else at the start of a window
        self.micro_steps = self._stage.micro_step if self._stage is not None else 0
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: Optional[float] = None
        self._elapsed = 0.0  # seconds inside step()
        self._warned = False
        self._world = dist.get_world_size(ddp.process_group) if dist.is_initialized() else 1
        # the parameters whose reduced gradients the hook's decode norm covers
        self._reduced = {id(p) for p in ddp_parameters(ddp)}
        self._bar = None
        if progress and (not dist.is_initialized() or dist.get_rank() == 0):
            try:
                from tqdm.auto import tqdm
            except ImportError as e:
                raise ImportError(
                    "pycomm.TrainLoop: progress=True needs tqdm: pip install tqdm"
                ) from e
            self._bar = tqdm(total=total, unit="step", desc="train")

    @property
    def samples_per_second(self) -> Optional[float]:
        """Samples over all ranks per second spent in :meth:`step` (needs ``batch_size``)."""
        if self.batch_size is None or self._elapsed <= 0:
            return None
        return self.batch_size * self._world * self.micro_steps / self._elapsed

    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run one micro-batch: ``closure()`` (the forward pass, returning the loss), backward,
        and on every k-th call the optimizer step. Returns the micro-batch's loss, detached."""
        if not callable(closure):
            raise TypeError(
                f"pycomm.TrainLoop.step: closure is a {type(closure).__name__}, expected a "
                "callable that runs the forward pass and returns the loss"
            )
        t0 = time.perf_counter()
        k = self.accumulate_steps
        final = (self.micro_steps + 1) % k == 0
        if self._stage is not None and self._stage.boundary() != final:
            raise RuntimeError(
                f"pycomm.TrainLoop: the accumulate stage is at micro-step "
                f"{self._stage.micro_step} of its own count but this loop at "
                f"{self.micro_steps}: either the model ran backward outside the loop, or a "
                "parameter got no gradient in the last backward, so DDP never handed its "
                "bucket to the hook (construct DDP with find_unused_parameters=True when a "
                "step can leave parameters unused)"
            )
        sync = final or self._stage is not None or k == 1
        with contextlib.nullcontext() if sync else self.ddp.no_sync():
            loss = closure()
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = (
                    f"a tensor of shape {tuple(loss.shape)}"
                    if isinstance(loss, torch.Tensor)
                    else f"a {type(loss).__name__}"
                )
                raise TypeError(
                    f"pycomm.TrainLoop.step: the closure returned {got}, expected a scalar "
                    "loss tensor"
                )
            scaled = loss / k if k > 1 else loss
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        self.micro_steps += 1
        if final:
            self._optimizer_step()
        self._elapsed += time.perf_counter() - t0
        return loss.detach()

    def _grads(self) -> list[torch.Tensor]:
        return [
            p.grad
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def _hook_sqnorm(self) -> Optional[float]:
        """The hook's norm, where it covers exactly the gradients the optimizer steps with
        (not with parameters excluded from DDP, or left out of the optimizer)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        stepped = {id(p) for p in params if p.grad is not None}
        if not (stepped <= self._reduced <= {id(p) for p in params}):
            return None
        get = getattr(getattr(self.ddp, STATE_ATTR, None), "reduced_sqnorm", None)
        return get() if get is not None else None

    def _optimizer_step(self) -> None:
        scaler = self.scaler
        if scaler is not None:
            scale_before = float(scaler.get_scale())
            scaler.unscale_(self.optimizer)
        grads = self._grads()
        dense = [g for g in grads if not g.is_sparse]
        # sparse gradients (nn.Embedding(sparse=True)): reduced exactly by every hook, outside
        # its decode norm; the norm of the gradient the optimizer adds in
        sparse_sq = sum(sparse_sqnorm(g) for g in grads if g.is_sparse)
        sq = self._hook_sqnorm()
        total: Optional[torch.Tensor] = None  # torch's own norm, where it is the one used
        if sq is not None:
            norm = math.sqrt(sq) if sq >= 0 else float("nan")
            if scaler is not None:
                norm /= float(scaler.get_scale())
        elif dense:
            total = torch.nn.utils.get_total_norm(dense, norm_type=2.0)
            norm = float(total)
        else:
            norm = 0.0
        if len(dense) < len(grads):
            norm, total = math.sqrt(norm * norm + sparse_sq), None
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            # The reduced gradients are the same on every rank, so is this decision.
            self.skipped_steps += 1
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"pycomm.TrainLoop: non-finite gradient (norm {norm}) at optimizer step "
                    f"{self.optimizer_steps + self.skipped_steps}: step skipped on every rank "
                    "(counted in skipped_steps; this warning is shown once)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            if scaler is not None:
                scaler.step(self.optimizer)  # finds the inf itself and skips
                scaler.update()
                self._rescale(scale_before, float(scaler.get_scale()))
            self.optimizer.zero_grad()
            self._tick()
            return
        if self.max_grad_norm is not None and grads:
            # torch.nn.utils.clip_grad_norm_'s coefficient, in its dtype (fp32, from the norm
            # as an fp32 tensor) and clamped at 1, so that clipping is its own bit for bit
            if total is None:
                total = torch.tensor(norm, dtype=torch.float32, device=grads[0].device)
            clip = self.max_grad_norm / (total + 1e-6)
            if float(clip) < 1.0:  # (torch multiplies by the clamped 1.0: no change)
                if dense:
                    torch._foreach_mul_(dense, clip.to(dense[0].device))
                for g in grads:
                    if g.is_sparse:
                        g.mul_(clip.to(g.device))
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
            self._rescale(scale_before, float(scaler.get_scale()))
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        self.optimizer_steps += 1
        self._tick()

    def _rescale(self, before: float, after: float) -> None:
        """The hook's residuals into the units of the next step's gradients, scaled by the
        loss scale ``after`` instead of ``before`` (a power of two apart: exact)."""
        rescale_residuals(getattr(self.ddp, STATE_ATTR, None), before, after)

    def _tick(self) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if self.last_grad_norm is not None:
                self._bar.set_postfix(grad_norm=f"{self.last_grad_norm:.3g}")

    def close(self) -> None:
        """Close the progress bar, if any."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _check_optimizer(ddp: DDP, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` steps some of ``ddp``'s trainable parameters (one that holds none of them
    would never change the model)."""
    mine = {id(p) for p in ddp.parameters() if p.requires_grad}
    if mine and not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "pycomm.TrainLoop: optimizer holds none of ddp's trainable parameters, expected "
            "the optimizer of this model (torch.optim.SGD(ddp.parameters(), ...)): its steps "
            "would never change the model"
        )


def _check_settings(
    ddp: DDP,
    stage: Optional[Accumulate],
    accumulate_steps: Optional[int],
    max_grad_norm: Optional[float],
    scaler: Optional[Any],
) -> int:
    """TrainLoop's settings checked on this rank; the window's length."""
    if stage is not None:
        k = stage.accumulate_steps
        if accumulate_steps is not None and accumulate_steps != k:
            raise ValueError(
                f"pycomm.TrainLoop: accumulate_steps={accumulate_steps!r}, but the model's "
                f"pycomm accumulate stage has accumulate_steps={k}; pass None or {k}"
            )
    else:
        k = (
            1
            if accumulate_steps is None
            else check_int("pycomm.TrainLoop", "accumulate_steps", accumulate_steps)
        )
    if k > 1 and stage is None and getattr(ddp, "static_graph", False):
        raise ValueError(
            f"pycomm.TrainLoop: accumulate_steps={k} on a DDP built with static_graph=True "
            "and no pycomm accumulate stage: accumulating there needs DDP's no_sync(), "
            "which a static graph does not support (DDP's reducer fails). Use "
            f"pycomm.wrap(module, accumulate_steps={k}, static_graph=True) (pycomm's stage "
            "accumulates without no_sync) or static_graph=False"
        )
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
            raise ValueError(
                f"pycomm.TrainLoop: max_grad_norm={max_grad_norm!r}, expected a positive "
                "number or None"
            )
        if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(
                f"pycomm.TrainLoop: max_grad_norm={max_grad_norm!r}, expected a positive "
                "finite number or None"
            )
    if scaler is not None and not all(
        hasattr(scaler, a) for a in ("scale", "unscale_", "step", "update", "get_scale")
    ):
        raise TypeError(
            f"pycomm.TrainLoop: scaler is a {type(scaler).__name__}, expected a "
            "torch.amp.GradScaler or None"
        )
    return k


def _scaler_config(scaler: Optional[Any]) -> Optional[dict[str, Any]]:
    """What the ranks' loss scalers must agree on (a rank scaling otherwise trains apart):
    the class, whether it is enabled, its scale and how it grows and backs off."""
    if scaler is None:
        return None
    config: dict[str, Any] = {"class": type(scaler).__name__}
    for name in ("is_enabled", "get_scale", "get_growth_factor", "get_backoff_factor",
                 "get_growth_interval"):  # fmt: skip
        method = getattr(scaler, name, None)
        if callable(method):
            try:
                config[name.removeprefix("get_")] = method()
            except AttributeError:  # a disabled GradScaler keeps no growth settings
                pass
        if config.get("is_enabled") is False:
            break
    return config
