"""Checkpoint layout and fingerprints: step_<N>/ directories, ``latest``, rotation, what a save replaces and
what it refuses to, the architecture check (also for --finetune, and a checkpoint without a recorded config) and
the partial load, refusing non-finite weights on save and on load, and --save checked before training."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from moe_core.config import TransformerConfig
from moe_core.training import checkpoint
from moe_core.training.checkpoint import CheckpointError, load_checkpoint, load_model_weights, save_checkpoint
from moe_core.training.config import TrainingConfig
from moe_core.training.step import setup_training
from moe_core.training.trainer import pretrain

MODEL = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                          moe_ffn_hidden_size=16, ffn_hidden_size=32, seq_length=8)
TRAINING = TrainingConfig(micro_batch_size=2, train_iters=10, lr_warmup_iters=0)


def _state(model: TransformerConfig = MODEL, seed: int = TRAINING.seed):
    return setup_training(model, dataclasses.replace(TRAINING, seed=seed))


def _save(save_dir, state, step, model: TransformerConfig | None = MODEL, keep=2):
    return save_checkpoint(save_dir, state.model, state.optimizer, state.scheduler, step, seed=TRAINING.seed,
                           model_config=model, keep=keep)


def _load(path, state, model=MODEL, **kwargs):
    return load_checkpoint(path, state.model, state.optimizer, state.scheduler, seed=TRAINING.seed,
                           model_config=model, **kwargs)


def test_rotation_keeps_the_newest_and_latest_points_at_the_last(tmp_path):
    state = _state()
    for step in (1, 2, 3, 4):
        assert _save(tmp_path, state, step) == tmp_path / f"step_{step}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_4"]
    assert (tmp_path / "latest").read_text() == "step_4\n"
    assert json.loads((tmp_path / "step_4" / "state.json").read_text())["model_config"]["num_layers"] == 2
    manifest = json.loads((tmp_path / "step_4" / "manifest.json").read_text())["files"]
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "state.json"]
    assert _load(tmp_path, _state()) == 4
    assert _load(tmp_path / "step_3", _state()) == 3
    _save(tmp_path, state, 5, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_5"]


@pytest.mark.parametrize("pointer", ["step_9\n", "../../etc\n", ""])
def test_an_unusable_latest_falls_back_to_the_newest_complete(tmp_path, pointer):
    state = _state()
    _save(tmp_path, state, 1)
    _save(tmp_path, state, 2)
    (tmp_path / "latest").write_text(pointer)
    notes = []
    assert _load(tmp_path, _state(), log=notes.append) == 2
    assert notes == [f"load: {tmp_path / 'latest'} names {pointer.strip()!r}, which is no complete checkpoint; "
                     "loading step_2, the newest complete one"]


@pytest.mark.parametrize("kind", ["file", "directory", "link"])
def test_a_stale_tmp_entry_is_replaced(tmp_path, kind):
    """A ``step_<N>.tmp`` is the saver's (a crash leaves one): whatever it is, the next save deletes it."""
    stale = tmp_path / "step_1.tmp"
    if kind == "file":
        stale.write_text("left by a crash")
    elif kind == "directory":
        (stale / "sub").mkdir(parents=True)
    else:
        stale.symlink_to(tmp_path / "nowhere")
    (tmp_path / "step_7.tmp").write_text("")  # another step's
    assert _save(tmp_path, _state(), 1) == tmp_path / "step_1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]
    assert _load(tmp_path, _state()) == 1


@pytest.mark.parametrize("name, kind, described", [
    ("step_2", "file", "not a directory"), ("step_2", "directory", "a directory without manifest.json"),
    ("step_9", "file", "not a directory"), ("latest", "directory", "not a file"),
])
def test_what_save_did_not_write_is_never_replaced(tmp_path, name, kind, described):
    """A ``step_<N>`` that is no checkpoint (or a ``latest`` that is no file) is the user's: a save refuses to
    start, naming it, and leaves the save directory as it was."""
    state = _state()
    _save(tmp_path, state, 1)
    foreign = tmp_path / name
    if name == "latest":
        foreign.unlink()
    if kind == "file":
        foreign.write_text("the user's")
    else:
        (foreign / "notes.txt").parent.mkdir()
        (foreign / "notes.txt").write_text("the user's")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=rf"save: {tmp_path} holds what save_checkpoint did not write under a name "
                                         rf"it writes: {foreign} \({described}\); .*move it away or save elsewhere"):
        _save(tmp_path, state, 2)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_non_finite_weights_are_never_saved(tmp_path):
    state = _state()
    _save(tmp_path, state, 1)
    with torch.no_grad():
        state.model.decoder.layers[1].mlp.experts.linear_fc2.weight[0, 0, 0] = float("inf")
    with pytest.raises(RuntimeError, match=r"refusing to save step 2: model\.decoder\.layers\.1\.mlp\.experts\."
                                           r"linear_fc2\.weight holds NaN or Inf"):
        _save(tmp_path, state, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]
    assert (tmp_path / "latest").read_text() == "step_1\n"


@pytest.mark.parametrize("change", [dict(num_layers=1), dict(num_attention_heads=4), dict(num_moe_experts=8),
                                    dict(hidden_size=32), dict(moe_router_score_function="sigmoid"),
                                    dict(moe_router_topk=1), dict(moe_ffn_hidden_size=8)],
                         ids=lambda c: next(iter(c)))
def test_another_architecture_is_refused_naming_the_field(tmp_path, change):
    _save(tmp_path, _state(), 3)
    other = dataclasses.replace(MODEL, **change)
    name, value = next(iter(change.items()))
    with pytest.raises(CheckpointError, match=rf"holds another architecture \({name}: {getattr(MODEL, name)!r} in "
                                              rf"the checkpoint, {value!r} now.*pass load_partial"):
        _load(tmp_path, _state(other), other)


def test_training_settings_may_change(tmp_path):
    """Fields of RESUMABLE_FIELDS (coefficients, dispatcher, sequence length) differ: the checkpoint loads."""
    state = _state()
    _save(tmp_path, state, 3)
    other = dataclasses.replace(MODEL, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3, seq_length=16,
                                moe_token_dispatcher_type="allgather")
    loaded = _state(other)
    assert _load(tmp_path, loaded, other) == 3
    for (name, want), got in zip(state.model.state_dict().items(), loaded.model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_partial_load_takes_the_matching_weights_only(tmp_path):
    saved = _state()
    _save(tmp_path, saved, 3)
    other = dataclasses.replace(MODEL, num_moe_experts=8)
    fresh, loaded = _state(other, seed=7), _state(other, seed=7)
    notes = []
    assert _load(tmp_path, loaded, other, partial=True, log=notes.append) == 0
    want, before = saved.model.state_dict(), fresh.model.state_dict()
    kept = {name for name in before if ".mlp." in name}  # the router and the experts: 8 experts now, not 4
    for name, got in loaded.model.state_dict().items():
        assert torch.equal(got, before[name] if name in kept else want[name]), name
    assert loaded.scheduler.last_epoch == 0
    assert notes[0].startswith(f"load: partial load of {tmp_path / 'step_3'}: 11 of 17 tensors; kept fresh: ")
    assert "num_moe_experts: 4 in the checkpoint, 8 now" in notes[0]


@pytest.mark.parametrize("blocked", ["unwritable", "foreign"])
def test_a_save_directory_that_would_fail_fails_before_training(tmp_path, blocked):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    if blocked == "unwritable":
        save, message = blocker / "ckpt", rf"save: cannot write checkpoints to {blocker / 'ckpt'}: .*Not a directory"
    else:  # a step far beyond the run's: found at start-up, not after hours of training
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "step_5000").write_text("")
        save, message = tmp_path / "ckpt", rf"{tmp_path / 'ckpt' / 'step_5000'} \(not a directory\)"
    cfg = dataclasses.replace(TRAINING, save=str(save), output_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match=message):
        pretrain(MODEL, cfg, log=lambda *_: None)
    assert not (tmp_path / "out").exists()  # nothing ran


def _save_non_finite(tmp_path, monkeypatch, where: str) -> str:
    """A checkpoint (step 1, manifest intact) with one NaN, as another tool could write it: the save's own
    check is switched off. Returns the tensor's key."""
    state = _state()
    get_state_dict(state.model, state.optimizer)  # creates AdamW's state (zero moments)
    weight = state.model.decoder.layers[1].mlp.experts.linear_fc2.weight
    with torch.no_grad():
        (weight if where == "model" else state.optimizer.state[weight]["exp_avg"])[0, 0, 0] = float("nan")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "_first_non_finite", lambda tree: None)
        _save(tmp_path, state, 1)
    prefix = "model." if where == "model" else "optim.state."
    suffix = "" if where == "model" else ".exp_avg"
    return f"{prefix}decoder.layers.1.mlp.experts.linear_fc2.weight{suffix}"


@pytest.mark.parametrize("loader", ["load", "finetune", "partial"])
@pytest.mark.parametrize("where", ["model", "optimizer"])
def test_non_finite_values_are_refused_at_load(tmp_path, monkeypatch, where, loader):
    key = _save_non_finite(tmp_path, monkeypatch, where)
    state = _state()
    load = {"load": lambda: _load(tmp_path, state),
            "finetune": lambda: load_model_weights(tmp_path, state.model, model_config=MODEL),
            "partial": lambda: _load(tmp_path, state, partial=True)}[loader]
    if where == "optimizer" and loader != "load":  # the weights alone are finite: they load
        load()
        return
    with pytest.raises(CheckpointError, match=rf"load: {key} in {tmp_path / 'step_1'} holds NaN or Inf"):
        load()


def test_the_finite_check_covers_every_floating_tensor():
    """Every floating tensor of a nested state dict counts (bf16 too, and a 0-dim one), empty ones and integers
    never do."""
    tree = {"a": {"b": torch.ones(3), "c": torch.zeros(0), "d": torch.arange(4)},
            "e": torch.tensor([1.0, -float("inf")], dtype=torch.bfloat16), "f": torch.tensor(2.0)}
    assert checkpoint._first_non_finite(tree) == "e"
    tree["e"] = tree["e"].nan_to_num()
    assert checkpoint._first_non_finite(tree) is None
    tree["a"]["b"][1] = float("nan")
    assert checkpoint._first_non_finite(tree) == "a.b"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_finite_check_syncs_the_host_once_on_cuda():
    """Hundreds of CUDA tensors of two dtypes and a CPU scalar (AdamW's step outside the fused optimizer): one
    synchronising call (the verdict's read), whatever the count."""
    tree = {f"w{i}": torch.randn(64, 33, device="cuda", dtype=torch.bfloat16 if i % 2 else torch.float32)
            for i in range(300)}
    tree["step"] = torch.tensor(3.0)
    for expected in (None, "w7"):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                found = checkpoint._first_non_finite(tree)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert found == expected
        syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
        assert len(syncs) == (1 if expected is None else 2), [str(w.message) for w in syncs]  # + the flags' read
        tree["w7"][3, 5] = float("inf")


@pytest.mark.parametrize("change", [dict(moe_router_topk=4), dict(moe_router_score_function="sigmoid")],
                         ids=lambda c: next(iter(c)))
def test_finetune_refuses_another_architecture_unless_partial(tmp_path, change):
    """--finetune compares the routing fields as --load does (same shapes, another function), and
    --load-partial is its opt-out too."""
    saved = _state()
    _save(tmp_path, saved, 3)
    other = dataclasses.replace(MODEL, **change)
    name, value = next(iter(change.items()))
    loaded = _state(other)
    with pytest.raises(CheckpointError, match=rf"another architecture \({name}: {getattr(MODEL, name)!r} in the "
                                              rf"checkpoint, {value!r} now\).*pass load_partial"):
        load_model_weights(tmp_path, loaded.model, model_config=other)
    notes = []
    load_model_weights(tmp_path, loaded.model, model_config=other, partial=True, log=notes.append)
    assert notes == [f"load: partial load of {tmp_path / 'step_3'}: 17 of 17 tensors; kept fresh: none; "
                     f"architecture differences: {name}: {getattr(MODEL, name)!r} in the checkpoint, {value!r} now"]
    for (key, want), got in zip(saved.model.state_dict().items(), loaded.model.state_dict().values(), strict=True):
        assert torch.equal(got, want), key


@pytest.mark.parametrize("loader", ["load", "finetune"])
def test_a_checkpoint_without_a_recorded_config_is_refused_unless_partial(tmp_path, loader):
    """Its architecture cannot be compared (an import by an older tools/hf_checkpoint.py): the error says how to
    fix it; --load-partial loads the weights whose names and shapes match."""
    _save(tmp_path, _state(), 3, model=None)
    state = _state()
    load = {"load": lambda **kw: _load(tmp_path, state, **kw),
            "finetune": lambda **kw: load_model_weights(tmp_path, state.model, model_config=MODEL, **kw)}[loader]
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'step_3' / 'state.json'} records no model config .*"
                                              r"re-import the checkpoint .* or pass load_partial"):
        load()
    notes = []
    load(partial=True, log=notes.append)
    assert notes[0].endswith("kept fresh: none; architecture differences: unknown (state.json records no model "
                             "config)")


@pytest.mark.parametrize("change, named", [
    (dict(num_moe_experts=8), r"decoder\.layers\.0\.mlp\.router\.weight \(8, 16\) \(\(4, 16\) in the checkpoint\)"),
    (dict(num_layers=3), r"decoder\.layers\.2\.input_layernorm\.weight \(16,\) \(missing in the checkpoint\)"),
], ids=["shape", "missing"])
def test_weights_of_other_shapes_are_named_when_the_architecture_is_not_checked(tmp_path, change, named):
    """Without a config to compare (tools/hf_checkpoint.py export): each weight the checkpoint lacks or holds in
    another shape is named, with both shapes."""
    _save(tmp_path, _state(), 3)
    other = dataclasses.replace(MODEL, **change)
    with pytest.raises(CheckpointError, match=rf"does not hold the weights .*{named}.*pass load_partial"):
        load_model_weights(tmp_path, _state(other).model)


@pytest.mark.parametrize("finetune, change", [(False, dict(num_layers=1)), (True, dict(moe_router_topk=4))],
                         ids=["load", "finetune"])
def test_pretrain_loads_another_architecture_only_when_partial(tmp_path, finetune, change):
    """--load and --finetune alike (a routing field too, where the shapes match): refused naming the field,
    loaded with --load-partial from step 0."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    cfg = dataclasses.replace(TRAINING, train_iters=2, eval_iters=1, data_path=[str(corpus)], log_interval=1,
                              output_dir=str(tmp_path / "out"))
    pretrain(MODEL, dataclasses.replace(cfg, save=str(tmp_path / "ckpt")), log=lambda *_: None)
    other = dataclasses.replace(MODEL, **change)
    name, value = next(iter(change.items()))
    differs = f"{name}: {getattr(MODEL, name)!r} in the checkpoint, {value!r} now"
    load = dataclasses.replace(cfg, load=str(tmp_path / "ckpt"), finetune=finetune)
    with pytest.raises(CheckpointError, match=rf"another architecture \({re.escape(differs)}\)"):
        pretrain(other, load, log=lambda *_: None)
    printed = []
    summary = pretrain(other, dataclasses.replace(load, load_partial=True), log=printed.append)
    assert len(summary.train_losses) == 2  # from step 0
    assert any(line.startswith("load: partial load of") and f"kept fresh: none; architecture differences: {differs}"
               in line for line in printed)
