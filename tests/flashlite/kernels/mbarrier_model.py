"""A model of Hopper's mbarrier and a random scheduler, for checking the Gluon kernels' barrier protocols on the CPU.

The warp-specialized kernels (a producer warp issuing TMA copies into a ring of shared-memory slots, consumer
warpgroups handing slots back) cannot run without a Hopper GPU, and a wrong phase or a missing hand-back there shows
up as a hang or as rare wrong numbers. Their protocols are restated in tests, wait for wait and arrival for arrival,
as generator "agents" over ``MBarrier``; ``interleave`` runs one ready agent at a time, chosen at random, with
copies landing at any later step, and raises ``Violation`` on a deadlock (or on a broken invariant the agents check
themselves).
"""
import random
from typing import Callable, Iterator, Optional

Agent = Iterator[Optional[Callable[[], bool]]]  # yields the condition it waits on; None: runnable at once


class MBarrier:
    """mbarrier: ``count`` arrivals and all expected transaction bytes complete a phase; ``passes(parity)`` as
    ``mbarrier.try_wait.parity`` reads it: the wait passes while the current phase has the other parity, so a
    barrier two phases ahead of its waiter would look the same as one not yet arrived."""

    def __init__(self, count: int = 1):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, expect_tx: int = 0):
        self.tx += expect_tx
        self.pending -= 1
        assert self.pending >= 0
        self._maybe_complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._maybe_complete()

    def passes(self, parity: int) -> bool:
        return (self.phase & 1) != parity


class Violation(AssertionError):
    pass


class NamedBarrier:
    """A hardware barrier (``bar.sync`` / ``bar.arrive id, threads``): a generation completes once ``threads``
    threads have arrived, waiting (sync) or not (arrive); every participant of a generation must name the same
    thread count, and more arrivals than it names are an error, as is a barrier left part-way at the end
    (``idle``). It has no phase: an arrival always counts towards the generation in progress."""

    def __init__(self):
        self.expected, self.arrived, self.generation = None, 0, 0

    def arrive(self, threads: int, count: int) -> int:
        """``count`` threads arrive naming ``threads``; returns the generation they belong to."""
        if self.expected is None:
            self.expected = threads
        elif self.expected != threads:
            raise Violation(f"named barrier: arrivals name {self.expected} and {threads} threads in one generation")
        self.arrived += count
        if self.arrived > self.expected:
            raise Violation(f"named barrier: {self.arrived} arrivals for {self.expected} threads")
        generation = self.generation
        if self.arrived == self.expected:
            self.generation, self.arrived, self.expected = self.generation + 1, 0, None
        return generation

    def sync(self, threads: int, count: int):
        """As an agent's ``yield from``: arrive, then wait until that generation completes."""
        generation = self.arrive(threads, count)
        yield lambda: self.generation > generation

    @property
    def idle(self) -> bool:
        return self.arrived == 0


def check_refill(held: list[set[int]], stages: int, slot: int, block: int) -> None:
    """Violation if ring slot ``slot`` is about to take ``block`` while a consumer still reads an older block in it
    (``held[c]``: the blocks consumer c still reads; block b sits in slot b % stages)."""
    for c, blocks in enumerate(held):
        for b in blocks:
            if b % stages == slot and b != block:
                raise Violation(f"slot {slot} takes block {block} while consumer {c} still reads block {b}")


def landing_copy(held: list[set[int]], stages: int, slots: Optional[list], barrier: MBarrier, slot: Optional[int],
                 block: Optional[int]) -> Agent:
    """A TMA copy in flight, as an agent: it lands at any later step (the scheduler picks when), writes ``block``
    into ``slots[slot]`` (``slots`` None: a tile outside the ring) after ``check_refill``, and completes one
    transaction byte of ``barrier``."""
    yield lambda: True
    if slots is not None:
        check_refill(held, stages, slot, block)
        slots[slot] = block
    barrier.complete_tx(1)


def interleave(agents: list[Agent], in_flight: list[Agent], seed: int, describe: Callable[[], str],
               max_steps: int = 100_000) -> None:
    """Run ``agents`` and every copy appended to ``in_flight`` at random until all are done; Violation on a deadlock
    (``describe()`` says where) or when ``max_steps`` pass."""
    rng = random.Random(seed)
    waiting = {agent: None for agent in agents}  # agent -> the condition it waits on (None: runnable)
    for _ in range(max_steps):
        for copy in in_flight:
            waiting.setdefault(copy, None)
        in_flight.clear()
        if not waiting:
            return
        ready = [a for a, cond in waiting.items() if cond is None or cond()]
        if not ready:
            raise Violation(f"deadlock: {len(waiting)} agents wait ({describe()})")
        agent = rng.choice(ready)
        try:
            waiting[agent] = next(agent)
        except StopIteration:
            del waiting[agent]
    raise Violation("no end after max_steps")
