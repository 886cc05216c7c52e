"""Per-sync diagnostics behind quality_int4_vs_exact.json: the bench's loop
(pycomm/bench/quality_local_sgd.py, one node), and at each sync of an outer loop the exact mean
pseudo-gradient (a plain fp32 all-reduce of the same tensors, before the exchange) against
what the exchange delivered: their norms, the error's norm relative to the exact mean's (all
of it and per parameter tensor), the cosine, the outer momentum's norm, and the held-out
loss after the sync. The last record is the final ``sync()`` (its pseudo-gradient is zero,
so what it delivers is the residual).

    python benchmarks/quality_int4_diag.py charlm 2000 0 \\
        diloco-m02-H50,diloco-m02-H50-exact,localsgd-H50,localsgd-H50-exact out.json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

import pycomm
from pycomm.bench.quality_local_sgd import VARIANTS
from pycomm.bench.quality_tasks import (
    TASKS,
    batches,
    build_model,
    docs_text,
    evaluate,
    friedman_data,
    loss_of,
)


def run_rank(names: list[str], seeds: list[int], steps: int, warmup: int, task_name: str):
    torch.set_num_threads(1)
    task = dataclasses.replace(TASKS[task_name], steps=steps)
    vocab = 0
    if task.kind == "friedman":
        data: Any = friedman_data()
    else:
        train, held, vocab = docs_text()
        data = (train, held)
    out = {}
    for seed in seeds:
        for name in names:
            torch.manual_seed(seed)
            model = build_model(task, vocab)
            opt = torch.optim.AdamW(model.parameters(), lr=task.lr["adamw"], weight_decay=0.01)
            outer: Any = pycomm.LocalSGD(model, sync_every=1, codec="allreduce")
            log: list[dict] = []
            for step, batch in enumerate(batches(task, data, steps, seed)):
                if step == warmup:
                    outer = VARIANTS[name].build(model, None)
                    _record(outer, log)
                opt.zero_grad()
                loss_of(task, model, batch).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                outer.step()
                if step >= warmup and (step - warmup + 1) % outer.sync_every == 0:
                    log[-1]["eval_after"] = evaluate(task, model, data)
            before = evaluate(task, model, data)
            outer.sync()
            out[f"{seed}|{name}"] = {
                "log": log, "final": evaluate(task, model, data), "before_final_sync": before,
            }  # fmt: skip
    return out


def _record(outer: pycomm.DiLoCo, log: list[dict]) -> None:
    """Wrap ``outer``'s exchange (its public ``all_reduce``) to log each sync: the exact mean
    of the same tensors (a plain fp32 all-reduce of copies) against what the exchange
    delivered. The call is waited for at once (these variants have no delay)."""
    exchange = outer.exchange
    all_reduce = exchange.all_reduce

    def logged(tensors: list, key, *args, **kwargs):
        ex = torch.cat([t.detach().float().flatten() for t in tensors])
        dist.all_reduce(ex)
        ex /= dist.get_world_size()
        work = all_reduce(tensors, key, *args, **kwargs)
        work.wait()
        got = torch.cat([t.flatten() for t in tensors])
        err = got - ex
        per, o = [], 0
        for t in tensors:
            n = t.numel()
            per.append(
                round(err[o : o + n].norm().item() / max(ex[o : o + n].norm().item(), 1e-12), 3)
            )
            o += n
        moms = [
            s["momentum_buffer"] for s in outer.optimizer.state.values() if "momentum_buffer" in s
        ]
        log.append({
            "g": ex.norm().item(),
            "err": err.norm().item(),
            "rel": err.norm().item() / max(ex.norm().item(), 1e-12),
            "cos": torch.nn.functional.cosine_similarity(got, ex, dim=0).item(),
            "per_tensor_rel": per,
            "mom": sum(m.norm().item() ** 2 for m in moms) ** 0.5,
        })  # fmt: skip
        return work

    exchange.all_reduce = logged


if __name__ == "__main__":
    task, steps, seeds, names, path = sys.argv[1:6]
    res = pycomm.launch(run_rank, 2, names.split(","), [int(s) for s in seeds.split(",")],
                        int(steps), 200, task, timeout=7200)[0]  # fmt: skip
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    for k, v in res.items():
        syncs = v["log"][:-1]
        rel = statistics.mean(x["rel"] for x in syncs)
        print(f"{k}: final {v['final']:.4f} (before the final sync {v['before_final_sync']:.4f}), "
              f"{len(syncs)} syncs, delivered error / exact mean {rel:.3f}, final sync's "
              f"residual {v['log'][-1]['err']:.3f} against a last pseudo-gradient of "
              f"{syncs[-1]['g']:.3f}")  # fmt: skip
