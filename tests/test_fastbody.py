"""The compiled reader of common ``/v1/lookup`` bodies agrees with msgspec.

``kvevents.api._fastbody.lookup_body`` may only accept what msgspec's ``LookupBody``
decoder accepts, with the same values; everything else must fall through to msgspec
(which words the errors). Checked on hand-picked edge cases, random bodies and byte
mutations, and over HTTP (same answers and errors either way).
"""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from fastapi.testclient import TestClient

from kvevents.api._fastbody import lookup_body
from kvevents.api.body import LookupBody
from kvevents.api import create_app
from kvevents.wire.schema import BlockStored, KVEventBatch
from kvevents.service.settings import AggregatorSettings

MSGSPEC = msgspec.json.Decoder(LookupBody)


def agree(raw: bytes) -> bool:
    """Asserts the two readers agree on ``raw``; returns whether the fast one read it."""
    fast = lookup_body(raw)
    try:
        want = MSGSPEC.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        assert fast is None, raw
        return False
    if fast is None:
        return False
    ids, model, lora = fast
    assert want.token_ids is not None
    assert list(ids) == want.token_ids
    assert (model, lora) == (want.model, want.lora_name)
    assert want.prompt is None and want.messages is None
    return True


ACCEPTED = [
    b'{"token_ids":[1,2,3]}',
    b'{"token_ids": []}',
    b' \t\r\n{ "token_ids" : [ 0 , 4294967295 ] , "model" : "m-1/x" } \n',
    b'{"model":null,"token_ids":[7],"lora_name":"a b"}',
    b'{"lora_name":null,"token_ids":[10,20]}',
]

LEFT_TO_MSGSPEC = [
    b'{"token_ids":[01]}', b'{"token_ids":[-1]}', b'{"token_ids":[1.0]}', b'{"token_ids":[1e3]}',
    b'{"token_ids":[4294967296]}', b'{"token_ids":[99999999999999999999]}', b'{"token_ids":[1,]}',
    b'{"token_ids":[,1]}', b'{"token_ids":null}', b'{"token_ids":"1"}', b'{"token_ids":[1]',
    b'{"token_ids":[1]} x', b'{"token_ids":[1],}', b'{"token_ids":[1],"token_ids":[2]}',
    b'{"token_ids":[1],"model":"\\u00e9"}', b'{"token_ids":[1],"model":"caf\xc3\xa9"}',
    b'{"token_ids":[1],"model":5}', b'{"token_ids":[1],"extra":1}', b'{"prompt":"hi"}',
    b'{"token_ids":[1],"prompt":"hi"}', b'{}', b'[]', b'', b'null', b'{"token_ids":[true]}',
    b'\xef\xbb\xbf{"token_ids":[1]}', b'{"token_ids":[1],"model":"a\tb"}',
]


@pytest.mark.parametrize("raw", ACCEPTED)
def test_common_bodies_are_read_as_msgspec_reads_them(raw):
    assert agree(raw)


@pytest.mark.parametrize("raw", LEFT_TO_MSGSPEC)
def test_other_bodies_are_left_to_msgspec(raw):
    assert lookup_body(raw) is None
    agree(raw)


def test_random_and_mutated_bodies():
    rng = random.Random(3)
    read = 0
    for _ in range(3000):
        body: dict = {"token_ids": [rng.choice([0, 1, 9, 10, 4294967295, rng.randrange(1 << 32),
                                                rng.randrange(10 ** rng.randrange(1, 10))])
                                    for _ in range(rng.randrange(0, 20))]}
        if rng.random() < 0.3:
            body["model"] = rng.choice([None, "m", "a/b-c.d"])
        if rng.random() < 0.3:
            body["lora_name"] = rng.choice([None, "x"])
        raw = bytearray(json.dumps(body, indent=rng.choice([None, 1])).encode())
        if rng.random() < 0.7:
            for _ in range(rng.randrange(1, 3)):
                i = rng.randrange(len(raw))
                raw[i] = rng.choice(b'0123456789,[]{}":. -enul\x00\xff:/')
        read += agree(bytes(raw))
    assert read > 1000


def test_ids_of_every_length_in_every_place():
    """Ids of 1 to 11 digits (and leading zeros), followed by each kind of byte, in the
    middle of a body (read eight bytes at a time) and in its last bytes (digit by
    digit): both readers agree."""
    after = [b",", b" ,", b"]", b".5", b"e1", b":", b"/", b"a", b"\xff", b"\x00"]
    read = 0
    for digits in range(1, 12):
        for lead in (b"1", b"9", b"0"):
            number = lead + b"7" * (digits - 1)
            for tail in after:
                for pad in (b"", b" " * 12):
                    for raw in (b'{"token_ids":[5,' + number + tail + b"1]" + pad + b"}",
                                b'{"token_ids":[' + number + tail + b"]}"):
                        read += agree(raw)
    # The fast reader takes every valid one: 20 numbers (1-10 digits, no leading zero,
    # at most 2^32 - 1), each followed by "," or " ,", with and without the padding.
    assert read == 80


@pytest.fixture
def client():
    app = create_app(AggregatorSettings(engines=()))
    with TestClient(app) as c:
        batch = KVEventBatch(1.0, [BlockStored(block_hashes=[1, 2], parent_block_hash=None,
                                               token_ids=list(range(8)), block_size=4)])
        app.state.aggregator.index.apply_batch("e0", batch, model="m")
        yield c


def test_lookups_over_http_are_the_same_either_way(client):
    """The fast reader's array reaches the index; msgspec's list gives the same answer."""
    raw = b'{"token_ids":[0,1,2,3,4,5,6,7,8]}'
    assert lookup_body(raw) is not None  # this body takes the compiled reader
    fast = client.post("/v1/lookup", content=raw)
    slow = client.post("/v1/lookup", json={"token_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8],
                                           "model": None, "prompt": None})
    assert fast.status_code == slow.status_code == 200
    assert fast.json() == slow.json()
    assert fast.json()["engines"][0]["matched_tokens"] == 8
    bad = client.post("/v1/lookup", content=b'{"token_ids":[0,1,-2]}')
    assert bad.status_code == 422 and bad.json()["field"] == "token_ids[2]"


@pytest.mark.parametrize("path", ["/v1/lookup", "/v1/route"])
def test_invalid_utf8_in_a_key_is_a_422_not_a_500(client, path):
    # msgspec raises UnicodeDecodeError (not DecodeError) for it: it was a 500.
    r = client.post(path, content=b'{"t\xffken_ids":[1]}')
    assert r.status_code == 422
    assert "UTF-8" in r.json()["error"]
