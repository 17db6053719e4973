"""The warp-specialized kernels' ring protocol (tabby/ops/gemm/fp8_ws.py, bf16_ws.py) as a model, run
under random interleavings of its partitions.

A GPU runs the partitions in one order each launch and a lucky order hides a race; the model
replays the kernels' barrier operations (the producer's ``_ring_fill``, the consumers' ready
waits and releases; one ring of two readers, or the weight gradient's two pipelines of one) with
mbarrier's semantics, a parity wait included: it passes while the barrier's current phase has the other parity, so a
waiter two phases early passes as if its phase had completed. The model checks that every read
finds the block it expects in its stage and that no stage is refilled before its readers have
released it, and that the partitions never all wait (deadlock). The handoff of a tile from the
consumers to an epilogue partition (ws_common.py's, the bf16 and FP8 down dgrads': ``acc_full``
of two arrivals, ``acc_free`` of one)
is modelled the same way: the epilogue reads each tile whole and once, and no consumer stores
over a tile the epilogue has not finished reading.
"""
import random

import pytest


class MBarrier:
    """An mbarrier: ``count`` arrivals complete the current phase; ``passes(parity)`` is
    ``mbarrier.wait``'s test (a fresh barrier counts as having completed the phase before 0)."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def passes(self, parity):
        return parity != (self.phase & 1)


class Ring:
    def __init__(self, stages, readers):
        self.S = stages
        self.ready = [MBarrier(1) for _ in range(stages)]
        self.empty = [MBarrier(readers) for _ in range(stages)]
        self.block = [None] * stages  # the K block a stage holds
        self.unreleased = [0] * stages  # readers of that block yet to release it
        self.readers = readers


def producer(ring, blocks_per_tile):
    """The producers (``_producer``, ``_wgrad_producer``): every tile's blocks in order through ``_ring_fill``."""
    it = 0
    for nb in blocks_per_tile:
        for _ in range(nb):
            s = it % ring.S
            yield lambda s=s, it=it: ring.empty[s].passes(((it // ring.S) & 1) ^ 1)
            assert ring.unreleased[s] == 0, f"stage {s} refilled with block {it} before block {ring.block[s]} was released"
            ring.block[s], ring.unreleased[s] = it, ring.readers
            ring.ready[s].arrive()  # the TMA transactions land
            it += 1


def read(ring, it):
    """A consumer's ready wait on block ``it``, the read, and the release (``_ring_mma``, ``_ring_retire``)."""
    s = it % ring.S
    yield lambda: ring.ready[s].passes((it // ring.S) & 1)
    assert ring.block[s] == it, f"block {it} read from stage {s}, which holds block {ring.block[s]}"
    yield lambda: True  # the MMA reads the stage: the other partitions may run meanwhile
    ring.unreleased[s] -= 1
    ring.empty[s].arrive()


def consumer(ring, blocks_per_tile):
    """A consumer of every block of every tile: the rows GEMMs' two consumers (a ring of two
    readers) or a weight-gradient pipeline's one."""
    it = 0
    for nb in blocks_per_tile:
        for _ in range(nb):
            yield from read(ring, it)
            it += 1


def lagged_consumer(ring, blocks_per_tile):
    """bf16_ws's consumers (``_mainloop``, gate/up's loop): block ``it``'s wgmma is issued once its
    stage is ready and still reads the stage while the next block's is issued; after that issue
    the wait for all but one wgmma (wait 1) completes block ``it``'s, which releases its stage; the
    tile's last block is released after its wait 0, before the epilogue."""
    it = 0
    for nb in blocks_per_tile:
        yield from lagged_tile(ring, it, nb)
        it += nb


def lagged_tile(ring, it, nb):
    """``lagged_consumer``'s tile of ``nb`` blocks from block ``it``."""
    for kb in range(nb):
        s = it % ring.S
        yield lambda s=s, it=it: ring.ready[s].passes((it // ring.S) & 1)
        assert ring.block[s] == it, f"block {it} read from stage {s}, which holds block {ring.block[s]}"
        yield lambda: True  # the wgmma in flight; the other partitions run
        if kb > 0:  # wait 1: the block before it is done
            p = (it - 1) % ring.S
            assert ring.block[p] == it - 1, f"block {it - 1}'s stage {p} refilled under its wgmma"
            ring.unreleased[p] -= 1
            ring.empty[p].arrive()
        it += 1
    if nb:  # wait 0: the tile's last block
        p = (it - 1) % ring.S
        assert ring.block[p] == it - 1, f"block {it - 1}'s stage {p} refilled under its wgmma"
        ring.unreleased[p] -= 1
        ring.empty[p].arrive()


def alternating_consumer(ring, blocks_per_tile, which):
    """Consumer ``which`` of two sharing one single-reader ring, taking alternate tiles and counting
    the other's blocks: no kernel's protocol (where the other's tile is longer than the ring, a
    parity wait passes two phases early); the check that the model sees such a race."""
    it = 0
    for j, nb in enumerate(blocks_per_tile):
        if j % 2 == which:
            for _ in range(nb):
                yield from read(ring, it)
                it += 1
        else:
            it += nb


def run(partitions, rng):
    """Step the partitions (generators yielding wait predicates) in a random order until all end."""
    waiting = {i: next(p, None) for i, p in enumerate(partitions)}
    waiting = {i: w for i, w in waiting.items() if w is not None}
    while waiting:
        runnable = [i for i, w in waiting.items() if w()]
        assert runnable, f"deadlock: partitions {sorted(waiting)} all wait"
        i = rng.choice(runnable)
        w = next(partitions[i], None)
        if w is None:
            del waiting[i]
        else:
            waiting[i] = w


def simulate_pipelines(blocks_per_tile, stages, rng):
    """``expert_wgrad_fp8_ws_kernel``: two producer/consumer pipelines, each its own ring of one
    reader, over alternate tiles of the walk (``_wgrad_producer``'s and ``_wgrad_consumer``'s WHICH)."""
    rings = [Ring(stages, readers=1) for _ in range(2)]
    parts = []
    for which, ring in enumerate(rings):
        mine = blocks_per_tile[which::2]
        parts += [producer(ring, mine), consumer(ring, mine)]
    run(parts, rng)


def random_tiles(rng, stages):
    # tiles of up to 3x the ring's blocks, empty ones (empty experts) among them
    return [rng.choice([0, rng.randint(1, 3), rng.randint(1, 3 * stages + 2)]) for _ in range(rng.randint(0, 12))]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_weight_gradient_pipelines_under_random_interleavings(stages):
    rng = random.Random(stages)
    for trial in range(300):
        simulate_pipelines(random_tiles(rng, stages), stages, rng)


@pytest.mark.parametrize("stages", [2, 4])
def test_two_readers_a_stage_under_random_interleavings(stages):
    rng = random.Random(10 + stages)
    for trial in range(200):
        tiles = random_tiles(rng, stages)
        ring = Ring(stages, readers=2)
        run([producer(ring, tiles), consumer(ring, tiles), consumer(ring, tiles)], rng)


def test_the_model_catches_alternating_consumers_on_one_single_reader_ring():
    # kimi-k2 at 4x its rows an expert: 11 blocks a tile against 4 stages; the second consumer's
    # first wait finds its stage's ready barrier two phases short and passes
    with pytest.raises(AssertionError, match="read from stage|refilled"):
        for seed in range(50):
            ring = Ring(4, readers=1)
            tiles = [11] * 6
            run([producer(ring, tiles), alternating_consumer(ring, tiles, 0), alternating_consumer(ring, tiles, 1)],
                random.Random(seed))


def test_the_model_catches_an_empty_barrier_counting_one_of_two_readers():
    # the rows GEMMs' ring with one arrival expected where both consumers read each stage: the
    # producer refills a stage as soon as the first consumer releases it, or the phases run ahead
    with pytest.raises(AssertionError, match="read from stage|refilled|deadlock"):
        for seed in range(50):
            ring = Ring(2, readers=2)
            ring.empty = [MBarrier(1) for _ in range(2)]
            run([producer(ring, [5] * 4), consumer(ring, [5] * 4), consumer(ring, [5] * 4)], random.Random(seed))


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_bf16_consumers_releasing_a_block_late_under_random_interleavings(stages):
    """bf16_ws's two consumers each keep one wgmma in flight and release a stage one block late:
    no stage is refilled under a wgmma that reads it, and the partitions never all wait."""
    rng = random.Random(20 + stages)
    for trial in range(200):
        tiles = random_tiles(rng, stages)
        ring = Ring(stages, readers=2)
        run([producer(ring, tiles), lagged_consumer(ring, tiles), lagged_consumer(ring, tiles)], rng)


def test_the_model_catches_a_one_stage_ring_with_a_late_release():
    # one stage: block it + 1 needs the stage block it holds until block it + 1's wgmma is issued
    with pytest.raises(AssertionError, match="deadlock"):
        ring = Ring(1, readers=2)
        run([producer(ring, [3]), lagged_consumer(ring, [3]), lagged_consumer(ring, [3])], random.Random(0))


class Handoff:
    """The shared tile between the consumers and the epilogue partition: ``full`` (one arrival per
    consumer), ``free`` (the epilogue's one), and which tile each consumer's half holds."""

    def __init__(self):
        self.full, self.free = MBarrier(2), MBarrier(1)
        self.half = [None, None]  # the tile number each half holds
        self.reading = None  # the tile the epilogue reads now


def handing_consumer(ring, blocks_per_tile, hand, which, wait_free=True):
    """A consumer of bf16_ws's / fp8_ws's ``_dgrad_consumer_tile``: the K loop (released a
    block late, as ``lagged_consumer``), then its half of the shared tile once the epilogue has
    read the tile before (wait on free, parity (n & 1) ^ 1), then its arrival on full."""
    it = 0
    for n, nb in enumerate(blocks_per_tile):
        yield from lagged_tile(ring, it, nb)
        it += nb
        if wait_free:
            yield lambda n=n: hand.free.passes((n & 1) ^ 1)
        assert hand.reading is None or hand.reading != hand.half[which], \
            f"tile {n}'s half {which} stored over tile {hand.half[which]} while the epilogue reads it"
        yield lambda: True  # the stores in flight
        hand.half[which] = n
        hand.full.arrive()


def epilogue(blocks_per_tile, hand):
    """``_dgrad_epilogue_tile`` / ``_gate_up_epilogue_tile``: wait on full (parity n & 1), read the
    tile's slices, arrive on free after the last slice is read, then the slices' math and stores."""
    for n in range(len(blocks_per_tile)):
        yield lambda n=n: hand.full.passes(n & 1)
        assert hand.half == [n, n], f"the epilogue's tile {n} finds halves of tiles {hand.half}"
        hand.reading = n
        for _ in range(3):  # slices read one by one: the consumers may run meanwhile
            yield lambda: True
            assert hand.half == [n, n], f"tile {n} overwritten (halves {hand.half}) while the epilogue reads it"
        hand.reading = None
        hand.free.arrive()
        yield lambda: True  # the last slice's math and the stores


def simulate_handoff(blocks_per_tile, stages, rng, wait_free=True):
    ring, hand = Ring(stages, readers=2), Handoff()
    run([producer(ring, blocks_per_tile), epilogue(blocks_per_tile, hand),
         handing_consumer(ring, blocks_per_tile, hand, 0, wait_free),
         handing_consumer(ring, blocks_per_tile, hand, 1, wait_free)], rng)


@pytest.mark.parametrize("stages", [2, 4, 5])
def test_epilogue_partition_handoff_under_random_interleavings(stages):
    """Every tile reaches the epilogue whole and once, none is stored over while it is read, and the
    four partitions never all wait; tiles of zero K blocks included (the handoff still runs)."""
    rng = random.Random(30 + stages)
    for trial in range(200):
        simulate_handoff(random_tiles(rng, stages), stages, rng)


def test_the_model_catches_consumers_that_do_not_wait_for_the_epilogue():
    with pytest.raises(AssertionError, match="stored over|overwritten|finds halves"):
        for seed in range(50):
            simulate_handoff([3] * 6, 2, random.Random(seed), wait_free=False)
