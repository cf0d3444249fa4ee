"""What a program will do with an event, known before it runs: the manifest's handler list.

The code generator guards every handler with its movement id (and a tick handler
with its period), and lists per handler the maps it uses and the context fields
it reads.  So for an event of a given movement the shim knows:

- whether any handler acts on it at all: if none does, the program would return
  without touching anything, and the event is not delivered;
- which maps the acting handlers may touch, which tells the engine when lazily
  deferred ticks must run first (`ticks.py`);
- whether they use no map at all: then their decisions are a function of the
  fields they read (decisions start at their defaults on every run), and the
  shim remembers them per value of those fields instead of running again;
- or whether they only read array maps at keys known before the run (the
  compiler's `map_reads`: constants or context fields): then their decisions are
  a function of those fields and of the entries' values, which the shim reads
  first and remembers the decisions per value of both.  This needs the maps in
  this process's memory (the JIT and the interpreter; not the kernel backend,
  whose maps live in the kernel).
"""
from __future__ import annotations

from ..machine.maptypes import ARRAY

MEMO_LIMIT = 256       # distinct field values per (hook, movement) before remembering stops


class Known:
    """Decisions known without running the program again, and how often they were reused."""
    __slots__ = ("decisions", "hits", "kept")

    def __init__(self, decisions: dict, kept: bool = True):
        self.decisions = decisions      # read-only: callers copy before they change it
        self.hits = 0                   # events served from here (the run that made it not counted)
        self.kept = kept                # False: one run's decisions, not remembered (hits are not counted)


class Acting:
    """The handlers of one program that act on one movement's events."""
    __slots__ = ("hook", "maps", "key_fields", "entries", "entry_maps", "reads", "memo", "retired", "watched")

    def __init__(self, hook: str, maps: frozenset, key_fields: tuple | None, entries: tuple = (),
                 reads: frozenset | None = None, entry_maps: tuple = ()):
        self.hook = hook
        self.maps = maps                 # maps the handlers may touch
        self.reads = reads               # context fields the handlers read (None: any)
        self.key_fields = key_fields     # fields the decisions depend on; None: not a function of them
        self.entries = entries           # the map entries they also depend on: (values, size, count, field, const)
        self.entry_maps = entry_maps     # ... the name of each one's map
        self.memo: dict[tuple, Known] = {}
        self.retired: list[Known] = []   # remembered once, kept for their counts
        self.watched = False             # its events wait for a batch (`observers.mark_observers`)

    def key(self, fields: dict) -> tuple | None:
        if self.key_fields is None:
            return None
        key = tuple([fields.get(f, 0) for f in self.key_fields])
        if self.entries:
            key += tuple([_entry(fields, *e) for e in self.entries])
        return key

    def remember(self, key, decisions: dict) -> Known | None:
        """Keep the decisions of a run for these field values (None if not remembered)."""
        if key is None:
            return None
        if len(self.memo) >= MEMO_LIMIT:     # the fields vary per event (a time, a size): stop
            self.retired.extend(self.memo.values())
            self.key_fields, self.memo = None, {}
            return None
        known = self.memo[key] = Known(dict(decisions))
        return known

    def known(self):
        """Every Known this has made, for the counts."""
        return list(self.memo.values()) + self.retired


def entry_span(fields: dict, size: int, count: int, field: str | None, const: int) -> slice | None:
    """Where in the map's values the entry a lookup at this key finds lies (None: out of
    range, the lookup finds nothing)."""
    index = (fields.get(field, 0) if field is not None else const) & 0xFFFFFFFF
    return slice(index * size, (index + 1) * size) if index < count else None


def _entry(fields: dict, values: memoryview, size: int, count: int, field: str | None, const: int):
    """An array entry's bytes as a lookup at this key would find them (None: out of range)."""
    span = entry_span(fields, size, count, field, const)
    return bytes(values[span]) if span is not None else None


def acting(hook: str, prog, handlers: list[dict] | None, movement: int | None,
           host_maps: bool = False) -> Acting | None:
    """What ``prog`` does for events of ``movement``: None if no handler acts on them.
    ``host_maps``: the program's maps are the ones in this process (not copies elsewhere),
    so entries read before a run are what it would read.

    Without a handler list (a program attached by hand) every event is delivered, every
    map of the program may be touched, and nothing is remembered."""
    if handlers is None:
        return Acting(hook, frozenset(m.name for m in prog.maps), None)
    by_movement = prog.hook.field("movement") is not None
    act = [h for h in handlers if not by_movement or h["movement"] in (None, movement)]
    if not act:
        return None
    maps = frozenset(m for h in act for m in h["maps"])
    fields = tuple(sorted({f for h in act for f in h.get("reads", ())}))
    reads = frozenset(fields) if all("reads" in h for h in act) else None
    if not maps:
        return Acting(hook, maps, fields if reads is not None else None, reads=reads)
    by_name = {m.name: m for m in prog.maps}
    map_reads = [r for h in act for r in h.get("map_reads") or ()]
    if not host_maps or any(h.get("map_reads") is None or "reads" not in h for h in act) \
            or any(by_name[name].type != ARRAY for name, _ in map_reads):
        return Acting(hook, maps, None, reads=reads)
    entries = sorted({(name, key.get("field"), key.get("const", 0)) for name, key in map_reads}, key=str)
    return Acting(hook, maps, fields, tuple(
        (memoryview(by_name[name].values), by_name[name].value_size, by_name[name].max_entries, field, const)
        for name, field, const in entries), reads, tuple(name for name, _, _ in entries))
