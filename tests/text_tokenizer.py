"""Small Hugging Face tokenizer directories built here, for the text tests.

Each is trained with ``tokenizers`` on a fixed text and saved with ``transformers``
(``PreTrainedTokenizerFast(...).save_pretrained``), exactly as a model repository ships
one. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]

# A ChatML-like template: BOS, turns ended by a special token, generation prompt,
# raise_exception on a bad role, text parts of list contents.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{% if message['tool_calls'] is defined %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = """\
The cache holds key and value tensors for every token the model has already seen.
When two requests share a prefix, the engine can reuse those blocks instead of
recomputing them. Routers that know where each prefix lives send a conversation back
to the engine that still holds it. Café, naïve, 東京, ✓, and emoji 🙂 are text too.
def add(a, b):\n    return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000
"""


def require_transformers():
    """``transformers`` (dev only). Missing: skip locally, fail under CI."""
    try:
        import transformers
    except ImportError:
        msg = "transformers is not installed (dev extra)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return transformers


# Llama 3's word split (its tokenizer.json's Split pattern).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_bytelevel(directory: Path, *, template_in_config: bool = False,
                    split: str | None = None, nfc: bool = False) -> Path:
    """A byte-level BPE (GPT-2 style) with a BOS post-processor and a chat template.

    ``template_in_config``: move the template from ``chat_template.jinja`` into
    ``tokenizer_config.json`` (the older layout). ``split``: a regex ``Split`` then
    ``ByteLevel`` without its own regex (the Llama 3 / Qwen shape; ``LLAMA3_SPLIT``).
    ``nfc``: an NFC normalizer (a shape the word cache does not take).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    jinja = directory / "chat_template.jinja"
    if template_in_config:
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = jinja.read_text() if jinja.exists() else CHAT_TEMPLATE
        config_path.write_text(json.dumps(config))
        jinja.unlink(missing_ok=True)
    return directory


def build_metaspace(directory: Path) -> Path:
    """A sentencepiece-style BPE (Metaspace, ``prepend_scheme="first"``), no template:
    a tokenizer whose first piece is special, so it is encoded whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS)
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.save_pretrained(directory)
    return directory
