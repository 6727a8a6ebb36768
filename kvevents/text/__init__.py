"""Prompt text and chat messages to token ids, with each model's own tokenizer.

Optional: needs the ``text`` extra (``tokenizers`` and ``jinja2``; never
``transformers``). The ids equal what ``transformers`` produces for the same
tokenizer directory (``tests/test_text_equivalence.py`` checks it).

Files, one stage each::

    registry.py   model name -> TextTokenizer, loaded once at startup from
                  ``--tokenizer MODEL=PATH``; load errors name the model and file
    tokenizer.py  TextTokenizer: one Hugging Face tokenizer directory; prompt and chat
                  encoding, decoding for display
    chat.py       the chat template (sandboxed jinja2, rendered as vLLM's OpenAI server
                  renders it) and the messages' validation
    chat_inputs.py what a template is handed for a request (messages rebuilt as vLLM
                  does, the request's tools, documents, template kwargs...)
    chat_format.py the content format a template expects ("string" or "openai"),
                  detected from its source as vLLM detects it
    segments.py   splits text at special tokens and caches each piece's ids (LRU), so a
                  conversation that grows turn by turn only tokenizes its new turns

Pipeline: messages -> ChatTemplate.render -> text -> SegmentCache (split at special
tokens; cached pieces reused, new pieces encoded in one batch) -> list[int].
"""

from __future__ import annotations

from kvevents.text.chat import ChatTemplateError
from kvevents.text.registry import TokenizerLoadError, TokenizerRegistry
from kvevents.text.tokenizer import TextTokenizer

__all__ = ["ChatTemplateError", "TextTokenizer", "TokenizerLoadError", "TokenizerRegistry"]
