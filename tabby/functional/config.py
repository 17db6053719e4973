"""Configuration of the Tabby layer."""
from __future__ import annotations

import os
from dataclasses import dataclass

# The megakernel's TMA loads pay off above this many routed forward FLOPs per rank (6*T*k*H*I):
# below it the host time of the ten descriptors shows. Between the measured points qwen3-30b-a3b
# 4096 tokens (0.31 TFLOP: 1.05 ms without TMA, 1.25 with) and gpt-oss-120b 4096 (0.82 TFLOP:
# megakernel with TMA 1.93 ms, faster than the sync-free path's 2.12); docs/perf-notes.md.
TMA_MIN_FLOP = 5e11

# With TMA loads and expert width I at most this, the megakernel runs two 4-warp programs per SM by
# default (``MoEConfig.mega_warps``). The down tile's K is I: at I = 768 a 128x256 tile has 12 K steps,
# so its pipeline fill and push epilogue weigh as much as its MMA (ticket trace: 12.1 us per tile
# against 6.9 us of MMA at peak), and a second program per SM covers them. Measured (EP2, forward,
# no autograd, docs/perf-notes.md session 5): qwen3-30b-a3b (I 768) 16384 tokens 2.65-2.68 ms with
# 4 warps against 2.85; qwen3.5-397b (I 1024) 4096 3.23-3.25 against 3.14-3.17, kimi-k2 (I 2048)
# 7.50 against 7.31, gpt-oss-120b (I 2880) 1.89 against 1.78: slower from I = 1024 on.
FOUR_WARPS_MAX_I = 768
# fwd_align_tiles=None pads experts to 2 row tiles only where they average at most this many tiles:
# the gain was measured at 1.25 (qwen3.5-397b 4096, 160 rows per expert), none at 16 (qwen3-30b-a3b
# 16384), and the padding adds a tile per expert to the worst-case size of the rows kept for the
# backward (+0.4 GB at qwen3.5-397b 4096, +0.55 at kimi-k2 4096).
ALIGN_MAX_TILES = 4

# Down tickets of the megakernel cover two column tiles by default where I (the down GEMM's K) is at
# most this: a short K loop (12-16 steps) pays the ticket, its waits and the pipeline fill once per
# two tiles. Measured (EP2, session 6, docs/perf-notes.md): bench forward qwen3.5-397b (I 1024) 4096
# 3.03 ms against 3.09, qwen3-30b-a3b (I 768) 16384 2.69 against 2.76; slower where K is long: kimi-k2
# (I 2048) 7.46 against 7.17, gpt-oss-120b (I 2880) 1.86 against 1.82 (no autograd).
TWO_DOWN_COLS_MAX_I = 1024

# fwd_pull_tokens=None pulls the peers' x whole (no fills) where an expert gets at least this many
# row tiles from each source rank on average (T*k / E global experts >= this * tile_m): then most
# tiles hold rows of one rank, and the tiles of this rank's rows, handed out first, cover the copy.
# Below it most tiles mix ranks and wait for the whole copy. Measured (EP2, forward under autograd,
# back-to-back pairs with the run's drift removed, session 13): qwen3-30b-a3b 16384 (8 tiles) ~2.5%
# faster; qwen3.5-397b 4096 (0.6 tiles) 30% slower. Session 15 (one bench each, 16384): glm-5 and
# gpt-oss-120b forward 1.15 / 1.08x the floor with it, 1.19 / 1.21 without (session 14).
PULL_TOKENS_MIN_TILES = 4

# fwd_group_m=None groups 2 row tiles (not 4) where an expert's weight matrices have at most this
# many elements each (H * I): small experts, whose tickets are short. Measured (EP2, forward under
# autograd, back-to-back pairs, session 16, docs/perf-notes.md): qwen3-30b-a3b (H*I 1.6M) 16384 2.0-3.7%
# faster in three pairs, 4096 even; slower with larger experts: glm-5 16384 (12.6M) 3.8-5.4%,
# gpt-oss-120b 16384 (8.3M) 2-9%, qwen3.5-397b 4096 (4.2M) 2-7%; kimi-k2 and gpt-oss-120b 4096 even.
GROUP_2_MAX_HI = 2 * 2**20


@dataclass(frozen=True)
class MoEConfig:
    """Knobs of the Tabby layer. The defaults are meant to be good without tuning.

    tile_m:          rows per tile of the routed buffer; each expert's segment is padded to it.
    pull_rows/cols:  the block one dispatch program copies per step (rows x columns).
    comm_programs:   programs of the pull-dispatch launch.
    max_wait_ms:     GPU time a spin-wait may take before it gives up and records an error (never
                     hang). Generous, because a peer may start late (its first call compiles kernels).
                     Also TABBY_MAX_WAIT_MS.
    max_wait_iters:  the same bound under the CPU interpreter, which has no clock: polls.
    debug:           check the device error record after every pass (a host sync). Also TABBY_DEBUG=1.
    megakernel:      forward through ONE persistent launch (ops/megakernel_fwd.py: pull dispatch into a
                     ring, gate/up, down + push, shared expert; tile-level counters) instead of the
                     dispatch / gate_up / down_push launches (the sync-free path, ``False``). On by
                     default: with row-tile groups and TMA loads it measured as fast as the sync-free
                     path or faster (docs/perf-notes.md, bench/results/).
    ring_rows:       rows of the megakernel's ring (xs and h); ring_rows // tile_m slots, at least 2.
                     4096 = 32 slots of 128 rows: measured faster than 2048 on qwen3-30b-a3b at EP2
                     (docs/perf-notes.md), since the fills must run far enough ahead of gate/up to
                     hide a pull's latency. Costs ring_rows * (H + I) * 2 bytes (23 MB there).
    fwd_comm_programs: programs of the megakernel that only pull rows (0: fills are tickets of the
                     compute order, taken by any program).
    fwd_programs:    the megakernel's persistent grid (None: the device's SM count; 3 on the CPU).
    fwd_prefetch:    merged mode: fills run this many row tiles ahead of gate/up in the ticket order,
                     in [0, ring slots) (None: half the slots).
    fwd_down_lag:    merged mode: down tiles run this many row tiles behind gate/up in the ticket
                     order, in [1, ring slots) (None: the row tiles the grid works on at once, plus one).
    fwd_fill_split:  each row tile is pulled as this many tickets (tile_m / fill_split rows each).
    fwd_group_m:     row tiles per group of the ticket order; gate/up and down tickets go column-major
                     over a group, so the row tiles of one expert read each weight block together
                     (with group_m > 1, fwd_prefetch and fwd_down_lag count groups). None: 4 when the
                     ring has 8 slots or more (measured: kimi-k2 10.5 -> 8.5 ms with 2, 4 as good),
                     2 for small experts (H * I <= GROUP_2_MAX_HI, qwen3-30b-a3b).
    fwd_down_bn:     columns of the megakernel's down tiles (None: the standalone kernel's, 256 for
                     H >= 256); 128 halves the down accumulator (measured slower).
    fwd_gate_up_bn:  columns of its gate/up tiles (None: the standalone kernel's, 128); 64 halves the
                     two accumulators (measured 20-25% slower with fwd_down_bn=128).
    fwd_ablate:      measurement only (`tabby tune`), makes the output WRONG: 1 skips the megakernel's
                     row copies, 2 its routed GEMM math, 4 pushes the down tiles' rows to this rank's own
                     buffer instead of their origins (waits and signals stay).
    fwd_tma:         the megakernel loads its GEMM operands through tensor descriptors (TMA) instead
                     of pointer tensors, which frees the registers the pointers hold (falls back to
                     pointer loads when a tensor is not 16-byte aligned). None: TMA when the rank's
                     routed forward is at least TMA_MIN_FLOP (``use_tma``): the ten descriptors cost
                     host time per call (measured: qwen3-30b-a3b, EP2, 4096 tokens, 1.25 ms with TMA
                     against 1.05 without; kimi-k2 7.98 against 8.24).
    fwd_num_stages:  software-pipeline depth of the megakernel's GEMM K loops (None: 4 with 8 warps,
                     192 KB of shared memory with the default tiles, measured 3-8% faster than 3 on
                     kimi-k2 and qwen3.5-397b; 3 with 4 warps, so that two programs fit an SM).
    fwd_pull_cols:   columns one fill of the megakernel copies per step (None: pull_cols). Wider steps
                     keep more bytes in flight per program, but measured no faster (1024) or slower
                     (2048) at qwen3-30b-a3b and qwen3.5-397b (docs/perf-notes.md, session 4).
    fwd_half_tiles:  the megakernel computes a row tile whose real rows fit in tile_m/2 (an expert's
                     last tile, often) as a half-height tile: half the MMA work on padding rows,
                     where experts get few rows (qwen3.5-397b at 4096 tokens: ~160 rows per expert,
                     128 + 64 rows of MMA instead of 2 x 128).
    fwd_num_warps:   warps per program of the megakernel (None: ``mega_warps``, 4 with TMA loads and
                     I <= FOUR_WARPS_MAX_I, else 8). With 4 the defaults of the tile widths (gate/up 64,
                     down 128: accumulators that fit 128 threads), stages (3) and programs (twice the
                     SMs) put two programs on each SM: one's waits, epilogues and fills overlap the
                     other's MMA.
    fwd_align_tiles: the megakernel's schedule pads each expert's row tiles to a multiple of this many
                     (padding tiles are skipped), so that an expert's tiles never straddle two row-tile
                     groups of the ticket order without need: with groups of 4 and 2 tiles per expert
                     (qwen3.5-397b at 4096), one odd expert misaligned every later pair, whose two
                     row tiles then read the expert's weights from HBM apart (ticket trace: gate/up
                     tiles 13% slower on the rank with an odd expert). None: 2 when the ticket order
                     groups row tiles (fwd_group_m >= 2, as by default) and experts average at most
                     ALIGN_MAX_TILES row tiles (T * k / E_local rows), else 1 (no padding). Costs a tile
                     per expert in the worst-case size of the rows kept for the backward.
    fwd_fill_stages: pipeline stages of a fill's column loop (1: one block of loads, then its stores;
                     > 1: the next blocks' loads go to shared memory as async copies while a block
                     is stored, so a fill keeps more bytes in flight than its registers hold). None:
                     3 with 4-warp programs (fills 27% (remote) and 13% (local) shorter in the ticket
                     trace at qwen3-30b-a3b 16384 EP2, the forward 1-3% faster), 1 with 8 warps, whose
                     GEMMs leave no shared memory for the fill's stages at every shape (a test shape
                     asked for 262144 bytes, over the SM's 232448).
    fwd_ticket_ahead: a megakernel program takes its next ticket while the current ticket's release
                     fence drains (the ticket atomic off the critical path); False: after the release.
    fwd_poll_together: a megakernel ticket's polls (a gate/up tile waits on two counters) go out in one
                     round trip, from two warps; False: one after the other, as before session 8.
                     Back-to-back under autograd (session 9) neither is faster: qwen3-30b-a3b 16384
                     2.675 / 2.666 ms and 2.684 / 2.887, gpt-oss-120b 16384 6.305 / 6.580, 7.006 / 6.792.
    fwd_fill_table:  a megakernel fill loads the ranks' address tables whole, in the round trip of its
                     rows' sources, and picks each row's entry in registers (False: each row's entry
                     loaded after its source, one more dependent round trip per fill).
    fwd_tile_ready:  a differentiated megakernel forward (its rows go to full-size buffers, not the
                     ring) counts filled rows per row tile, so its fills wait for no ring slot (False:
                     per ring slot, as the ring-only forward). With fwd_fill_table, back-to-back under
                     autograd (session 10): 0.5-0.8% faster on average at qwen3-30b-a3b 16384 and
                     qwen3.5-397b 4096 EP2 (within the noise pair by pair), 3% at qwen3-30b-a3b EP1.
    fwd_down_cols:   column tiles per down ticket of the megakernel (at most: the largest count up to it
                     that divides the down column tiles). One ticket runs its columns in one K loop, so
                     the ticket's atomic, its wait and the pipeline fill are paid once per ticket: at
                     K = I of 768-1024 a down tile has 12-16 K steps, and those costs weighed a third of
                     its MMA (ticket trace, session 5). None: 2 where I <= TWO_DOWN_COLS_MAX_I, else 1.
    fwd_trace_events: measurement only (``tabby tune --trace``): the megakernel records up to this many
                     tickets per program (kind, when taken, after its waits, at its end) into a
                     trace that ``ops.megakernel_fwd.LAST_TRACE`` holds after the call. 0: off.
    overlap_publish: the forward's copy of x into its symmetric buffer (x has its own ready flag)
                     runs on the current stream while a high-priority side stream waits for the
                     peers' routing and builds the schedule; False: one after the other. Back-to-back
                     under autograd, drift removed, qwen3-30b-a3b 16384: 2.62 ms against 2.65
                     (noise ~0.02; x copied on a side stream instead: 2.645; perf-notes, session 9).
    fwd_peer_flags:  the megakernel forward sets and waits for its pass's flags inside its kernels instead
                     of in launches between them: the schedule's count launch publishes the routing
                     (this rank's chunks, the last of which signals FWD_READY) and waits for the
                     peers'; the megakernel signals x ready at its start and waits for the peers'
                     before its first ticket, and its last program signals DONE and waits for the
                     peers'. Four launches fewer per forward (two copies and three signal/wait
                     launches become none; the scan is the count launch's last program either way).
                     Kernel timeline at qwen3-30b-a3b 16384 EP2 (session 11): the megakernel starts
                     53 us into the forward instead of 69, the combine right after it; back to back
                     under autograd against False: 2.662 / 2.664 and 2.735 / 2.853 ms (noise ~0.05).
    fwd_local_rows:  the megakernel's fills copy only rows from other ranks; its gate/up tiles gather
                     their A rows through pointers, this rank's straight from x (Hopper's TMA cannot
                     gather rows; the weights still come through TMA). Needs TMA operand loads
                     (``use_tma``), else off. A differentiated forward then keeps xs without this
                     rank's rows and the backward copies them in from x before its weight gradient.
                     Why: about half the routed rows are local at EP2 and a fill part of local rows
                     costs ~11.5 us of a program's time (session 8's trace). Back to back under
                     autograd at EP2 (session 12, with the run's linear clock drift removed): 1.3%
                     faster at qwen3-30b-a3b 16384, 4% at qwen3.5-397b 4096.
    fwd_early_ticket: a GEMM ticket of the megakernel takes the program's next ticket between its K
                     loop and its epilogue, and polls that ticket's counters before its own release,
                     so that the take's and the polls' round trips (~1.2-1.4 us of waits per ticket,
                     the same with no row copies at all: latency, not dependencies; session 8's
                     trace) overlap the epilogue and the release's fence. Needs TMA, else off.
                     Measured slower (session 13, back-to-back pairs with the drift removed: 1% at
                     qwen3-30b-a3b 16384, 4% at qwen3.5-397b 4096): off.
    fwd_pull_tokens: the megakernel's dispatch pulls every peer's x whole, once, with a copy engine
                     beside the kernel (``streamops``: stream waits and writes on flags, no SM taken),
                     instead of (token, k) rows by fill tickets; gate/up gathers every A row from x
                     or those tokens, tiles of this rank's rows first (the schedule's tile order) so
                     that the others find the copy done. At EP2 with top-8 of 128 experts nearly every
                     token goes to both ranks, about 4 rows each: NVLink carries ~4x fewer bytes, no
                     program spends time on fills, and the kept xs [R, H] of a differentiated forward
                     becomes the tokens [W*T, H] (the backward gathers from them). Needs
                     ``fwd_peer_flags`` and ``fwd_local_rows`` (TMA), no comm programs; else off.
                     None: on where experts average PULL_TOKENS_MIN_TILES row tiles per source
                     rank (``pull_tokens``). Off by default in session 14, after wrong results in
                     the bench's process: session 15 found the cause, a wait on counter index -1
                     (the protocol's "no wait") that read the word before the counters
                     (``megakernel_fwd._wait``), not the copy stream.
    fwd_save_for_backward: when the forward is differentiated, the megakernel also writes the routed
                     rows, their router weights and g | u into full-size buffers (what the sync-free
                     forward keeps), so the backward does not replay dispatch and gate/up; False:
                     the forward keeps only the ring and the backward recomputes (MoK's way: less
                     memory, a slower backward). A forward without autograd keeps only the ring.
    """

    tile_m: int = 128
    pull_rows: int = 32
    pull_cols: int = 512
    comm_programs: int = 132
    max_wait_ms: float = float(os.environ.get("TABBY_MAX_WAIT_MS", 60_000))
    max_wait_iters: int = int(os.environ.get("TABBY_MAX_WAIT_ITERS", 1 << 24))
    debug: bool = os.environ.get("TABBY_DEBUG", "0") == "1"
    megakernel: bool = True
    ring_rows: int = 4096
    fwd_comm_programs: int = 0
    fwd_programs: int | None = None
    fwd_prefetch: int | None = None
    fwd_down_lag: int | None = None
    fwd_fill_split: int = 4
    fwd_group_m: int | None = None
    fwd_down_bn: int | None = None
    fwd_gate_up_bn: int | None = None
    fwd_ablate: int = 0
    fwd_tma: bool | None = None
    fwd_save_for_backward: bool = True
    fwd_num_stages: int | None = None
    fwd_pull_cols: int | None = None
    fwd_half_tiles: bool = True
    fwd_num_warps: int | None = None
    fwd_trace_events: int = 0
    fwd_down_cols: int | None = None
    fwd_align_tiles: int | None = None
    fwd_fill_stages: int | None = None
    fwd_ticket_ahead: bool = True
    fwd_poll_together: bool = True
    fwd_fill_table: bool = True
    fwd_tile_ready: bool = True
    fwd_peer_flags: bool = True
    fwd_local_rows: bool = True
    fwd_early_ticket: bool = False
    fwd_pull_tokens: bool | None = None
    overlap_publish: bool = True

    def use_tma(self, T: int, k: int, H: int, I: int) -> bool:
        """Whether the megakernel loads through TMA for T tokens/rank, top-k, model H, expert I."""
        if self.fwd_tma is not None:
            return bool(self.fwd_tma)
        return 6 * T * k * H * I >= TMA_MIN_FLOP

    def pull_tokens(self, T: int, k: int, E: int) -> bool:
        """Whether the megakernel pulls the peers' x whole (``fwd_pull_tokens``, or by
        PULL_TOKENS_MIN_TILES) for T tokens/rank, top-k, E experts over all ranks."""
        if self.fwd_pull_tokens is not None:
            return bool(self.fwd_pull_tokens)
        return T * k >= PULL_TOKENS_MIN_TILES * self.tile_m * E

    def token_pull_on(self, T: int, k: int, H: int, I: int, E: int) -> bool:
        """Whether the megakernel forward runs the token pull: ``pull_tokens`` and what it needs
        (the in-kernel peer flags, local rows through TMA, no comm programs, H % 8 == 0)."""
        return bool(self.megakernel and self.pull_tokens(T, k, E) and self.fwd_peer_flags and self.fwd_local_rows
                    and self.use_tma(T, k, H, I) and self.fwd_comm_programs == 0 and H % 8 == 0)

    def mega_warps(self, T: int, k: int, H: int, I: int) -> int:
        """Warps per megakernel program (``fwd_num_warps``, or by FOUR_WARPS_MAX_I) for these sizes."""
        if self.fwd_num_warps is not None:
            return self.fwd_num_warps
        return 4 if self.use_tma(T, k, H, I) and I <= FOUR_WARPS_MAX_I else 8

    def fill_stages(self, warps: int) -> int:
        """Pipeline stages of the megakernel's fills (``fwd_fill_stages``, or by the warps per program)."""
        if self.fwd_fill_stages is not None:
            return self.fwd_fill_stages
        return 3 if warps == 4 else 1

    def down_cols(self, I: int) -> int:
        """Column tiles per megakernel down ticket (``fwd_down_cols``, or by TWO_DOWN_COLS_MAX_I)."""
        if self.fwd_down_cols is not None:
            return self.fwd_down_cols
        return 2 if I <= TWO_DOWN_COLS_MAX_I else 1

    def group_m(self, H: int | None = None, I: int | None = None) -> int:
        """Row tiles per group of the megakernel's ticket order (``fwd_group_m``, or the launcher's
        default for the ring's slots, at most 2 for small experts: GROUP_2_MAX_HI; H, I None: the
        ring's default alone)."""
        from ..ops.megakernel_fwd import default_group_m

        if self.fwd_group_m:
            return self.fwd_group_m
        small = H is not None and I is not None and H * I <= GROUP_2_MAX_HI
        return default_group_m(self.ring_rows // self.tile_m, max_group=2 if small else 4)

    def align_tiles(self, T: int, k: int, E_local: int) -> int:
        """Row tiles each expert's schedule segment is padded to a multiple of (``fwd_align_tiles``,
        or by ALIGN_MAX_TILES for T tokens, top-k and E_local experts per rank; the sync-free path: 1)."""
        if not self.megakernel:
            return 1
        if self.fwd_align_tiles is not None:
            return self.fwd_align_tiles
        few_tiles = T * k <= ALIGN_MAX_TILES * self.tile_m * E_local  # rows per local expert, on average
        return 2 if self.group_m() >= 2 and few_tiles else 1

    def wait_budget(self) -> int:
        """The budget argument of the kernels' bounded waits (``ops.sync.wait_geq``)."""
        from ..ops import INTERPRET

        return self.max_wait_iters if INTERPRET else int(self.max_wait_ms * 1e6)
