"""One model's tokenizer, loaded from a local Hugging Face tokenizer directory.

The directory holds ``tokenizer.json`` (required), ``tokenizer_config.json`` (special
tokens, maybe the chat template) and maybe ``chat_template.jinja`` (which wins over
the config's template, as in ``transformers``).

* :meth:`TextTokenizer.encode_prompt` equals ``AutoTokenizer(...)(prompt)["input_ids"]``:
  the text's ids with the special tokens the tokenizer's post-processor adds (a BOS...).
* :meth:`TextTokenizer.encode_chat` equals the ids vLLM 0.32's OpenAI server computes
  for a chat request (:class:`~kvevents.text.chat_inputs.ChatOptions`: its ``tools``,
  ``chat_template_kwargs``...; by default, ``apply_chat_template(messages,
  add_generation_prompt=True, tokenize=True)``): the rendered template's ids, special
  tokens added only with ``add_special_tokens`` (the template writes its own).
* :meth:`~TextTokenizer.prompt_ids` and :meth:`~TextTokenizer.chat_ids`: the same ids
  as ``array('q')``, for callers that hand them to the index (no Python int per token).

Checked against ``transformers`` 5.x loading the directory as its generic fast
tokenizer (the post-processor in ``tokenizer.json`` decides BOS/EOS). Not replicated: a
tokenizer class that rewrites the post-processor from ``add_bos_token`` /
``add_eos_token`` in the config at load time; for such a model, export its
``tokenizer.json`` with the post-processor it uses.

Lifecycle: built once at startup by the registry, then read-only apart from its
piece cache (thread-safe). Construction raises ``ValueError`` with the file at fault.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any

import msgspec

from kvevents.text.chat import ChatMessage, ChatTemplate, ChatTemplateError
from kvevents.text.chat_inputs import ChatOptions
from kvevents.text.segments import SegmentEncoder, batch_encoder
from kvevents.text.words import WordEncoder, split_pattern, word_tokenizer

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
_PROBE_TEXT = "Hello, world!  It's 2 o'clock\n\tcafé 東京 ✓"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_source(directory: Path, config: dict) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    if isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        source = named.get("default")
        return source if isinstance(source, str) else None
    return None


_REQUEST_TEMPLATES = 16  # request-brought templates kept compiled per tokenizer


def _engine_template(given: str) -> str:
    """An engine's ``--chat-template`` as vLLM reads it: a file's contents when it names a
    readable file, else the template itself."""
    try:
        path = Path(given)
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, ValueError):  # a template's text is no path (too long, NUL...)
        pass
    return given


def _first_piece_special(tokenizer_json: dict) -> bool:
    """True when a component treats the first piece of the input differently
    (Metaspace ``prepend_scheme="first"``), which rules out piecewise encoding."""
    found = False

    def walk(node: Any) -> None:
        nonlocal found
        if isinstance(node, dict):
            if node.get("prepend_scheme") == "first":
                found = True
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk({k: tokenizer_json.get(k) for k in ("normalizer", "pre_tokenizer")})
    return found


class TextTokenizer:
    """See the module docstring."""

    def __init__(self, model: str, directory: str | Path, cache_tokens: int = 2_000_000,
                 chat_template: str | None = None, content_format: str = "auto",
                 exclude_tools_when_tool_choice_none: bool = False) -> None:
        """``chat_template``: the template the engine renders with when it is not the
        directory's (vLLM's ``--chat-template``: a file's path or the template itself);
        ``content_format``: the engine's ``--chat-template-content-format``;
        ``exclude_tools_when_tool_choice_none``: the engine's flag of that name (a request
        with ``tool_choice: "none"`` is rendered without its tools)."""
        from tokenizers import Tokenizer

        self.model = model
        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} not found (a Hugging Face tokenizer directory has one)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            tok = Tokenizer.from_str(json.dumps(raw))
        except Exception as exc:  # the Rust loader raises a bare Exception
            raise ValueError(f"{path}: not a valid tokenizer ({exc})") from None
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        config: dict = {}
        config_path = self.directory / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{config_path}: invalid JSON ({exc})") from None
        special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        self._special = special
        self._content_format = content_format
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        source = _engine_template(chat_template) if chat_template else _template_source(self.directory, config)
        try:
            self.chat = ChatTemplate(source, special, content_format) if source else None
        except ChatTemplateError as exc:
            raise ValueError(f"{chat_template or self.directory}: {exc}") from None
        # Templates a request brought (``chat_template``), compiled once each (bounded).
        self._request_templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        self._lock = threading.Lock()

        added = tok.get_added_tokens_decoder()
        split = [t.content for t in added.values()
                 if t.special and not t.normalized and not (t.lstrip or t.rstrip or t.single_word)]
        if _first_piece_special(raw):
            split = []
        words = self._word_encoder(raw, tok, added, split)
        self._pieces = SegmentEncoder(tok, split, max_tokens=cache_tokens, words=words)
        if split and not self._pieces.self_check(self._probe(split)):
            self._pieces.disable_pieces()
        self._prefix, self._suffix = self._post_processor_affixes()
        self._whole = getattr(tok, "encode_batch_fast", None) or tok.encode_batch

    @staticmethod
    def _word_encoder(raw: dict, tok: Any, added: dict, split: list[str]) -> WordEncoder | None:
        """The word cache for new ASCII text, when this tokenizer's shape allows it and it
        gives the library's ids on the probes (see words.py)."""
        pattern = split_pattern(raw)
        if pattern is None:
            return None
        exact = {t.content: (i, not (t.lstrip or t.rstrip or t.single_word)) for i, t in added.items()}
        def one(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

        words = WordEncoder(pattern, batch_encoder(tok), exact, encode_one=one,
                            encode_word=word_tokenizer(tok.model))
        ok = words.self_check(one, split)
        return words if ok else None

    @staticmethod
    def _probe(split: list[str]) -> str:
        out = []
        for i, t in enumerate(split[:16]):
            out.append(f"{_PROBE_TEXT} {i}{t}\n {t} x{t}")
        return "".join(out) + _PROBE_TEXT

    def _post_processor_affixes(self) -> tuple[list[int], list[int]] | tuple[None, None]:
        """The ids the post-processor puts around a single text ([BOS], [EOS]...), or
        (None, None) when it does more than add a fixed prefix and suffix."""
        plain = self._tok.encode(_PROBE_TEXT, add_special_tokens=False).ids
        full = self._tok.encode(_PROBE_TEXT, add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start:start + len(plain)] == plain:
                return full[:start], full[start + len(plain):]
        return None, None

    @property
    def has_chat_template(self) -> bool:
        return self.chat is not None

    @property
    def repeatable_chat(self) -> bool:
        """Whether the same messages always render the same text (the template does not
        read the clock), so a conversation's ids may be kept by its messages."""
        return self.chat is not None and self.chat.timeless

    @property
    def piecewise(self) -> bool:
        """Whether text is encoded piece by piece (cached per turn)."""
        return self._pieces.piecewise

    def encode_prompt(self, prompt: str) -> list[int]:
        """Ids of a plain prompt, special tokens added as the tokenizer defines."""
        return self.prompt_ids(prompt).tolist()

    def prompt_ids(self, prompt: str, add_special_tokens: bool = True) -> array:
        """:meth:`encode_prompt` as ``array('q')``: what the index reads as it is, without
        a Python int per token (``tolist`` of a 600-token prompt costs ~17 us).
        ``add_special_tokens=False`` (a request's own): the text's ids alone."""
        if not add_special_tokens:
            return self._pieces.encode(prompt)
        if self._prefix is None:  # GIL released, no offsets (see segments.py)
            return array("q", self._whole([prompt], add_special_tokens=True)[0].ids)
        ids = self._pieces.encode(prompt)
        if not self._prefix and not self._suffix:
            return ids
        return array("q", self._prefix) + ids + array("q", self._suffix)

    def template_for(self, options: ChatOptions | None = None) -> ChatTemplate:
        """The template a request renders with: its own ``chat_template`` (an engine
        started with ``--trust-request-chat-template`` uses it; one that is not refuses
        the request), else the engine's. Raises :class:`ChatTemplateError`."""
        source = options.chat_template if options is not None else None
        if source:
            with self._lock:  # (chat_ids runs on worker threads too)
                got = self._request_templates.get(source)
            if got is None:
                got = ChatTemplate(source, self._special, self._content_format)
                with self._lock:
                    self._request_templates[source] = got
                    if len(self._request_templates) > _REQUEST_TEMPLATES:
                        self._request_templates.popitem(last=False)
            return got
        if self.chat is None:
            raise ChatTemplateError(f"the tokenizer of model {self.model!r} has no chat template")
        return self.chat

    def drops_tools(self, tool_choice: object) -> bool:
        """Whether the engine renders a request with this ``tool_choice`` without its
        tools (vLLM: ``"none"`` under ``--exclude-tools-when-tool-choice-none``)."""
        return tool_choice == "none" and self.exclude_tools_when_tool_choice_none

    def render_chat(self, messages: list[ChatMessage], options: ChatOptions | None = None) -> str:
        """The prompt text of a conversation, as vLLM renders it for a request with
        ``options`` (default: a plain request). Raises :class:`ChatTemplateError`
        (also when the tokenizer has no chat template)."""
        if options is not None and options.tools and self.drops_tools(options.tool_choice):
            options = msgspec.structs.replace(options, tools=None)
        return self.template_for(options).render(messages, options)

    def encode_chat(self, messages: list[ChatMessage], options: ChatOptions | None = None) -> list[int]:
        """Ids of a conversation as vLLM computes them for a chat request (see
        :meth:`render_chat`)."""
        return self.chat_ids(messages, options).tolist()

    def chat_ids(self, messages: list[ChatMessage], options: ChatOptions | None = None) -> array:
        """:meth:`encode_chat` as ``array('q')`` (see :meth:`prompt_ids`)."""
        text = self.render_chat(messages, options)
        if options is not None and options.add_special_tokens:
            return self.prompt_ids(text)
        return self.encode_rendered(text)

    def encode_rendered(self, text: str) -> array:
        """Ids of an already rendered chat text (no special tokens added)."""
        return self._pieces.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` for display (special tokens kept)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def cache_stats(self) -> dict[str, int]:
        return self._pieces.stats()

    def max_token_chars(self) -> int | None:
        """The most characters of text one token stands for (None: no bound; see
        :func:`~kvevents.text.limits.token_chars_bound`), computed at the first call."""
        got = self.__dict__.get("_max_token_chars", False)
        if got is False:
            from kvevents.text.token_chars import token_chars_bound
            got = self._max_token_chars = token_chars_bound(self._tok)
        return got
