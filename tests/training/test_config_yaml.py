"""What a run YAML (``--config``) may hold: the sections model: and training:, no duplicate keys, no anchors or
aliases; and every field of both configs, from YAML, Python or flags, of its annotated type."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest

from moe_core.config import TransformerConfig, load_yaml
from moe_core.training.config import TrainingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import pretrain_gpt  # noqa: E402

MODEL = "model:\n  num_layers: 1\n  hidden_size: 16\n  num_attention_heads: 2\n"
REQUIRED = dict(num_layers=1, hidden_size=16, num_attention_heads=2)


def _parse(tmp_path: Path, text: str):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    return pretrain_gpt.parse_args(["--config", str(config)])


@pytest.mark.parametrize("section", ["trainig", "optimizer", "num_layers"])
def test_unknown_top_level_section_is_refused(tmp_path, section):
    with pytest.raises(ValueError, match=rf"c\.yaml: unknown top-level sections \['{section}'\]; a config holds only "
                                         r"model:, training:"):
        _parse(tmp_path, MODEL + f"{section}:\n  lr: 0.1\n")


def test_an_empty_training_section_gives_the_defaults(tmp_path):
    model, training = _parse(tmp_path, MODEL + "training:\n")
    assert model.num_layers == 1 and training == TrainingConfig()


@pytest.mark.parametrize("text", ["model: [1, 2]\n", "model:\n  - num_layers\n"])
def test_a_section_must_be_a_mapping(tmp_path, text):
    with pytest.raises(ValueError, match=r"c\.yaml: model: expected a mapping of fields, got list"):
        _parse(tmp_path, text)


def test_duplicate_key_names_key_and_lines(tmp_path):
    with pytest.raises(ValueError, match=r"c\.yaml:7:3: duplicate key 'lr' \(first on line 6\)"):
        _parse(tmp_path, MODEL + "training:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ValueError, match=r"c\.yaml:5:1: duplicate key 'model' \(first on line 1\)"):
        _parse(tmp_path, MODEL + MODEL)


def test_anchors_and_aliases_are_refused(tmp_path):
    """An alias bomb (each level nine aliases of the one below) would expand to 9**9 strings."""
    levels = ["a0: &a0 x"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(levels) + "\n")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"bomb\.yaml:1:5: anchors and aliases are not allowed, got &a0"):
        load_yaml(path)
    assert time.monotonic() - start < 5
    path.write_text(MODEL + "training:\n  lr: *x\n")
    with pytest.raises(ValueError, match=r"bomb\.yaml:6:7: anchors and aliases are not allowed, got \*x"):
        load_yaml(path)


@pytest.mark.parametrize("text, message", [
    ("model: [1\n", r"c\.yaml:2:1: expected ',' or ']'"),
    ("model:\n\tnum_layers: 1\n", r"c\.yaml:2:1: found character '\\t'"),
    ("- 1\n", r"c\.yaml: expected a YAML mapping at the top level, got list"),
])
def test_malformed_yaml_names_file_and_line(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        _parse(tmp_path, text)


def test_config_must_be_a_regular_file(tmp_path):
    with pytest.raises(ValueError, match=r"^config: /dev/zero: expected a regular file, got a character device$"):
        pretrain_gpt.parse_args(["--config", "/dev/zero"])
    with pytest.raises(ValueError, match=rf"^config: {tmp_path}: expected a regular file, got a directory$"):
        pretrain_gpt.parse_args(["--config", str(tmp_path)])


@pytest.mark.parametrize("text, message", [
    ('training:\n  bf16: "false"\n', r"^bf16: expected a bool, got str \('false'\)$"),
    ("training:\n  use_torch_fsdp2: 'no'\n", r"^use_torch_fsdp2: expected a bool, got str \('no'\)$"),
    ("training:\n  use_torch_fsdp2: 2\n", r"^use_torch_fsdp2: expected a bool, got int \(2\)$"),
    ("training:\n  data_path: 5\n", r"^data_path: expected a list of strings or None, got int \(5\)$"),
    ("training:\n  data_path: [a.txt, 5]\n", r"^data_path: expected a list of strings or None, got list"),
    ("training:\n  output_dir: null\n", r"^output_dir: expected a string, got NoneType \(None\)$"),
    ("training:\n  save: 3\n", r"^save: expected a string or None, got int \(3\)$"),
    ('  qk_layernorm: "false"\n', r"^qk_layernorm: expected a bool, got str \('false'\)$"),
    ("  moe_layer_freq: [1, true]\n", r"^moe_layer_freq: expected an int or a list of ints, got list"),
    ("  activation_func: 3\n", r"^activation_func: expected a string, got int \(3\)$"),
])
def test_yaml_values_of_the_wrong_type_name_the_field(tmp_path, text, message):
    with pytest.raises(TypeError, match=message):
        _parse(tmp_path, MODEL + text)


def test_yaml_booleans_and_a_single_data_path(tmp_path):
    model, training = _parse(tmp_path, MODEL + "  qk_layernorm: yes\ntraining:\n  bf16: no\n  data_path: a.txt\n")
    assert model.qk_layernorm is True and training.bf16 is False and training.data_path == ["a.txt"]


@pytest.mark.parametrize("cls, field", [(cls, f) for cls in (TransformerConfig, TrainingConfig)
                                        for f in dataclasses.fields(cls)], ids=lambda x: getattr(x, "name", None))
def test_every_field_is_type_checked(cls, field):
    """Generic: each field of both dataclasses refuses a mapping, and each bool field the string "false"."""
    base = REQUIRED if cls is TransformerConfig else {}
    with pytest.raises(TypeError, match=rf"^{field.name}: expected .*, got dict \({{'x': 1}}\)$"):
        cls(**{**base, field.name: {"x": 1}})
    if field.type == "bool":
        with pytest.raises(TypeError, match=rf"^{field.name}: expected a bool, got str \('false'\)$"):
            cls(**{**base, field.name: "false"})
