import pytest

from connector.offload import CPUOffloadingManager, OffloadKey

POLICIES = ["lru", "arc"]


def keys(*hs):
    return [OffloadKey(h) for h in hs]


def stored(m, *hs):
    out = m.prepare_store(keys(*hs))
    assert out is not None
    m.complete_store(out.keys_to_store, True)
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_store_then_lookup_counts_leading_ready_run(policy):
    m = CPUOffloadingManager(4, 16, policy)
    out = m.prepare_store(keys(1, 2, 3))
    assert out.keys_to_store == tuple(keys(1, 2, 3)) and len(set(out.store_spec.slots)) == 3
    assert m.lookup(keys(1, 2, 3)) == 0  # not ready before complete_store
    m.complete_store(keys(1, 2, 3))
    assert m.lookup(keys(1, 2, 3, 4)) == 3
    assert m.lookup(keys(2, 9, 3)) == 1
    again = m.prepare_store(keys(1, 2, 4))
    assert again.keys_to_store == tuple(keys(4)) and again.evicted_keys == ()
    ev = m.take_events()
    assert [(e.keys, e.removed) for e in ev] == [(tuple(keys(1, 2, 3)), False)]


@pytest.mark.parametrize("policy", POLICIES)
def test_pressure_evicts_and_pinned_blocks_survive(policy):
    m = CPUOffloadingManager(3, 16, policy)
    stored(m, 1, 2, 3)
    m.take_events()
    m.prepare_load(keys(1))  # pinned
    out = stored(m, 4, 5)
    assert set(out.evicted_keys) == set(keys(2, 3))
    assert m.lookup(keys(1)) == 1 and m.lookup(keys(2)) == 0
    assert [e.removed for e in m.take_events()] == [True, False]
    # Everything pinned or in flight: cannot allocate, and nothing changes.
    m.prepare_load(keys(4, 5))
    assert m.prepare_store(keys(6)) is None
    assert m.lookup(keys(1)) == 1 and m.lookup(keys(4, 5)) == 2
    m.complete_load(keys(1))
    out = stored(m, 6)
    assert out.evicted_keys == tuple(keys(1))


@pytest.mark.parametrize("policy", POLICIES)
def test_unready_blocks_are_never_evicted(policy):
    m = CPUOffloadingManager(2, 16, policy)
    assert m.prepare_store(keys(1, 2)) is not None
    assert m.prepare_store(keys(3)) is None
    m.complete_store(keys(1, 2))
    assert m.prepare_store(keys(3)) is not None


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_rolls_back(policy):
    m = CPUOffloadingManager(2, 16, policy)
    out = m.prepare_store(keys(1, 2))
    m.complete_store(keys(1, 2), success=False)
    assert m.lookup(keys(1)) == 0 and m.num_free_slots() == 2
    assert m.take_events() == []
    out2 = stored(m, 1, 2)  # the slots are reusable
    assert sorted(out2.store_spec.slots) == sorted(out.store_spec.slots)


@pytest.mark.parametrize("policy", POLICIES)
def test_touch_changes_victim(policy):
    m = CPUOffloadingManager(2, 16, policy)
    stored(m, 1)
    stored(m, 2)
    m.touch(keys(1))
    assert stored(m, 3).evicted_keys == tuple(keys(2))


def test_arc_ghost_hit_adapts_target():
    m = CPUOffloadingManager(2, 16, "arc")
    stored(m, 1)
    stored(m, 2)
    stored(m, 3)  # evicts 1 into ghost list B1
    p0 = m.policy.p
    stored(m, 1)  # recency miss: T1 target grows, 1 goes to T2
    assert m.policy.p > p0
    assert m.lookup(keys(1)) == 1


def test_prepare_load_of_missing_block_raises():
    m = CPUOffloadingManager(2, 16)
    with pytest.raises(KeyError):
        m.prepare_load(keys(7))


def test_invalid_policy():
    with pytest.raises(ValueError):
        CPUOffloadingManager(2, 16, "fifo")
