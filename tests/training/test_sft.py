"""SFT data: chat template, assistant-only labels, packing with document masks (the packed loss is the sum of the
conversations' losses), epochs of rows; and import -> SFT -> export of a tiny Qwen3-MoE on the shipped chat file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.training.batch import IGNORE_INDEX, Batch
from moe_core.training.checkpoint import load_model_weights
from moe_core.training.sft import PackedRows, build_sft, pack, read_conversations, tokenize_conversation
from moe_core.training.tokenizer import load_pretrained_tokenizer
from moe_core.training.trainer import pretrain
from tests.training._tokenizers import build_tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "examples" / "chat_sft.jsonl"
sys.path.insert(0, str(ROOT / "tools"))
import hf_checkpoint  # noqa: E402
import pretrain_gpt  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


def test_only_assistant_turns_are_trained(tokenizer_dir):
    tokenizer = load_pretrained_tokenizer(tokenizer_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 plus 7?"},
                {"role": "assistant", "content": "It is 19."}, {"role": "user", "content": "And 2 plus 2?"},
                {"role": "assistant", "content": "4."}]
    ids, trained = tokenize_conversation(tokenizer, messages)
    assert ids.tolist() == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    runs, start = [], None  # the trained tokens form two runs: the two assistant turns with their end of turn
    for i, flag in enumerate([*trained.tolist(), False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append(tokenizer.decode(ids[start:i].tolist()))
            start = None
    assert runs == ["It is 19.<|im_end|>\n", "4.<|im_end|>\n"]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer_dir, tmp_path):
    tokenizer = load_pretrained_tokenizer(tokenizer_dir)
    tokenizer.chat_template = "{{ messages | length }}" + tokenizer.chat_template  # the start depends on the end
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ValueError, match="x.jsonl:3: the chat template renders the conversation up to message 1 "
                                         "differently once later messages follow"):
        tokenize_conversation(tokenizer, messages, "x.jsonl:3")


def test_packed_loss_is_the_sum_of_the_conversations_losses(tokenizer_dir):
    """Conversations packed into rows with document masks and restarted positions give, in float64, the sum of
    the losses of each conversation run alone over its assistant tokens."""
    tokenizer = load_pretrained_tokenizer(tokenizer_dir)
    samples = [tokenize_conversation(tokenizer, m) for _, m in read_conversations(CHAT)[:12]]
    seq = 400
    assert max(len(ids) for ids, _ in samples) <= seq + 1  # none cut
    rows = pack(samples, seq, pad_id=0)
    assert len(rows.input_ids) < len(samples)  # several conversations share a row
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=48, vocab_size=len(tokenizer), seq_length=seq, num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=24, moe_router_dtype="fp64")
    torch.manual_seed(0)
    model = GPTModel(config).double().eval()
    with torch.no_grad():  # the per-token losses are float32 (GPTModel's convention): summed in float64
        packed = model(*rows).double().sum()
        alone = sum(model(torch.from_numpy(ids[None, :-1]),
                          torch.from_numpy(np.where(trained[1:], ids[1:], IGNORE_INDEX)[None])).double().sum()
                    for ids, trained in samples)
        torch.testing.assert_close(packed, alone, rtol=1e-9, atol=0)
        # Without the document masks, conversations would see their row's earlier ones.
        assert not torch.isclose(model(rows.input_ids, rows.labels, rows.position_ids).double().sum(), alone,
                                 rtol=1e-6)
    counted = sum(int((trained[1:]).sum()) for _, trained in samples)
    assert int((rows.labels != IGNORE_INDEX).sum()) == counted


def test_pack_fills_rows_in_order_and_pads():
    samples = [(np.arange(5), np.ones(5, bool)), (np.arange(100, 104), np.zeros(4, bool)),
               (np.arange(200, 230), np.ones(30, bool))]
    rows = pack(samples, 8, pad_id=9)
    assert rows.input_ids.tolist() == [[0, 1, 2, 3, 100, 101, 102, 9], [200 + i for i in range(8)]]
    assert rows.labels.tolist() == [[1, 2, 3, 4] + [IGNORE_INDEX] * 4, [201 + i for i in range(8)]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], list(range(8))]  # the long one is cut
    assert rows.document_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0] * 8]


def test_rows_are_drawn_by_epoch_permutations():
    count = 21
    rows = PackedRows(Batch(*(torch.arange(count)[:, None].repeat(1, 4) for _ in range(4))), count, 0, 4 * count)
    drawn = torch.cat([rows.batch(6, seed=5, step=s).input_ids[:, 0] for s in range(14)])  # 84 rows: 4 epochs
    for epoch in range(4):  # each epoch takes every row once, in its own order
        assert sorted(drawn[epoch * count:(epoch + 1) * count].tolist()) == list(range(count))
    assert drawn[:count].tolist() != drawn[count:2 * count].tolist()
    assert torch.equal(rows.batch(6, seed=5, step=3).input_ids, drawn[18:24, None].repeat(1, 4))
    assert not torch.equal(rows.batch(6, seed=6, step=3).input_ids, drawn[18:24, None].repeat(1, 4))
    shards = [rows.batch(6, seed=5, step=3, rank=r, world=3) for r in range(3)]
    assert torch.equal(torch.cat([s.labels for s in shards]), rows.batch(6, seed=5, step=3).labels)


def test_conversations_split_in_file_order(tokenizer_dir):
    data = build_sft([str(CHAT)], str(tokenizer_dir / "tokenizer.json"), "9,1", 256, 512)
    assert (data["train"].num_samples, data["valid"].num_samples) == (288, 32)
    assert data["train"].num_truncated > 0 and data["train"].rows.input_ids.shape[1] == 256
    with pytest.raises(ValueError, match=r"token id \d+ is outside the model's \[0, vocab_size\) = \[0, 100\)"):
        build_sft([str(CHAT)], str(tokenizer_dir / "tokenizer.json"), "9,1", 256, 100)
    with pytest.raises(ValueError, match="the valid split of the 320 conversations is empty"):
        build_sft([str(CHAT)], str(tokenizer_dir / "tokenizer.json"), "1,0", 256, 512)


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user"}]}', "expected {\"messages\""),
    ('{"text": "not a chat"}', "expected {\"messages\""),
    ('{"messages": [', r"invalid JSON \(Expecting value at column 15\)"),
])
def test_malformed_chat_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"data_path: {path}:3: {message}"):
        read_conversations(path)


def test_sft_needs_a_chat_template(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="tokenizer: SFT needs a Hugging Face tokenizer with a chat template"):
        build_sft([str(CHAT)], None, None, 64, 512)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (plain / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    with pytest.raises(ValueError, match=f"tokenizer: {plain}/tokenizer.json has no chat template"):
        build_sft([str(CHAT)], str(plain / "tokenizer.json"), None, 64, 512)
    with pytest.raises(ValueError, match="sft: expected chat JSONL files"):
        pretrain_gpt.parse_args(["--sft"])


def test_import_sft_export(tmp_path, tokenizer_dir):
    """The README's path: a tiny Qwen3-MoE with a ChatML tokenizer, imported, fine-tuned with --sft on the shipped
    chat file, exported; transformers loads the export, chat template included, with our logits."""
    hf_dir = tmp_path / "qwen3-tiny"
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, eos_token_id=0,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (hf_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    imported = tmp_path / "imported"
    hf_checkpoint.main(["import", str(hf_dir), str(imported), "--seq-length", "256"])
    model_cfg, train_cfg = pretrain_gpt.parse_args([
        "--config", str(imported / "model.yaml"), "--load", str(imported / "checkpoint"), "--finetune", "--sft",
        "--tokenizer", str(hf_dir / "tokenizer.json"), "--data-path", str(CHAT), "--train-iters", "4",
        "--micro-batch-size", "2", "--lr", "1e-3", "--eval-iters", "1", "--log-interval", "1",
        "--output-dir", str(tmp_path / "run"), "--save", str(tmp_path / "sft")])
    summary = pretrain(model_cfg, train_cfg, log=lambda *_: None)
    assert len(summary.train_losses) == 4 and summary.end_valid_loss < summary.start_valid_loss
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("data_wait_ms" in r for r in rows if "loss" in r)
    out = tmp_path / "exported"
    hf_checkpoint.main(["export", str(out), "--config", str(imported / "model.yaml"), "--load", str(tmp_path / "sft"),
                        "--reference", str(hf_dir)])
    tuned = GPTModel(model_cfg).eval()
    load_model_weights(str(tmp_path / "sft"), tuned)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(hf_dir).chat_template
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reloaded(ids).logits - tuned(ids)).abs().max() <= 1e-5
