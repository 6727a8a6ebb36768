"""Model name -> :class:`~kvevents.text.tokenizer.TextTokenizer`.

Built once when the server starts from ``--tokenizer MODEL=PATH`` (or
``KVEVENTS_TOKENIZERS`` / the config file's ``tokenizers``); every tokenizer is loaded
then, so a bad path stops the server at startup with one line naming the model and
file, not at the first request. Read-only afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvevents.text.tokenizer import TextTokenizer


class TokenizerLoadError(ValueError):
    """A configured tokenizer could not be loaded (message names model and file)."""


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
        for model, directory in specs:
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
        for model, directory in specs:
            try:
                loaded.append(TextTokenizer(model, directory, cache_tokens))
            except (ValueError, OSError) as exc:
                raise TokenizerLoadError(f"tokenizer for model {model!r}: {exc}") from None
        return cls(loaded)

    def get(self, model: str | None) -> TextTokenizer | None:
        return self._by_model.get(model) if model is not None else None

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def __len__(self) -> int:
        return len(self._by_model)
