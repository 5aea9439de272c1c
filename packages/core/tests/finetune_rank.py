"""One rank of `narrows finetune` launched by torchrun, with an optional planted fault
(``NARROWS_TEST_FAULT``) for the twins in `test_finetune_ranks.py`."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from narrows.core.app.cli import main
from narrows.core.app.finetune import loop
from narrows.core.protocol import determinism

fault = os.environ.get("NARROWS_TEST_FAULT", "")
argv = sys.argv[1:]
if fault == "mean":  # DDP's own averaging instead of the sum the loss normalisation needs
    determinism.rank_ordered_sum = lambda average=False: (
        lambda state, bucket: default_hooks.allreduce_hook(dist.group.WORLD, bucket)
    )
elif fault == "seed":  # every micro-batch seeded alike: not the masks one process draws
    loop.micro_seed = lambda seed, index: seed
elif fault == "diverge" and os.environ["RANK"] == "1":  # a rank given other flags
    argv += ["--seed", "1"]
sys.exit(main(["finetune", *argv]))
