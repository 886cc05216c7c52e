"""The error-feedback residuals of an engine, kept per key ``(index, numel, dtype)``.

Residuals (:class:`ResidualStore`, with the decode statistics that decide whether a step's
new residuals are kept): a codec that declares ``keeps_residual_on_nonfinite`` updates each
residual in place (or, with ``strict_skip``, writes a second copy). Every encode of one without
it goes through :meth:`Workspace.encode`, which gives it the rule: the codec writes its new
residual to a scratch buffer, merged back where it is finite. Two ways, chosen by the hooks'
``strict_skip`` option:

- One copy (the default): the codec updates each residual in place, and where its input is not
  finite it keeps the old value (the codec protocol's rule, which ``check_codec`` checks). A
  step with a NaN or Inf (skipped by ``TrainLoop``) thus leaves every non-finite block's
  residual as it was and never a non-finite residual; the blocks that were finite on a rank
  keep that step's update. Deterministic: a rerun gives the same bits. 4 bytes a parameter
  for the local residual and 4/N for the reduced chunk's (fp32 residuals; half in bf16).
- Two copies (``strict_skip=True``): a step writes its new residuals beside the kept ones, and
  they are committed (swapped in) at the start of the next step only if every decode of the
  step decoded finite, so a step with a NaN or Inf anywhere leaves the residuals bitwise as
  they were, on every rank alike; twice the memory. On an accelerator that decision is a
  select on the device: the hook never waits for the device.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

__all__ = ["PHASE_1", "ResidualStore", "Residuals", "check_residuals"]

# The third field of a residual key that holds phase 1's residual alone: a reduce-scatter's
# (pycomm.Exchange, pycomm.fsdp), ``(index, n, PHASE_1)``; an all-reduce's is its dtype.
PHASE_1 = "phase 1"

Residuals = dict[str, torch.Tensor]  # "r1": phase-1 residual, "r2": phase-2 residual


def check_residuals(where: str, engine: Any, loaded: dict[tuple, dict]) -> None:
    """Refuse (ValueError naming the key) loaded residuals of another size or dtype than
    ``engine`` keeps for their keys; ``where`` starts the message."""
    for key, res in loaded.items():
        for name, numel in engine.key_sizes(key).items():
            got = res[name].numel() if name in res else 0
            what = f"{where}: cannot load the residual of key {key[0]} ({key[1]} elements)"
            if got != numel:
                raise ValueError(
                    f"{what}: {name} has {got} elements, expected {numel} for this world size "
                    "and block"
                )
            if res[name].dtype != engine.residual_dtype:
                raise ValueError(
                    f"{what}: {name} has dtype {res[name].dtype}, expected "
                    f"{engine.residual_dtype} (residual_dtype)"
                )


class ResidualStore:
    """Residuals per key ``(index, numel, dtype)`` (a DDP bucket's, an Exchange call's), as of
    the last finite step; one key per index (an index that comes back with another size starts
    afresh).

    Args:
        where: how error messages start (``pycomm <hook> hook``).
        stats: the caller's counters; ``residual_bytes`` and the non-finite decodes (under
            ``nonfinite``, the caller's name for them) are kept here.
        dtype: the residuals' storage dtype (float32 or bfloat16).
        strict: two copies, a non-finite step's updates dropped (see the module docstring).
    """

    def __init__(
        self,
        where: str,
        stats: dict[str, Any],
        dtype: torch.dtype,
        strict: bool = False,
        nonfinite: str = "nonfinite",
    ) -> None:
        self.where, self.stats, self.dtype, self.strict = where, stats, dtype, strict
        self.nonfinite = nonfinite
        stats.setdefault(nonfinite, 0)
        self.residuals: dict[tuple, Residuals] = {}
        self.next: dict[tuple, Residuals] = {}  # the current step's new residuals
        self.touched: set[tuple] = set()  # buckets whose ``next`` holds the current step's
        self.bad_steps: set[int] = set()
        self.pending: Optional[dict[tuple, Residuals]] = None  # loaded, placed when first used
        self.lock = threading.Lock()  # decode callbacks of different buckets may race
        # (step, [squared norm, non-finite values], False) per decode, or, once a step is
        # committed on an accelerator, (step, [squared norm, non-finite buckets], True)
        self.decoded: list[tuple[int, torch.Tensor, bool]] = []
        self.sqnorm: dict[int, float] = {}
        self.last_sqnorm = 0.0
        self.on_device: Optional[bool] = None  # None: on an accelerator (see commit)

    def get(self, key: tuple, sizes: dict[str, int], device: torch.device) -> tuple:
        """(r1, r2, r1_out, r2_out) of ``key``: the kept residuals to read and the buffers
        this step's new ones go to (None where ``sizes`` has no such residual). ``sizes`` gives
        each residual's elements when the key is first seen."""
        res = self.residuals.get(key)
        if res is None:
            if self.pending is not None:
                if key not in self.pending:
                    raise ValueError(
                        f"{self.where}: key {key[0]} ({key[1]} elements, {key[2]}) has no "
                        f"residual in the loaded state, which holds keys "
                        f"{sorted(self.pending)}: the tensors exchanged changed (a model, or "
                        "its DDP buckets)"
                    )
                res = self.pending.pop(key)
            else:
                res = {
                    name: torch.zeros(numel, dtype=self.dtype, device=device)
                    for name, numel in sizes.items()
                }
            self.forget(key[0])
            self.put(key, res)
        self.touched.add(key)
        if not self.strict:  # updated in place (the codec's residual_out None)
            return res.get("r1"), res.get("r2"), None, None
        nxt = self.next[key]
        return res.get("r1"), res.get("r2"), nxt.get("r1"), nxt.get("r2")

    def forget(self, index: Any) -> None:
        """Drop the residuals of every key of ``index`` (a DDP bucket, an Exchange key's calls):
        one that comes back with another size or dtype starts afresh, and the old residual,
        which no call of the new size can use, is freed rather than kept beside the new one
        (a key exchanged at many sizes would otherwise keep one residual for each)."""
        for key in [k for k in self.residuals if k[0] == index]:
            del self.residuals[key]
            self.next.pop(key, None)
            self.touched.discard(key)
        self.stats["residual_bytes"] = self.nbytes()

    def put(self, key: tuple, res: Residuals) -> None:
        """Keep ``res`` as ``key``'s residuals, as a finished step leaves them (also a
        residual converted from another checkpoint format), in place of any it had."""
        self.residuals[key] = res
        if self.strict:
            self.next[key] = {name: torch.empty_like(t) for name, t in res.items()}
        self.stats["residual_bytes"] = self.nbytes()

    def place_loaded(self) -> None:
        """Place every loaded residual now, as if each key had come: a key without one
        then starts from zeros instead of being refused (``pycomm.Exchange``, whose keys may
        take their first compressed call after a load)."""
        pending, self.pending = self.pending or {}, None
        for key, res in pending.items():
            self.put(key, res)

    def nbytes(self, index: Optional[Any] = None, pending: bool = False) -> int:
        """Bytes of the kept residuals (two copies' with ``strict``), of every key, or of
        the keys that start with ``index``; ``pending``: those loaded and not placed
        yet too."""
        kept = list(self.residuals.items())
        if pending and self.pending:
            kept += list(self.pending.items())
        total = sum(
            t.numel() * t.element_size()
            for key, r in kept
            if index is None or key[0] == index
            for t in r.values()
        )
        return (2 if self.strict else 1) * total

    def note_decode(self, st: torch.Tensor, step: int) -> None:
        """Keep a decode's [squared norm, non-finite count] (from a callback thread) until
        :meth:`fold`, which runs when the stats are read (and, on the CPU, at the start of every
        step): no callback reads a device value."""
        with self.lock:
            self.decoded.append((step, st, False))

    def fold(self) -> None:
        """Fold the kept decode results into the counters and ``last_sqnorm``, the squared
        norm of the latest step's reduced gradients."""
        with self.lock:
            pending, self.decoded = self.decoded, []
        for step, st, summed in pending:
            sq, bad = st.tolist()
            self.sqnorm[step] = self.sqnorm.get(step, 0.0) + sq
            self.stats[self.nonfinite] += int(bad) if summed else int(bad > 0)
            if bad > 0:  # the norm of a gradient holding NaN or Inf is not finite
                self.bad_steps.add(step)
                self.sqnorm[step] = float("nan")
        if self.sqnorm:
            latest = max(self.sqnorm)
            self.last_sqnorm = self.sqnorm[latest]
            self.sqnorm = {latest: self.last_sqnorm}

    def commit(self, step: int, device: torch.device) -> None:
        """End of ``step`` (all its buckets decoded): keep its new residuals, unless some
        bucket came out non-finite, in which case the step's residual updates are dropped.

        On the CPU the decision reads the decodes' flags. On an accelerator it is taken on the
        device (a select between the kept and the new residuals, one pass over them), so the
        hook never waits for the device: the flags reach the host only when stats are read."""
        on_device = self.on_device
        if on_device is None:
            on_device = device.type != "cpu"
        if not self.strict:  # updated in place: nothing to swap
            if not on_device:
                self.fold()
        elif not on_device:
            self.fold()
            if step not in self.bad_steps:
                for key in self.touched:
                    self.residuals[key], self.next[key] = self.next[key], self.residuals[key]
        elif step not in self.bad_steps:  # (a stats read may have folded it already)
            finite = self._finite_on_device(step)
            for key in self.touched:
                new, kept = self.next[key], self.residuals[key]
                if finite is not None:
                    for name, t in new.items():
                        torch.where(finite, t, kept[name], out=t)
                self.residuals[key], self.next[key] = new, kept
        self.touched = set()
        self.bad_steps = {s for s in self.bad_steps if s > step}

    def settle(self, keys: set, keep: bool) -> None:
        """Two copies (``strict``) settled per key instead of per step: the new residuals of
        ``keys`` are swapped in (``keep``, when their call committed) or dropped (it did not:
        the kept ones stay as they were before it). A call under a torchft manager commits
        when the manager's ``should_commit`` says so, not when a DDP step ends."""
        for key in keys & self.touched:
            if keep and key in self.residuals:
                self.residuals[key], self.next[key] = self.next[key], self.residuals[key]
        self.touched -= keys

    def resize(self, key: tuple, sizes: dict[str, int]) -> None:
        """Fit ``key``'s kept residuals to ``sizes`` (the engine's for another world size):
        each keeps its first elements (r1 is laid out as the tensor, its tail the padding),
        grown with zeros; a residual whose size is unchanged is kept as it is, and r2, the
        error of the chunk this rank reduced for the others, starts from zeros whenever the
        ranks' chunks changed, as its elements belong to another chunk then."""
        res = self.residuals.get(key)
        if res is None or {n: t.numel() for n, t in res.items()} == sizes:
            return
        new = {}
        for name, numel in sizes.items():
            t = torch.zeros(numel, dtype=self.dtype, device=next(iter(res.values())).device)
            if name == "r1" and name in res:
                m = min(numel, res[name].numel())
                t[:m] = res[name][:m]
            new[name] = t
        self.touched.discard(key)
        self.put(key, new)

    def _finite_on_device(self, step: int) -> Optional[torch.Tensor]:
        """A device bool, true when every decode of ``step`` was finite (None: no decode, as
        in a warm-up step). The step's decode results are summed into one entry on the device,
        [squared norm, non-finite buckets], so that they do not pile up between reads."""
        with self.lock:
            mine = [st for s, st, _ in self.decoded if s == step]
            if not mine:
                return None
            rows = torch.stack(mine)
            summary = torch.stack([rows[:, 0].sum(), (rows[:, 1] > 0).sum().to(rows.dtype)])
            self.decoded = [e for e in self.decoded if e[0] != step] + [(step, summary, True)]
        return summary[1] == 0

    def snapshot(self) -> dict[tuple, Residuals]:
        """A copy of the kept residuals (for ``state_dict``)."""
        return {k: {n: t.clone() for n, t in r.items()} for k, r in self.residuals.items()}

    def load(self, loaded: dict[tuple, Residuals]) -> None:
        """Forget the residuals and take ``loaded``'s, placed as their buckets come."""
        self.residuals, self.next, self.touched = {}, {}, set()
        # none saved (before the first compressed step): every bucket starts from zeros, as
        # in the run that saved them
        self.pending = {k: {n: t.clone() for n, t in r.items()} for k, r in loaded.items()} or None
