"""Model name -> :class:`~kvevents.text.tokenizer.TextTokenizer`.

Built once when the server starts from ``--tokenizer MODEL=PATH`` (or
``KVEVENTS_TOKENIZERS`` / the config file's ``tokenizers``); every tokenizer is loaded
then, so a bad path stops the server at startup with one line naming the model and
file, not at the first request. Read-only afterwards.

PATH may carry the engine's own rendering settings, comma-separated after the
directory, for an engine that does not render with the directory's template:
``chat_template=FILE`` (vLLM's ``--chat-template``: a file, or the template's text) and
``content_format=string|openai`` (vLLM's ``--chat-template-content-format``) and
``exclude_tools_when_tool_choice_none=true`` (vLLM's flag of that name), e.g.
``--tokenizer llama=/models/llama,chat_template=/models/tool_chat.jinja``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvevents.text.tokenizer import TextTokenizer


class TokenizerLoadError(ValueError):
    """A configured tokenizer could not be loaded (message names model and file)."""


_OPTIONS = {"chat_template": "chat_template", "content_format": "content_format",
            "exclude_tools_when_tool_choice_none": "exclude_tools_when_tool_choice_none"}
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def split_options(given: str) -> tuple[str, dict[str, Any]]:
    """``DIR[,chat_template=FILE][,content_format=FORMAT][,exclude_tools_when_tool_choice_none=BOOL]``
    -> (DIR, options). A part that is not ``KEY=VALUE`` with a known key stays in the
    directory (a path may hold a comma). Raises ValueError for a bad content format or
    boolean."""
    parts = given.split(",")
    cut = len(parts)
    while cut > 1 and parts[cut - 1].partition("=")[0].strip() in _OPTIONS and "=" in parts[cut - 1]:
        cut -= 1
    options = {}
    for part in parts[cut:]:
        key, _, value = part.partition("=")
        options[_OPTIONS[key.strip()]] = value.strip()
    if options.get("content_format", "auto") not in ("auto", "string", "openai"):
        raise ValueError(f"content_format must be auto, string or openai, got {options['content_format']!r}")
    flag = options.get("exclude_tools_when_tool_choice_none")
    if flag is not None:
        if flag.lower() not in _BOOLEANS:
            raise ValueError(f"exclude_tools_when_tool_choice_none must be true or false, got {flag!r}")
        options["exclude_tools_when_tool_choice_none"] = _BOOLEANS[flag.lower()]
    return ",".join(parts[:cut]).strip(), options


class TokenizerRegistry:
    """See the module docstring. An empty registry is valid (token ids only)."""

    def __init__(self, tokenizers: Iterable[TextTokenizer] = ()) -> None:
        self._by_model = {t.model: t for t in tokenizers}

    @classmethod
    def load(cls, specs: Iterable[tuple[str, str]], cache_tokens: int = 2_000_000
             ) -> TokenizerRegistry:
        """Load ``(model, directory)`` pairs. Raises :class:`TokenizerLoadError`."""
        specs = list(specs)
        models = [model for model, _ in specs]
        for model in models:
            if models.count(model) > 1:
                raise TokenizerLoadError(f"tokenizer for model {model!r} given more than once")
        for model, given in specs:
            try:
                directory, _ = split_options(given)
            except ValueError as exc:
                raise TokenizerLoadError(f"tokenizer for model {model!r}: {exc}") from None
            if not Path(directory).is_dir():
                raise TokenizerLoadError(
                    f"tokenizer for model {model!r}: {directory} is not a directory")
        if specs:
            try:
                import jinja2  # noqa: F401
                import tokenizers  # noqa: F401
            except ImportError as exc:
                raise TokenizerLoadError(
                    f"--tokenizer needs the 'text' extra ({exc.name} is missing): "
                    "pip install 'kvevents[text]'") from None
        loaded = []
        for model, given in specs:
            directory, options = split_options(given)
            try:
                loaded.append(TextTokenizer(model, directory, cache_tokens, **options))
                loaded[-1].max_token_chars()  # its vocabulary's pass now, not on a request
            except (ValueError, OSError) as exc:
                raise TokenizerLoadError(f"tokenizer for model {model!r}: {exc}") from None
        return cls(loaded)

    def get(self, model: str | None) -> TextTokenizer | None:
        return self._by_model.get(model) if model is not None else None

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def __len__(self) -> int:
        return len(self._by_model)
