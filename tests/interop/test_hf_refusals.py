"""What ``load_hf`` and ``save_hf`` refuse, each error naming the file and the field or tensor: index entries
that leave the directory, integer and boolean weights, NaN and Inf, contradictory or malformed config.json
and index files, damaged shards, and an export ``reference`` of another model. The HF cache's own symlinks
(snapshots into blobs) still load: the positive control of the containment rule."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_core.interop.hf import load_hf, save_hf
from moe_core.interop.hf_config import config_from_hf
from tests.interop._common import CASES, build_hf

INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.1.block_sparse_moe.experts.5.w1.weight"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A Mixtral of many shards (one per few tensors) and its moe_core load."""
    path = tmp_path_factory.mktemp("hf")
    build_hf(CASES["mixtral-gqa-hd16-e8k2"]()).save_pretrained(path, max_shard_size="8KB")
    assert len(list(path.glob("model-*.safetensors"))) >= 12
    return path, load_hf(path)


@pytest.fixture
def hf_dir(sharded, tmp_path):
    """A copy of the sharded checkpoint to damage."""
    shutil.copytree(sharded[0], tmp_path / "hf")
    return tmp_path / "hf"


def _index(path):
    return json.loads((path / INDEX).read_text())


def _write_index(path, index):
    (path / INDEX).write_text(json.dumps(index))


def _shard_of(path, key):
    return path / _index(path)["weight_map"][key]


def _assert_same_model(loaded, expected):
    (config, model), (expected_config, expected_model) = loaded, expected
    assert config == expected_config
    for name, value in expected_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_index_entries_that_leave_the_directory_are_refused(hf_dir, tmp_path, where):
    """The file outside holds exactly the tensors the entry names: without the rule, the load succeeds."""
    shard = _shard_of(hf_dir, EXPERT)
    outside = tmp_path / "elsewhere" / "x.safetensors"
    outside.parent.mkdir()
    shutil.move(shard, outside)
    if where == "symlink":
        os.symlink(outside, shard)
        name = shard.name
    else:
        name = str(outside) if where == "absolute" else os.path.relpath(outside, hf_dir)
        index = _index(hf_dir)
        index["weight_map"] = {k: name if v == shard.name else v for k, v in index["weight_map"].items()}
        _write_index(hf_dir, index)
    with pytest.raises(ValueError, match=f"{INDEX}: weight_map entry '.*' leads outside .*refusing"):
        load_hf(hf_dir)


def test_hf_cache_snapshot_symlinks_into_blobs_load(sharded, tmp_path):
    """huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>. Its links stay allowed."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(sharded[0].iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / file.name)
    _assert_same_model(load_hf(snapshot), sharded[1])


@pytest.mark.parametrize("dtype, name", [(torch.int64, "I64"), (torch.bool, "BOOL")])
def test_integer_and_boolean_weights_are_refused(hf_dir, dtype, name):
    shard = _shard_of(hf_dir, EXPERT)
    tensors = load_file(shard)
    tensors[EXPERT] = (tensors[EXPERT] > 0).to(dtype)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{shard.name}: tensor {EXPERT} has dtype {name}; expected a floating"):
        load_hf(hf_dir)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_tensor_and_shard(hf_dir, value):
    shard = _shard_of(hf_dir, EXPERT)
    tensors = load_file(shard)
    tensors[EXPERT][3, 7] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{shard}: tensor {EXPERT} holds NaN or Inf"):
        load_hf(hf_dir)


def test_a_damaged_shard_is_named(hf_dir):
    shard = _shard_of(hf_dir, EXPERT)
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated: the header no longer covers the file
    with pytest.raises(ValueError, match=f"{shard}: not a readable safetensors file"):
        load_hf(hf_dir)
    shard.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match=f"{shard}: not a readable safetensors file"):
        load_hf(hf_dir)


def test_index_defects_name_the_file_and_field(hf_dir):
    index = _index(hf_dir)
    (hf_dir / INDEX).write_text('{"weight_map": {')
    with pytest.raises(ValueError, match=f"{hf_dir / INDEX}: not valid JSON: .* at line 1 column"):
        load_hf(hf_dir)
    for bad in ({"metadata": {}}, {"weight_map": ["model.safetensors"]}):
        _write_index(hf_dir, bad)
        with pytest.raises(ValueError, match=f"{INDEX}: field 'weight_map': expected an object of tensor key"):
            load_hf(hf_dir)
    _write_index(hf_dir, {"weight_map": {**index["weight_map"], EXPERT: 3}})
    with pytest.raises(ValueError, match=f"{INDEX}: weight_map entry '{EXPERT}': expected a file name, got 3"):
        load_hf(hf_dir)
    shard = hf_dir / index["weight_map"][EXPERT]
    _write_index(hf_dir, {"weight_map": {**index["weight_map"], EXPERT: "model-99999.safetensors"}})
    with pytest.raises(FileNotFoundError, match=f"weight_map entry '{EXPERT}': .*model-99999.safetensors does not"):
        load_hf(hf_dir)
    other = next(v for k, v in index["weight_map"].items() if v != shard.name)
    _write_index(hf_dir, {"weight_map": {**index["weight_map"], EXPERT: other}})  # a shard without that tensor
    with pytest.raises(ValueError, match=f"{other}: tensor {EXPERT}: File does not contain tensor"):
        load_hf(hf_dir)


def _edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))
    return raw


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts=4), "num_experts=4 and num_local_experts=8 contradict each other"),
    (dict(rope_theta=5e5), r"rope_theta=500000.0 and rope_parameters.rope_theta=10000.0 contradict each other"),
    (dict(hidden_size="32"), "Field 'hidden_size' expected int, got str"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}), "rope_parameters.rope_theta: expected"),
    (dict(num_local_experts=0), "num_moe_experts"),
    (dict(num_attention_heads=0), "num_attention_heads=0 is not supported"),
    (dict(dtype="int8"), "dtype='int8': expected a floating-point torch dtype"),
    (dict(model_type=None), "model_type=None is not supported"),
    (dict(model_type=["mixtral"]), r"model_type=\['mixtral'\] is not supported"),
])
def test_config_defects_name_the_file_and_field(hf_dir, changes, message):
    _edit_config(hf_dir, **changes)
    with pytest.raises(ValueError, match=f"{hf_dir / 'config.json'}: .*{message}"):
        load_hf(hf_dir)


def test_config_that_is_not_json_names_the_file(hf_dir):
    (hf_dir / "config.json").write_text('{"model_type": "mixtral",\n "hidden_size": 32,,}')
    with pytest.raises(ValueError, match=f"{hf_dir / 'config.json'}: not valid JSON: .* line 2 column 20"):
        load_hf(hf_dir)
    (hf_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got a JSON list"):
        load_hf(hf_dir)


@pytest.mark.parametrize("changes, message", [
    (dict(mlp_only_layers=[1, 2, 5]), r"mlp_only_layers names layers \[2, 5\], but num_hidden_layers=2"),
    (dict(mlp_only_layers=[-1]), r"mlp_only_layers names layers \[-1\]"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0 is not supported"),
    (dict(num_experts=8, num_local_experts=4), "num_experts=8 and num_local_experts=4 contradict each other"),
])
def test_qwen3_layer_fields_that_contradict_the_model_raise(changes, message):
    raw = json.loads(CASES["qwen3-gqa-hd16-e8k2"]().to_json_string(use_diff=True))
    raw.update(changes)
    with pytest.raises(ValueError, match=f"^config.json: {message}"):
        config_from_hf(raw)


def test_equal_duplicate_fields_are_accepted(sharded):
    """Both spellings with one value (as some Hub configs write them) are no contradiction."""
    raw = json.loads((sharded[0] / "config.json").read_text())
    raw.update(num_experts=8, rope_theta=1e4)
    assert config_from_hf(raw) == sharded[1][0]


@pytest.mark.parametrize("case, fields", [
    ("mixtral-e16k4", "model_type: 'mixtral' there, 'qwen3_moe' exported.*hidden_size: 64 there, 32 exported"),
    ("qwen3-e16k4-dense-tied", "vocab_size: 160 there, 128 exported.*num_experts: 16 there, 8 exported"),
    ("llama", "model_type: 'llama' there, 'qwen3_moe' exported\\)"),
])
def test_export_reference_of_another_model_is_refused(tmp_path, case, fields):
    build_hf(CASES["qwen3-gqa-hd16-e8k2"]()).save_pretrained(tmp_path / "hf")
    if case == "llama":  # an architecture moe_core does not read
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}')
    else:
        build_hf(CASES[case]()).save_pretrained(tmp_path / "other")
    config, model = load_hf(tmp_path / "hf")
    with pytest.raises(ValueError, match=f"reference: .*other/config.json describes another model \\({fields}"):
        save_hf(model, config, tmp_path / "out", reference=tmp_path / "other")
    assert not (tmp_path / "out").exists()
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    save_hf(model, config, tmp_path / "out", reference=tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "generation_config.json",
                                                                      "model.safetensors", "tokenizer.json"]
