"""save_hf of a Hugging Face directory's model, with a SIGKILL at one point of the write (fault injection).

    MOE_CORE_FAULT=<call>:<n> python _save_hf_with_fault.py HF_DIR OUT_DIR

loads HF_DIR and exports it to OUT_DIR (shards of 8 KB, HF_DIR as the reference, overwrite=True), killing
this process with SIGKILL (a kill -9: no cleanup) at the ``n``-th call of ``call``: ``save_file`` (a
safetensors shard, killed when half of it is written), ``copy`` (a reference file, killed when half of it is
copied) or ``rename`` (killed before ``os.rename``). MOE_CORE_FAULT unset: an ordinary export.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

from moe_core.interop import hf
from moe_core.interop.hf import load_hf, save_hf


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(call: str, count: int) -> None:
    calls = {"n": 0}

    def due() -> bool:
        calls["n"] += 1
        return calls["n"] == count

    save_file, copyfile, rename = hf.save_file, shutil.copyfile, os.rename

    def faulty_save_file(tensors, filename, *args, **kwargs):
        save_file(tensors, filename, *args, **kwargs)
        if due():
            os.truncate(filename, Path(filename).stat().st_size // 2)
            _kill()

    def faulty_copyfile(src, dst, *args, **kwargs):
        if due():
            data = Path(src).read_bytes()
            Path(dst).write_bytes(data[:len(data) // 2])
            _kill()
        return copyfile(src, dst, *args, **kwargs)

    def faulty_rename(src, dst, *args, **kwargs):
        if due():
            _kill()
        return rename(src, dst, *args, **kwargs)

    if call == "save_file":
        hf.save_file = faulty_save_file
    elif call == "copy":
        shutil.copyfile = faulty_copyfile
    else:
        os.rename = faulty_rename


if __name__ == "__main__":
    fault = os.environ.get("MOE_CORE_FAULT")
    if fault:
        name, n = fault.split(":")
        _arm(name, int(n))
    config, model = load_hf(sys.argv[1])
    save_hf(model, config, sys.argv[2], max_shard_size="8KB", reference=sys.argv[1], overwrite=True)
