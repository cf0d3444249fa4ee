"""Context packing: the batch paths say exactly what packing one event at a time says."""
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_ext.contract.context import ContextCodec
from fabric_ext.contract.hooks import HOOKS

HOOK_LIST = sorted(HOOKS.values(), key=lambda h: (h.island_kind, h.name))
value = st.one_of(st.integers(0, 2**64 - 1), st.integers(-5, -1), st.floats(0, 1e12))


@st.composite
def batches(draw):
    hook = draw(st.sampled_from(HOOK_LIST))
    inputs = [f.name for f in hook.fields if not f.decision]
    fields = inputs + ["not_a_field"] + ([f.name for f in hook.fields] if draw(st.booleans()) else [])
    n = draw(st.integers(1, 6))
    common = {k: draw(value) for k in draw(st.sets(st.sampled_from(fields)))}
    columns = {k: draw(st.lists(value, min_size=n, max_size=n)) for k in draw(st.sets(st.sampled_from(fields)))}
    return hook, n, common, columns


@settings(max_examples=150, deadline=None)
@given(batches())
def test_pack_many_rows_are_the_contexts_packed_one_by_one(batch):
    hook, n, common, columns = batch
    codec = ContextCodec(hook)
    rows = codec.pack_many(n, common, columns)
    for i in range(n):
        one = {**common, **{k: v[i] for k, v in columns.items()}}
        assert rows[i].tobytes() == bytes(codec.pack(one))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([h for h in HOOK_LIST if h.decisions]), st.data())
def test_changed_many_reads_each_row_as_changed_does(hook, data):
    codec = ContextCodec(hook)
    n = data.draw(st.integers(1, 6))
    rows = codec.pack_many(n, {})
    for i in range(n):       # some rows keep the defaults, some decide, some decide alike
        for f in data.draw(st.lists(st.sampled_from(hook.decisions), max_size=3)):
            off = hook.layout[f.name][0]
            rows[i, off:off + f.size] = list(data.draw(st.sampled_from([1, 7, 2**32 - 1])).to_bytes(f.size, "little"))
    got = codec.changed_many(rows)
    assert got == [codec.changed(rows[i].tobytes()) or None for i in range(n)]
    assert codec.first_decided(rows) == next((i for i, c in enumerate(got) if c), None)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(HOOK_LIST), st.data())
def test_a_stamp_makes_the_context_packing_makes(hook, data):
    """`stamp`: the fixed fields once, the varying ones per context, what `pack` gives for both."""
    codec = ContextCodec(hook)
    inputs = [f.name for f in hook.fields if not f.decision] + ["not_a_field"]
    fixed = {k: data.draw(value) for k in data.draw(st.sets(st.sampled_from(inputs)))}
    varying = tuple(data.draw(st.lists(st.sampled_from(inputs), unique=True, max_size=4)))
    stamp = codec.stamp(fixed, varying)
    for _ in range(3):
        given_ = [data.draw(value) for _ in varying]
        assert stamp(*given_) == bytes(codec.pack({**fixed, **dict(zip(varying, given_))}))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(HOOK_LIST), st.data())
def test_the_reused_buffer_holds_exactly_what_a_new_context_would(hook, data):
    """`fill` packs over whatever the last event and its program left in the buffer: every
    field it is not given reads zero (inputs) or its default (decisions) again."""
    codec = ContextCodec(hook)
    names = [f.name for f in hook.fields]
    for _ in range(3):
        given_ = {k: data.draw(value) for k in data.draw(st.sets(st.sampled_from(names)))}
        given_["not_a_field"] = 5
        buf = codec.fill(given_)
        assert bytes(buf) == bytes(codec.pack(given_))
        buf[:] = bytes([0xA5]) * codec.size       # what a run might leave behind
