"""Packing hook contexts from the hook catalogue: the runtime's side of fabric.h."""
from __future__ import annotations

import ctypes
import operator
import struct

import numpy as np

from ..units import DEVICE, quantity_as

_FMT = {"u32": "<I", "u64": "<Q"}
SHARED_LIMIT = 1024     # distinct decision outcomes (and batch sizes) a codec keeps structures for
_MASK = {"<I": 0xFFFFFFFF, "<Q": 0xFFFFFFFFFFFFFFFF}
_NO_PLAN = object()     # `fill` has not met this set of field names yet


def _pack_into(st: struct.Struct, buf, offset: int, values, masks) -> None:
    try:
        st.pack_into(buf, offset, *values)
    except struct.error:       # a float, a negative or too large a value: as C would store it
        st.pack_into(buf, offset, *[int(v) & m for v, m in zip(values, masks)])


_STAMP_FACTORIES: dict[str, object] = {}     # source -> a compiled `_stamp_factory`


def _stamp_factory(n_consts: int, given: str, values: str):
    """A function of (pack, its error, a masking pack, the fixed values ``c0``..) that returns
    a function of the ``given`` names packing ``values`` (names of both, in the struct's order):
    compiled once per arrangement of fields, the fixed values bound as the closure's (a
    compile costs as much as a few hundred packs)."""
    consts = "".join(f", c{i}" for i in range(n_consts))
    source = (f"def factory(pack, error, masked{consts}):\n"
              f"    def make({given}):\n"
              f"        try:\n            return pack({values})\n"
              f"        except error:\n            return masked([{values}])\n"     # as `_pack_into`
              f"    return make\n")
    factory = _STAMP_FACTORIES.get(source)
    if factory is None:
        scope: dict = {}
        exec(source, scope)     # noqa: S102 - names made here, nothing from input
        factory = scope["factory"]
        if len(_STAMP_FACTORIES) < SHARED_LIMIT:
            _STAMP_FACTORIES[source] = factory
    return factory


class ContextCodec:
    """Fills a hook's context struct and reads its decisions back, by field name.

    Fields the hook does not have are ignored, so one dict of event fields can
    serve every hook that fires for an event."""

    def __init__(self, hook):
        self.hook = hook
        self.size = hook.ctx_size
        self._offs = {name: (off, struct.Struct(_FMT[f.ctype])) for name, (off, f) in hook.layout.items()}
        self._decisions = [(n, off, struct.Struct(_FMT[f.ctype]), f.default)
                           for n, (off, f) in hook.layout.items() if f.decision]
        self._template = bytearray(self.size)
        for _n, off, st, default in self._decisions:
            st.pack_into(self._template, off, default)
        self.buffer = ctypes.create_string_buffer(self.size)   # reused by `fill`
        self._template_bytes = bytes(self._template)
        self._plans: dict[tuple, tuple] = {}
        self._fills: dict[tuple, tuple | None] = {}
        self._many: dict[tuple, tuple] = {}     # (fill struct, rows) -> n rows' struct and masks
        self._outcomes: dict[tuple, dict] = {}       # raw decision values -> their shared `changed` dict
        items = hook.layout.items()
        self._dtype = np.dtype({"names": [n for n, _ in items], "offsets": [off for _, (off, _) in items],
                                "formats": [_FMT[f.ctype] for _, (_, f) in items], "itemsize": self.size})
        # every decision read back with one unpack, compared with the defaults at once
        self._dec_defaults: tuple = ()
        self._defaults = {n: d for n, _, _, d in self._decisions}
        if self._decisions:
            start = self._decisions[0][1]
            fmt, pos = "<", start
            for _n, off, st, _ in self._decisions:
                fmt += "x" * (off - pos) + st.format[-1]
                pos = off + st.size
            self._dec_struct, self._dec_start = struct.Struct(fmt), start
            self._row_decisions = struct.Struct(fmt[:1] + "x" * start + fmt[1:] + "x" * (self.size - pos))
            self._dec_names = [n for n, *_ in self._decisions]
            self._dec_defaults = tuple(d for *_, d in self._decisions)
        self._inputs_first = not self._decisions or all(       # what `fill`'s one struct assumes
            off < self._dec_start for off, f in hook.layout.values() if not f.decision)

    def pack(self, values: dict[str, int] | None = None, **kw) -> bytearray:
        """A new context with the given fields (decisions too) and every other decision at its default."""
        buf = bytearray(self._template)
        self._write(buf, {**values, **kw} if values and kw else values or kw)   # one write: gaps pack as zeros
        return buf

    def fill(self, values: dict[str, int]):
        """The codec's own reusable buffer, filled: no allocation per event.  Usually one pack
        over the whole context: the given inputs, zeros for the others, the decisions' defaults."""
        buf = self.buffer
        names = tuple(values)
        plan = self._fills.get(names, _NO_PLAN)      # (without a call: every run fills a context)
        if plan is _NO_PLAN:
            plan = self._fill_plan(names)
        if plan is None:
            ctypes.memmove(buf, self._template_bytes, self.size)
            self._write(buf, values)
        else:
            st, getter, masks, _ = plan
            _pack_into(st, buf, 0, getter(values) + self._dec_defaults, masks)
        return buf

    def _fill_plan(self, names: tuple):
        """`fill`'s struct for events with these fields, or None where they name a decision
        (then the template is copied and the fields written over it); kept per set of names."""
        plan = self._fills.get(names, _NO_PLAN)
        if plan is not _NO_PLAN:
            return plan
        plan = None
        if self._inputs_first and self._defaults.keys().isdisjoint(names):
            st, start, getter, masks, order = self._layout_for(names)
            fmt, end = "<" + "x" * start + st.format[1:], start + st.size
            if self._decisions:
                fmt += "x" * (self._dec_start - end) + self._dec_struct.format[1:]
                masks = masks + [_MASK[s.format] for _, _, s, _ in self._decisions]
            plan = (struct.Struct(fmt + "x" * (self.size - struct.calcsize(fmt))), getter, masks, order)
        self._fills[names] = plan
        return plan

    def _layout_for(self, names: tuple):
        """One struct covering the given inputs (other names are left out) in offset order, a
        getter that pulls their values from a dict in that order, their masks and names in
        that order (cached per set of names).

        Padding between them packs as zeros, which is safe: every hook lays its inputs out
        before its decisions, so no decision lies between two inputs."""
        hit = self._plans.get(names)
        if hit is None:
            fields = sorted((self._offs[n][0], n, self._offs[n][1]) for n in names
                            if n in self._offs and n not in self._defaults)
            fmt, pos, order = "<", fields[0][0] if fields else 0, []
            start = pos
            for off, n, st in fields:
                fmt += "x" * (off - pos) + st.format[-1]
                pos = off + st.size
                order.append(n)
            getter = operator.itemgetter(*order) if len(order) > 1 else (
                (lambda d, n=order[0]: (d[n],)) if order else (lambda d: ()))
            masks = [_MASK[self._offs[n][1].format] for n in order]
            hit = self._plans[names] = (struct.Struct(fmt), start, getter, masks, order)
        return hit

    def _write(self, buf, values):
        if not values:
            return
        st, start, getter, masks, _ = self._layout_for(tuple(values))
        _pack_into(st, buf, start, getter(values), masks)
        for name in self._defaults.keys() & values.keys():     # decisions one by one
            off, fst = self._offs[name]
            _pack_into(fst, buf, off, (values[name],), (_MASK[fst.format],))

    def pack_many(self, n: int, common: dict[str, int], columns: dict[str, list] | None = None) -> np.ndarray:
        """A 2-D uint8 array of n contexts (for batch runs): every decision at its default,
        ``common`` fields the same in every row, ``columns`` one value per row.

        Built as bytes and viewed once: a transfer has a handful of chunks, where numpy's
        per-call cost would outweigh the per-row work."""
        size, columns = self.size, columns or {}
        names = tuple(common) + tuple(k for k in columns if k not in common)
        plan = self._fills[names] if names in self._fills else self._fill_plan(names)
        if plan is None:       # a decision among the fields: each row as `pack` makes it
            buf = bytearray(b"".join(bytes(self.pack(common, **{k: v[i] for k, v in columns.items()}))
                                     for i in range(n)))
        else:
            st, getter, masks, order = plan
            row = getter({**common, **dict.fromkeys(columns, 0)}) + self._dec_defaults
            flat, width = list(row) * n, len(row)      # every row's values, then one pack
            for k, values in columns.items():
                if k in order:
                    flat[order.index(k)::width] = values
            many = self._many.get((st, n))
            if many is None:
                many = (struct.Struct("<" + st.format[1:] * n), masks * n)
                if len(self._many) < SHARED_LIMIT:
                    self._many[st, n] = many
            buf = bytearray(n * size)
            _pack_into(many[0], buf, 0, flat, many[1])
        return np.frombuffer(buf, dtype=np.uint8).reshape(n, size)

    def stamp(self, fixed: dict[str, int], varying: tuple[str, ...]):
        """A function of the ``varying`` fields' values (in that order) that returns the context,
        as bytes, with those and the ``fixed`` fields (inputs only) and every decision at its
        default: for many contexts that differ in a few fields.  Fields the hook lacks are ignored."""
        names = tuple(fixed) + tuple(v for v in varying if v not in fixed)
        plan = self._fill_plan(names)
        if plan is None:
            raise ValueError(f"{self.hook.name}: a decision among the fields {names}")
        st, _, masks, order = plan
        # the struct's values in its order: each field's, given or fixed, then the decisions'
        # defaults.  The function is made from source, as dataclasses and namedtuple make theirs,
        # with the fixed values bound: picking them out of a tuple at each call cost twice the
        # pack (a watcher's context is made for every chunk it is shown)
        given = [f"v{i}" for i in range(len(varying))]
        consts = [fixed.get(n, 0) for n in order if n not in varying] + list(self._dec_defaults)
        names = iter(f"c{i}" for i in range(len(consts)))
        values = ", ".join([given[varying.index(n)] if n in varying else next(names) for n in order] + list(names))
        return _stamp_factory(len(consts), ", ".join(given), values)(
            st.pack, struct.error, lambda vs: st.pack(*[int(v) & m for v, m in zip(vs, masks)]), *consts)

    def first_decided(self, rows: np.ndarray) -> int | None:
        """The first row of a batch whose decisions are not all at their defaults (None: none)."""
        if not self._decisions or not len(rows):
            return None
        lo, hi = self._dec_start, self._dec_start + self._dec_struct.size
        differs = (rows[:, lo:hi] != np.frombuffer(self._template_bytes[lo:hi], dtype=np.uint8)).any(axis=1)
        return int(differs.argmax()) if differs.any() else None

    def changed_many(self, rows: np.ndarray) -> list[dict[str, int] | None]:
        """`changed` for every row of a batch (None where nothing changed)."""
        if not self._decisions:
            return [None] * len(rows)
        return [self._changed(v) or None for v in self._row_decisions.iter_unpack(rows.tobytes())]

    def dtype(self) -> np.dtype:
        """The context struct as a numpy structured dtype, to build many contexts at once."""
        return self._dtype

    def decisions(self, buf) -> dict[str, int]:
        return {n: st.unpack_from(buf, off)[0] for n, off, st, _ in self._decisions}

    def changed(self, buf) -> dict[str, int]:
        """Decisions whose value differs from the default (what the program decided).  Read-only:
        contexts that decided alike share one dict (up to SHARED_LIMIT outcomes per codec), so
        callers may count outcomes by identity."""
        return self.changed_of(self.outcome(buf))

    def outcome(self, buf) -> tuple:
        """Every decision field's value as the context holds it, in layout order: a key to count
        runs by, which `changed_of` turns into what `changed` gives."""
        return self._dec_struct.unpack_from(buf, self._dec_start) if self._decisions else ()

    def changed_of(self, outcome: tuple) -> dict[str, int]:
        """`changed` of a context whose `outcome` this is."""
        return self._changed(outcome) if outcome else {}

    def _changed(self, values: tuple) -> dict[str, int]:
        out = self._outcomes.get(values)
        if out is None:
            out = {n: v for n, v, d in zip(self._dec_names, values, self._dec_defaults) if v != d}
            if len(self._outcomes) < SHARED_LIMIT:
                self._outcomes[values] = out
        return out


def fields_from_text(hook, text: str, ids=None) -> dict[str, int]:
    """A context given by field names, as ``fabric-vm run --ctx`` takes it:
    ``movement=kv_export,bytes=2MiB,src=gpu0``.  A value with a unit must be of the field's
    dimension and is converted to the context's base unit (bytes, ns, B/s, %); a bare whole
    number is taken as it is; a movement's or a device field's name is looked up in
    ``ids("movements")`` or ``ids("devices")``, the id tables (name -> id) of the policy the
    program is from (``ids`` None: there is none).  ValueError says which field is wrong and why."""
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        field = hook.field(name)
        if not eq or not raw:
            raise ValueError(f"'{item}' is not FIELD=VALUE")
        if field is None:
            raise ValueError(f"{hook.island_kind}.{hook.name} has no field '{name}' "
                             f"(it has: {', '.join(hook.layout)})")
        if name in values:
            raise ValueError(f"'{name}' is given twice; give each field once")
        if raw[0].isalpha() or raw[0] == "_":
            values[name] = _named(hook, field, raw, ids)
            continue
        try:
            value = quantity_as(raw, field.dim, name)
        except ValueError as e:
            raise ValueError(f"{name}={raw}: {e}") from None
        if value != int(value) or not 0 <= value < 1 << (8 * field.size):
            raise ValueError(f"{name}={raw}: not a whole number that fits in its {field.ctype}")
        values[name] = int(value)
    return values


def _named(hook, field, name: str, ids) -> int:
    what = "movements" if field.name == "movement" else "devices" if field.dim == DEVICE else None
    if what is None:
        raise ValueError(f"{field.name}={name}: {hook.island_kind}.{hook.name}'s '{field.name}' takes a number")
    if ids is None:
        raise ValueError(f"{field.name}={name}: names need the policy's manifest.json beside the object; "
                         "give the id instead")
    table = ids(what)
    if name not in table:
        raise ValueError(f"{field.name}={name}: no such name (the policy has: {', '.join(sorted(table)) or 'none'})")
    return table[name]
