"""The framework adapters' own refusals, raised on every rank: pycomm.accelerate.register
needs only what it reads of an Accelerator (its gradient_accumulation_steps, its DDP kwargs
handler), so these run without Accelerate installed."""

import re
import types

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm.accelerate


def _rank_accelerate_refused_on_one_rank(case):
    rank = dist.get_rank()
    accelerator = types.SimpleNamespace(
        num_processes=2, ddp_handler=None, gradient_accumulation_steps=2 if rank == 0 else 1
    )
    model = DDP(torch.nn.Linear(4, 2))
    kwargs = {}
    if case == "two accumulators":
        kwargs["accumulate_steps"] = 2
    elif case == "a bad accumulate_steps beside the accelerator's":
        kwargs["accumulate_steps"] = "2" if rank == 0 else 1  # rank 0 accumulates too
    elif case == "an option twice" and rank == 1:
        kwargs = {"hook_options": {"block": 64}, "block": 32}
    try:
        pycomm.accelerate.register(accelerator, model, hook="int8", **kwargs)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("two accumulators", r"on rank 0: .*accumulate_steps=2 with the accelerator's "
         r"gradient_accumulation_steps=2: two accumulators"),
        ("an option twice", r"on rank 1: .*'block' given both"),
        ("a bad accumulate_steps beside the accelerator's", r"pycomm.accelerate."
         r"register: on rank 0: accumulate_steps='2', expected an int >= 1"),
    ],
)  # fmt: skip
def test_accelerate_register_refused_on_one_rank_is_raised_on_every_rank(case, pattern):
    for error in run_ranks(_rank_accelerate_refused_on_one_rank, 2, case, timeout=60):
        assert error is not None and error[0] == "ValueError", error
        assert re.search(pattern, error[1]), error[1]
