"""``pycomm.Exchange``: a compressed collective on any tensor, outside DDP's hook.

Model averaging every k steps, an outer optimizer's sync (local SGD, DiLoCo), a user's own
optimizer: each averages a tensor across ranks and may send it compressed. An ``Exchange``
runs pycomm's engine on a tensor of the caller's: any registered codec, a user's too
(:meth:`Exchange.codecs` lists them), or the exact ``"allreduce"``; error feedback kept per
``key``; the two-phase exchange, the node hierarchy (``hierarchy="node"``, all_reduce), the
non-finite rule, per call (docs/failures.md, "A non-finite gradient skips the step
everywhere") and the byte counts are the engine's, as under DDP.
``pycomm.fsdp.compress`` is an adapter over it: FSDP2's reduce-scatter of each module is a
``reduce_scatter`` of an ``Exchange``, keyed by the module's name. The guide, with code that
runs: docs/exchange.md.

Example:
    >>> ex = pycomm.Exchange("int8")                    # collective: every rank, same options
    >>> ex.all_reduce(model_delta, key="delta").wait()  # model_delta: the mean over ranks
    >>> ex.reduce_scatter(shard, full, key="grads").wait()
    >>> ex.all_gather(full, shard, key="weights").wait()
    >>> ex.stats["bytes_sent"], ex.state_dict()
    >>> work = ex.reduce_scatter(shard, full, key="grads", scale=0.25)  # premultiplied sum
    >>> work.wait(); work.bytes_sent                    # this call's bytes, no device wait

Rules a caller keeps, as for any collective of ``torch.distributed``:

- Constructing an ``Exchange`` is collective (as ``dist.new_group`` is): every rank of the
  group builds it, with the same codec and options. The ranks compare what each resolved
  (the codec's class and format, every option with its default) before any exchange; a
  difference is a ValueError on every rank naming it.
- Every rank issues the same calls in the same order (the same ``key``, shapes and dtypes).
  The ranks check it (``check_order``): by default every call is compared, the calls queued
  together by one small all-reduce of their digests, before their collectives; a difference
  is a ValueError on every rank naming each rank's call (raised by a key's first call, by
  the ``wait()`` of a later one).
- A call returns at once: the Exchange's own thread issues its collectives in call order, on
  process groups of its own, while the caller goes on. Calls on different keys are in flight
  together; a key's next call starts once its last one is done. A list of tensors is one
  exchange.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pycomm.exchange.core import Exchange
    from pycomm.exchange.issue import Work
    from pycomm.exchange.keys import rank_order_sum

__all__ = ["Exchange", "Work", "rank_order_sum"]


_PUBLIC = {"Exchange": "core", "Work": "issue", "rank_order_sum": "keys"}


def __getattr__(name: str) -> Any:
    # imported when first used: the engine and the node hierarchy (this package's
    # submodules) sit below pycomm.hooks, which the public face imports
    if name not in _PUBLIC:
        raise AttributeError(f"module 'pycomm.exchange' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pycomm.exchange.{_PUBLIC[name]}"), name)
