"""A prompt the model cannot take is refused before it is tokenized.

A token of a tokenizer stands for at most so many characters
(:func:`~kvevents.text.limits.token_chars_bound`), so a text longer than the context
(``max_model_len``, which vLLM gives in ``/v1/models``; on the lookup API
``max_prompt_tokens``) times that has more tokens than the context holds: it is refused
with the same 400 as after tokenizing, naming the field, without tokenizing it (a
2,000,000-character chat cost ~190 MB of RSS per request to tokenize). Checked: the
bound on tokenizers of each shape (and none where the pipeline may drop text), and a
real ``kvevents serve`` in front of engines reporting their context: ten 2M-character
chats in flight at once are 400s within 2 s with little memory, a chat at the bound is
served, one character more is refused; the lookup API the same with
``max_prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from hostile_support import GatewayProcess, tokenizer, wait_for  # noqa: F401 (fixture)
from hostile_engine import EngineThread
from support import free_port
from kvevents.text.limits import chars_limit, check_chars, token_chars_bound
from kvevents.text.prompt import InputError, check_length

CONTEXT = 4096
WORDS = "The cache holds key and value tensors for every token the model has seen. "


def _text(n: int) -> str:
    return (WORDS * (n // len(WORDS) + 1))[:n]


# -- the bound ----------------------------------------------------------------------------

def _bpe(normalizer=None, pre=None, **model):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "abab": 3}, merges=[("a", "b"), ("ab", "ab")],
                               **model))
    tok.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tok.normalizer = normalizer
    return tok


def test_the_longest_token_bounds_the_characters_per_token():
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
    assert token_chars_bound(_bpe()) == 4  # "abab"
    tok = _bpe()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True)])
    assert token_chars_bound(tok) == 12  # an added token is a token too
    # Unicode composition makes text up to 4x shorter before the model sees it.
    assert token_chars_bound(_bpe(normalizers.NFC())) == 16
    assert token_chars_bound(_bpe(normalizers.Sequence([normalizers.NFKC(), normalizers.Prepend("_")]))) == 16
    assert token_chars_bound(_bpe(normalizers.Replace("  ", " "))) == 8
    assert token_chars_bound(_bpe(pre=pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))) == 4
    assert token_chars_bound(_bpe(pre=pre_tokenizers.Metaspace())) == 4


def test_no_bound_where_the_pipeline_may_drop_text():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    assert token_chars_bound(_bpe(normalizers.BertNormalizer())) is None  # strips accents
    assert token_chars_bound(_bpe(normalizers.StripAccents())) is None
    assert token_chars_bound(_bpe(normalizers.Replace(" ", ""))) is None  # a deletion
    assert token_chars_bound(_bpe(pre=pre_tokenizers.Whitespace())) is None  # drops spaces
    assert token_chars_bound(_bpe(pre=pre_tokenizers.Split(" ", behavior="removed"))) is None
    assert token_chars_bound(_bpe(pre=pre_tokenizers.Punctuation(behavior="removed"))) is None
    assert token_chars_bound(_bpe(pre=pre_tokenizers.Punctuation())) == 4
    assert token_chars_bound(_bpe(unk_token="a", fuse_unk=True)) is None  # a run of unknowns: 1 token
    assert token_chars_bound(_bpe(unk_token="a", fuse_unk=True, byte_fallback=True)) == 4
    assert token_chars_bound(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None


def test_a_text_over_what_the_tokens_can_hold_is_refused_as_after_tokenizing():
    assert chars_limit(4_000_000) == (4_000_000, "max_prompt_chars")
    assert chars_limit(4_000_000, 1_000_000, 13) == (4_000_000, "max_prompt_chars")
    assert chars_limit(4_000_000, CONTEXT, 13, "max_model_len") == (
        CONTEXT * 13, f"max_model_len {CONTEXT} tokens, of at most 13 characters each")
    assert chars_limit(4_000_000, CONTEXT, None) == (4_000_000, "max_prompt_chars")  # no bound known
    limit, why = chars_limit(4_000_000, CONTEXT, 13, "max_model_len")
    check_chars("x" * limit, limit, "prompt", why)
    with pytest.raises(InputError) as before:
        check_chars("x" * (limit + 1), limit, "prompt", why)
    with pytest.raises(InputError) as after:
        check_length(range(CONTEXT + 1), CONTEXT, "prompt")
    assert before.value.status == after.value.status == 400  # one status for the condition
    assert before.value.field == after.value.field == "prompt"
    assert "max_model_len 4096 tokens" in before.value.message, before.value.message


# -- against a real kvevents serve ---------------------------------------------------------

@pytest.fixture
def engines():
    es = EngineThread([free_port(), free_port()], max_model_len=CONTEXT)
    yield es
    es.close()


def _chat(chars: int) -> bytes:
    # content only: the role ("user") counts as 4 characters of text too
    return json.dumps({"model": "fake", "max_tokens": 4, "messages": [
        {"role": "user", "content": _text(chars - 4)}]}).encode()


def test_a_chat_the_model_cannot_take_is_refused_before_tokenizing(engines, tokenizer):
    with GatewayProcess(engines.urls, "--tokenizer", f"fake={tokenizer}") as g:
        url = g.url + "/v1/chat/completions"
        # The gateway has read the engines' context (its models refresh at start).
        assert wait_for(lambda: httpx.post(url, content=_chat(2_000_000), timeout=10).status_code == 400, 10)
        from kvevents.text import TokenizerRegistry
        per_token = TokenizerRegistry.load([("fake", str(tokenizer))]).get("fake").max_token_chars()
        bound = CONTEXT * per_token

        # At the bound: tokenized, then refused on its ids (more than the context holds, as
        # the engine would refuse it), without a trip to an engine.
        r = httpx.post(url, content=_chat(bound), timeout=30)
        assert r.status_code == 400, r.text[:300]
        assert f"tokens; the limit is {CONTEXT} (max_model_len)" in r.json()["error"]["message"], r.text
        r = httpx.post(url, content=_chat(2000), timeout=30)  # within the context: served
        assert r.status_code == 200, r.text[:300]
        r = httpx.post(url, content=_chat(bound + 1), timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and err["type"] == "invalid_request_error", err
        assert f"{bound + 1} characters; the limit is {bound}" in err["message"], err
        assert f"max_model_len {CONTEXT} tokens" in err["message"], err
        # A completion's prompt string: the same.
        r = httpx.post(g.url + "/v1/completions", timeout=30,
                       json={"model": "fake", "max_tokens": 4, "prompt": _text(bound + 1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text

        # Ten 2,000,000-character chats at once: each a 400 within 2 s, with little memory
        # (tokenizing them cost ~190 MB each).
        body = _chat(2_000_000)
        rss0, peak = g.rss_mb(), g.rss_mb()

        async def one(c: httpx.AsyncClient) -> tuple[int, float]:
            t = time.monotonic()
            r = await c.post(url, content=body, headers={"content-type": "application/json"})
            return r.status_code, time.monotonic() - t

        async def ten() -> list:
            nonlocal peak
            async with httpx.AsyncClient(timeout=30) as c:
                task = asyncio.gather(*(one(c) for _ in range(10)))
                while not task.done():
                    peak = max(peak, g.rss_mb())
                    await asyncio.sleep(0.02)
                return await task

        got = asyncio.run(ten())
        assert [s for s, _ in got] == [400] * 10, got
        assert max(t for _, t in got) < 2, got
        assert peak - rss0 < 60, (peak, rss0)
        # only the chat within the context reached an engine
        assert g.metric("kvevents_gateway_requests_total", status="200") == 1
        assert "Traceback" not in g.log_text()


def test_the_lookup_api_refuses_text_over_max_prompt_tokens_before_tokenizing(engines, tokenizer):
    from kvevents.text import TokenizerRegistry
    per_token = TokenizerRegistry.load([("fake", str(tokenizer))]).get("fake").max_token_chars()
    with GatewayProcess(engines.urls, "--tokenizer", f"fake={tokenizer}",
                        env={"KVEVENTS_MAX_PROMPT_TOKENS": "100"}) as g:
        for path in ("/v1/lookup", "/v1/route"):
            r = httpx.post(g.url + path, json={"model": "fake", "prompt": _text(100 * per_token + 1)},
                           timeout=10)
            assert r.status_code == 400 and r.json()["field"] == "prompt", r.text
            assert "max_prompt_tokens 100 tokens" in r.json()["error"], r.text
            # Within the characters, over the tokens: the same 400, after tokenizing.
            r = httpx.post(g.url + path, json={"model": "fake", "prompt": _text(1000)}, timeout=10)
            assert r.status_code == 400 and r.json()["field"] == "prompt", r.text
            assert "tokens; the limit is 100" in r.json()["error"], r.text


def test_an_images_data_is_not_counted_as_prompt_characters(engines, tokenizer):
    """A chat with a large image (a 300,000-character data URL) under a 4,096-token
    context and ``max_prompt_chars`` 100,000, both far less: its text is short, so the
    gateway routes it and the lookup API answers it; the same characters as text are
    refused by both."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 300_000}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    with GatewayProcess(engines.urls, "--tokenizer", f"fake={tokenizer}",
                        env={"KVEVENTS_MAX_PROMPT_CHARS": "100000"}) as g:  # (the lookup's bound)
        url = g.url + "/v1/chat/completions"
        assert wait_for(lambda: httpx.post(url, content=_chat(2_000_000), timeout=10).status_code == 400, 10)
        r = httpx.post(url, json={"model": "fake", "max_tokens": 4, "messages": messages}, timeout=30)
        assert r.status_code == 200, r.text[:300]
        r = httpx.post(g.url + "/v1/lookup", json={"model": "fake", "messages": messages}, timeout=30)
        assert r.status_code == 200, r.text[:300]
        as_text = [{"role": "user", "content": [{"type": "text", "text": "A" * 300_000}]}]
        r = httpx.post(url, json={"model": "fake", "max_tokens": 4, "messages": as_text}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
        # A media chat whose text is too long for the lookup's limits: refused before it is
        # rendered or tokenized, naming the field.
        with_text = [{"role": "user", "content": [as_text[0]["content"][0], image]}]
        r = httpx.post(g.url + "/v1/lookup", json={"model": "fake", "messages": with_text}, timeout=30)
        assert r.status_code == 400 and r.json()["field"] == "messages", r.text[:300]
