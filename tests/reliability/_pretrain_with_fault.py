"""tools/pretrain_gpt.py's main, with a SIGKILL at one point of the save of one step (fault injection).

    MOE_CORE_FAULT=<call>:<n>@<step> python _pretrain_with_fault.py <pretrain_gpt flags>

kills this process with SIGKILL (no cleanup, no flush: a kill -9) right before the ``n``-th call of ``call``
made while the checkpoint of ``step`` is being saved. ``call`` is one of the file-system calls a save makes:
``write_item`` (DCP writing one tensor into its data file), ``fsync``, ``rename`` (os.rename, Path.rename),
``replace`` (os.replace) and ``unlink`` (deleting a file). MOE_CORE_FAULT unset: an ordinary run.
MOE_CORE_THREADS sets torch's thread count (the test's own, so float results match it bitwise).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import pretrain_gpt  # noqa: E402

from moe_core.training import trainer  # noqa: E402


def _arm(call: str, count: int, step: int) -> None:
    state = {"armed": False, "calls": 0}
    modules = {"write_item": (dcp_filesystem, "_write_item"), "fsync": (os, "fsync"), "rename": (os, "rename"),
               "replace": (os, "replace"), "unlink": (os, "unlink")}
    module, name = modules[call]
    original = getattr(module, name)

    def faulty(*args, **kwargs):
        if state["armed"]:
            state["calls"] += 1
            if state["calls"] == count:
                os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(module, name, faulty)
    save = trainer.save_checkpoint

    def save_checkpoint(save_dir, model, optimizer, scheduler, at_step, *args, **kwargs):
        state["armed"] = at_step == step
        try:
            return save(save_dir, model, optimizer, scheduler, at_step, *args, **kwargs)
        finally:
            state["armed"] = False

    trainer.save_checkpoint = save_checkpoint


if __name__ == "__main__":
    if "MOE_CORE_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["MOE_CORE_THREADS"]))
    fault = os.environ.get("MOE_CORE_FAULT")
    if fault:
        where, step = fault.split("@")
        call, count = where.split(":")
        _arm(call, int(count), int(step))
    pretrain_gpt.main(sys.argv[1:])
