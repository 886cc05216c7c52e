"""Ray Train with pycomm.ray on local CPU workers (a local Ray on the loopback, no dashboard):
the scenarios of tests/integrations/test_ray.py, each worker's results written as JSON into
``argv[1]/<run>-rank<rank>.json``.

Runs: ``first`` (2 workers: plain prepare_model against pycomm's allreduce, the refusals, int8
for 4 epochs reporting a checkpoint after epoch 2), ``resume`` (2 workers: int8 resumed from
that checkpoint for epochs 3-4, with and without the hook state), ``single`` (1 worker).
"""

import json
import logging
import os
import sys
import tempfile
import warnings

import ray
import ray.train
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _epoch(model, opt, epoch: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * epoch + rank)
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return None


def _worker(config: dict) -> None:
    import pycomm
    import pycomm.ray

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    run, out = config["run"], config["out"]
    res: dict = {"world_size": ctx.get_world_size()}
    messages: list = []
    handler = logging.Handler()
    handler.emit = lambda r: messages.append(r.getMessage())
    logging.getLogger("pycomm.ray").addHandler(handler)

    def train(model, epochs, start=0, opt_state=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        for epoch in range(start, start + epochs):
            _epoch(model, opt, epoch, rank)
        return opt

    if run == "first":
        plain = ray.train.torch.prepare_model(_net())
        train(plain, 2)
        ours = pycomm.ray.prepare_model(_net(), hook="allreduce")
        train(ours, 2)
        res["allreduce"] = torch.equal(_flat(plain), _flat(ours))
        res["allreduce_steps"] = pycomm.hook_state(ours).stats["steps"]
        res["fsdp"] = _error(lambda: pycomm.ray.prepare_model(_net(), parallel_strategy="fsdp"))
        res["none"] = _error(lambda: pycomm.ray.prepare_model(_net(), parallel_strategy=None))
        res["options"] = _error(lambda: pycomm.ray.prepare_model(_net(), "int8", [64]))
        res["bad_hook"] = _error(lambda: pycomm.ray.prepare_model(_net(), hook="int9"))
        res["one_worker"] = _error(  # bad on worker 1 only: the same error on both
            lambda: pycomm.ray.prepare_model(_net(), "int8", [64] if rank == 1 else None)
        )

        model = pycomm.ray.prepare_model(_net(), hook="int8")
        opt = train(model, 2)
        with tempfile.TemporaryDirectory() as d:
            res["saved"] = os.path.basename(pycomm.ray.save_state(model, d))
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()},
                           os.path.join(d, "model.pt"))  # fmt: skip
            ray.train.report({"epoch": 2}, checkpoint=Checkpoint.from_directory(d))
        train(model, 2, start=2, opt_state=opt.state_dict())
        res["full"] = _flat(model).tolist()
        res["compressed"] = pycomm.hook_state(model).stats["compression"] > 1
    elif run == "resume":
        ckpt = ray.train.get_checkpoint()
        res["files"] = sorted(os.listdir(ckpt.to_directory()))
        for load in (True, False):
            model = pycomm.ray.prepare_model(_net(), hook="int8")
            with ckpt.as_directory() as d:
                saved = torch.load(os.path.join(d, "model.pt"), weights_only=True)
            model.module.load_state_dict(saved["model"])
            if load:
                res["loaded"] = pycomm.ray.load_state(model, ckpt)
            train(model, 2, start=2, opt_state=saved["opt"])
            res[f"resumed_load{load}"] = _flat(model).tolist()
        other = pycomm.ray.prepare_model(_net(), hook="onebit")
        res["other_hook"] = _error(lambda: pycomm.ray.load_state(other, ckpt))
    else:  # one worker
        model = pycomm.ray.prepare_model(_net(), hook="int8")
        res["bare"] = type(model).__name__
        before = _flat(model).clone()
        train(model, 1)
        res["trained"] = not torch.equal(before, _flat(model))
        with tempfile.TemporaryDirectory() as d:
            res["saved"] = pycomm.ray.save_state(model, d)
        res["loaded"] = pycomm.ray.load_state(model, out)
        res["messages"] = [m for m in messages if "one worker" in m]
    with open(os.path.join(out, f"{run}-rank{rank}.json"), "w") as f:
        json.dump(res, f)


def main(out: str) -> None:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    try:
        # "resume" runs under the name of "first": Ray hands it that run's latest checkpoint
        for run, workers, name in (
            ("first", 2, "int8"),
            ("resume", 2, "int8"),
            ("single", 1, "one"),
        ):
            TorchTrainer(
                _worker,
                train_loop_config={"run": run, "out": out},
                scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                run_config=RunConfig(name=name, storage_path=os.path.join(out, "ray")),
            ).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
