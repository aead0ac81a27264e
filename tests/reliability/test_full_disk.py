"""A full disk during a save (injected: each write of one file fails with ENOSPC, as torch's writer and
Python's report it): the error names the checkpoint, the file and that the disk is full; ``latest`` still names
the previous checkpoint, which loads; the next save, with space again, publishes and cleans up."""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from moe_core.training import checkpoint_files as files
from moe_core.training.checkpoint import load_checkpoint, save_checkpoint
from moe_core.training.step import setup_training
from tests.reliability._common import TINY, parse


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _torch_write_item(*_args, **_kwargs):
    """What torch.save raises into a stream on a full disk: inline_container.cc's message, the OSError as its
    context only."""
    try:
        raise _enospc()
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


class _FullFile(io.RawIOBase):
    """A file on a full disk: every write fails."""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        raise _enospc()


def _open_full(name: str):
    def open_(path, mode="r", *args, **kwargs):
        return _FullFile() if os.path.basename(path) == name else open(path, mode, *args, **kwargs)
    return open_


def _state(tmp_path):
    model, training = parse(TINY + ["--output-dir", str(tmp_path / "out")])
    return model, training, setup_training(model, training)


@pytest.mark.parametrize("failing", ["__0_0.distcp", files.STATE, files.MANIFEST])
def test_a_full_disk_names_the_checkpoint_and_file_and_keeps_the_previous(tmp_path, monkeypatch, failing):
    model, training, state = _state(tmp_path)
    save = tmp_path / "ckpt"

    def save_step(step: int):
        return save_checkpoint(save, state.model, state.optimizer, state.scheduler, step, seed=training.seed,
                               model_config=model)

    save_step(1)
    weights = {k: v.clone() for k, v in state.model.state_dict().items()}
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    with monkeypatch.context() as patch:
        if failing == "__0_0.distcp":
            patch.setattr(dcp_filesystem, "_write_item", _torch_write_item)
        else:
            patch.setattr(files, "open", _open_full(failing), raising=False)
        with pytest.raises(OSError, match=rf"save: the checkpoint {save / 'step_2'} was not written: the disk is full: "
                                          rf"\[Errno {errno.ENOSPC}\] No space left on device: "
                                          rf"'{save / 'step_2.tmp' / failing}'; {save / 'latest'} still names the "
                                          "previous one") as raised:
            save_step(2)
    assert raised.value.errno == errno.ENOSPC
    assert (save / "latest").read_text() == "step_1\n"
    _, _, loaded = _state(tmp_path)
    assert load_checkpoint(save, loaded.model, loaded.optimizer, loaded.scheduler, seed=training.seed,
                           model_config=model) == 1
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert save_step(3) == save / "step_3"
    assert sorted(p.name for p in save.iterdir()) == ["latest", "step_1", "step_3"]
