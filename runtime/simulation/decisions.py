"""What the hook site remembers between events, in one place (the engine's `DecisionCache`).

Two kinds of memory sit above the shims' own (`dispatch.Acting`: decisions per value of the
fields a program reads):

- a `HookPlan` per place an event happens (island, the transfer's ends, movement): which hooks
  there have a program acting on the movement, and whether all of them decide from the
  transfer's own fields alone;
- a `Standing` per (transfer, island, moment) where the plan is static: the decisions hold for
  every chunk of the transfer issued at the island (moment "issue/src" or "issue/dst") or
  entering it on the transfer's path ("enter"), so later chunks take them without asking the
  shims.  They are kept on the transfer (`Transfer.standing`, keyed by island and moment),
  where each of its chunks finds them in one lookup.  Their uses are counted as hits of the
  decisions they repeat when the run's report is drawn (`settle`).  A static plan's decisions
  are a function of the transfer's own fields, so one `Standing` serves every transfer with
  the same values of those the hooks read (`HookPlan.shared`): a transfer's first chunk takes
  it as its later ones do; an `AtHop` serves every transfer on the same path with those
  values, while its guard holds.

A program detached after a fault takes its island's standing decisions with it (`forget`).
The fabric reads none of this itself (a transfer only carries its standing decisions for the
hook site): it asks the hook site at each decision point, and its trains ask what stands
(`HookSite.standing`), keep what they work out of it until what stands for the transfer
changes (`HookSite.stands_for`: a transfer's `standing` dict is replaced at every change, never
changed in place), and tell the hook site the uses (`HookSite.took`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from .dispatch import MEMO_LIMIT, Known


@dataclass(frozen=True, slots=True)
class HookPlan:
    hooks: tuple[str, ...]      # the hooks whose program acts on the movement here, in firing order
    static: bool                # each decides from the transfer's own fields alone
    queue_split: bool = False   # one reads what is queued ahead by priority (ev.queued_ahead_hi/_lo)
    at_hop: bool = False        # not static, but each decides from those, the ports at the chunk's
                                # hop and array entries at keys among them (`AtHop`)
    watch: tuple = ()           # (island, hook, movement) of each hook: the ticks that write what its
                                # handlers read run first (`HookSite.before_reading`)
    key: tuple | None = None    # static or at_hop: where the transfer's fields the hooks
                                # read lie in `Transfer.ctx`
    observed: bool = False      # every hook's program only watches the movement's events (`Watched`)
    shared: dict = field(default_factory=dict, compare=False)   # `key_of` -> what stands there
    watchers: dict = field(default_factory=dict, compare=False)     # (moment, hop, path) -> its `Watched`
    _pick: object = field(default=None, init=False, repr=False, compare=False)   # ctx -> the key's values

    def __post_init__(self):
        if self.key is not None:        # (`key_of`: one C call at every transfer's start)
            object.__setattr__(self, "_pick", operator.itemgetter(*self.key) if self.key else (lambda ctx: ()))

    def key_of(self, transfer, hop: int, path: tuple):
        """What a static plan's decisions are a function of, for ``transfer``: the values of
        its fields the hooks read (the one value, where one); an at_hop plan's, those, the
        path of its chunk and its hop there (which give its ports) and the map entries read,
        which its `AtHop`'s guard checks."""
        values = self._pick(transfer.ctx)
        return values if self.static else (values, hop, path)


@dataclass(slots=True)
class Standing:
    decisions: dict | None      # what the fabric applies, read-only (None: nothing)
    repeats: list[Known]        # the decisions these are, whose hits the uses count as
    prefetch: int = 0           # an issue hook's prefetch decision, which the hook site applies
    uses: int = 0
    watched = False             # (`Watched`: each chunk that takes it is given to programs)


@dataclass(slots=True)
class AtHop(Standing):
    """Decisions of an `at_hop` plan: they hold at one hop of the transfer's path, while the
    map entries they read are unchanged."""
    hop: int = 0
    guard: tuple = ()           # (the map's values, the entry's span, its bytes then) each
    refresh: object = None      # a `ticks.Refresher`, called with the time before they are read
                                # from its ``fresh_until`` on: the ticks that write them run
                                # (`HookSite.before_reading`); None: none does


@dataclass(slots=True)
class Watched(Standing):
    """Nothing decided, for every chunk: the hooks' programs only watch (`observers.mark_observers`).
    Each chunk that takes it at its hop is still given to them (`ShimHookSite.on_issue`,
    `on_enter`), which keep its context for their batch.  One serves every transfer on a path
    (`HookPlan.watchers`): a context's fields are those of the hop, its transfer's and its own."""
    hop: int = 0
    split: bool = False         # a handler reads what is queued ahead by priority
    queue: object = None        # where the chunks queue on from the hop (`servers.Server`; None: nowhere)
    stamps: tuple = ()          # (shim, hook, the hook's contexts at the hop: `ContextCodec.stamp` of
                                # the transfer's fields, then the chunk's) each
    watched = True


@dataclass
class DecisionCache:
    plans: dict[tuple, HookPlan] = field(default_factory=dict)
    _holders: set = field(default_factory=set)         # the transfers with standing decisions
    _settled: dict[int, Standing] = field(default_factory=dict)    # by id: a shared one once

    def stand(self, transfer, island: str, moment: str, standing: Standing, share: tuple | None = None) -> None:
        """``standing`` holds for the transfer's later chunks at ``island`` at ``moment``, and
        where ``share`` is (a plan, a `HookPlan.key_of`) for the later transfers with that key."""
        self._holders.add(transfer)
        transfer.standing = {**transfer.standing, (island, moment): standing}
        if standing.repeats:        # (uses to count as hits)
            self._settled[id(standing)] = standing
        if share is not None:
            plan, key = share
            if len(plan.shared) < MEMO_LIMIT or key in plan.shared:
                plan.shared[key] = standing

    def stand_all(self, transfer, found: dict) -> None:
        """What is shared by other transfers (`HookPlan.shared`, `HookPlan.watchers`) holds for
        ``transfer``'s chunks too: ``found`` by (island, moment)."""
        self._holders.add(transfer)
        transfer.standing = {**transfer.standing, **found} if transfer.standing else found

    @property
    def standing(self) -> dict[tuple, Standing]:
        """Every standing decision by (transfer, island, moment): a view, made when asked."""
        return {(t, island, moment): s for t in self._holders for (island, moment), s in t.standing.items()}

    def forget(self, island: str) -> None:
        """A program of ``island`` was detached: what it decided no longer holds.  What stands
        for watchers may (`HookPlan.watchers`): a detached program's shim keeps nothing it is
        shown (`Shim.keep`)."""
        for t in self._holders:
            t.standing = {k: s for k, s in t.standing.items() if k[0] != island}
        for where, plan in self.plans.items():
            if where[0] == island:
                plan.shared.clear()

    def settle(self) -> None:
        """Count each standing decision's uses as hits of the decisions it repeats (once)."""
        for s in self._settled.values():
            for known in s.repeats:
                known.hits += s.uses
            s.uses = 0
