"""What each engine serves, as its own ``GET /v1/models`` says: base models and LoRA
adapters (vLLM lists an adapter loaded with ``--lora-modules`` or at run time as an
entry whose ``parent`` is its base model).

The gateway sends ``"model": "<adapter>"`` only to engines that list the adapter, and
looks it up in the index under the adapter's identity (its base model's namespace, the
adapter as ``lora_name``). Learned when the gateway starts, every ``interval_s``, and
again soon after an engine answers 404 for a model (an adapter unloaded, or loaded
elsewhere).

Lifecycle: :meth:`ModelCatalog.run` is one background task (cancelled with the
gateway); an engine that does not answer keeps what was learned of it last, and an
engine no longer followed is dropped at the next refresh. The event loop's thread only.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

__all__ = ["ModelCatalog", "ServedModel", "identity_digest"]

#: Seconds between refreshes while some engine has not answered (starting up, say).
RETRY_S = 2.0


@dataclass(frozen=True)
class ServedModel:
    """One ``/v1/models`` entry: ``parent`` is the base model of an adapter (None: a
    base model)."""

    id: str
    parent: str | None
    entry: dict


class ModelCatalog:
    """See the module docstring."""

    def __init__(self, interval_s: float = 30.0, timeout_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._by_engine: dict[str, dict[str, ServedModel]] = {}
        self._wake = asyncio.Event()
        self.refreshes = 0  # completed refreshes (tests wait on it)
        self._contexts: dict[str, int] = {}  # model -> max_model_len (context_len)
        self._contexts_at = -1  # the refresh they were read at

    # -- reading ---------------------------------------------------------------------

    def parent_of(self, engine: str, model: str) -> str | None:
        """The base model when ``engine`` serves ``model`` as an adapter, else None."""
        got = self._by_engine.get(engine, {}).get(model)
        return got.parent if got is not None else None

    def serves(self, engine: str, model: str) -> bool:
        return model in self._by_engine.get(engine, {})

    def identity(self, model: str | None, targets: list) -> tuple[str | None, str | None]:
        """(the index's model, lora_name) of a request for ``model`` sent to ``targets``
        (engine specs): an adapter's base model (when every target names the same one,
        else None: any model) and the adapter; a base model's own name and no adapter."""
        if model is None or not targets:
            return model, None
        if any(self.parent_of(s.name, model) is None for s in targets):
            return model, None
        bases = {s.model for s in targets}
        return (bases.pop() if len(bases) == 1 else None), model

    def context_len(self, model: str | None) -> int | None:
        """The longest context (``max_model_len``, which vLLM's and SGLang's entries
        carry) of an engine listing ``model``; None when none says. One dictionary read:
        the table is rebuilt at most once per refresh."""
        if self._contexts_at != self.refreshes:
            contexts: dict[str, int] = {}
            for models in self._by_engine.values():
                for m in models.values():
                    n = m.entry.get("max_model_len")
                    if type(n) is int and n > 0 and n > contexts.get(m.id, 0):
                        contexts[m.id] = n
            self._contexts, self._contexts_at = contexts, self.refreshes
        return self._contexts.get(model) if model is not None else None

    def adapters(self) -> dict[str, ServedModel]:
        """Every adapter some engine lists, by id (the first engine's entry)."""
        out: dict[str, ServedModel] = {}
        for models in self._by_engine.values():
            for m in models.values():
                if m.parent is not None:
                    out.setdefault(m.id, m)
        return out

    async def listing(self, client: httpx.AsyncClient, urls: list[str], served: list[str],
                      created: int) -> list[dict]:
        """``GET /v1/models``'s entries: what the engines at ``urls`` list now (merged by
        id), then adapters learned earlier, then the ``served`` names specs give."""
        answers = await asyncio.gather(*(client.get(u + "/v1/models", timeout=self.timeout_s)
                                         for u in urls), return_exceptions=True)
        data: dict[str, dict] = {}
        for resp in answers:
            if isinstance(resp, httpx.Response) and resp.status_code == 200:
                try:
                    doc = resp.json()
                except ValueError:
                    continue
                for m in self.parse(doc).values():
                    data.setdefault(m.id, m.entry)
        for adapter in self.adapters().values():
            data.setdefault(adapter.id, adapter.entry)
        for name in served:
            data.setdefault(name, {"id": name, "object": "model", "created": created,
                                   "owned_by": "kvevents"})
        return list(data.values())

    # -- learning --------------------------------------------------------------------

    def stale(self, engine: str) -> None:
        """``engine`` answered 404 for a model: ask every engine again now."""
        log.info("engine %s answered 404 for a model: asking the engines' /v1/models again", engine)
        self._wake.set()

    @staticmethod
    def parse(doc: object) -> dict[str, ServedModel]:
        """The models of a ``/v1/models`` answer (entries that are not objects with a
        string ``id`` are skipped)."""
        out: dict[str, ServedModel] = {}
        data = doc.get("data") if isinstance(doc, dict) else None
        for item in data if isinstance(data, list) else ():
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                parent = item.get("parent")
                parent = parent if isinstance(parent, str) and parent != item["id"] else None
                out[item["id"]] = ServedModel(item["id"], parent, item)
        return out

    async def refresh(self, client: httpx.AsyncClient, engines: Iterable[tuple[str, str]]) -> int:
        """Ask every (name, http URL) engine's ``/v1/models`` concurrently; engines not
        in ``engines`` are forgotten, those that do not answer keep their last list.
        Returns how many did not answer."""
        engines = list(engines)

        async def ask(url: str) -> dict[str, ServedModel] | None:
            try:
                resp = await client.get(url + "/v1/models", timeout=self.timeout_s)
                return self.parse(resp.json()) if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None

        answers = await asyncio.gather(*(ask(url) for _, url in engines))
        names = {name for name, _ in engines}
        for name in [n for n in self._by_engine if n not in names]:
            del self._by_engine[name]
        for (name, _), got in zip(engines, answers):
            if got is not None:
                self._by_engine[name] = got
        self.refreshes += 1
        return sum(got is None for got in answers)

    async def run(self, client: httpx.AsyncClient,
                  engines: Callable[[], Iterable[tuple[str, str]]]) -> None:
        """Refresh now, then every ``interval_s`` (every ``RETRY_S`` while an engine has
        not answered: one starting up) or soon after :meth:`stale`."""
        while True:
            self._wake.clear()
            missing = 0
            try:
                missing = await self.refresh(client, engines())
            except Exception:  # noqa: BLE001 - a background loop survives anything
                log.exception("refreshing the engines' models failed; retrying later")
            try:
                await asyncio.wait_for(self._wake.wait(),
                                       min(self.interval_s, RETRY_S) if missing else self.interval_s)
                await asyncio.sleep(0.2)  # several 404s at once: one refresh
            except asyncio.TimeoutError:
                pass


def identity_digest(lora: str | None, cache_salt: str | None, media: tuple = ()) -> bytes:
    """What a prompt's blocks are keyed by besides its tokens (adapter, salt, media items),
    as a short digest (so the salt is kept nowhere): b"" for a plain request."""
    if lora is None and cache_salt is None and not media:
        return b""
    return hashlib.blake2b(json.dumps([lora, cache_salt, *media]).encode(), digest_size=8).digest()
