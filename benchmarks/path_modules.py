"""Which pycomm modules one DDP bucket, one FSDP2 reduce-scatter and one
``pycomm.Exchange.all_reduce`` pass through, counted at run time: every function and method
defined in a pycomm module is wrapped to note its module when called, on whatever thread calls
it (the caller's, the exchange's issuing thread, the collectives' callback threads), while one
compressed step's backward runs. A "stop" is a call that enters another pycomm module than the
one it is called from (on the same thread); the modules are the distinct ones entered.
``pycomm.ops`` (the kernels' Python face) counts; torch's modules do not.

    python benchmarks/path_modules.py              # int8, 2 ranks on gloo
    python benchmarks/path_modules.py --hook int4
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
import threading
from typing import Any

import torch

import pycomm


class _Trace:
    """Wraps pycomm's functions and methods; while ``on``, notes each call that enters a
    module other than its caller's."""

    def __init__(self) -> None:
        self.on = False
        self.stops: list[str] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()
        self.local = threading.local()
        mods = [
            m
            for n, m in sys.modules.items()
            if n.startswith("pycomm") and m is not None and not n.startswith("pycomm.bench")
        ]
        wrapped: dict[int, Any] = {}  # each function once, wherever a module imported it
        for mod in mods:
            for value in list(vars(mod).values()):
                if inspect.isfunction(value) and value.__module__ == mod.__name__:
                    wrapped[id(value)] = self._wrap(value, mod.__name__)
                elif inspect.isclass(value) and value.__module__ == mod.__name__:
                    for k, v in list(vars(value).items()):
                        if inspect.isfunction(v) and not (k.startswith("__") and k != "__call__"):
                            setattr(value, k, self._wrap(v, mod.__name__))
        for mod in mods:
            for attr, value in list(vars(mod).items()):
                if id(value) in wrapped:
                    setattr(mod, attr, wrapped[id(value)])

    def _wrap(self, fn: Any, module: str) -> Any:
        @functools.wraps(fn)
        def noted(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            stack = getattr(self.local, "stack", None)
            if stack is None:
                stack = self.local.stack = []
            if not stack or stack[-1] != module:
                with self.lock:
                    self.stops.append(module)
                    self.threads.add(threading.current_thread().name)
            stack.append(module)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()

        return noted

    def start(self) -> None:
        self.stops, self.threads = [], set()
        self.on = True

    def stop(self) -> list[str]:
        self.on = False
        # the Exchange's issuing thread, if the path went through it (a thread hop)
        return [*self.stops, *(f"thread:{t}" for t in sorted(self.threads) if "exchange" in t)]


def _ddp(hook: str, trace: _Trace) -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    ddp = pycomm.wrap(model, hook=hook, bucket_cap_mb=1.0)  # one bucket
    x = torch.randn(8, 256)
    for _ in range(4):  # past the warm-up: the compressed exchange
        ddp(x).sum().backward()
    out = ddp(x).sum()
    trace.start()
    out.backward()  # the hook, and DDP's wait for its future
    return trace.stop()


def _fsdp(hook: str, trace: _Trace) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    fully_shard(model)
    comm = pycomm.fsdp.compress(model, hook=hook, hook_options={"start_iter": 0})
    x = torch.randn(8, 256)
    for _ in range(2):
        model(x).sum().backward()
    out = model(x).sum()
    trace.start()
    out.backward()  # the root module's one reduce-scatter, through the Exchange
    _ = comm.exchange.stats  # every call done (its callbacks on the issuing thread)
    return trace.stop()


def _exchange(hook: str, trace: _Trace) -> list[str]:
    ex = pycomm.Exchange(hook)
    t = torch.randn(256 * 256)
    ex.all_reduce(t, key="t").wait()  # the key's first call (its order compared in full)
    trace.start()
    ex.all_reduce(t, key="t").wait()
    _ = ex.stats  # every call done (its callbacks on the issuing thread)
    return trace.stop()


def run_rank(hook: str) -> dict[str, list[str]]:
    import pycomm.fsdp  # noqa: F401 - wrapped with the rest

    trace = _Trace()  # before the models: what they bind is the wrapped code
    return {
        "DDP bucket": _ddp(hook, trace),
        "FSDP2 reduce-scatter": _fsdp(hook, trace),
        "Exchange.all_reduce": _exchange(hook, trace),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hook", default="int8")
    args = ap.parse_args()
    res = pycomm.launch(run_rank, 2, args.hook, backend="gloo", timeout=120)[0]
    for path, noted in res.items():
        stops = [s for s in noted if not s.startswith("thread:")]
        hops = [s.removeprefix("thread:") for s in noted if s.startswith("thread:")]
        modules = list(dict.fromkeys(stops))
        print(f"{path} ({args.hook}): {len(modules)} modules, {len(stops)} stops")
        print(f"  on the Exchange's issuing thread: {', '.join(hops) or 'no'}")
        print("  modules: " + ", ".join(modules))
        print("  stops:   " + " -> ".join(stops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
