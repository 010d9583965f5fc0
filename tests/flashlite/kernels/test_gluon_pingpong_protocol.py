"""A model of the ping-pong Gluon kernel's barrier protocol (step 3), run under random interleavings on the CPU.

The kernel (``_pp_producer``, ``_pp_consumer``, ``_pp_blocks``, ``_take_turn`` in
``flashlite.kernels.attention_fwd_gluon``) cannot run without a Hopper GPU, and a wrong phase or a missing
hand-back there shows up as a hang or as rare wrong numbers. So its protocol is restated here, wait for wait and
arrival for arrival, over a model of the mbarrier (``mbarrier_model`` beside this file: arrival count, transaction
bytes, phase parity). Copies land at any later time. A scheduler runs one ready agent at a time (the producer, the
two consumers, the copies in flight), chosen at random, and checks on every step:

* progress: the run ends with every agent done (no deadlock);
* the ring: a slot is refilled only when no consumer still reads an older block in it, and a consumer that passes
  a "ready" wait finds exactly the block it expects, landed;
* the turns: consumer 0's turn k comes after consumer 1's turn k - 1 and consumer 1's turn k after consumer 0's turn
  k, while the other has such a turn.

The kernel has a second form of the same protocol (NAMED_BARRIERS): turns and slot releases through hardware named
barriers (``bar.sync`` / ``bar.arrive``: a thread count, no phase) instead of mbarriers. It is modelled here too
(``NamedBarrier``), with one more check: at the end no named barrier holds arrivals (an arrival without its waiter
would be counted towards a later generation, or left for the next program on the SM).

Changing the kernel's protocol means changing this model with it. Deliberately broken protocols (a producer that
ignores the second consumer's hand-back; turn waits without their predicates; with named barriers, turn hand-overs
or releases without theirs) must be caught, so that the checks are known to bite.
"""
import pytest

from .mbarrier_model import MBarrier, NamedBarrier, Violation, check_refill, interleave, landing_copy

CONSUMER_THREADS, PRODUCER_THREADS = 128, 32


class Kernel:
    """One program: n_blocks[c] key blocks for consumer c, a ring of ``stages`` slots."""

    def __init__(self, n_blocks, stages, *, named=False, ignore_release_of=None, unpredicated_turns=False,
                 unpredicated_hand_overs=False, unpredicated_releases=False):
        self.n, self.stages, self.named = n_blocks, stages, named
        self.turns_of = [n + 1 if n > 0 else 0 for n in n_blocks]
        self.q_ready = [MBarrier() for _ in range(2)]
        self.k_ready = [MBarrier() for _ in range(stages)]
        self.v_ready = [MBarrier() for _ in range(stages)]
        self.kv_empty = [[MBarrier() for _ in range(stages)] for _ in range(2)]
        self.turns = [MBarrier() for _ in range(2)]
        self.turn_barriers = [NamedBarrier() for _ in range(2)]  # TURN_BARRIER + c
        self.slot_barriers = [NamedBarrier() for _ in range(stages)]  # SLOT_BARRIER + slot
        self.k_slot = [None] * stages  # the block whose keys have landed in each slot
        self.v_slot = [None] * stages
        self.held = [set(), set()]  # blocks each consumer still reads
        self.turn_log = []  # (consumer, turn) in the order they were taken
        self.in_flight = []  # copies issued, not landed: generators
        self.ignore_release_of = ignore_release_of
        self.unpredicated_turns = unpredicated_turns
        self.unpredicated_hand_overs, self.unpredicated_releases = unpredicated_hand_overs, unpredicated_releases

    def readers(self, block):
        """Consumers that read key block ``block``."""
        return sum(block < n for n in self.n)

    # -- the copies --------------------------------------------------------------------------------------------
    def _copy(self, slots, barrier, slot, block):
        return landing_copy(self.held, self.stages, slots, barrier, slot, block)

    def _issue(self, slots, barrier, slot, block):
        barrier.arrive(expect_tx=1)
        self.in_flight.append(self._copy(slots, barrier, slot, block))

    # -- the producer (_pp_producer) ---------------------------------------------------------------------------
    def producer(self):
        for c in range(2):
            if self.n[c] > 0:
                self._issue(None, self.q_ready[c], None, None)
        for j in range(max(self.n)):
            slot, phase = j % self.stages, ((j // self.stages) & 1) ^ 1
            if self.named:
                readers = self.readers(j - self.stages)
                if j >= self.stages and readers > 0:
                    yield from self.slot_barriers[slot].sync(PRODUCER_THREADS + CONSUMER_THREADS * readers,
                                                             PRODUCER_THREADS)
            for c in range(2 if not self.named else 0):
                if c == self.ignore_release_of:
                    continue
                if j - self.stages < self.n[c]:
                    yield lambda c=c: self.kv_empty[c][slot].passes(phase)
            check_refill(self.held, self.stages, slot, j)
            self._issue(self.k_slot, self.k_ready[slot], slot, j)
            self._issue(self.v_slot, self.v_ready[slot], slot, j)

    # -- a consumer (_pp_consumer, _pp_blocks, _take_turn, _release) -------------------------------------------
    def _ready(self, slots, barriers, j, c):
        slot = j % self.stages
        yield lambda: barriers[slot].passes((j // self.stages) & 1)
        if slots[slot] != j:
            raise Violation(f"consumer {c} expects block {j} in slot {slot}, finds {slots[slot]}")

    def _take_turn(self, c, k):
        other = self.turns_of[1 - c]
        if self.named:
            if (1 <= k <= other if c == 0 else k < other) or self.unpredicated_turns:
                yield from self.turn_barriers[c].sync(2 * CONSUMER_THREADS, CONSUMER_THREADS)
        elif c == 0:
            if k <= other or self.unpredicated_turns:
                yield lambda: self.turns[0].passes((k & 1) ^ 1)
        elif k < other or self.unpredicated_turns:
            yield lambda: self.turns[1].passes(k & 1)
        # Turn order, as the scheduler saw it.
        if c == 0 and 1 <= k <= other and (1, k - 1) not in self.turn_log:
            raise Violation(f"consumer 0 takes turn {k} before consumer 1's turn {k - 1}")
        if c == 1 and k < other and (0, k) not in self.turn_log:
            raise Violation(f"consumer 1 takes turn {k} before consumer 0's turn {k}")
        self.turn_log.append((c, k))

    def _pass_turn(self, c, k):
        if not self.named:
            self.turns[1 - c].arrive()
            return
        other = self.turns_of[1 - c]
        if (k < other if c == 0 else k + 1 < other) or self.unpredicated_hand_overs:
            self.turn_barriers[1 - c].arrive(2 * CONSUMER_THREADS, CONSUMER_THREADS)

    def _release(self, c, j):
        self.held[c].discard(j)
        if not self.named:
            self.kv_empty[c][j % self.stages].arrive()
        elif j + self.stages < max(self.n) or self.unpredicated_releases:
            self.slot_barriers[j % self.stages].arrive(PRODUCER_THREADS + CONSUMER_THREADS * self.readers(j),
                                                       CONSUMER_THREADS)

    def consumer(self, c):
        n = self.n[c]
        if n == 0:
            return
        q = self.q_ready[c]
        yield lambda: q.passes(0)
        yield from self._ready(self.k_slot, self.k_ready, 0, c)
        self.held[c].add(0)
        yield from self._take_turn(c, 0)
        self._pass_turn(c, 0)
        for j in range(1, n):
            yield from self._ready(self.k_slot, self.k_ready, j, c)
            self.held[c].add(j)
            yield from self._ready(self.v_slot, self.v_ready, j - 1, c)
            yield from self._take_turn(c, j)
            self._pass_turn(c, j)
            self._release(c, j - 1)
        yield from self._ready(self.v_slot, self.v_ready, n - 1, c)
        yield from self._take_turn(c, n)
        self._pass_turn(c, n)
        self._release(c, n - 1)


def run(kernel: Kernel, seed: int) -> None:
    """Interleave the agents at random until all are done; Violation on a deadlock, a broken invariant or a named
    barrier left holding arrivals."""
    interleave([kernel.producer(), kernel.consumer(0), kernel.consumer(1)], kernel.in_flight, seed,
               lambda: f"blocks {kernel.n}, {kernel.stages} stages, turns taken {kernel.turn_log}")
    left = [b for b in kernel.turn_barriers + kernel.slot_barriers if not b.idle]
    if left:
        raise Violation(f"{len(left)} named barriers hold arrivals at the end (blocks {kernel.n})")


CASES = [(n0, n1, stages) for stages in (2, 3, 4) for n0 in range(7) for n1 in range(7)]


@pytest.mark.parametrize("named", [False, True], ids=["mbarriers", "named_barriers"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_protocol_ends_and_keeps_the_ring_and_the_turns(stages, named):
    # Every pair of block counts up to 6 (the consumers of a program differ by one or two blocks under causal masks,
    # and one may have none), 40 random interleavings each.
    for n0 in range(7):
        for n1 in range(7):
            for seed in range(40):
                kernel = Kernel((n0, n1), stages, named=named)
                run(kernel, seed)
                assert sorted(kernel.turn_log) == sorted([(0, k) for k in range(kernel.turns_of[0])]
                                                         + [(1, k) for k in range(kernel.turns_of[1])])


def _caught(make, cases) -> bool:
    for n0, n1, stages in cases:
        for seed in range(40):
            try:
                run(make(n0, n1, stages), seed)
            except Violation:
                return True
    return False


def test_a_producer_that_ignores_one_consumer_is_caught():
    # A slot refilled once consumer 0 alone has handed it back: consumer 1 may still be reading it.
    assert _caught(lambda n0, n1, s: Kernel((n0, n1), s, ignore_release_of=1), [(4, 5, 2), (6, 6, 3)])


def test_turns_without_their_predicates_deadlock_when_the_work_differs():
    # Consumer 1 has more turns than consumer 0: without the predicate it waits for an arrival that never comes.
    assert _caught(lambda n0, n1, s: Kernel((n0, n1), s, unpredicated_turns=True), [(2, 3, 2)])


def test_named_barriers_a_producer_that_ignores_one_consumer_is_caught():
    # The release's thread count left at one consumer's: the other consumer's arrivals overrun the generation.
    class OneReader(Kernel):
        def readers(self, block):
            return min(1, super().readers(block))
    assert _caught(lambda n0, n1, s: OneReader((n0, n1), s, named=True), [(4, 5, 2), (6, 6, 3)])


@pytest.mark.parametrize("broken", ["unpredicated_turns", "unpredicated_hand_overs", "unpredicated_releases"])
def test_named_barriers_without_their_predicates_are_caught(broken):
    # Turn waits, hand-overs or releases on every turn / block: a wait that nothing completes, or arrivals with no
    # waiter (left in the barrier, or run into a later generation).
    assert _caught(lambda n0, n1, s: Kernel((n0, n1), s, named=True, **{broken: True}),
                   [(2, 3, 2), (3, 2, 2), (5, 5, 3), (1, 4, 2)])
