"""A hook that is known to train worse with the optimizer in use says so, whatever loop drives
the training (pycomm.TrainLoop, Lightning, Accelerate, a loop of one's own).

A hook state whose class gives :meth:`HookState.optimizer_advice` is watched once its
parameters are known (``bind_parameters``, which ``pycomm.wrap``/``register`` call, or the
first hook call on each DDP bucket). One global optimizer step pre-hook, installed with the
first watched state, checks at each optimizer's first step whether it steps a parameter of a
watched model and warns (``UserWarning``, on every rank) with the state's advice, once per
(hook state, optimizer). The answer is cached per optimizer: its later steps cost one
dictionary lookup. States and optimizers are held weakly.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id(parameter) -> the watched hook state whose model holds it
_STATE_OF: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
# optimizer -> (generation, parameter groups) when it was last checked
_CHECKED: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
# hook state -> the optimizers it has warned about
_ADVISED: weakref.WeakKeyDictionary[Any, weakref.WeakSet] = weakref.WeakKeyDictionary()
_generation = 0  # bumped whenever a watched parameter is added: every optimizer is rechecked
_STEP_HOOK: list = []

# frames of these packages are skipped when the warning names the line that caused it
_LIBRARIES = ("pycomm", "torch", "lightning", "pytorch_lightning", "accelerate")


def gives_advice(state: Any) -> bool:
    """Whether ``state``'s class can advise against an optimizer at all."""
    own = getattr(type(state), "optimizer_advice", None)
    # the base's (HookState's) advises nothing
    return own is not None and getattr(own, "__qualname__", "") != "HookState.optimizer_advice"


def watch(state: Any, parameters: Iterable[torch.Tensor]) -> None:
    """Check optimizers that step any of ``parameters`` against ``state``'s advice (at their
    first step; again after a later call adds parameters).

    Example:
        >>> pycomm.hooks.advice.watch(state, model.parameters())
    """
    global _generation
    added = False
    for p in parameters:
        if _STATE_OF.get(id(p)) is not state:
            _STATE_OF[id(p)] = state
            added = True
    if added:
        _generation += 1
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_check_step))


def _check_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _STATE_OF:
        return
    key = (_generation, len(optimizer.param_groups))
    try:
        if _CHECKED.get(optimizer) == key:
            return
        _CHECKED[optimizer] = key
    except TypeError:  # an optimizer that cannot be weakly referenced: checked every step
        pass
    states: list = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = _STATE_OF.get(id(p))
            if state is not None and all(state is not s for s in states):
                states.append(state)
    for state in states:
        advise(state, optimizer)


def advise(state: Any, optimizer: Any) -> Optional[str]:
    """Warn with ``state.optimizer_advice(optimizer)`` unless ``state`` already warned about
    this optimizer; returns the advice when it warned, else None.

    Example:
        >>> pycomm.hooks.advice.advise(pycomm.hook_state(ddp), optimizer)
    """
    get = getattr(state, "optimizer_advice", None)
    if get is None:
        return None
    try:
        seen = _ADVISED.get(state)
    except TypeError:  # not weakly referenceable: cannot tell a second call, so no warning
        return None
    if seen is not None and optimizer in seen:
        return None
    why = get(optimizer)
    if why is None:
        return None
    if seen is None:
        seen = _ADVISED[state] = weakref.WeakSet()
    seen.add(optimizer)
    warnings.warn(why, UserWarning, stacklevel=_caller_level())
    return why


def _caller_level() -> int:
    """The ``stacklevel`` that names the first frame outside pycomm, torch and the training
    frameworks (the user's ``optimizer.step()``, ``TrainLoop(...)`` or ``trainer.fit()``)."""
    frame = sys._getframe(2)  # the caller of advise()
    level = 2
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] not in _LIBRARIES:
            return level
        frame, level = frame.f_back, level + 1
    return 2
