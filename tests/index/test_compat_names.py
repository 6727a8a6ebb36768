"""0.1.0's result names (``LookupResult.pods``, ``PodMatch``, ``PodMatch.pod``) keep
working, with a DeprecationWarning, and change nothing that is encoded."""

import warnings

import msgspec
import pytest

import kvevents.index as index_pkg
from kvevents.index import EngineMatch, LookupResult, PodMatch, PrefixIndex
from kvevents.wire.schema import BlockStored, KVEventBatch


def _result() -> LookupResult:
    m = EngineMatch(engine="e1", tokens=8, tiers={"GPU": 8}, block_size=4)
    return LookupResult(prompt_tokens=12, block_size=4, engines=[m], model="m")


def test_pod_match_is_engine_match():
    assert PodMatch is EngineMatch
    assert "PodMatch" in index_pkg.__all__
    from kvevents.index.results import PodMatch as from_results
    assert from_results is EngineMatch


def test_old_attribute_names_return_the_same_values_and_warn():
    r = _result()
    with pytest.warns(DeprecationWarning, match=r"renamed to LookupResult\.engines.*removed in 0\.3\.0"):
        pods = r.pods
    assert pods is r.engines
    with pytest.warns(DeprecationWarning, match=r"renamed to EngineMatch\.engine.*removed in 0\.3\.0"):
        assert r.engines[0].pod == "e1"


def test_old_attribute_names_are_read_only():
    r = _result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(AttributeError):
            r.pods = []  # type: ignore[misc]
        with pytest.raises(AttributeError):
            r.engines[0].pod = "x"  # type: ignore[misc]
    assert r.engines[0].engine == "e1"


def test_new_names_do_not_warn():
    r = _result()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert r.engines[0].engine == "e1"
        msgspec.json.encode(r)


def test_properties_do_not_change_the_encoding():
    r = _result()
    raw = msgspec.json.encode(r)
    doc = msgspec.json.decode(raw)
    assert set(doc) == {"prompt_tokens", "block_size", "engines", "model", "lora_name"}
    assert set(doc["engines"][0]) == {"engine", "tokens", "tiers", "block_size"}
    assert "pods" not in doc and "pod" not in doc["engines"][0]
    assert msgspec.structs.fields(LookupResult)[2].name == "engines"
    assert [f.name for f in msgspec.structs.fields(EngineMatch)] == [
        "engine", "tokens", "tiers", "block_size"]
    # Round trip, and msgpack likewise.
    assert msgspec.json.decode(raw, type=LookupResult) == r
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=LookupResult) == r


def test_a_real_lookup_answers_under_both_names():
    idx = PrefixIndex()
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                     block_size=4, lora_id=None)
    idx.apply_batch("e1", KVEventBatch(0.0, [ev]), model="m")
    r = idx.lookup([1, 2, 3, 4], model="m")
    with pytest.warns(DeprecationWarning):
        assert [p.engine for p in r.pods] == ["e1"]
    with pytest.warns(DeprecationWarning):
        assert r.engines[0].pod == "e1"
    assert b"pods" not in msgspec.json.encode(r)
