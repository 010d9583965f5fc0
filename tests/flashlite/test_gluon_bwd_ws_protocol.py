"""Models of the warp-specialized Gluon backward kernels' barrier protocols (dK/dV, both of its consumers'
schedules; dQ), run under random interleavings on the CPU.

The dK/dV kernel (``_dkdv_ws_producer``, ``_dkdv_ws_consumer``, ``_dkdv_block``, ``_dkdv_overlapped_step`` and
``_hand_back`` in ``flashlite.kernels.attention_bwd_gluon``) runs on a Hopper GPU only. Its protocol is restated
here, wait for wait and arrival for arrival, over ``tests.flashlite.mbarrier_model``:

* the producer copies each consumer's K and V (none for a consumer whose keys all lie past S_k), then, for each
  iteration t of the stream, waits until both consumers have handed back the iteration STAGES before it, and
  copies t's Q and dO tiles into slot t % STAGES (two copies completing the slot's "ready" barrier);
* each consumer waits for its K and V (where it has keys) and takes every iteration of the stream:
  * one block at a time: it waits for slot t, reads it, and hands it back;
  * overlapped: it waits for slot t, reads it and slot t - 1 (block t - 1's dK multiplies its dS^T by Q(t - 1),
    issued with block t's products), then hands slot t - 1 back; after the last block it reads that block's slot
    once more (its dK) and hands it back.

The dQ kernel (``_dq_ws_producer``, ``_dq_ws_consumer``): each consumer owns its query rows and reads key/value
blocks 0 to n_c - 1 (the two counts differ under causal masks, and one may be 0); the producer copies each
consumer's Q and dO (only where it has blocks to read), then every block either reads, block j into slot
j % STAGES once each consumer that read block j - STAGES has handed it back (waits predicated on that).

On every step the models check that the run ends (no deadlock), that a slot is refilled only when no consumer
still reads the older block in it, and that a consumer that passes a "ready" wait finds exactly the block it
expects, landed. Changing a kernel's protocol means changing its model with it. Deliberately broken protocols (a
producer that ignores the second consumer's hand-back; an overlapped consumer that hands block t's slot back before
block t's dK has read it; a dQ producer whose waits lack their predicates) must be caught, so that the checks are
known to bite.
"""
import pytest

from tests.flashlite.mbarrier_model import MBarrier, Violation, interleave, landing_copy


class DkdvWsKernel:
    """One program: ``n_iters`` streamed Q/dO blocks, a ring of ``stages`` slots, ``has_keys[c]`` whether consumer c
    gets K and V, ``overlap`` the consumers' schedule."""

    def __init__(self, n_iters, stages, has_keys=(True, True), *, overlap=False, ignore_release_of=None,
                 early_release=False):
        self.n, self.stages, self.has_keys, self.overlap = n_iters, stages, has_keys, overlap
        self.kv_ready = [MBarrier() for _ in range(2)]
        self.ready = [MBarrier() for _ in range(stages)]
        self.empty = [[MBarrier() for _ in range(stages)] for _ in range(2)]
        self.q_slot = [None] * stages  # the block whose Q tile has landed in each slot
        self.do_slot = [None] * stages
        self.held = [set(), set()]  # blocks each consumer still reads
        self.in_flight = []  # copies issued, not landed: generators
        self.ignore_release_of = ignore_release_of
        self.early_release = early_release

    def _copy(self, slots, barrier, slot, block):
        return landing_copy(self.held, self.stages, slots, barrier, slot, block)

    # -- the producer (_dkdv_ws_producer, _issue_q_do) ---------------------------------------------------------
    def producer(self):
        for c in range(2):
            if self.has_keys[c]:  # expect(pred) and the two copies (pred)
                self.kv_ready[c].arrive(expect_tx=2)
                self.in_flight += [self._copy(None, self.kv_ready[c], None, None) for _ in range(2)]
        for t in range(self.n):
            slot, phase = t % self.stages, ((t // self.stages) & 1) ^ 1
            for c in range(2):
                if c != self.ignore_release_of:
                    yield lambda c=c: self.empty[c][slot].passes(phase)
            self.ready[slot].arrive(expect_tx=2)
            self.in_flight += [self._copy(self.q_slot, self.ready[slot], slot, t),
                               self._copy(self.do_slot, self.ready[slot], slot, t)]

    # -- a consumer (_dkdv_ws_consumer) ------------------------------------------------------------------------
    def _wait_ready(self, c, t):
        slot = t % self.stages
        yield lambda: self.ready[slot].passes((t // self.stages) & 1)
        if self.q_slot[slot] != t or self.do_slot[slot] != t:
            raise Violation(f"consumer {c} expects block {t} in slot {slot}, finds Q {self.q_slot[slot]}, "
                            f"dO {self.do_slot[slot]}")
        self.held[c].add(t)

    def _read(self, c, t):
        if t not in self.held[c] or self.q_slot[t % self.stages] != t:
            raise Violation(f"consumer {c} reads block {t} after handing its slot back")

    def _hand_back(self, c, t):
        self.held[c].discard(t)
        self.empty[c][t % self.stages].arrive()

    def consumer(self, c):
        if self.has_keys[c]:
            yield lambda: self.kv_ready[c].passes(0)
        if not self.overlap:
            for t in range(self.n):
                yield from self._wait_ready(c, t)
                self._read(c, t)
                yield None  # the block's wgmmas: other agents may run meanwhile
                self._read(c, t)
                self._hand_back(c, t)
            return
        for t in range(self.n):
            yield from self._wait_ready(c, t)
            self._read(c, t)  # S^T(t), dP^T(t), dV(t)
            if t > 0:
                self._read(c, t - 1)  # dK(t - 1): dS^T(t - 1) Q(t - 1)
            if self.early_release:
                self._hand_back(c, t)  # broken: block t's dK, in the next iteration, still reads Q(t)
            yield None
            if t > 0:
                self._read(c, t - 1)
                self._hand_back(c, t - 1)
        if self.n > 0:
            self._read(c, self.n - 1)  # the last block's dK
            yield None
            self._read(c, self.n - 1)
            self._hand_back(c, self.n - 1)


def run(kernel: DkdvWsKernel, seed: int) -> None:
    interleave([kernel.producer(), kernel.consumer(0), kernel.consumer(1)], kernel.in_flight, seed,
               lambda: f"{kernel.n} blocks, {kernel.stages} stages, keys {kernel.has_keys}, overlap {kernel.overlap}")


@pytest.mark.parametrize("overlap", [False, True], ids=["one_block_at_a_time", "overlapped"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_protocol_ends_and_keeps_the_ring(stages, overlap):
    # Streams of 0 to 9 blocks (a program's keys may see no query block at all), with and without the second
    # consumer's keys (the last program of a head), 30 random interleavings each; every block handed back once.
    for n in range(10):
        for has_keys in ((True, True), (True, False)):
            for seed in range(30):
                kernel = DkdvWsKernel(n, stages, has_keys, overlap=overlap)
                run(kernel, seed)
                assert kernel.held == [set(), set()]
                assert all(barrier.phase == sum(1 for t in range(n) if t % stages == slot)
                           for consumer in kernel.empty for slot, barrier in enumerate(consumer))


def _caught(make, cases) -> bool:
    for n, stages in cases:
        for seed in range(40):
            try:
                run(make(n, stages), seed)
            except Violation:
                return True
    return False


@pytest.mark.parametrize("overlap", [False, True], ids=["one_block_at_a_time", "overlapped"])
def test_a_producer_that_ignores_one_consumer_is_caught(overlap):
    # A slot refilled once consumer 0 alone has handed it back: consumer 1 may still be reading it.
    assert _caught(lambda n, s: DkdvWsKernel(n, s, overlap=overlap, ignore_release_of=1), [(6, 2), (8, 3)])


def test_an_overlapped_consumer_that_hands_a_slot_back_before_its_dk_is_caught():
    assert _caught(lambda n, s: DkdvWsKernel(n, s, overlap=True, early_release=True), [(6, 2), (8, 3)])


class DqWsKernel:
    """One dQ program: consumer c reads key/value blocks 0 to ``n_blocks[c]`` - 1 through a ring of ``stages``."""

    def __init__(self, n_blocks, stages, *, unpredicated_waits=False):
        self.n, self.stages, self.unpredicated_waits = n_blocks, stages, unpredicated_waits
        self.q_ready = [MBarrier() for _ in range(2)]
        self.ready = [MBarrier() for _ in range(stages)]
        self.empty = [[MBarrier() for _ in range(stages)] for _ in range(2)]
        self.k_slot = [None] * stages
        self.v_slot = [None] * stages
        self.held = [set(), set()]
        self.in_flight = []

    def _copy(self, slots, barrier, slot, block):
        return landing_copy(self.held, self.stages, slots, barrier, slot, block)

    def producer(self):
        for c in range(2):
            if self.n[c] > 0:
                self.q_ready[c].arrive(expect_tx=2)
                self.in_flight += [self._copy(None, self.q_ready[c], None, None) for _ in range(2)]
        for j in range(max(self.n)):
            slot, phase = j % self.stages, ((j // self.stages) & 1) ^ 1
            for c in range(2):
                if self.unpredicated_waits or j - self.stages < self.n[c]:
                    yield lambda c=c: self.empty[c][slot].passes(phase)
            self.ready[slot].arrive(expect_tx=2)
            self.in_flight += [self._copy(self.k_slot, self.ready[slot], slot, j),
                               self._copy(self.v_slot, self.ready[slot], slot, j)]

    def consumer(self, c):
        if self.n[c] > 0:
            yield lambda: self.q_ready[c].passes(0)
        for j in range(self.n[c]):
            slot = j % self.stages
            yield lambda: self.ready[slot].passes((j // self.stages) & 1)
            if self.k_slot[slot] != j or self.v_slot[slot] != j:
                raise Violation(f"consumer {c} expects block {j} in slot {slot}, finds K {self.k_slot[slot]}, "
                                f"V {self.v_slot[slot]}")
            self.held[c].add(j)
            yield None  # the block's wgmmas
            self.held[c].discard(j)
            self.empty[c][slot].arrive()


def run_dq(kernel: DqWsKernel, seed: int) -> None:
    interleave([kernel.producer(), kernel.consumer(0), kernel.consumer(1)], kernel.in_flight, seed,
               lambda: f"blocks {kernel.n}, {kernel.stages} stages")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_dq_protocol_ends_and_keeps_the_ring(stages):
    # Every pair of block counts up to 7 (causal: the later rows see one or two blocks more; either may see none).
    for n0 in range(8):
        for n1 in range(8):
            for seed in range(20):
                kernel = DqWsKernel((n0, n1), stages)
                run_dq(kernel, seed)
                assert kernel.held == [set(), set()]


def test_a_dq_producer_whose_waits_lack_their_predicates_deadlocks():
    # Consumer 0 reads fewer blocks: an unpredicated wait for its hand-back of a block it never read never passes.
    caught = False
    for seed in range(20):
        try:
            run_dq(DqWsKernel((1, 5), 2, unpredicated_waits=True), seed)
        except Violation:
            caught = True
    assert caught
