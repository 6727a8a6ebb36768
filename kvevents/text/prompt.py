"""A request's prompt as token ids: given as ids, or tokenized from text or chat.

Exactly one of ``token_ids``, ``prompt`` or ``messages``; text needs ``model`` to name
a model with a tokenizer (``serve --tokenizer MODEL=PATH``). Every refusal is an
:class:`InputError` that carries the HTTP status it deserves and names the field, raised
before anything is looked up or counted. No HTTP here: the service's handlers and the
router call these, and decide which thread tokenizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvevents.text.chat import ChatMessage, ChatTemplateError
from kvevents.text.chat_inputs import ChatOptions
from kvevents.text.registry import TokenizerRegistry

INPUTS = ("token_ids", "prompt", "messages")


class InputError(ValueError):
    """A request the service refuses: ``status`` (a 4xx; a 503 for a condition of the
    moment), a message, the field to fix, and headers for the answer (``Retry-After``).
    The aggregator's API answers it as ``{"error": message, "field": field}``
    (:mod:`kvevents.api.errors`, where it is also named ``ApiError``); the gateway in
    OpenAI's shape."""

    def __init__(self, status: int, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.headers = headers


def chosen_input(token_ids: object, prompt: object, messages: object) -> str:
    """Which of ``token_ids``, ``prompt``, ``messages`` the request gives (exactly one)."""
    given = [name for name, value in zip(INPUTS, (token_ids, prompt, messages)) if value is not None]
    if not given:
        raise InputError(422, "one of token_ids, prompt or messages is required", "token_ids")
    if len(given) > 1:
        raise InputError(422, f"give exactly one of token_ids, prompt or messages, not "
                              f"{' and '.join(given)}", given[1])
    return given[0]


def text_encoder(tokenizers: TokenizerRegistry, model: str | None, field: str,
                 value: str | Sequence[ChatMessage], options: ChatOptions | None = None
                 ) -> Callable[[], Sequence[int]]:
    """A call that tokenizes ``value`` (a prompt, or chat messages) with ``model``'s
    tokenizer, as vLLM does for a request with ``options``. Raises :class:`InputError`
    now when there is no such tokenizer; the call raises it for messages the chat
    template refuses."""
    tok = tokenizers.get(model)
    if tok is None:
        known = ", ".join(tokenizers.models()) or "none configured"
        if model is None:
            raise InputError(422, f"{field} needs model to name its tokenizer (tokenizers: {known})",
                             "model")
        raise InputError(422, f"no tokenizer for model {model!r} (tokenizers: {known}; "
                              f"add one with serve --tokenizer MODEL=PATH)", "model")
    # array('q'): the index reads it as it is (see TextTokenizer.prompt_ids).
    if field == "prompt":
        special = options is None or options.add_special_tokens is not False
        return lambda: tok.prompt_ids(value, special)  # type: ignore[arg-type]

    def encode_chat() -> Sequence[int]:
        try:
            return tok.chat_ids(value, options)  # type: ignore[arg-type]
        except ChatTemplateError as exc:
            raise InputError(422, f"messages: {exc}", "messages") from None
    return encode_chat


def check_length(ids: Sequence[int], limit: int, field: str, why: str = "") -> None:
    """400 on ``field`` for more than ``limit`` tokens: the same status as a prompt
    refused by its characters before tokenizing (:mod:`kvevents.text.limits`); ``why``:
    what sets the limit, for the message."""
    if len(ids) > limit:
        raise InputError(400, f"{field} has {len(ids)} tokens; the limit is {limit}"
                              + (f" ({why})" if why else ""), field)
