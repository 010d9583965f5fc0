"""A model of the warp-specialized Gluon dQ kernel's barrier protocol, run under random interleavings on the CPU.

The dQ kernel (``_dq_ws_producer``, ``_dq_ws_consumer`` in ``flashlite.kernels.attention_bwd_gluon``) runs on a
Hopper GPU only. Its protocol is restated here, wait for wait and arrival for arrival, over
``mbarrier_model`` (beside this file): each consumer owns its query rows and reads key/value blocks 0 to n_c - 1 (the
two counts differ under causal masks, and one may be 0); the producer copies each consumer's Q and dO (only where it
has blocks to read), then every block either reads, block j into slot j % STAGES once each consumer that read block
j - STAGES has handed it back (waits predicated on that).

On every step the model checks that the run ends (no deadlock), that a slot is refilled only when no consumer still
reads the older block in it, and that a consumer that passes a "ready" wait finds exactly the block it expects,
landed. Changing the kernel's protocol means changing its model with it. A deliberately broken protocol (a producer
whose waits lack their predicates) must be caught, so that the checks are known to bite. (The warp-specialized dK/dV
kernel and its model were deleted with it.)
"""
import pytest

from .mbarrier_model import MBarrier, Violation, interleave, landing_copy


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
