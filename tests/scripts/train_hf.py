"""The Hugging Face Trainer with pycomm.transformers, under torchrun (2 gloo ranks on the CPU) or
as one process. Runs the scenarios of tests/integrations/test_transformers.py in one launch and
writes each rank's results as JSON into ``argv[1]/rank<rank>.json``.

``argv[2]``: ``all`` (every scenario, 2 ranks) or ``single`` (one process).
"""

import contextlib
import json
import logging
import os
import shutil
import sys
import warnings

import torch
from transformers import Trainer, TrainingArguments

import pycomm
import pycomm.transformers


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def forward(self, x, labels):
        return {"loss": ((self.net(x) - labels) ** 2).mean()}


def data(n: int = 48) -> list:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 16, generator=g), torch.randn(n, 1, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def args(out: str, **kw) -> TrainingArguments:
    base = dict(
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,  # 6 micro-batches a rank and epoch: 3 optimizer steps
        num_train_epochs=3,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
        seed=0,
    )
    base.update(kw)
    return TrainingArguments(out, **base)


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def fit(out: str, hook=None, resume=None, **kw):
    model = Net()
    trainer = Trainer(model=model, args=args(out, **kw), train_dataset=data())
    cb = None if hook is None else pycomm.transformers.register(trainer, hook=hook)
    trainer.train(resume_from_checkpoint=resume)
    return flat(model), cb


def error(fn) -> "str | None":
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return None


@contextlib.contextmanager
def _messages(name: str):
    """The messages logged to ``name`` inside the block."""
    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(name).addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger(name).removeHandler(handler)


def main(out_dir: str, mode: str) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rank = int(os.environ.get("RANK", "0"))
    res: dict = {}
    tmp = os.path.join(out_dir, "runs")

    if mode == "single":
        model = Net()
        trainer = Trainer(model=model, args=args(f"{tmp}/single"), train_dataset=data())
        cb = pycomm.transformers.register(trainer, hook="int8")
        with _messages("pycomm.transformers") as said:
            trainer.train()
            trainer.train()  # a second train(): still no hook, no second message
        res["state"] = cb.state is None
        res["trained"] = not torch.equal(flat(model), flat(Net()))
        res["messages"] = said
    else:
        # resume: int8, 3 epochs of 3 steps, a checkpoint every 4 steps; the same Trainer
        # setup resumed from checkpoint-4 must end bitwise where the uninterrupted run did
        full, cb = fit(f"{tmp}/int8", "int8", save_strategy="steps", save_steps=4)
        res["saved"] = sorted(os.listdir(f"{tmp}/int8/checkpoint-4"))
        res["compressed"] = cb.state.stats["compression"] > 1
        resumed, cb = fit(
            f"{tmp}/int8", "int8", save_strategy="steps", save_steps=4,
            resume=f"{tmp}/int8/checkpoint-4",
        )  # fmt: skip
        res["resume"] = (torch.equal(full, resumed), (full - resumed).abs().max().item())
        res["resumed_steps"] = cb.state.stats["steps"]
        # the check that the resume can fail: the same checkpoint without pycomm's files
        # (as one written without pycomm) warns, starts the hook afresh, and ends elsewhere
        bare = f"{tmp}/int8-bare/checkpoint-4"
        if rank == 0:
            shutil.copytree(
                f"{tmp}/int8/checkpoint-4", bare, ignore=shutil.ignore_patterns("pycomm_*")
            )
        torch.distributed.barrier()
        with _messages("pycomm.transformers") as said:
            afresh, cb = fit(f"{tmp}/int8-bare", "int8", resume=bare)
        res["afresh"] = (torch.equal(full, afresh), (full - afresh).abs().max().item())
        res["afresh_steps"] = cb.state.stats["steps"]
        res["afresh_said"] = said

        # allreduce: bitwise the Trainer without pycomm, accumulation included
        plain, _ = fit(f"{tmp}/plain")
        ours, cb = fit(f"{tmp}/allreduce", "allreduce")
        res["allreduce"] = torch.equal(plain, ours)
        res["allreduce_steps"] = cb.state.stats["steps"]
        # a second train() on the same Trainer (it keeps its DDP): the same hook goes on
        model = Net()
        trainer = Trainer(model=model, args=args(f"{tmp}/twice"), train_dataset=data())
        cb = pycomm.transformers.register(trainer, hook="int8")
        trainer.train()
        first = cb.state
        trainer.train()
        res["twice"] = [cb.state is first, cb.state.stats["steps"]]
        res["params"] = ours.tolist()

        # refusals
        trainer = Trainer(model=Net(), args=args(f"{tmp}/x"), train_dataset=data())
        res["accumulate"] = error(
            lambda: pycomm.transformers.register(trainer, "int8", {"accumulate_steps": 2})
        )
        res["options_type"] = error(lambda: pycomm.transformers.register(trainer, "int8", 3))
        # a bad option on one rank only: the same error on both
        res["one_rank"] = error(
            lambda: pycomm.transformers.register(
                trainer, "int8", {"accumulate_steps": 2} if rank == 1 else {}
            )
        )
        trainer.args.deepspeed = {"train_batch_size": "auto"}  # deepspeed is not installed here
        res["deepspeed"] = error(lambda: pycomm.transformers.register(trainer, "int8"))
        res["fsdp"] = error(
            lambda: pycomm.transformers.register(
                Trainer(
                    model=Net(),
                    args=args(f"{tmp}/fsdp", fsdp=True, fsdp_config={"version": 2}),
                    train_dataset=data(),
                ),
                "int8",
            )
        )
        res["bad_hook"] = error(lambda: fit(f"{tmp}/bad", "int9"))
        res["other_hook"] = error(
            lambda: fit(
                f"{tmp}/int8",
                "onebit",
                save_strategy="steps",
                save_steps=4,
                resume=f"{tmp}/int8/checkpoint-4",
            )  # fmt: skip
        )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
