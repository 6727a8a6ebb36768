from kvevents.wire.schema import BlockRemoved, BlockStored

from connector.events_tracker import ChunkPayload, OffloadEventsTracker
from connector.offload import OffloadingEvent, OffloadKey


def payload(hashes, parent, bs=2):
    return ChunkPayload(tuple(hashes), parent, tuple(range(bs * len(hashes))), bs, "lora-a", (("lora-a",),) * len(hashes))


def ev(keys, removed):
    return OffloadingEvent(tuple(OffloadKey(k) for k in keys), 4, "CPU", removed)


def test_overlapping_chunks_announce_and_remove_each_block_once():
    t = OffloadEventsTracker("CPU")
    # Two chunks share blocks 10, 11 (a prefix not aligned to the chunk) and differ after.
    t.snapshot(OffloadKey(12), payload([10, 11, 12], parent=9))
    t.snapshot(OffloadKey(13), payload([10, 11, 13], parent=9))
    out = t.translate([ev([12], False), ev([13], False)])
    assert all(isinstance(e, BlockStored) and e.medium == "CPU" for e in out)
    assert [e.block_hashes for e in out] == [[10, 11, 12], [13]]
    assert out[0].parent_block_hash == 9 and out[0].token_ids == list(range(6)) and out[0].block_size == 2
    assert out[0].lora_name == "lora-a" and len(out[0].extra_keys) == 3
    # The second event is a valid chain segment: its parent is block 11, its tokens block 13's.
    assert out[1].parent_block_hash == 11 and out[1].token_ids == [4, 5]
    # Evicting one chunk must not remove the still-resident shared blocks.
    assert t.translate([ev([12], True)]) == [BlockRemoved(block_hashes=[12], medium="CPU", group_idx=0)]
    assert t.translate([ev([13], True)]) == [BlockRemoved(block_hashes=[10, 11, 13], medium="CPU", group_idx=0)]
    assert t.announced_hashes() == set()


def test_eviction_fans_out_all_constituents():
    t = OffloadEventsTracker("CPU")
    t.snapshot(OffloadKey(4), payload([1, 2, 3, 4], parent=None))
    (stored,) = t.translate([ev([4], False)])
    assert stored.block_hashes == [1, 2, 3, 4] and stored.parent_block_hash is None
    (removed,) = t.translate([ev([4], True)])
    assert removed.block_hashes == [1, 2, 3, 4]


def test_discarded_snapshot_and_reset_leave_no_state():
    t = OffloadEventsTracker("CPU")
    t.snapshot(OffloadKey(4), payload([3, 4], parent=2))
    t.discard([OffloadKey(4)])
    t.snapshot(OffloadKey(6), payload([5, 6], parent=4))
    t.translate([ev([6], False)])
    t.reset()
    assert t.announced_hashes() == set() and t.translate([ev([6], True)]) == []


def test_old_style_events():
    t = OffloadEventsTracker("CPU", self_describing=False)
    t.snapshot(OffloadKey(4), payload([3, 4], parent=2))
    (stored,) = t.translate([ev([4], False)])
    assert stored.block_hashes == [4] and stored.token_ids == [] and stored.block_size == 0
    assert stored.parent_block_hash is None
    assert t.constituents(OffloadKey(4)) == (3, 4)
    (removed,) = t.translate([ev([4], True)])
    assert removed.block_hashes == [4]
