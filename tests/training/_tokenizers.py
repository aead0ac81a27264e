"""A small byte-level BPE tokenizer directory built locally (nothing is downloaded): ChatML special tokens and
chat template, ``<|endoftext|>`` as its end-of-sequence token, as Qwen's base tokenizers."""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer_dir(directory: Path, vocab_size: int = 400) -> Path:
    """``directory`` holding ``tokenizer.json``, ``tokenizer_config.json`` and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
            "What is 12 plus 7? It is 19.", "user assistant system: hello, how are you today?"]
    tok.train_from_iterator(text * 40, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(directory))
    return directory
