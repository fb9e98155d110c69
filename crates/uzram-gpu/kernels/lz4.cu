// uzram: LZ4 block compression of 4 KiB pages on the GPU, and the check of every block.
//
// A slot's work is: copy its control words and pages to the device, one compression
// kernel (uzram_lz4_fast, or uzram_lz4_high), then uzram_lz4_verify, which decodes every
// block and compares it with the page before exporting it to the host. Kernels read the
// page count and raw threshold from the control words, so one captured graph per slot
// serves every fill of that slot.
//
// Control words (device memory, copied from the host before every run):
//   ctrl[0] pages in this run   ctrl[1] raw threshold   ctrl[2] packed-bytes counter (0)
//   ctrl[3] blocks the check walked serially (0)
//   ctrl[4] packed bytes the host copies itself: the check exports only what lies beyond
//
// uzram_lz4_fast: each block is one warp and compresses whole pages (grid-stride). The page
// (plus 16 bytes of zero padding) and a 2048-entry u16 hash table live in shared memory
// (8.2 KB per warp: 25 warps per SM on Hopper; a 4096-entry table gives 17 warps, a 0.4 %
// better ratio and a 20 % slower kernel; see docs/gpu.md).
// The parse is LZ4's parse with LZ4's insertion rule (every position tested outside a match
// is inserted; inside a match only end-2), but every position is tested (no skip
// acceleration), 32 at a time: lane i tests position ip+i against the most recent earlier
// position with the same hash (an earlier lane of the same group, else the table), and if
// that fails against the position one last-match offset back; the first lane that finds a
// 4-byte match wins; then up to LAZY lazy steps (as LZ4HC) move the
// match one position on while that reaches further. Match extension and emission are
// warp-wide.
//
// Output of the compression kernels, for n pages, in `meta` (2n+1 u32 words) and `packed`
// (device memory; the verify kernel exports the checked results to the host):
//   meta[i]       (size word) 0: the block would not be shorter than `limit` bytes, store raw;
//                 0xffffffff: the page is one u64 word repeated (the word is its packed data);
//                 otherwise the block's length in bytes (< limit)
//   meta[n + i]   byte offset of page i's packed data (block, or the 8-byte word; nothing
//                 for raw pages) in `packed`
//   meta[2n]      unused here (the verify kernel writes the host's total)
//   meta[2n+1+i]  unused here (the verify kernel writes page i's checksum for the host)
// The packed total is counted in ctrl[2].
// Each page has an 8192-byte slot of `scratch` (device only): its first 4096 bytes hold the
// fast kernel's block while it is built (the high kernel builds it in shared memory), its
// second 4096 bytes the hints, where each sequence starts, for the check (note_sequence in
// the fast kernel, step 3c in the high one). Then one atomicAdd reserves the block's room in
// `packed` (packed_room: the block and the store's checksum after it, rounded to 8) and it
// is copied there, so the host copies back only the compressed bytes. Packed order is
// arbitrary; the offsets say where each page is. The host passes a raw threshold of at most
// 4088, so a slot's rooms never pass `pages * 4096` bytes.
// End-of-block rules of the LZ4 format: the last 5 bytes are literals, the last match starts
// at least 12 bytes before the end, matches are >= 4 bytes, offsets <= 65535.
//
// Regenerate the embedded PTX with scripts/gpu-ptx after any change to this file.
//
// uzram_lz4_dict (with uzram_lz4_dict_chains) is another backend's kernel, LZ4 with an
// external dictionary, with an output contract of its own: see its section at the end.
//
// uzram_lz4_verify: one warp per page. It decodes each block the way uzram's CPU decoder
// does (same acceptance rules: literal-only last sequence, offsets inside the page, exactly
// 4096 bytes out) and compares every byte with the input page. It parses 32 sequences at a
// time, one per lane, from where the compressor's hints (the scratch slot's hint area) say they
// start, and accepts only if those starts are the decoder's own parse; otherwise (hints
// missing or wrong) it walks the block serially, one sequence at a time. A same-filled page's word
// is compared with every word of the page. The meta goes into the host's pinned buffers
// (mapped into the device's address space), and so do the packed bytes of the results that
// pass, except the first ctrl[4] bytes of `packed`, which the host copies with a copy
// engine (launch.rs, `copied_bytes`): the check's stores into mapped memory hold SMs while
// they cross PCIe (docs/bench/gpu-runs.md). A block that fails is reported as
// SIZE_REJECTED, and the host, which reads only results that passed, compresses that page
// on the CPU. A block is never trusted because the compressor wrote it.
// It also computes the CRC32C of every page as the device holds it (each lane the CRC of
// 128 bytes, combined in five shuffle steps) into out_meta[2n+1+i]. The host compares it
// with the checksum the page's writer computed before it staged the page: a block checked
// here against a device copy that is not the staged page (a copy that went wrong, a slot
// refilled too early) is caught there.

#define PAGE_BYTES 4096u
#ifndef HASH_LOG
#define HASH_LOG 11u
#endif
// LAZY n: up to n lazy-match steps per match (0: plain greedy); see docs/gpu.md.
#ifndef LAZY
#define LAZY 2u
#endif
#define HASH_ENTRIES (1u << HASH_LOG)
#define MIN_MATCH 4u
#define MF_LIMIT 12u
#define LAST_LITERALS 5u
#define FULL_MASK 0xffffffffu
#define SIZE_SAME_FILLED 0xffffffffu
#define SIZE_REJECTED 0xfffffffeu
#define SIZE_RAW 0u

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// The sum of `v` over this lane and the lower lanes of the warp.
__device__ __forceinline__ u32 warp_inclusive_sum(u32 v, u32 lane) {
#pragma unroll
    for (u32 d = 1u; d < 32u; d <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, v, d);
        if (lane >= d) {
            v += y;
        }
    }
    return v;
}

// Four bytes at byte offset `pos` of the page, little-endian.
__device__ __forceinline__ u32 read32(const u32* words, u32 pos) {
    const u32 i = pos >> 2;
    return __funnelshift_r(words[i], words[i + 1], (pos & 3u) * 8u);
}

// Whether the four bytes of the word `v` are one byte repeated (a run of one byte starts
// there). A macro: as an inline function it moved the high kernel's branches (other PTX).
// It reads `v` twice: pass a variable, not an expression with effects.
#define ONE_BYTE(v) ((v) == ((v) & 0xffu) * 0x01010101u)

__device__ __forceinline__ u32 hash4(u32 v) {
    return (v * 2654435761u) >> (32u - HASH_LOG);
}

// Bytes an LZ4 length field of value `n` needs after the 4-bit token nibble.
__device__ __forceinline__ u32 ext_bytes(u32 n) {
    return n >= 15u ? (n - 15u) / 255u + 1u : 0u;
}

// Writes the extension bytes of length value `n` (>= 15) at `o`, warp-wide.
__device__ __forceinline__ void write_ext(u8* o, u32 n, u32 lane) {
    const u32 count = ext_bytes(n);
    const u32 last = (n - 15u) % 255u;
    for (u32 i = lane; i < count; i += 32u) {
        o[i] = (i + 1u == count) ? (u8)last : (u8)255u;
    }
}

// Writes the extension bytes of length value `n` at `o`, one thread; returns how many
// (none below 15).
__device__ __forceinline__ u32 put_ext(u8* o, u32 n) {
    if (n < 15u) {
        return 0u;
    }
    u32 w = 0u;
    u32 r = n - 15u;
    for (; r >= 255u; r -= 255u) {
        o[w++] = 255u;
    }
    o[w++] = (u8)r;
    return w;
}

// Writes the bytes of the `width`-byte destination chunk `d` that lie inside bytes
// [first, len) of a block whose byte `start` belongs at d[0] (neighbouring blocks own the
// others, and a copy the bytes before `first`).
__device__ __forceinline__ void copy_edge(u8* d, const u8* src, int start, u32 width, u32 first,
                                          u32 len) {
    for (u32 b = 0; b < width; ++b) {
        const int idx = start + (int)b;
        if (idx >= (int)first && (u32)idx < len) {
            d[b] = src[idx];
        }
    }
}

// Copies a `len`-byte block from `src` (16-byte aligned, readable a word past the block's
// last whole word) to `dst` (any alignment), thread `t` of `threads`: whole 4-byte words
// where the destination word lies inside the block, single bytes at the two ends
// (neighbouring blocks own the other bytes there).
// (No __restrict__ here: `src` was written earlier in this kernel, so its loads must not be
// turned into read-only-cache loads.)
__device__ __forceinline__ void copy_block(u8* dst, const u8* src, u32 len, u32 t, u32 threads) {
    const u32 mis = (u32)((size_t)dst & 3u);
    u32* dw = (u32*)(dst - mis);
    const u32* sw = (const u32*)src;
    const u32 words = (mis + len + 3u) >> 2;
    for (u32 j = t; j < words; j += threads) {
        const int start = (int)(j * 4u) - (int)mis;   // block byte at this word's byte 0
        if (start >= 0 && (u32)start + 4u <= len) {
            const u32 s = (u32)start;
            dw[j] = __funnelshift_r(sw[s >> 2], sw[(s >> 2) + 1u], (s & 3u) * 8u);
        } else {
            copy_edge((u8*)dw + j * 4u, src, start, 4u, 0u, len);
        }
    }
}

// Copies bytes [first, len) of a checked block from shared memory `src` (16-byte aligned, a
// word of slack after it) to the host's mapped buffer, where the block starts at `dst` (any
// alignment), warp-wide: 16 bytes per lane where the destination's 16-byte chunk lies
// inside those bytes, single bytes at the two ends (neighbouring blocks own the other bytes
// there, and the host's copy the bytes before `first`). These stores cross PCIe, where every
// transaction costs: 16-byte stores send a quarter of the 4-byte ones.
__device__ __forceinline__ void export_block(u8* dst, const u32* src, u32 first, u32 len,
                                             u32 lane) {
    const u32 mis = (u32)((size_t)dst & 15u);
    uint4* d4 = (uint4*)(dst - mis);
    const u8* s8 = (const u8*)src;
    const u32 chunks = (mis + len + 15u) >> 4;
    for (u32 j = ((mis + first) >> 4) + lane; j < chunks; j += 32u) {
        const int start = (int)(j * 16u) - (int)mis;   // block byte at this chunk's byte 0
        if (start >= (int)first && (u32)start + 16u <= len) {
            const u32 i = (u32)start >> 2;
            const u32 sh = ((u32)start & 3u) * 8u;
            uint4 v;
            v.x = __funnelshift_r(src[i], src[i + 1u], sh);
            v.y = __funnelshift_r(src[i + 1u], src[i + 2u], sh);
            v.z = __funnelshift_r(src[i + 2u], src[i + 3u], sh);
            v.w = __funnelshift_r(src[i + 3u], src[i + 4u], sh);
            d4[j] = v;
        } else {
            copy_edge((u8*)d4 + j * 16u, s8, start, 16u, first, len);
        }
    }
}

// One past the end of the match that continues from position s against r (s > r), stopping
// at `limit`; warp-wide, 128 bytes per step (4 per lane).
__device__ __forceinline__ u32 extend_match(const u32* words, u32 s, u32 r, u32 limit, u32 lane) {
    for (;;) {
        const u32 pos = s + lane * 4u;
        u32 diff;
        if (pos >= limit) {
            diff = 0xffu;
        } else {
            diff = read32(words, pos) ^ read32(words, r + lane * 4u);
            const u32 room = limit - pos;
            if (room < 4u) {
                diff |= FULL_MASK << (room * 8u);
            }
        }
        const u32 miss = __ballot_sync(FULL_MASK, diff != 0u);
        if (miss != 0u) {
            const u32 l = (u32)(__ffs(miss) - 1);
            const u32 d = __shfl_sync(FULL_MASK, diff, l);
            return s + l * 4u + ((u32)(__ffs(d) - 1) >> 3);
        }
        s += 128u;
        r += 128u;
    }
}

// Sequence hints: where each sequence of a block starts, for the check's parallel decode.
// The compressor writes them in the hint area of the page's scratch slot (its second 4096
// bytes, which no block reaches): the count in the area's last u16, sequence i's token
// offset in the (i+2)-th u16 from the top. NO_HINTS (or any count the area cannot hold)
// leaves the check to its serial walk. (When the hints shared the block's 4096 bytes, the
// longer blocks left no room for them: 80 of mixed-swap's 65536 pages were walked serially,
// and those few walks held back the fast ring by 15 %: docs/bench/gpu-runs.md.)
#define NO_HINTS 0xffffu
#define MAX_HINTS (PAGE_BYTES / 2u - 1u)
// Bytes of a page's scratch slot: the block being built, then the hint area.
#define SCRATCH_SLOT_BYTES (2u * PAGE_BYTES)

// A page's scratch slot.
__device__ __forceinline__ u8* scratch_slot(u8* scratch, u32 page) {
    return scratch + (size_t)page * SCRATCH_SLOT_BYTES;
}

// The u16 above the page's hint area: hint i is top[-2 - i], the count top[-1].
__device__ __forceinline__ u16* hint_top(u8* slot) {
    return (u16*)(slot + SCRATCH_SLOT_BYTES);
}

// A block's room in `packed`: its bytes, the 4 bytes of the store's checksum after them,
// rounded up to 8. That is the form and size of the store's own object for it
// (store/arena.rs), so a run of blocks next to each other here lands in the store with one
// copy-engine copy that the host places (batch/place.rs); the host writes each block's last
// word and checksum itself. Offsets stay multiples of 8, as the store's handles are.
__device__ __forceinline__ u32 packed_room(u32 len) {
    return (len + 4u + 7u) & ~7u;
}

// A same-filled page's result, by one thread: its 8-byte word in `packed`, and its size
// word SIZE_SAME_FILLED.
__device__ __forceinline__ void put_same_filled(u8* packed, u32* total, u32* sizes, u32* offsets,
                                                u32 page, uint4 first) {
    const u32 off = atomicAdd(total, 8u);
    u8* d = packed + off;
    const u32 w[2] = {first.x, first.y};
    for (u32 b = 0; b < 8u; ++b) {
        d[b] = (u8)(w[b >> 2] >> ((b & 3u) * 8u));
    }
    sizes[page] = SIZE_SAME_FILLED;
    offsets[page] = off;
}

// Records the next sequence's token offset `op` (warp-uniform) while the hint area has room
// (a block has at most about PAGE_BYTES / MIN_MATCH sequences, so it always has).
__device__ __forceinline__ void note_sequence(u8* slot, u32* hints, u32 op, u32 lane) {
    if (*hints == NO_HINTS) {
        return;
    }
    if (*hints >= MAX_HINTS) {
        *hints = NO_HINTS;
        return;
    }
    if (lane == 0u) {
        hint_top(slot)[-2 - (int)*hints] = (u16)op;
    }
    *hints += 1u;
}

// Publishes the hint count once the block is complete.
__device__ __forceinline__ void publish_hints(u8* slot, u32 hints, bool fits, u32 lane) {
    __syncwarp();
    if (lane == 0u) {
        hint_top(slot)[-1] = (u16)(fits ? hints : NO_HINTS);
    }
}

extern "C" __global__ void __launch_bounds__(32)
uzram_lz4_fast(const uint4* __restrict__ in, u8* __restrict__ scratch,
               u8* __restrict__ packed, u32* __restrict__ meta, u32* __restrict__ ctrl)
{
    const u32 npages = ctrl[0];
    const u32 limit = ctrl[1];
    u32* const sizes = meta;
    u32* const offsets = meta + npages;
    u32* const total = ctrl + 2;
    __shared__ __align__(16) u32 s_page[PAGE_BYTES / 4u + 4u];
    __shared__ __align__(16) u16 s_table[HASH_ENTRIES];

    const u32 lane = threadIdx.x;
    const u8* sp = (const u8*)s_page;
    // Largest block we may emit: strictly shorter than `limit`, never more than a page.
    const u32 cap = limit == 0u ? 0u : (limit > PAGE_BYTES ? PAGE_BYTES : limit) - 1u;
    const u32 last_start = PAGE_BYTES - MF_LIMIT;          // last position a match may start at
    const u32 match_end = PAGE_BYTES - LAST_LITERALS;      // a match must end at or before this
    const u32 lower_lanes = (1u << lane) - 1u;
    const u32 higher_lanes = lane == 31u ? 0u : (FULL_MASK << (lane + 1u));

    for (u32 page = blockIdx.x; page < npages; page += gridDim.x) {
        const uint4* src = in + (size_t)page * (PAGE_BYTES / 16u);
        u8* o = scratch_slot(scratch, page);

        // Load the page into shared memory and test for a same-filled page on the way.
        const uint4 first = src[0];
        bool same = true;
        uint4* dst = (uint4*)s_page;
#pragma unroll
        for (u32 k = 0; k < 8u; ++k) {
            const uint4 v = src[lane + 32u * k];
            dst[lane + 32u * k] = v;
            same = same && v.x == first.x && v.y == first.y && v.z == first.x && v.w == first.y;
        }
        if (lane < 4u) {
            s_page[PAGE_BYTES / 4u + lane] = 0u;
        }
        if (__all_sync(FULL_MASK, same)) {
            if (lane == 0u) {
                put_same_filled(packed, total, sizes, offsets, page, first);
            }
            __syncwarp();
            continue;
        }
        uint4* table4 = (uint4*)s_table;
        for (u32 k = lane; k < HASH_ENTRIES * 2u / 16u; k += 32u) {
            table4[k] = make_uint4(0u, 0u, 0u, 0u);
        }
        __syncwarp();

        u32 anchor = 0u, ip = 0u, op = 0u;
        u32 rep = 0u;   // offset of the last match emitted
        u32 hints = 0u;
        bool fits = true;
        while (ip <= last_start) {
            const u32 p = ip + lane;
            const bool active = p <= last_start;
            const u32 v = read32(s_page, active ? p : last_start);
            const u32 h = active ? hash4(v) : HASH_ENTRIES + lane;
            const u32 peers = __match_any_sync(FULL_MASK, h);
            const u32 earlier = peers & lower_lanes;
            u32 cand = 0u;
            if (earlier != 0u) {
                cand = ip + (31u - __clz(earlier));
            } else if (active) {
                cand = s_table[h];
            }
            bool hit = active && cand < p && read32(s_page, cand) == v;
            // Else the offset of the last match (structured data repeats at a stride that a
            // 2048-entry table loses): +0.18 % ratio on mixed-swap, +0.32 % on python-heap.
            if (!hit && active && rep != 0u && p >= rep && read32(s_page, p - rep) == v) {
                hit = true;
                cand = p - rep;
            }
            const u32 hits = __ballot_sync(FULL_MASK, hit);
            const u32 k = hits != 0u ? (u32)(__ffs(hits) - 1) : 32u;
            // Insert the tested positions up to and including the matching one; for each
            // hash only the latest position survives, as in a sequential insert.
            const u32 inserting = k >= 31u ? FULL_MASK : ((2u << k) - 1u);
            if (active && lane <= k && (peers & inserting & higher_lanes) == 0u) {
                s_table[h] = (u16)p;
            }
            __syncwarp();
            if (k == 32u) {
                ip += 32u;
                continue;
            }

            // A match at position ip+k.
            u32 p0 = ip + k;
            u32 r0 = __shfl_sync(FULL_MASK, cand, k);
            u32 end = extend_match(s_page, p0 + MIN_MATCH, r0 + MIN_MATCH, match_end, lane);
#if LAZY
            // Lazy steps (as LZ4HC): while the next position matches too and reaches at least
            // two bytes further, emit one more literal and take that match instead.
            for (u32 step = 0; step < LAZY; ++step) {
                const u32 nk = p0 - ip + 1u;   // lane that tested the next position
                if (nk >= 32u || ((hits >> nk) & 1u) == 0u) {
                    break;
                }
                const u32 r1 = __shfl_sync(FULL_MASK, cand, nk);
                const u32 end1 =
                    extend_match(s_page, p0 + 1u + MIN_MATCH, r1 + MIN_MATCH, match_end, lane);
                if (end1 <= end + 1u) {
                    break;
                }
                p0 += 1u;
                r0 = r1;
                end = end1;
            }
#endif
            // Extend it backwards over pending literals.
            u32 mp = p0, ref = r0;
            while (mp > anchor && ref > 0u && sp[mp - 1u] == sp[ref - 1u]) {
                --mp;
                --ref;
            }

            // Emit the sequence: token, literal length, literals, offset, match length.
            const u32 lit = mp - anchor;
            const u32 ml = end - mp - MIN_MATCH;
            const u32 need = 1u + ext_bytes(lit) + lit + 2u + ext_bytes(ml);
            if (op + need > cap) {
                fits = false;
                break;
            }
            note_sequence(o, &hints, op, lane);
            if (lane == 0u) {
                o[op] = (u8)(((lit < 15u ? lit : 15u) << 4) | (ml < 15u ? ml : 15u));
            }
            u32 q = op + 1u;
            if (lit >= 15u) {
                write_ext(o + q, lit, lane);
                q += ext_bytes(lit);
            }
            for (u32 i = lane; i < lit; i += 32u) {
                o[q + i] = sp[anchor + i];
            }
            q += lit;
            if (lane == 0u) {
                const u32 off = mp - ref;
                o[q] = (u8)(off & 0xffu);
                o[q + 1u] = (u8)(off >> 8);
            }
            q += 2u;
            if (ml >= 15u) {
                write_ext(o + q, ml, lane);
            }
            op += need;
            anchor = end;
            ip = end;
            rep = mp - ref;
            // LZ4's rule: the position two bytes before the match end goes into the table.
            if (lane == 0u) {
                const u32 pp = end - 2u;
                s_table[hash4(read32(s_page, pp))] = (u16)pp;
            }
            __syncwarp();
        }

        if (fits) {
            // The last sequence: literals only.
            const u32 lit = PAGE_BYTES - anchor;
            const u32 need = 1u + ext_bytes(lit) + lit;
            if (op + need > cap) {
                fits = false;
            } else {
                note_sequence(o, &hints, op, lane);
                if (lane == 0u) {
                    o[op] = (u8)((lit < 15u ? lit : 15u) << 4);
                }
                u32 q = op + 1u;
                if (lit >= 15u) {
                    write_ext(o + q, lit, lane);
                    q += ext_bytes(lit);
                }
                for (u32 i = lane; i < lit; i += 32u) {
                    o[q + i] = sp[anchor + i];
                }
                op += need;
            }
        }
        // Move the block to its packed place (the slot writes above are this warp's own,
        // ordered by __syncwarp).
        const u32 len = fits ? op : 0u;
        u32 off = 0u;
        if (lane == 0u) {
            off = len != 0u ? atomicAdd(total, packed_room(len)) : 0u;
            sizes[page] = len;
            offsets[page] = off;
        }
        off = __shfl_sync(FULL_MASK, off, 0);
        __syncwarp();
        copy_block(packed + off, o, len, lane, 32u);
        publish_hints(o, hints, fits, lane);
        __syncwarp();
    }
}

// Reads byte `i` of a block held in shared memory as words.
__device__ __forceinline__ u32 byte_at(const u32* words, u32 i) {
    return (words[i >> 2] >> ((i & 3u) * 8u)) & 0xffu;
}

// Reads an LZ4 length extension starting at *ip (the nibble was 15): adds the bytes to
// `n`. False if the block ends first or the length passes a page.
__device__ __forceinline__ bool read_ext(const u32* blk, u32 len, u32* ip, u32* n) {
    for (;;) {
        if (*ip >= len) {
            return false;
        }
        const u32 b = byte_at(blk, *ip);
        *ip += 1u;
        *n += b;
        if (*n > PAGE_BYTES) {
            return false;
        }
        if (b != 255u) {
            return true;
        }
    }
}

// Decodes the `len`-byte block in `blk` against the page in `page` (both shared memory),
// warp-wide; true iff it decodes to exactly that page under the CPU decoder's rules.
__device__ bool block_matches(const u32* blk, u32 len, const u8* page, u32 lane) {
    const u8* b8 = (const u8*)blk;
    u32 ip = 0u, op = 0u;
    for (;;) {
        if (ip >= len) {
            return false;
        }
        const u32 token = b8[ip];
        ip += 1u;
        u32 lit = token >> 4;
        if (lit == 15u && !read_ext(blk, len, &ip, &lit)) {
            return false;
        }
        if (ip + lit > len || op + lit > PAGE_BYTES) {
            return false;
        }
        bool bad = false;
        for (u32 k = lane; k < lit; k += 32u) {
            bad |= b8[ip + k] != page[op + k];
        }
        if (__any_sync(FULL_MASK, bad)) {
            return false;
        }
        ip += lit;
        op += lit;
        if (ip == len) {
            return op == PAGE_BYTES;   // the last sequence has literals only
        }
        if (ip + 2u > len) {
            return false;
        }
        const u32 off = b8[ip] | (b8[ip + 1u] << 8);
        ip += 2u;
        if (off == 0u || off > op) {
            return false;
        }
        u32 ml = token & 15u;
        if (ml == 15u && !read_ext(blk, len, &ip, &ml)) {
            return false;
        }
        ml += MIN_MATCH;
        if (op + ml > PAGE_BYTES) {
            return false;
        }
        // Byte op+k of the output is byte op-off+k of the output; by induction over k this
        // holds for the decoder's output iff it holds for the page.
        for (u32 k = lane; k < ml; k += 32u) {
            bad |= page[op + k] != page[op - off + k];
        }
        if (__any_sync(FULL_MASK, bad)) {
            return false;
        }
        op += ml;
    }
}

// The bits in which bytes [a, a+n) of `x` and bytes [b, b+n) of `y` differ (both shared
// memory held as words, a word of slack after their data), OR-ed over the 4-byte steps
// from `first`, `step` bytes apart: one lane alone (0, 4) or a warp (lane * 4, 128).
__device__ __forceinline__ u32 byte_diff(const u32* x, u32 a, const u32* y, u32 b, u32 n,
                                         u32 first, u32 step) {
    u32 diff = 0u;
    for (u32 k = first; k < n; k += step) {
        u32 d = read32(x, a + k) ^ read32(y, b + k);
        if (n - k < 4u) {
            d &= (1u << ((n - k) * 8u)) - 1u;
        }
        diff |= d;
    }
    return diff;
}

// True iff those bytes are the same, this lane alone.
__device__ __forceinline__ bool same_bytes(const u32* x, u32 a, const u32* y, u32 b, u32 n) {
    return byte_diff(x, a, y, b, n, 0u, 4u) == 0u;
}

// The same, warp-wide: 128 bytes a step.
__device__ __forceinline__ bool same_bytes_warp(const u32* x, u32 a, const u32* y, u32 b, u32 n,
                                                u32 lane) {
    return __all_sync(FULL_MASK, byte_diff(x, a, y, b, n, lane * 4u, 128u) == 0u);
}

// Sequences longer than this (literals plus match) are compared warp-wide, after the others.
#define SEQ_LANE_BYTES 64u

// block_matches, 32 sequences at a time, from the compressor's hints (`top`, see
// note_sequence): lane i parses sequence i of a group from where its hint says it starts,
// and the parse is the decoder's exactly when the first hint is 0 and every sequence ends
// where the next one's hint says it starts (by induction from the block's first byte), the
// last one, literals only, at the block's end. Output offsets come from a warp prefix sum of
// the sequences' lengths; then every byte is compared with the page as block_matches does
// (a match's bytes with the page's own earlier bytes). True only when all of that holds;
// false also when a hint is wrong, so a false answer is decided by block_matches again.
__device__ bool block_matches_hinted(const u32* blk, u32 len, const u32* page, const u16* top,
                                     u32 lane) {
    const u8* b8 = (const u8*)blk;
    const u32 count = top[-1];
    if (count == 0u || count > MAX_HINTS) {
        return false;
    }
    u32 op_base = 0u;
    for (u32 group = 0u; group < count; group += 32u) {
        const u32 i = group + lane;
        const bool active = i < count;
        const u32 start = active ? top[-2 - (int)i] : 0u;
        const u32 follow = (lane == 31u && i + 1u < count) ? top[-3 - (int)i] : 0u;
        const u32 next = __shfl_down_sync(FULL_MASK, start, 1);
        bool bad = false;
        u32 ip = start, lit = 0u, lit_ip = 0u, off = 0u, ml = 0u;
        if (active) {
            bad = (i == 0u && start != 0u) || start >= len;
            if (!bad) {
                const u32 token = b8[ip];
                ip += 1u;
                lit = token >> 4;
                bad = lit == 15u && !read_ext(blk, len, &ip, &lit);
                ml = token & 15u;
            }
            if (!bad) {
                lit_ip = ip;
                bad = ip + lit > len;
                ip += lit;
            }
            if (!bad && i + 1u == count) {
                bad = ip != len;   // the last sequence: literals only, to the block's end
                ml = 0u;
            } else if (!bad) {
                bad = ip + 2u > len;
                if (!bad) {
                    off = b8[ip] | (b8[ip + 1u] << 8);
                    ip += 2u;
                    bad = ml == 15u && !read_ext(blk, len, &ip, &ml);
                    ml += MIN_MATCH;
                }
                if (!bad) {
                    bad = ip != (lane == 31u ? follow : next);
                }
            }
        }
        const u32 out = (active && !bad) ? lit + ml : 0u;
        const u32 incl = warp_inclusive_sum(out, lane);
        const u32 op = op_base + incl - out;
        const u32 m = op + lit;   // where the match starts
        if (active && !bad) {
            bad = op + out > PAGE_BYTES || (ml != 0u && (off == 0u || off > m));
        }
        if (__any_sync(FULL_MASK, bad)) {
            return false;
        }
        const bool mine = active && out <= SEQ_LANE_BYTES;
        if (mine) {
            bad = !same_bytes(blk, lit_ip, page, op, lit) ||
                  !same_bytes(page, m, page, m - off, ml);
        }
        if (__any_sync(FULL_MASK, bad)) {
            return false;
        }
        u32 longs = __ballot_sync(FULL_MASK, active && !mine);
        while (longs != 0u) {
            const u32 l = (u32)(__ffs(longs) - 1);
            longs &= longs - 1u;
            const u32 l_lit_ip = __shfl_sync(FULL_MASK, lit_ip, l);
            const u32 l_op = __shfl_sync(FULL_MASK, op, l);
            const u32 l_lit = __shfl_sync(FULL_MASK, lit, l);
            const u32 l_m = __shfl_sync(FULL_MASK, m, l);
            const u32 l_off = __shfl_sync(FULL_MASK, off, l);
            const u32 l_ml = __shfl_sync(FULL_MASK, ml, l);
            if (!same_bytes_warp(blk, l_lit_ip, page, l_op, l_lit, lane) ||
                !same_bytes_warp(page, l_m, page, l_m - l_off, l_ml, lane)) {
                return false;
            }
        }
        op_base += __shfl_sync(FULL_MASK, incl, 31);
    }
    return op_base == PAGE_BYTES;
}

// CRC32C (Castagnoli, reflected 0x82F63B78) of every byte value, initial value 0.
__device__ const u32 CRC32C_TABLE[256] = {
    0x00000000u, 0xf26b8303u, 0xe13b70f7u, 0x1350f3f4u, 0xc79a971fu, 0x35f1141cu,
    0x26a1e7e8u, 0xd4ca64ebu, 0x8ad958cfu, 0x78b2dbccu, 0x6be22838u, 0x9989ab3bu,
    0x4d43cfd0u, 0xbf284cd3u, 0xac78bf27u, 0x5e133c24u, 0x105ec76fu, 0xe235446cu,
    0xf165b798u, 0x030e349bu, 0xd7c45070u, 0x25afd373u, 0x36ff2087u, 0xc494a384u,
    0x9a879fa0u, 0x68ec1ca3u, 0x7bbcef57u, 0x89d76c54u, 0x5d1d08bfu, 0xaf768bbcu,
    0xbc267848u, 0x4e4dfb4bu, 0x20bd8edeu, 0xd2d60dddu, 0xc186fe29u, 0x33ed7d2au,
    0xe72719c1u, 0x154c9ac2u, 0x061c6936u, 0xf477ea35u, 0xaa64d611u, 0x580f5512u,
    0x4b5fa6e6u, 0xb93425e5u, 0x6dfe410eu, 0x9f95c20du, 0x8cc531f9u, 0x7eaeb2fau,
    0x30e349b1u, 0xc288cab2u, 0xd1d83946u, 0x23b3ba45u, 0xf779deaeu, 0x05125dadu,
    0x1642ae59u, 0xe4292d5au, 0xba3a117eu, 0x4851927du, 0x5b016189u, 0xa96ae28au,
    0x7da08661u, 0x8fcb0562u, 0x9c9bf696u, 0x6ef07595u, 0x417b1dbcu, 0xb3109ebfu,
    0xa0406d4bu, 0x522bee48u, 0x86e18aa3u, 0x748a09a0u, 0x67dafa54u, 0x95b17957u,
    0xcba24573u, 0x39c9c670u, 0x2a993584u, 0xd8f2b687u, 0x0c38d26cu, 0xfe53516fu,
    0xed03a29bu, 0x1f682198u, 0x5125dad3u, 0xa34e59d0u, 0xb01eaa24u, 0x42752927u,
    0x96bf4dccu, 0x64d4cecfu, 0x77843d3bu, 0x85efbe38u, 0xdbfc821cu, 0x2997011fu,
    0x3ac7f2ebu, 0xc8ac71e8u, 0x1c661503u, 0xee0d9600u, 0xfd5d65f4u, 0x0f36e6f7u,
    0x61c69362u, 0x93ad1061u, 0x80fde395u, 0x72966096u, 0xa65c047du, 0x5437877eu,
    0x4767748au, 0xb50cf789u, 0xeb1fcbadu, 0x197448aeu, 0x0a24bb5au, 0xf84f3859u,
    0x2c855cb2u, 0xdeeedfb1u, 0xcdbe2c45u, 0x3fd5af46u, 0x7198540du, 0x83f3d70eu,
    0x90a324fau, 0x62c8a7f9u, 0xb602c312u, 0x44694011u, 0x5739b3e5u, 0xa55230e6u,
    0xfb410cc2u, 0x092a8fc1u, 0x1a7a7c35u, 0xe811ff36u, 0x3cdb9bddu, 0xceb018deu,
    0xdde0eb2au, 0x2f8b6829u, 0x82f63b78u, 0x709db87bu, 0x63cd4b8fu, 0x91a6c88cu,
    0x456cac67u, 0xb7072f64u, 0xa457dc90u, 0x563c5f93u, 0x082f63b7u, 0xfa44e0b4u,
    0xe9141340u, 0x1b7f9043u, 0xcfb5f4a8u, 0x3dde77abu, 0x2e8e845fu, 0xdce5075cu,
    0x92a8fc17u, 0x60c37f14u, 0x73938ce0u, 0x81f80fe3u, 0x55326b08u, 0xa759e80bu,
    0xb4091bffu, 0x466298fcu, 0x1871a4d8u, 0xea1a27dbu, 0xf94ad42fu, 0x0b21572cu,
    0xdfeb33c7u, 0x2d80b0c4u, 0x3ed04330u, 0xccbbc033u, 0xa24bb5a6u, 0x502036a5u,
    0x4370c551u, 0xb11b4652u, 0x65d122b9u, 0x97baa1bau, 0x84ea524eu, 0x7681d14du,
    0x2892ed69u, 0xdaf96e6au, 0xc9a99d9eu, 0x3bc21e9du, 0xef087a76u, 0x1d63f975u,
    0x0e330a81u, 0xfc588982u, 0xb21572c9u, 0x407ef1cau, 0x532e023eu, 0xa145813du,
    0x758fe5d6u, 0x87e466d5u, 0x94b49521u, 0x66df1622u, 0x38cc2a06u, 0xcaa7a905u,
    0xd9f75af1u, 0x2b9cd9f2u, 0xff56bd19u, 0x0d3d3e1au, 0x1e6dcdeeu, 0xec064eedu,
    0xc38d26c4u, 0x31e6a5c7u, 0x22b65633u, 0xd0ddd530u, 0x0417b1dbu, 0xf67c32d8u,
    0xe52cc12cu, 0x1747422fu, 0x49547e0bu, 0xbb3ffd08u, 0xa86f0efcu, 0x5a048dffu,
    0x8ecee914u, 0x7ca56a17u, 0x6ff599e3u, 0x9d9e1ae0u, 0xd3d3e1abu, 0x21b862a8u,
    0x32e8915cu, 0xc083125fu, 0x144976b4u, 0xe622f5b7u, 0xf5720643u, 0x07198540u,
    0x590ab964u, 0xab613a67u, 0xb831c993u, 0x4a5a4a90u, 0x9e902e7bu, 0x6cfbad78u,
    0x7fab5e8cu, 0x8dc0dd8fu, 0xe330a81au, 0x115b2b19u, 0x020bd8edu, 0xf0605beeu,
    0x24aa3f05u, 0xd6c1bc06u, 0xc5914ff2u, 0x37faccf1u, 0x69e9f0d5u, 0x9b8273d6u,
    0x88d28022u, 0x7ab90321u, 0xae7367cau, 0x5c18e4c9u, 0x4f48173du, 0xbd23943eu,
    0xf36e6f75u, 0x0105ec76u, 0x12551f82u, 0xe03e9c81u, 0x34f4f86au, 0xc69f7b69u,
    0xd5cf889du, 0x27a40b9eu, 0x79b737bau, 0x8bdcb4b9u, 0x988c474du, 0x6ae7c44eu,
    0xbe2da0a5u, 0x4c4623a6u, 0x5f16d052u, 0xad7d5351u,
};
// CRC32C_SHIFT[l][b]: the CRC state 1 << b carried over 128 << l zero bytes.
__constant__ u32 CRC32C_SHIFT[5][32] = {
    {
        0x6992cea2u, 0xd3259d44u, 0xa3a74c79u, 0x42a2ee03u, 0x8545dc06u, 0x0f67cefdu,
        0x1ecf9dfau, 0x3d9f3bf4u, 0x7b3e77e8u, 0xf67cefd0u, 0xe915a951u, 0xd7c72453u,
        0xaa623e57u, 0x51280a5fu, 0xa25014beu, 0x414c5f8du, 0x8298bf1au, 0x00dd08c5u,
        0x01ba118au, 0x03742314u, 0x06e84628u, 0x0dd08c50u, 0x1ba118a0u, 0x37423140u,
        0x6e846280u, 0xdd08c500u, 0xbffdfcf1u, 0x7a178f13u, 0xf42f1e26u, 0xedb24abdu,
        0xde88e38bu, 0xb8fdb1e7u,
    },
    {
        0xdcb17aa4u, 0xbc8e83b9u, 0x7cf17183u, 0xf9e2e306u, 0xf629b0fdu, 0xe9bf170bu,
        0xd69258e7u, 0xa8c8c73fu, 0x547df88fu, 0xa8fbf11eu, 0x541b94cdu, 0xa837299au,
        0x558225c5u, 0xab044b8au, 0x53e4e1e5u, 0xa7c9c3cau, 0x4a7ff165u, 0x94ffe2cau,
        0x2c13b365u, 0x582766cau, 0xb04ecd94u, 0x6571edd9u, 0xcae3dbb2u, 0x902bc195u,
        0x25bbf5dbu, 0x4b77ebb6u, 0x96efd76cu, 0x2833d829u, 0x5067b052u, 0xa0cf60a4u,
        0x4472b7b9u, 0x88e56f72u,
    },
    {
        0xbd6f81f8u, 0x7f337501u, 0xfe66ea02u, 0xf921a2f5u, 0xf7af331bu, 0xeab210c7u,
        0xd088577fu, 0xa4fcd80fu, 0x4c15c6efu, 0x982b8ddeu, 0x35bb6d4du, 0x6b76da9au,
        0xd6edb534u, 0xa8371c99u, 0x55824fc3u, 0xab049f86u, 0x53e549fdu, 0xa7ca93fau,
        0x4a795105u, 0x94f2a20au, 0x2c0932e5u, 0x581265cau, 0xb024cb94u, 0x65a5e1d9u,
        0xcb4bc3b2u, 0x937bf195u, 0x231b95dbu, 0x46372bb6u, 0x8c6e576cu, 0x1d30d829u,
        0x3a61b052u, 0x74c360a4u,
    },
    {
        0xfe314258u, 0xf98ef241u, 0xf6f19273u, 0xe80f5217u, 0xd5f2d2dfu, 0xae09d34fu,
        0x59ffd06fu, 0xb3ffa0deu, 0x6213374du, 0xc4266e9au, 0x8da0abc5u, 0x1ead217bu,
        0x3d5a42f6u, 0x7ab485ecu, 0xf5690bd8u, 0xef3e6141u, 0xdb90b473u, 0xb2cd1e17u,
        0x60764adfu, 0xc0ec95beu, 0x84355d8du, 0x0d86cdebu, 0x1b0d9bd6u, 0x361b37acu,
        0x6c366f58u, 0xd86cdeb0u, 0xb535cb91u, 0x6f87e1d3u, 0xdf0fc3a6u, 0xbbf3f1bdu,
        0x720b958bu, 0xe4172b16u,
    },
    {
        0xf7506984u, 0xeb4ca5f9u, 0xd3753d03u, 0xa3060cf7u, 0x43e06f1fu, 0x87c0de3eu,
        0x0a6dca8du, 0x14db951au, 0x29b72a34u, 0x536e5468u, 0xa6dca8d0u, 0x48552751u,
        0x90aa4ea2u, 0x24b8ebb5u, 0x4971d76au, 0x92e3aed4u, 0x202b2b59u, 0x405656b2u,
        0x80acad64u, 0x04b52c39u, 0x096a5872u, 0x12d4b0e4u, 0x25a961c8u, 0x4b52c390u,
        0x96a58720u, 0x28a778b1u, 0x514ef162u, 0xa29de2c4u, 0x40d7b379u, 0x81af66f2u,
        0x06b2bb15u, 0x0d65762au,
    },
};
// The initial value 0xffffffff carried over a whole page (4096 zero bytes).
#define CRC32C_PAGE_INIT 0x6706be76u

// One 32-bit little-endian word into a CRC state (byte by byte, table in shared memory).
__device__ __forceinline__ u32 crc32c_word(u32 c, u32 w, const u32* tab) {
    c ^= w;
    c = tab[c & 0xffu] ^ (c >> 8);
    c = tab[c & 0xffu] ^ (c >> 8);
    c = tab[c & 0xffu] ^ (c >> 8);
    c = tab[c & 0xffu] ^ (c >> 8);
    return c;
}

// The CRC state c carried over 128 << level zero bytes (a linear map: one column a bit).
__device__ __forceinline__ u32 crc32c_shift(u32 c, u32 level) {
    u32 r = 0u;
#pragma unroll
    for (u32 b = 0u; b < 32u; ++b) {
        r ^= (0u - ((c >> b) & 1u)) & CRC32C_SHIFT[level][b];
    }
    return r;
}

// CRC32C of the page at src, in lane 0 (the other lanes hold partial states). Each lane
// takes 128 consecutive bytes; the states of neighbouring runs are joined pairwise, the
// left one carried over the right one's length.
__device__ __forceinline__ u32 crc32c_page(const uint4* src, const u32* tab, u32 lane) {
    u32 c = 0u;
    const uint4* p = src + lane * 8u;
#pragma unroll
    for (u32 k = 0; k < 8u; ++k) {
        const uint4 v = p[k];
        c = crc32c_word(c, v.x, tab);
        c = crc32c_word(c, v.y, tab);
        c = crc32c_word(c, v.z, tab);
        c = crc32c_word(c, v.w, tab);
    }
#pragma unroll
    for (u32 level = 0u; level < 5u; ++level) {
        const u32 right = __shfl_down_sync(FULL_MASK, c, 1u << level);
        c = crc32c_shift(c, level) ^ right;
    }
    return ~(c ^ CRC32C_PAGE_INIT);
}

extern "C" __global__ void __launch_bounds__(32)
uzram_lz4_verify(const uint4* __restrict__ in, const u8* __restrict__ scratch,
                 const u8* __restrict__ packed, const u32* __restrict__ meta,
                 u32* __restrict__ ctrl, u8* __restrict__ out_packed,
                 u32* __restrict__ out_meta)
{
    const u32 npages = ctrl[0];
    const u32 limit = ctrl[1];
    const u32 copied = ctrl[4];
    const u32 lane = threadIdx.x;
    __shared__ __align__(16) u32 s_page[PAGE_BYTES / 4u + 4u];
    __shared__ __align__(16) u32 s_blk[PAGE_BYTES / 4u + 4u];
    __shared__ u32 s_crc[256];
    if (blockIdx.x == 0u && lane == 0u) {
        out_meta[2u * (size_t)npages] = ctrl[2];
    }
    for (u32 i = lane; i < 256u; i += 32u) {
        s_crc[i] = CRC32C_TABLE[i];
    }
    __syncwarp();
    // No correct parse packs a slot's blocks past this; the result buffer is host memory
    // (mapped), so a block placed past it by a faulty compressor is never read or exported.
    const size_t cap = (size_t)npages * PAGE_BYTES;
    for (u32 page = blockIdx.x; page < npages; page += gridDim.x) {
        const u32 size = meta[page];
        const u32 off = meta[npages + page];
        u32 result = size;
        const u32 crc = crc32c_page(in + (size_t)page * (PAGE_BYTES / 16u), s_crc, lane);
        if (lane == 0u) {
            out_meta[2u * (size_t)npages + 1u + page] = crc;
        }
        const size_t placed_end = (size_t)off + (size == SIZE_SAME_FILLED ? 8u : (size_t)size);
        if (size != SIZE_RAW && placed_end > cap) {
            result = SIZE_REJECTED;
        } else if (size == SIZE_RAW) {
            // Nothing to check: the host stores the page it staged.
        } else if (size == SIZE_SAME_FILLED) {
            const uint4* src = in + (size_t)page * (PAGE_BYTES / 16u);
            const u32 lo = packed[off] | (packed[off + 1u] << 8) | (packed[off + 2u] << 16) |
                           ((u32)packed[off + 3u] << 24);
            const u32 hi = packed[off + 4u] | (packed[off + 5u] << 8) |
                           (packed[off + 6u] << 16) | ((u32)packed[off + 7u] << 24);
            bool same = true;
#pragma unroll
            for (u32 k = 0; k < 8u; ++k) {
                const uint4 v = src[lane + 32u * k];
                same = same && v.x == lo && v.y == hi && v.z == lo && v.w == hi;
            }
            if (__all_sync(FULL_MASK, same)) {
                if (lane < 8u && off + lane >= copied) {
                    out_packed[off + lane] = packed[off + lane];
                }
            } else {
                result = SIZE_REJECTED;
            }
        } else if (size >= limit || size >= PAGE_BYTES) {
            result = SIZE_REJECTED;
        } else {
            const uint4* src = in + (size_t)page * (PAGE_BYTES / 16u);
            uint4* dst = (uint4*)s_page;
#pragma unroll
            for (u32 k = 0; k < 8u; ++k) {
                dst[lane + 32u * k] = src[lane + 32u * k];
            }
            u8* b8 = (u8*)s_blk;
            for (u32 i = lane; i < size; i += 32u) {
                b8[i] = packed[off + i];
            }
            __syncwarp();
            const u16* top = (const u16*)(scratch + (size_t)(page + 1u) * SCRATCH_SLOT_BYTES);
            bool good = block_matches_hinted(s_blk, size, s_page, top, lane);
            if (!good) {
                // No hints, or hints that are not the decoder's parse: walk it serially
                // (ctrl[3] counts these walks, for tests and benchmarks).
                if (lane == 0u) {
                    atomicAdd(ctrl + 3, 1u);
                }
                good = block_matches(s_blk, size, (const u8*)s_page, lane);
            }
            if (!good) {
                result = SIZE_REJECTED;
            } else if (off + size > copied) {
                export_block(out_packed + off, s_blk, off >= copied ? 0u : copied - off, size, lane);
            }
        }
        if (lane == 0u) {
            out_meta[page] = result;
            out_meta[npages + page] = (result == SIZE_RAW || result == SIZE_REJECTED) ? 0u : off;
        }
        __syncwarp();
    }
}

// ---------------------------------------------------------------------------------------
// uzram_lz4_high: a deeper parse for a better ratio (LZ4HC's class), same output contract.
//
// One block of HIGH_THREADS (8 warps) per page, grid-stride over the slot's pages:
//  1. hash chains over every position (chain[p]: the last earlier position with the same
//     4-byte hash): every warp links positions within its 32s, then warp 0 links each
//     32's first of a hash to the one before, in position order;
//  2. all threads find each position's best match: walk its chain up to HIGH_DEPTH
//     candidates and keep the longest match (up to HIGH_CAP bytes; nearest on ties),
//     every HIGH_SAMPLE-th position first; a position between two takes over its sampled
//     position's match, same offset, when that still covers MIN_MATCH bytes of it, and
//     otherwise searches its own chain (inside a long match the parse only ever asks for
//     the match's first bytes and its lazy successors). In two phases (HIGH_TWO_PHASE,
//     below) every position first walks HIGH_DEPTH_A candidates, and a third pass walks
//     to HIGH_DEPTH only where no earlier match reaches past the position. A
//     candidate can only beat the best length L so far if its byte L matches too: that
//     byte alone is compared before the match is measured from its first byte (a chain
//     holds every position of the same hash, collisions too; a length under MIN_MATCH
//     never beats the best, which starts at MIN_MATCH - 1), so most candidates cost one
//     shared-memory byte load. (Comparing the 4 bytes ending at byte L and the first 4,
//     as LZ4HC does, with 3 steps a turn, the kernel ran 13 % / 10 % slower, python-heap /
//     mixed-swap: docs/bench/gpu-runs.md.)
//     A warp settles 32 positions at a
//     time where no search is needed (no earlier position of their hash, or a sampled
//     match that covers them) and queues the rest; each lane takes HIGH_STEPS chain steps
//     per loop turn, and idle lanes take the next queued positions once HIGH_REFILL of them
//     are idle, so the lanes of a warp stay converged however long their chains are (a
//     loop per position kept 12 of 32 lanes busy; fetching each lane's next position inside
//     the walk's loop, whether it needed a search or not, was 9 % slower: docs/bench/gpu-runs.md);
//  3. the parse: each position's decision from a backward price pass over the best
//     matches (a literal or the position's match whole, whichever leaves the least to the
//     page's end; warp 0's 32 lanes, each over a part of the page), then warp 0's walk
//     from sequence to sequence, measuring matches longer than HIGH_CAP in full, then every
//     sequence's size and place in the block (all threads), its bytes (a thread per
//     sequence) and the block's copy out (all threads).
// Shared memory per block is about 24.5 KiB (the page, the chains and then the parse's
// sequences, the best offsets, the hash heads, the best lengths and then the block), so 8
// pages share an SM: the serial steps of one page overlap the others' searches. (A backward
// price DP over every length of every match instead of step 3 gained 0.5 % in ratio at a
// quarter of the speed: docs/gpu.md. HIGH_PRICE below weighs each match whole.)
// ---------------------------------------------------------------------------------------

// The search in two phases (below: HIGH_TWO_PHASE). 2, the default: the reach marks.
#ifndef HIGH_TWO_PHASE
#define HIGH_TWO_PHASE 2u
#endif
// Chain steps a position's walk takes at most (in two phases: the deep walk's). In one
// phase 48 stores 0.01-0.46 points of HC-9 more on seven corpora for 6-11 % of the ring
// (run 260, docs/bench/gpu-runs.md); with the reach marks at 48 the kernel runs 8-9 %
// faster than one phase at 32 on the compiler, JVM and runtime heaps at the same ratio
// (runs 279-280).
#ifndef HIGH_DEPTH
#define HIGH_DEPTH (HIGH_TWO_PHASE ? 48u : 32u)
#endif
#ifndef HIGH_LAZY
#define HIGH_LAZY 2u
#endif
#define HIGH_CAP 64u
// A chain walk ends once it found a match this long (LZ4HC has none: HIGH_CAP).
#ifndef HIGH_NICE
#define HIGH_NICE HIGH_CAP
#endif
// Every HIGH_SAMPLE-th position (a power of two; 1: all) is searched first; a position
// between two inherits its sampled position's match when that still covers MIN_MATCH bytes
// of it, and otherwise searches its own chain. 16 (with inheritance from 4 bytes on)
// measured best (docs/bench/gpu-runs.md): 1.5-1.9x the speed of searching every
// position, for 0.1 % of ratio.
#ifndef HIGH_SAMPLE
#define HIGH_SAMPLE 16u
#endif
// How many bytes of a position the sample's match must still cover for it to be taken over
// (MIN_MATCH: any match). Measured with the greedy rule (run 24); with the price pass the CPU
// model (parse_model --sample 16 --inherit 8) finds 8 worth 0.04-1.6 points of HC-9 on the
// slices, most on the JVM one, for a third to a half more candidates compared. In the kernel
// 8 gives 0.01-0.39 points on seven full corpora (javac 0.980 -> 0.982) for 5-9 % of the
// ring (run 260, docs/bench/gpu-runs.md).
#ifndef HIGH_INHERIT
#define HIGH_INHERIT MIN_MATCH
#endif
static_assert(HIGH_INHERIT >= MIN_MATCH, "an inherited match must reach MIN_MATCH bytes");
// A position inherits HIGH_CAP ("at least this long: measure it in full") from a sample up to
// HIGH_SAMPLE - 1 bytes back, and the parse trusts its first MIN_MATCH bytes.
static_assert((HIGH_SAMPLE & (HIGH_SAMPLE - 1u)) == 0u, "HIGH_SAMPLE must be a power of two (a sample is p & ~(HIGH_SAMPLE - 1))");
static_assert(HIGH_SAMPLE - 1u + MIN_MATCH <= HIGH_CAP, "an inherited HIGH_CAP must still cover MIN_MATCH bytes");
// 8 warps a page, 8 pages an SM (64 warps, the most an SM holds; 32 registers a thread,
// with a few bytes spilled): 17 % / 14 % faster than 4 warps and 9 pages (36 warps),
// 6 warps and 8 pages 6 % / 0 % (docs/bench/gpu-runs.md). The host launches the block
// size the kernel declares (launch.rs checks it).
#ifndef HIGH_THREADS
#define HIGH_THREADS 256u
#endif
#ifndef HIGH_BLOCKS_PER_SM
#define HIGH_BLOCKS_PER_SM 8
#endif
// Chain steps a busy lane takes per turn of the search loop, between the warp's votes on
// who is idle: with the one-byte test 4 is 6-7 % faster than 3, 5 and 6 slower than 4
// (with the two-word test, 3 was best: docs/bench/gpu-runs.md). A lane whose
// walk ends in a turn's first step idles for the rest of it. With the shorter step of run
// 224, 5 and 6 no longer spill and run 0-1 % slower than 4.
#ifndef HIGH_STEPS
#define HIGH_STEPS 4u
#endif
// Idle lanes take new positions once this many are idle (or all are): 1 % faster than at
// every idle lane, 4 as fast, 16 slower (docs/bench/gpu-runs.md).
#ifndef HIGH_REFILL
#define HIGH_REFILL 8
#endif
// A search lane's state: no position; walking a position's chain; its walk ended, its best
// match not yet stored. The store waits for the next turn's vote, out of the chain steps:
// a step then costs fewer instructions (no predicated stores at every step's end), and
// with a u32 state instead of a bool (no byte shuffles) the kernel ran 1.8-3.1 % faster
// (run 220, docs/bench/gpu-runs.md).
#define WALK_IDLE 0u
#define WALK_BUSY 1u
#define WALK_DONE 2u
// The parse's decisions (step 3a). 1 (shipped): a backward price pass over each position's
// best match (a literal costs a byte, a match its token, offset and length bytes), run by
// warp 0's 32 lanes while the other warps wait, each lane's part of the page decided from
// HIGH_PRICE_OVERLAP positions past it. 0: greedy with HIGH_LAZY lazy steps. 1 stores
// 0.5-1.0 % more (0.973-0.994 of LZ4HC-9 against 0.963-0.988 on the shared corpora and three
// captured heaps) with the kernel 3-5 % slower. Run by lanes of every warp, or a position at
// a time, it was slower (each warp that runs it issues every step, however few lanes work:
// half the kernel's speed; those variants are in 7d8a361; runs 190-192,
// docs/bench/gpu-runs.md).
#ifndef HIGH_PRICE
#define HIGH_PRICE 1u
#endif
#ifndef HIGH_PRICE_OVERLAP
#define HIGH_PRICE_OVERLAP 64u
#endif
static_assert(31u * (PAGE_BYTES / 32u + 4u) < PAGE_BYTES, "warp 0's last part is not empty");
static_assert(32u * HIGH_CAP * 2u <= PAGE_BYTES, "the lanes' cost windows fit the free half of s_link");
#define HIGH_HASH_LOG 11u
#define NO_POS 0xffffu
// Flags beside a position's hash while the chains are built (the hash takes HIGH_HASH_LOG bits).
#define CHAIN_FIRST 0x4000u
#define CHAIN_LAST 0x8000u
// The position's first 4 bytes are one byte, and so are those of the position before it
// (inside a run, HIGH_PATTERN) or not (a run's first).
#define CHAIN_RUN_IN 0x2000u
#define CHAIN_RUN_FIRST 0x1000u
// HIGH_PATTERN 2: a link to the top of a run of one byte (the run's last position with 4 of
// the byte ahead: a link from past the run reaches no other of its positions, and those
// inside it are linked to the run's first) carries this bit, so that the walk knows a run's
// top from the link it loaded, without testing bytes. Positions stay below it (PAGE_BYTES).
#define LINK_TOP 0x8000u
static_assert(PAGE_BYTES <= LINK_TOP, "a position is below LINK_TOP");
// The parse's per-position byte (lazy shift << 6 | length) where a length must be measured.
#define LAZY_MEASURE 0xffu
static_assert(HIGH_LAZY <= 2u && HIGH_CAP <= 64u, "a lazy shift and an uncapped length fit a byte below LAZY_MEASURE");
static_assert(HIGH_HASH_LOG <= 14u, "the chain flags sit above the hash");

__device__ __forceinline__ u32 hash_high(u32 v) {
    return (v * 2654435761u) >> (32u - HIGH_HASH_LOG);
}

// The i-th position a thread block searches in pass 0 (every HIGH_SAMPLE-th position) or
// pass 1 (the others), in increasing order.
__device__ __forceinline__ u32 high_pos(u32 pass, u32 i) {
    const u32 gap = HIGH_SAMPLE > 1u ? HIGH_SAMPLE - 1u : 1u;   // positions between two samples
    if (HIGH_SAMPLE == 1u) {
        return i;
    }
    return pass == 0u ? i * HIGH_SAMPLE : (i / gap) * HIGH_SAMPLE + 1u + i % gap;
}

// match_len compares HIGH_MATCH_WORDS words a turn, each word of the two positions loaded
// once and funnel-shifted into place (a word a turn through read32, two loads per side, was
// 10 % slower; one loaded word a turn 8 %, 2 and 3 words 4-6 %: docs/bench/gpu-runs.md).
#ifndef HIGH_MATCH_WORDS
#define HIGH_MATCH_WORDS 4u
#endif
// Words of zeros after the page in shared memory: match_len reads up to HIGH_MATCH_WORDS - 1
// words past the page's end (its last turn starts before match_end, 5 bytes short of it).
#define HIGH_PAD_WORDS (HIGH_MATCH_WORDS > 4u ? HIGH_MATCH_WORDS : 4u)

// Bytes that match from positions a and b (a < b) onward, from the first, up to `limit`
// bytes; b + limit <= the page's match end.
__device__ __forceinline__ u32 match_len(const u32* words, u32 a, u32 b, u32 limit) {
    const u32 sa = (a & 3u) * 8u;
    const u32 sb = (b & 3u) * 8u;
    const u32* wa = words + (a >> 2);
    const u32* wb = words + (b >> 2);
    u32 a0 = wa[0], b0 = wb[0];
    u32 l = 0u;
    while (l < limit) {
        u32 an[HIGH_MATCH_WORDS + 1u], bn[HIGH_MATCH_WORDS + 1u];
        an[0] = a0;
        bn[0] = b0;
#pragma unroll
        for (u32 k = 1u; k <= HIGH_MATCH_WORDS; ++k) {
            an[k] = wa[k];
            bn[k] = wb[k];
        }
#pragma unroll
        for (u32 k = 0u; k < HIGH_MATCH_WORDS; ++k) {
            const u32 x = __funnelshift_r(an[k], an[k + 1u], sa) ^ __funnelshift_r(bn[k], bn[k + 1u], sb);
            if (x != 0u) {
                l += 4u * k + ((u32)(__ffs(x) - 1) >> 3);
                return l < limit ? l : limit;
            }
        }
        a0 = an[HIGH_MATCH_WORDS];
        b0 = bn[HIGH_MATCH_WORDS];
        wa += HIGH_MATCH_WORDS;
        wb += HIGH_MATCH_WORDS;
        l += 4u * HIGH_MATCH_WORDS;
    }
    return limit;
}

// Runs of one byte (LZ4HC's pattern analysis, at its levels 9 and up). Without it, a
// position whose first 4 bytes are one byte repeated finds along its chain every position of
// each earlier run of that byte, each matching no further than its run: its HIGH_DEPTH
// candidates are spent inside the nearest runs. With HIGH_PATTERN, the chains skip the
// inside of runs (a position of a run but its first links to the run's first, which links
// on as before), and a candidate at the top of an earlier run stands for the whole run: the
// run's position with as many of the byte left as the searched position has (the one whose
// match can go on past the run), or the run's first when the run is shorter. Positions of
// other 4 bytes lose nothing: a run's positions cannot match them. It reaches 0.981-0.996
// of HC-9 on the four full corpora (0.973-0.994 without) and runs the kernel at 0.84-0.90 of
// its speed (runs 233-238, docs/bench/gpu-runs.md): the longer candidates it meets are the
// work. HIGH_PATTERN 2 (the default) finds a run's top by a bit of the link the walk loads
// (LINK_TOP), HIGH_PATTERN 1 by testing two bytes at every step: the same parse, 2 is 1.4 %
// faster on the compiler heaps (run 238). 0 builds the kernel without runs of one byte.
#ifndef HIGH_PATTERN
#define HIGH_PATTERN 2u
#endif

// The search in two phases: every position first walks at most HIGH_DEPTH_A candidates;
// then only the positions marked below walk on to HIGH_DEPTH (from their chain's head again;
// the longer of the two phases' matches stays). Positions inside a long match are never a
// sequence's start, so deep walks there buy nothing. How the positions are marked:
// 2 (the reach marks, default): those that no first-phase match starting HIGH_NEAR + 1 or
//   more positions before them reaches past; a block-wide prefix maximum, a few
//   instructions a position. At depth 48 the same ratio as one phase at 32 (-0.1 to +0.2
//   points of HC-9), the kernel 8-9 % faster on the compiler, JVM and runtime heaps, 7 %
//   slower on a database heap whose pages compress 3.6:1 (runs 279-280).
// 1: the greedy-and-lazy walk over the first phase's matches (warp 0, from the page's start):
//   every literal, each decision and the HIGH_NEAR positions after it. 0.2-0.8 points more,
//   but the walk costs a quarter of the kernel while the block's other warps wait (run 278).
// 3: the same walk, each thread over its own 16 positions from HIGH_WARM before them:
//   +0.0-0.5 points, at HIGH_DEPTH_A 4 and depth 32 4-7 % faster on the heaps and 2-8 %
//   slower on the others (runs 279-280).
// 0: one phase, every position walks HIGH_DEPTH.
#ifndef HIGH_DEPTH_A
#define HIGH_DEPTH_A 8u
#endif
#ifndef HIGH_NEAR
#define HIGH_NEAR 2u
#endif
#ifndef HIGH_WARM
#define HIGH_WARM 16u
#endif
// Beside a first-phase length (at most HIGH_CAP): its walk reached its chain's end, so a
// deeper walk finds nothing more.
#define LENS_ENDED 0x80u
#define LENS_LEN 0x7fu
static_assert(HIGH_CAP < LENS_ENDED, "a length and the ended flag share a byte");
static_assert(HIGH_NEAR + 1u + HIGH_LAZY <= MIN_MATCH + 1u, "the marked positions after a decision end inside its match");

// Sets bits [from, to) of `bits`.
__device__ __forceinline__ void mark_range(u32* bits, u32 from, u32 to) {
    while (from < to) {
        const u32 b = from & 31u;
        const u32 n = 32u - b < to - from ? 32u - b : to - from;
        bits[from >> 5] |= (n == 32u ? FULL_MASK : ((1u << n) - 1u)) << b;
        from += n;
    }
}

extern "C" __global__ void __launch_bounds__(HIGH_THREADS, HIGH_BLOCKS_PER_SM)
uzram_lz4_high(const uint4* __restrict__ in, u8* __restrict__ scratch,
               u8* __restrict__ packed, u32* __restrict__ meta, u32* __restrict__ ctrl)
{
    const u32 npages = ctrl[0];
    const u32 limit = ctrl[1];
    u32* const sizes = meta;
    u32* const offsets = meta + npages;
    u32* const total = ctrl + 2;
    // The page, the chains (s_link), the best offsets (s_off) and the hash heads, best
    // lengths and then the block (s_small) are parts of one shared array: ptxas then
    // addresses them all from one base register, where with four arrays it rebuilt an
    // array's base (SR_CgaCtaId) at every chain step (2-4 % of the kernel, run 220).
    __shared__ __align__(16) u8 s_mem[PAGE_BYTES + HIGH_PAD_WORDS * 4u + 5u * PAGE_BYTES];
    u32* const s_page = (u32*)s_mem;
    u16* const s_link = (u16*)(s_mem + PAGE_BYTES + HIGH_PAD_WORDS * 4u);
    u16* const s_off = s_link + PAGE_BYTES;
    u32* const s_small = (u32*)(s_off + PAGE_BYTES);
    __shared__ u32 s_flag;
    __shared__ u16 s_queue[HIGH_THREADS / 32u][32];   // each warp's positions to search
    __shared__ u32 s_next[3];                          // each pass's next 32 positions
#if HIGH_TWO_PHASE
    __shared__ u32 s_deep[PAGE_BYTES / 32u];           // positions the deep walk searches
#endif
    __shared__ u32 s_emit[3];                          // the parse's sequences, block offset and length
    __shared__ u32 s_scan[HIGH_THREADS / 32u];         // each warp's sum of sequence sizes
    u16* const heads = (u16*)s_small;
    u8* const lens = (u8*)s_small;

    const u32 tid = threadIdx.x;
    const u32 warp = tid >> 5;
    const u32 lane = tid & 31u;
    const u8* sp = (const u8*)s_page;
    const u32 cap = limit == 0u ? 0u : (limit > PAGE_BYTES ? PAGE_BYTES : limit) - 1u;
    const u32 last_start = PAGE_BYTES - MF_LIMIT;
    const u32 match_end = PAGE_BYTES - LAST_LITERALS;
    const u32 lower_lanes = (1u << lane) - 1u;
    const u32 higher_lanes = lane == 31u ? 0u : (FULL_MASK << (lane + 1u));

    for (u32 page = blockIdx.x; page < npages; page += gridDim.x) {
        const uint4* src = in + (size_t)page * (PAGE_BYTES / 16u);
        u8* o = scratch_slot(scratch, page);

        // Load the page; same-filled test; clear the hash heads.
        const uint4 first = src[0];
        bool same = true;
        uint4* dst = (uint4*)s_page;
        for (u32 k = tid; k < PAGE_BYTES / 16u; k += HIGH_THREADS) {
            const uint4 v = src[k];
            dst[k] = v;
            same = same && v.x == first.x && v.y == first.y && v.z == first.x && v.w == first.y;
        }
        if (tid < HIGH_PAD_WORDS) {
            s_page[PAGE_BYTES / 4u + tid] = 0u;
        }
        for (u32 k = tid; k < (1u << HIGH_HASH_LOG); k += HIGH_THREADS) {
            heads[k] = NO_POS;
        }
#if HIGH_TWO_PHASE
        for (u32 k = tid; k < PAGE_BYTES / 32u; k += HIGH_THREADS) {
            s_deep[k] = 0u;
        }
#endif
        if (tid == 0u) {
            s_flag = 1u;
            s_next[0] = 0u;
            s_next[1] = 0u;
            s_next[2] = 0u;
        }
        __syncthreads();
        if (!same) {
            s_flag = 0u;   // any thread may clear it; all write the same value
        }
        __syncthreads();
        if (s_flag != 0u) {
            if (tid == 0u) {
                put_same_filled(packed, total, sizes, offsets, page, first);
            }
            __syncthreads();
            continue;
        }

        // 1. Hash chains. a) Every warp, 32 positions at a time: each position's hash, and
        //    its link to the last earlier position of its 32 with the same hash; s_off (free
        //    until the search) keeps the hash and whether the position is the first and the
        //    last of its hash in its 32. b) Warp 0, in position order: a first takes its
        //    link from the heads, a last becomes the head. (Warp 0 alone doing both, with
        //    the other warps waiting, made the kernel 5 % slower: docs/bench/gpu-runs.md.)
        for (u32 base = warp * 32u; base <= last_start; base += HIGH_THREADS) {
            const u32 p = base + lane;
            const bool active = p <= last_start;
            const u32 v4 = active ? read32(s_page, p) : 0u;
            const u32 h = active ? hash_high(v4) : (1u << HIGH_HASH_LOG) + lane;
            const u32 peers = __match_any_sync(FULL_MASK, h);
            const u32 earlier = peers & lower_lanes;
            u32 run = 0u;
#if HIGH_PATTERN == 2
            // Before the links: a link to a lane inside a run of one byte carries LINK_TOP.
            if (active && ONE_BYTE(v4)) {
                run = p != 0u && sp[p - 1u] == (v4 & 0xffu) ? CHAIN_RUN_IN : CHAIN_RUN_FIRST;
            }
            const u32 ins = __ballot_sync(FULL_MASK, run == CHAIN_RUN_IN);
#endif
            if (active) {
                if (earlier != 0u) {
#if HIGH_PATTERN == 2
                    const u32 t = 31u - __clz(earlier);
                    s_link[p] = (u16)((base + t) | (((ins >> t) & 1u) != 0u ? LINK_TOP : 0u));
#else
                    s_link[p] = (u16)(base + (31u - __clz(earlier)));
#endif
                }
#if HIGH_PATTERN == 1
                if (ONE_BYTE(v4)) {
                    run = p != 0u && sp[p - 1u] == (v4 & 0xffu) ? CHAIN_RUN_IN : CHAIN_RUN_FIRST;
                }
#endif
                s_off[p] = (u16)(h | run | (earlier == 0u ? CHAIN_FIRST : 0u)
                                 | ((peers & higher_lanes) == 0u ? CHAIN_LAST : 0u));
            }
        }
        __syncthreads();
        if (warp == 0u) {
            u32 v = s_off[lane];
#if HIGH_PATTERN
            u32 run_first = 0u;   // the last run's first before these 32
#endif
            for (u32 base = 0u; base <= last_start; base += 32u) {
                const u32 p = base + lane;
                const u32 pn = p + 32u;
                const u32 vn = pn <= last_start ? s_off[pn] : 0u;
                const u32 h = v & ((1u << HIGH_HASH_LOG) - 1u);
                if ((v & CHAIN_FIRST) != 0u) {
                    s_link[p] = heads[h];
                }
#if HIGH_PATTERN
                // Inside a run: linked to its first (the latest run's first at or before p).
                // (Warp 1 doing this beside warp 0 ran the kernel 1 % slower: run 237.)
                const u32 firsts = __ballot_sync(FULL_MASK, (v & CHAIN_RUN_FIRST) != 0u);
                const u32 upto = firsts & (lower_lanes | (1u << lane));
                if ((v & CHAIN_RUN_IN) != 0u) {
                    s_link[p] = (u16)(upto != 0u ? base + (31u - __clz(upto)) : run_first);
                }
                if (firsts != 0u) {
                    run_first = base + (31u - __clz(firsts));
                }
#endif
                __syncwarp();
                if ((v & CHAIN_LAST) != 0u) {
#if HIGH_PATTERN == 2
                    heads[h] = (u16)(p | ((v & CHAIN_RUN_IN) != 0u ? LINK_TOP : 0u));
#else
                    heads[h] = (u16)p;
#endif
                }
                __syncwarp();
                v = vn;
            }
        }
        __syncthreads();

        // 2. The best match of every position. Pass 0 searches every HIGH_SAMPLE-th
        //    position; pass 1 the others. A warp takes 32 positions of a pass at a time and
        //    settles warp-wide those that need no search (no earlier position with their
        //    hash; in pass 1 a sampled match that still covers MIN_MATCH bytes of them,
        //    taken with the same offset); the rest join the warp's queue. Each busy lane
        //    takes HIGH_STEPS chain steps per loop turn, and idle lanes take the next queued
        //    positions once HIGH_REFILL of them are idle, so the lanes stay converged however
        //    long their chains are and a position costs lane turns only when it is searched.
        const u32 passes = (HIGH_SAMPLE > 1u ? 2u : 1u) + (HIGH_TWO_PHASE ? 1u : 0u);
        for (u32 pass = 0u; pass < passes; ++pass) {
            const bool deep = HIGH_TWO_PHASE && pass + 1u == passes;
            const u32 depth = HIGH_TWO_PHASE && !deep ? HIGH_DEPTH_A : HIGH_DEPTH;
#if HIGH_TWO_PHASE == 2
            if (deep) {
                // A position is searched deeper unless a first-phase match starting HIGH_NEAR
                // + 1 or more positions before it reaches past it: thread t takes the window
                // of positions from 16 t - HIGH_NEAR, and a block-wide prefix maximum of where
                // the windows' matches end gives each thread the furthest end before it.
                const int first = (int)(tid * 16u) - (int)HIGH_NEAR;
                u32 ends[16];
                u32 mine = 0u;
#pragma unroll
                for (u32 j = 0u; j < 16u; ++j) {
                    const int r = first + (int)j;
                    const u32 l = r >= 0 && r <= (int)last_start ? lens[r] & LENS_LEN : 0u;
                    ends[j] = r >= 0 ? (u32)r + l : 0u;
                    mine = ends[j] > mine ? ends[j] : mine;
                }
                u32 incl = mine;
#pragma unroll
                for (u32 k = 1u; k < 32u; k <<= 1) {
                    const u32 o = __shfl_up_sync(FULL_MASK, incl, k);
                    incl = lane >= k && o > incl ? o : incl;
                }
                if (lane == 31u) {
                    s_scan[warp] = incl;
                }
                u32 before = __shfl_up_sync(FULL_MASK, incl, 1);
                before = lane == 0u ? 0u : before;
                __syncthreads();
#pragma unroll
                for (u32 w = 0u; w < HIGH_THREADS / 32u; ++w) {
                    before = w < warp && s_scan[w] > before ? s_scan[w] : before;
                }
                u32 bits = 0u;
#pragma unroll
                for (u32 i = 0u; i < 16u; ++i) {
                    // `before` is now the furthest end of the matches starting at or before
                    // position 16 t + i - HIGH_NEAR - 1.
                    bits |= (before > tid * 16u + i ? 0u : 1u) << i;
                    before = ends[i] > before ? ends[i] : before;
                }
                const u32 odd = __shfl_down_sync(FULL_MASK, bits, 1);
                if ((lane & 1u) == 0u) {
                    s_deep[tid >> 1] = bits | (odd << 16);
                }
                __syncthreads();
            }
#elif HIGH_TWO_PHASE == 3
            if (deep) {
                // Every thread walks the greedy-and-lazy parse of the first phase's matches
                // over its 16 positions, from HIGH_WARM positions before them (where a walk
                // from the page's start would be, to a few positions): every literal, each
                // decision and the HIGH_NEAR positions after it are marked. (Warp 0 walking
                // the page from its start, a sequence a turn, cost a quarter of the kernel.)
                const u32 s0 = tid * 16u;
                const u32 e0 = s0 + 16u;
                u32 a = s0 >= HIGH_WARM ? s0 - HIGH_WARM : 0u;
                u32 bits = 0u;
                while (a < e0 && a <= last_start) {
                    const u32 l = lens[a] & LENS_LEN;
                    if (l == 0u) {
                        bits |= a >= s0 ? 1u << (a - s0) : 0u;
                        ++a;
                        continue;
                    }
                    u32 mp = a, ml = l;
                    for (u32 step = 0u; step < HIGH_LAZY; ++step) {
                        const u32 q1 = mp + 1u;
                        const u32 l1 = q1 <= last_start ? lens[q1] & LENS_LEN : 0u;
                        if (l1 <= ml + 1u) {
                            break;
                        }
                        bits |= mp >= s0 && mp < e0 ? 1u << (mp - s0) : 0u;
                        mp = q1;
                        ml = l1;
                    }
#pragma unroll
                    for (u32 k = 0u; k <= HIGH_NEAR; ++k) {
                        const u32 q = mp + k;
                        bits |= q >= s0 && q < e0 ? 1u << (q - s0) : 0u;
                    }
                    a = mp + ml;
                }
                const u32 odd = __shfl_down_sync(FULL_MASK, bits, 1);
                if ((lane & 1u) == 0u) {
                    s_deep[tid >> 1] = bits | (odd << 16);
                }
                __syncthreads();
            }
#elif HIGH_TWO_PHASE
            if (deep) {
                // The greedy-and-lazy walk over the first phase's matches (warp 0): every
                // literal, each decision and the HIGH_NEAR positions after it are marked.
                if (warp == 0u) {
                    u32 a = 0u;
                    while (a <= last_start) {
                        const u32 q = a + lane;
                        const u32 lq = q <= last_start ? lens[q] & LENS_LEN : 0u;
                        const u32 hits = __ballot_sync(FULL_MASK, lq != 0u);
                        u32 upto = a + 32u, next = a + 32u;
                        if (hits != 0u) {
                            const u32 k = (u32)(__ffs(hits) - 1);
                            u32 mp = a + k;
                            u32 ml = __shfl_sync(FULL_MASK, lq, k);
                            for (u32 step = 0u; step < HIGH_LAZY; ++step) {
                                const u32 q1 = mp + 1u;
                                const u32 l1 = q1 <= last_start ? lens[q1] & LENS_LEN : 0u;
                                if (l1 <= ml + 1u) {
                                    break;
                                }
                                mp = q1;
                                ml = l1;
                            }
                            upto = mp + 1u + HIGH_NEAR;
                            next = mp + ml;
                        }
                        if (lane == 0u) {
                            mark_range(s_deep, a, upto < last_start + 1u ? upto : last_start + 1u);
                        }
                        a = next;
                    }
                }
                __syncthreads();
            }
#endif
            const u32 n0 = HIGH_SAMPLE > 1u ? last_start / HIGH_SAMPLE + 1u : last_start + 1u;
            const u32 count = deep ? last_start + 1u : (pass == 0u ? n0 : last_start + 1u - n0);
            u16* const queue = s_queue[warp];
            u32 taken = 0u, queued = 0u;   // warp-uniform counts of positions through `queue`
            bool more = true;              // warp-uniform: the pass has positions left
            u32 state = WALK_IDLE;
            u32 p = 0u, c = NO_POS, d = 0u, best = 0u, boff = 0u, tail = 0u, lim = 0u, nice = 0u;
#if HIGH_PATTERN
            u32 prun = 0u;   // the run of one byte at p (0: p's first 4 bytes are not one)
#endif
            for (;;) {
                if (state == WALK_DONE) {
                    const bool ok = best >= MIN_MATCH;
                    s_off[p] = ok ? (u16)boff : 0u;
                    lens[p] = (u8)((ok ? best : 0u) | (HIGH_TWO_PHASE && !deep && c == NO_POS ? LENS_ENDED : 0u));
                    state = WALK_IDLE;
                }
                const u32 idle = __ballot_sync(FULL_MASK, state == WALK_IDLE);
                if (idle == FULL_MASK || __popc(idle) >= HIGH_REFILL) {
                    // Idle lanes take queued positions in lane order; an empty queue is
                    // refilled from the pass's next 32 positions.
                    const u32 want = __popc(idle);
                    const u32 rank = __popc(idle & lower_lanes);
                    u32 given = 0u;
                    for (;;) {
                        const u32 left = queued - taken;
                        const u32 avail = left < want - given ? left : want - given;
                        if (state == WALK_IDLE && rank >= given && rank < given + avail) {
                            p = queue[(taken + rank - given) & 31u];
                            state = WALK_BUSY;
                            const u32 room = match_end - p;
                            lim = room < HIGH_CAP ? room : HIGH_CAP;
                            nice = lim < HIGH_NICE ? lim : HIGH_NICE;
                            c = s_link[p];
                            best = MIN_MATCH - 1u;   // a match must reach MIN_MATCH bytes
                            boff = 0u;
#if HIGH_TWO_PHASE
                            if (deep && lens[p] >= MIN_MATCH) {
                                // What the first phase found: only a longer match counts.
                                best = lens[p];
                                boff = s_off[p];
                            }
#endif
                            tail = sp[p + best];     // the byte a longer match must share
#if HIGH_PATTERN
                            {
                                // p's run of one byte (up to lim), if its first 4 are one.
                                const u32 v = read32(s_page, p);
                                // A run that reaches lim needs nothing of HIGH_PATTERN: its
                                // first candidate (its own run's first) matches lim bytes.
                                prun = ONE_BYTE(v)
                                    ? 1u + match_len(s_page, p, p + 1u, lim - 1u) : 0u;
                                prun = prun < lim ? prun : 0u;
                            }
#endif
                            d = 0u;
                        }
                        taken += avail;
                        given += avail;
                        if (given == want || !more) {
                            break;
                        }
                        u32 t = 0u;
                        if (lane == 0u) {
                            t = atomicAdd(&s_next[pass], 1u);
                        }
                        t = __shfl_sync(FULL_MASK, t, 0);
                        if (t * 32u >= count) {
                            more = false;
                            break;
                        }
                        const u32 j = t * 32u + lane;
                        const u32 q = deep ? j : high_pos(pass, j);
                        bool need = false;
#if HIGH_TWO_PHASE
                        if (deep) {
                            if (j < count) {
                                const u32 lq = lens[q];
                                const u32 room = match_end - q;
                                need = ((s_deep[q >> 5] >> (q & 31u)) & 1u) != 0u
                                    && (lq & LENS_ENDED) == 0u
                                    && lq < (room < HIGH_CAP ? room : HIGH_CAP)
                                    && s_link[q] != NO_POS;
                            }
                        } else
#endif
                        if (j < count) {
                            u32 l = 0u, o = 0u;
                            need = s_link[q] != NO_POS;
                            if (pass == 1u) {
                                const u32 sq = q & ~(HIGH_SAMPLE - 1u);
                                const u32 lq = lens[sq] & LENS_LEN;
                                if (lq >= q - sq + HIGH_INHERIT) {
                                    l = lq >= HIGH_CAP ? HIGH_CAP : lq - (q - sq);
                                    o = s_off[sq];
                                    need = false;
                                }
                            }
                            if (!need) {
                                s_off[q] = (u16)o;
                                lens[q] = (u8)l;
                            }
                        }
                        const u32 got = __ballot_sync(FULL_MASK, need);
                        __syncwarp();   // the queue is empty: every lane has read what it took
                        if (need) {
                            queue[(queued + __popc(got & lower_lanes)) & 31u] = (u16)q;
                        }
                        queued += __popc(got);
                        __syncwarp();
                    }
                }
                if (!__any_sync(FULL_MASK, state == WALK_BUSY)) {
                    break;
                }
                // A busy lane takes up to HIGH_STEPS chain steps; a walk that ends leaves the
                // loop (one test of the lane's state a turn, not a step). A match of `nice`
                // bytes ends the walk through its depth, so that a step tests only the chain's
                // end and the depth (run 224: the kernel 3.5-3.7 % faster than testing the
                // state and all three at every step).
                if (state == WALK_BUSY) {
#pragma unroll
                    for (u32 u = 0u; u < HIGH_STEPS; ++u) {
                        // A candidate whose byte `best` differs cannot be longer; the others
                        // are measured from their first byte (the hash may have collided).
#if HIGH_PATTERN == 2
                        // c is a link: a position, with LINK_TOP where it tops a run of one
                        // byte. From a position in a run, such a top stands for its run as in
                        // HIGH_PATTERN 1 (a run of another byte, a hash collision, matches p
                        // not at all, so skipping it loses nothing).
                        u32 pos = c & ~LINK_TOP;
                        u32 m = pos;
                        if (prun != 0u && (c & LINK_TOP) != 0u) {
                            const u32 first = s_link[pos];   // the run's first: no LINK_TOP
                            if (first < pos) {
                                const u32 fit = pos + 4u > prun ? pos + 4u - prun : 0u;
                                m = fit > first ? fit : first;
                                pos = first;
                            }
                        }
#elif HIGH_PATTERN
                        // The candidate measured: c, or where c is inside an earlier run of
                        // p's byte (then linked to the run's first), the run's position that
                        // has p's run of the byte left, or the run's first if it is shorter;
                        // the walk goes on from the first's link. (Another position whose
                        // byte and byte before are p's, a hash collision, only loses c.)
                        u32 m = c;
                        if (prun != 0u && c != 0u && sp[c] == sp[p] && sp[c - 1u] == sp[p]) {
                            const u32 first = s_link[c];
                            if (first != NO_POS) {   // an earlier position: never past c
                                const u32 fit = c + 4u > prun ? c + 4u - prun : 0u;
                                m = fit > first ? fit : first;
                                c = first;
                            }
                        }
#else
                        const u32 m = c;
#endif
                        if (sp[m + best] == tail) {
                            const u32 l = match_len(s_page, m, p, lim);
                            if (l > best) {
                                best = l;
                                boff = p - m;
                                // At lim the walk ends below: no byte past it is read.
                                tail = sp[p + (best < lim ? best : lim - 1u)];
                                if (best >= nice) {
                                    d = depth - 1u;
                                }
                            }
                        }
#if HIGH_PATTERN == 2
                        c = s_link[pos];
#else
                        c = s_link[c];
#endif
                        ++d;
                        if (c == NO_POS || d >= depth) {
                            state = WALK_DONE;
                            break;
                        }
                    }
                }
            }
            __syncthreads();
        }
#if HIGH_TWO_PHASE
        // The first phase's ended flags off the lengths the parse reads.
        for (u32 k = tid; k < PAGE_BYTES / 16u; k += HIGH_THREADS) {
            uint4 v = ((uint4*)lens)[k];
            v.x &= 0x7f7f7f7fu;
            v.y &= 0x7f7f7f7fu;
            v.z &= 0x7f7f7f7fu;
            v.w &= 0x7f7f7f7fu;
            ((uint4*)lens)[k] = v;
        }
        __syncthreads();
#endif

        // 3. The parse, in four steps over s_link (free once the search is done):
        //  a) the decision at each position, as one byte: 0 for a literal, or the match's
        //     length (with the greedy rule, also a lazy shift), or LAZY_MEASURE where a length
        //     is capped and must be measured (the price pass: warp 0; the greedy rule: every
        //     thread, its lazy steps from the lengths alone);
        //  b) warp 0: the decisions, one step per sequence (find the next position with a
        //     match, read its byte, move on to the sequence's end); only a LAZY_MEASURE
        //     position takes the measured steps of the serial parse;
        //  c) every thread: each sequence's back extension and encoded size, a block-wide
        //     prefix sum of the sizes (where each starts in the block, also the check's
        //     hints), the room reserved;
        //  d) every thread: a sequence's bytes into shared memory; then the block into `packed`.
        // The block is the serial parse's, byte for byte (a sequence's end does not depend
        // on where the previous one ended, and the block fits exactly when its total does).
        // Warp 0 parsing and emitting alone, the other warps waiting, took 27-32 % of the
        // kernel; the parallel decisions made it 7-10 % faster (docs/bench/gpu-runs.md),
        // a thread per sequence writing them another 11 %.
        {
            u8* const step_of = (u8*)s_link;                  // a): per position
            u32* const seq_end = (u32*)s_link + PAGE_BYTES / 4u;   // b): mp | len << 16
            u32* const seq_at = (u32*)s_link;                 // c): start | offset in block << 16
#if HIGH_PRICE
            if (warp == 0u) {
                // Lane i decides positions [i * 132, (i + 1) * 132) (lane 31 the last 4):
                // parts of 132, not 128, so that at each step the lanes read lengths and
                // write decisions in 32 different banks. Each part is decided backward from
                // HIGH_PRICE_OVERLAP positions past it (whose costs it takes as level beyond
                // them): each position's least cost to the page's end, a literal or its match
                // whole (a capped length weighed as HIGH_CAP, measured in full by b). The
                // costs of the next HIGH_CAP positions sit in a window of the free half of
                // s_link (b's sequences take it only after the barrier below).
                const u32 start = lane * (PAGE_BYTES / 32u + 4u);
                const u32 end = lane == 31u ? PAGE_BYTES : start + PAGE_BYTES / 32u + 4u;
                const u32 far = end + HIGH_PRICE_OVERLAP < PAGE_BYTES ? end + HIGH_PRICE_OVERLAP : PAGE_BYTES;
                u16* const window = (u16*)s_link + PAGE_BYTES / 2u + lane * HIGH_CAP;
                // The lanes step through the same offsets of their windows: each lane's slots
                // are permuted (by its lane number) so that they fall into different banks.
                const u32 swizzle = lane << 1;
                u32 next = 0u;   // the cost from the position after the one decided on
                // Four positions at a time, from the last: every match of the four ends at
                // or past the group (MIN_MATCH >= 4), so all four windows' costs are read at
                // once, before the group's own costs take their slots, and only the
                // literals' costs chain from one position to the next, in registers.
                static_assert(MIN_MATCH >= 4u, "a group's matches end past the group");
                for (u32 g = far; g > start; g -= 4u) {
                    const u32 p0 = g - 4u;
                    const u32 lw = *(const u32*)(lens + p0);
                    u32 len[4], after[4];
#pragma unroll
                    for (u32 k = 0u; k < 4u; ++k) {
                        const u32 p = p0 + k;
                        len[k] = p <= last_start ? (lw >> (8u * k)) & 0xffu : 0u;
                        const u32 q = p + (len[k] < HIGH_CAP ? len[k] : HIGH_CAP);
                        after[k] = len[k] != 0u && q < far ? window[(q ^ swizzle) % HIGH_CAP] : 0u;
                    }
                    u32 steps = 0u;
#pragma unroll
                    for (u32 j = 0u; j < 4u; ++j) {
                        const u32 k = 3u - j;
                        const u32 l = len[k] < HIGH_CAP ? len[k] : HIGH_CAP;
                        const u32 c = 3u + ext_bytes(l - MIN_MATCH) + after[k];
                        const bool take = len[k] != 0u && c < next + 1u;
                        next = take ? c : next + 1u;
                        window[((p0 + k) ^ swizzle) % HIGH_CAP] = (u16)next;
                        steps |= (!take ? 0u : (len[k] >= HIGH_CAP ? LAZY_MEASURE : len[k])) << (8u * k);
                    }
                    if (p0 < end) {
                        *(u32*)(step_of + p0) = steps;
                    }
                }
            }
#else
            for (u32 k = tid; k <= last_start; k += HIGH_THREADS) {
                const u32 l0 = lens[k];
                u32 e = l0 == 0u ? 0u : (l0 >= HIGH_CAP ? LAZY_MEASURE : l0);
                if (e != 0u && e != LAZY_MEASURE) {
                    u32 mp = k, ml = l0;
                    for (u32 step = 0u; step < HIGH_LAZY; ++step) {
                        const u32 q1 = mp + 1u;
                        const u32 l1 = q1 <= last_start ? lens[q1] : 0u;
                        if (l1 >= HIGH_CAP) {
                            e = LAZY_MEASURE;
                            break;
                        }
                        if (l1 <= ml + 1u) {   // also no match there (0)
                            break;
                        }
                        mp = q1;
                        ml = l1;
                    }
                    if (e != LAZY_MEASURE) {
                        e = ((mp - k) << 6) | ml;
                    }
                }
                step_of[k] = (u8)e;
            }
#endif
            __syncthreads();
            if (warp == 0u) {
                u32 a = 0u, n = 0u;
                while (a <= last_start) {
                    const u32 q = a + lane;
                    const u32 eq = q <= last_start ? step_of[q] : 0u;
                    const u32 hits = __ballot_sync(FULL_MASK, eq != 0u);
                    if (hits == 0u) {
                        a += 32u;
                        continue;
                    }
                    const u32 k = (u32)(__ffs(hits) - 1);
                    u32 mp = a + k;
                    const u32 e = __shfl_sync(FULL_MASK, eq, k);
                    u32 mlen;
                    if (e != LAZY_MEASURE) {
                        mp += e >> 6;
                        mlen = e & 63u;
                    } else {
                        u32 off = s_off[mp];
                        mlen = lens[mp];
                        if (mlen >= HIGH_CAP) {
                            mlen = extend_match(s_page, mp + MIN_MATCH, mp - off + MIN_MATCH, match_end, lane) - mp;
                        }
                        // Lazy steps (as LZ4HC): take the next position's match instead
                        // while it reaches at least two bytes further.
                        for (u32 step = 0u; step < HIGH_LAZY; ++step) {
                            const u32 q1 = mp + 1u;
                            if (q1 > last_start || lens[q1] == 0u) {
                                break;
                            }
                            const u32 off1 = s_off[q1];
                            u32 l1 = lens[q1];
                            if (l1 >= HIGH_CAP) {
                                l1 = extend_match(s_page, q1 + MIN_MATCH, q1 - off1 + MIN_MATCH, match_end, lane) - q1;
                            }
                            if (l1 <= mlen + 1u) {
                                break;
                            }
                            mp = q1;
                            off = off1;
                            mlen = l1;
                        }
                    }
                    if (lane == 0u) {
                        seq_end[n] = mp | (mlen << 16);
                    }
                    ++n;
                    a = mp + mlen;
                }
                if (lane == 0u) {
                    s_emit[0] = n;
                }
            }
            __syncthreads();
            // c) Thread t takes sequences 4t..4t+3 (the last, n, is the literals after the
            //    last match): back extension over its pending literals, size, then the sum.
            const u32 n = s_emit[0];
            u32 mine = 0u;
            for (u32 i = tid * 4u; i < tid * 4u + 4u && i <= n; ++i) {
                const u32 prev = i == 0u ? 0u : seq_end[i - 1u];
                const u32 anchor = (prev & 0xffffu) + (prev >> 16);
                u32 need, st = PAGE_BYTES;
                if (i < n) {
                    const u32 mp = seq_end[i] & 0xffffu;
                    const u32 mlen = seq_end[i] >> 16;
                    const u32 off = s_off[mp];
                    st = mp;
                    while (st > anchor && st > off && sp[st - 1u] == sp[st - 1u - off]) {
                        --st;
                    }
                    const u32 lit = st - anchor;
                    need = 1u + ext_bytes(lit) + lit + 2u + ext_bytes(mlen + (mp - st) - MIN_MATCH);
                } else {
                    const u32 lit = PAGE_BYTES - anchor;
                    need = 1u + ext_bytes(lit) + lit;
                }
                seq_at[i] = st | (need << 16);
                mine += need;
            }
            const u32 incl = warp_inclusive_sum(mine, lane);
            if (lane == 31u) {
                s_scan[warp] = incl;
            }
            __syncthreads();
            u32 before = incl - mine, sum = 0u;
#pragma unroll
            for (u32 w = 0u; w < HIGH_THREADS / 32u; ++w) {
                before += w < warp ? s_scan[w] : 0u;
                sum += s_scan[w];
            }
            for (u32 i = tid * 4u; i < tid * 4u + 4u && i <= n; ++i) {
                const u32 v = seq_at[i];
                seq_at[i] = (v & 0xffffu) | (before << 16);
                hint_top(o)[-2 - (int)i] = (u16)before;
                before += v >> 16;
            }
            if (tid == 0u) {
                const u32 len = sum <= cap ? sum : 0u;
                const u32 at = len != 0u ? atomicAdd(total, packed_room(len)) : 0u;
                sizes[page] = len;
                offsets[page] = at;
                s_emit[0] = len != 0u ? n + 1u : 0u;
                s_emit[1] = at;
                s_emit[2] = len;
                hint_top(o)[-1] = (u16)(len != 0u ? n + 1u : NO_HINTS);
            }
            __syncthreads();
            // d) Sequence i by thread i, into s_small (the lengths are no longer needed),
            //    then the block into `packed` by all threads, a word a store. (A warp per
            //    sequence was 11 % slower in all, its lanes idle on short literal runs; byte
            //    stores straight into `packed` 3 % slower: docs/bench/gpu-runs.md.)
            const u32 nseq = s_emit[0];
            u8* const blk = (u8*)s_small;
            for (u32 i = tid; i < nseq; i += HIGH_THREADS) {
                const u32 prev = i == 0u ? 0u : seq_end[i - 1u];
                const u32 anchor = (prev & 0xffffu) + (prev >> 16);
                const u32 at = seq_at[i];
                const u32 st = at & 0xffffu;
                const u32 op = at >> 16;
                const bool last = i + 1u == nseq;
                const u32 lit = (last ? PAGE_BYTES : st) - anchor;
                u32 ml = 0u, off = 0u;
                if (!last) {
                    const u32 mp = seq_end[i] & 0xffffu;
                    ml = (seq_end[i] >> 16) + (mp - st) - MIN_MATCH;
                    off = s_off[mp];
                }
                u8* const d = blk + op;
                d[0] = (u8)(((lit < 15u ? lit : 15u) << 4) | (last ? 0u : (ml < 15u ? ml : 15u)));
                u32 w = 1u + put_ext(d + 1u, lit);
                for (u32 b = 0u; b < lit; ++b) {
                    d[w + b] = sp[anchor + b];
                }
                w += lit;
                if (!last) {
                    d[w] = (u8)(off & 0xffu);
                    d[w + 1u] = (u8)(off >> 8);
                    put_ext(d + w + 2u, ml);
                }
            }
            __syncthreads();
            copy_block(packed + s_emit[1], blk, s_emit[2], tid, HIGH_THREADS);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------
// uzram_lz4_dict: LZ4 blocks of 4 KiB pages with an external dictionary, for the cold
// tier's recompressor (`GpuDictLz4`, src/dict_lz4.rs). The device's trained dictionary,
// up to DICT_MAX_BYTES, is each block's prefix: a block decodes with any LZ4 decoder given
// the dictionary as its prefix (liblz4's LZ4_decompress_safe_usingDict, lz4_flex's
// decompress_into_with_dict). Its output is its own, which the host turns into the slot
// format: page i's block at out[i * 4096], its length in sizes[i] (0: it would not be
// shorter than `limit`, store the page raw) and the CRC32C of the page as the device read
// it in crcs[i]. No check kernel follows: the store decodes every block on the CPU, with
// the dictionary, and compares it with the page before it takes it.
//
// uzram_lz4_dict_chains runs once per dictionary: hash chains over its positions
// (dict_head: the last position of each 4-byte hash; dict_prev: the one before it of the
// same hash), which every page's search walks, so no page pays for them.
//
// uzram_lz4_dict: one block of DICT_THREADS (4 warps) per page (grid-stride), the page and
// its tables in shared memory (about 30 KiB: 7 pages, 28 warps an SM; with one warp a page,
// 7 warps an SM could not hide the dictionary's loads from L2: the kernel ran at a quarter
// of the speed);
//  1. warp 0: chains over the page's positions, 32 at a time (__match_any_sync links a
//     position to the nearest earlier lane of its hash, else to the table's last);
//  2. each position's longest match, nearest on ties, a thread a position: up to
//     DICT_PAGE_DEPTH earlier page positions of its hash, then up to DICT_DICT_DEPTH
//     dictionary positions (every dictionary position is farther back than the page's). A
//     dictionary match ends by the dictionary's end, so decoders that keep the dictionary
//     in a buffer of its own never copy one across into the page. Lengths are measured up
//     to DICT_CAP, so that a long run costs each position a bounded compare;
//  3. thread 0: a backward price pass (each position a literal, its match whole, or cut to
//     4..DICT_CUT_SHORT bytes, which need no length byte, or to a few bytes less than
//     whole, to end where a better match starts; a literal costs a byte, a match its
//     token, offset and length bytes), then the forward walk that writes the sequences,
//     measuring a capped match in full;
//  4. the block to `out` (whole 16-byte words: the page's 4096 bytes are its own), and
//     the page's CRC32C (warp 0, while step 1 waits for the page).
// Matches are measured 4 bytes a step (a dictionary's bytes come from L2, and a load a byte
// made each compare a round trip).
// Steps 1 (serially), 2 and 3 are plain C (`__host__ __device__`), which
// scripts/gpu-dict-host-check builds into a host program and checks against liblz4's
// decoder on the corpora without a GPU.
// ---------------------------------------------------------------------------------------

#define DICT_MAX_BYTES 32768u
// Bytes of the dictionary's device buffer: its longest, and room for the word reads that
// measure a match up to its last byte.
#define DICT_BUF_BYTES (DICT_MAX_BYTES + 16u)
#define DICT_THREADS 128u
#define DICT_HASH_LOG 14u
#define DICT_PAGE_HASH_LOG 12u
#define DICT_NO_POS 0xffffu
#ifndef DICT_PAGE_DEPTH
#define DICT_PAGE_DEPTH 48u
#endif
#ifndef DICT_DICT_DEPTH
#define DICT_DICT_DEPTH 32u
#endif
// Match lengths are measured up to this many bytes (and a walk ends at one this long).
#define DICT_CAP 256u
// Cut lengths the price pass tries: 4..DICT_CUT_SHORT (no length byte below 19), and the
// whole length less 1..DICT_CUT_NEAR.
#define DICT_CUT_SHORT 18u
#define DICT_CUT_NEAR 4u
#define DICT_LAST_START (PAGE_BYTES - MF_LIMIT)
#define DICT_MATCH_END (PAGE_BYTES - LAST_LITERALS)

static_assert(DICT_MAX_BYTES + PAGE_BYTES <= 65535u, "every dictionary offset fits LZ4's 16 bits");
static_assert(DICT_MAX_BYTES <= DICT_NO_POS, "dictionary positions fit a u16 beside DICT_NO_POS");

// A byte or u16 of the dictionary's read-only device memory (plain loads on the host).
__host__ __device__ __forceinline__ u32 dict_ro8(const u8* p) {
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
}

__host__ __device__ __forceinline__ u32 dict_ro16(const u16* p) {
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
}

__host__ __device__ __forceinline__ u32 dict_read32(const u8* b, u32 p) {
    return (u32)b[p] | ((u32)b[p + 1u] << 8) | ((u32)b[p + 2u] << 16) | ((u32)b[p + 3u] << 24);
}

__host__ __device__ __forceinline__ u32 dict_hash(u32 v, u32 log) {
    return (v * 2654435761u) >> (32u - log);
}

__host__ __device__ __forceinline__ u32 dict_ext(u32 n) {
    return n >= 15u ? (n - 15u) / 255u + 1u : 0u;
}

__host__ __device__ __forceinline__ u32 dict_ctz(u32 x) {
#ifdef __CUDA_ARCH__
    return (u32)(__ffs(x) - 1);
#else
    return (u32)__builtin_ctz(x);
#endif
}

// Four bytes at byte i of the dictionary (readable to DICT_BUF_BYTES), from its aligned
// words.
__host__ __device__ __forceinline__ u32 dict_word(const u8* dict, u32 i) {
    const u32* w = (const u32*)dict;
#ifdef __CUDA_ARCH__
    const u32 lo = __ldg(w + (i >> 2)), hi = __ldg(w + (i >> 2) + 1u);
    return __funnelshift_r(lo, hi, (i & 3u) * 8u);
#else
    const u32 lo = w[i >> 2], hi = w[(i >> 2) + 1u];
    return (i & 3u) == 0u ? lo : (lo >> ((i & 3u) * 8u)) | (hi << (32u - (i & 3u) * 8u));
#endif
}

// Bytes from page[p] that equal those from page[c] (c < p), up to `room` (the page is
// readable 3 bytes past p + room).
__host__ __device__ __forceinline__ u32 dict_page_run(const u8* page, u32 c, u32 p, u32 room) {
    for (u32 l = 0u; l < room; l += 4u) {
        const u32 x = dict_read32(page, c + l) ^ dict_read32(page, p + l);
        if (x != 0u) {
            l += dict_ctz(x) >> 3;
            return l < room ? l : room;
        }
    }
    return room;
}

// Bytes from page[p] that equal those from dict[d], up to `room`.
__host__ __device__ __forceinline__ u32 dict_dict_run(const u8* page, const u8* dict, u32 d,
                                                      u32 p, u32 room) {
    for (u32 l = 0u; l < room; l += 4u) {
        const u32 x = dict_word(dict, d + l) ^ dict_read32(page, p + l);
        if (x != 0u) {
            l += dict_ctz(x) >> 3;
            return l < room ? l : room;
        }
    }
    return room;
}

// The dictionary's chains; `head` has 1 << DICT_HASH_LOG entries, `prev` dict_len.
__host__ __device__ inline void dict_chains(const u8* dict, u32 dict_len, u16* head, u16* prev) {
    for (u32 h = 0u; h < (1u << DICT_HASH_LOG); ++h) {
        head[h] = DICT_NO_POS;
    }
    for (u32 d = 0u; d < dict_len; ++d) {
        if (d + MIN_MATCH <= dict_len) {
            const u32 h = dict_hash(dict_read32(dict, d), DICT_HASH_LOG);
            prev[d] = head[h];
            head[h] = (u16)d;
        } else {
            prev[d] = DICT_NO_POS;
        }
    }
}

// The page's chains over the positions a match may start at, serially (the kernel builds
// the same 32 at a time); `head` has 1 << DICT_PAGE_HASH_LOG entries.
__host__ __device__ inline void dict_page_chains(const u8* page, u16* head, u16* prev) {
    for (u32 h = 0u; h < (1u << DICT_PAGE_HASH_LOG); ++h) {
        head[h] = DICT_NO_POS;
    }
    for (u32 p = 0u; p <= DICT_LAST_START; ++p) {
        const u32 h = dict_hash(dict_read32(page, p), DICT_PAGE_HASH_LOG);
        prev[p] = head[h];
        head[h] = (u16)p;
    }
}

// Bytes position p shares with offset `off` back (into the dictionary where off > p; such
// a match stops at the dictionary's end), up to `room`.
__host__ __device__ inline u32 dict_match_len(const u8* page, const u8* dict, u32 dict_len, u32 p,
                                              u32 off, u32 room) {
    if (off <= p) {
        return dict_page_run(page, p - off, p, room);
    }
    const u32 d = dict_len - (off - p);
    return dict_dict_run(page, dict, d, p, room < dict_len - d ? room : dict_len - d);
}

// Position p's longest match (nearest on ties; lengths up to DICT_CAP) into lens[p] (0:
// none) and offs[p]. `prev`: the page's chains; p <= DICT_LAST_START.
__host__ __device__ inline void dict_search(const u8* page, const u16* prev, const u8* dict,
                                            const u16* dict_head, const u16* dict_prev,
                                            u32 dict_len, u32 p, u16* lens, u16* offs) {
    const u32 lim = DICT_MATCH_END - p;
    const u32 room = lim < DICT_CAP ? lim : DICT_CAP;
    u32 best = MIN_MATCH - 1u, boff = 0u;
    u32 c = prev[p];
    for (u32 k = 0u; c != DICT_NO_POS && k < DICT_PAGE_DEPTH && best < room; ++k) {
        // Only a candidate that also matches byte `best` can be longer.
        if (page[c + best] == page[p + best]) {
            const u32 l = dict_page_run(page, c, p, room);
            if (l > best) {
                best = l;
                boff = p - c;
            }
        }
        c = prev[c];
    }
    if (dict_len >= MIN_MATCH && best < room) {
        u32 d = dict_ro16(dict_head + dict_hash(dict_read32(page, p), DICT_HASH_LOG));
        for (u32 k = 0u; d != DICT_NO_POS && k < DICT_DICT_DEPTH && best < room; ++k) {
            const u32 r = room < dict_len - d ? room : dict_len - d;
            if (r > best && dict_ro8(dict + d + best) == page[p + best]) {
                const u32 l = dict_dict_run(page, dict, d, p, r);
                if (l > best) {
                    best = l;
                    boff = p + dict_len - d;
                }
            }
            d = dict_ro16(dict_prev + d);
        }
    }
    lens[p] = best >= MIN_MATCH ? (u16)best : (u16)0u;
    offs[p] = (u16)boff;
}

// The backward price pass: `lens` (positions 0..DICT_LAST_START) becomes each position's
// choice, 0 for a literal or the length to take; `cost` (PAGE_BYTES + 1 entries) is
// scratch.
__host__ __device__ inline void dict_price(u16* lens, u16* cost) {
    for (u32 p = PAGE_BYTES; p > DICT_LAST_START; --p) {
        cost[p] = (u16)(PAGE_BYTES - p);
    }
    for (u32 p = DICT_LAST_START + 1u; p-- > 0u;) {
        u32 best = cost[p + 1u] + 1u, pick = 0u;
        const u32 m = lens[p];
        if (m >= MIN_MATCH) {
            u32 c = 3u + dict_ext(m - MIN_MATCH) + cost[p + m];
            if (c < best) {
                best = c;
                pick = m;
            }
            const u32 short_end = m - 1u < DICT_CUT_SHORT ? m - 1u : DICT_CUT_SHORT;
            for (u32 l = MIN_MATCH; l <= short_end; ++l) {
                c = 3u + cost[p + l];
                if (c < best) {
                    best = c;
                    pick = l;
                }
            }
            const u32 near = m > DICT_CUT_SHORT + DICT_CUT_NEAR ? m - DICT_CUT_NEAR : DICT_CUT_SHORT + 1u;
            for (u32 l = near; l < m; ++l) {
                c = 3u + dict_ext(l - MIN_MATCH) + cost[p + l];
                if (c < best) {
                    best = c;
                    pick = l;
                }
            }
        }
        cost[p] = (u16)best;
        lens[p] = (u16)pick;
    }
}

// Writes length value n's extension bytes (none below 15) at o; returns how many.
__host__ __device__ inline u32 dict_put_ext(u8* o, u32 n) {
    if (n < 15u) {
        return 0u;
    }
    u32 w = 0u;
    u32 r = n - 15u;
    for (; r >= 255u; r -= 255u) {
        o[w++] = 255u;
    }
    o[w++] = (u8)r;
    return w;
}

// The forward walk over the choices: the block into `blk`; its length, or 0 if it would be
// longer than `cap` bytes.
__host__ __device__ inline u32 dict_emit(const u8* page, const u8* dict, u32 dict_len,
                                         const u16* choice, const u16* offs, u8* blk, u32 cap) {
    u32 op = 0u, anchor = 0u, p = 0u;
    while (p <= DICT_LAST_START) {
        u32 l = choice[p];
        if (l == 0u) {
            ++p;
            continue;
        }
        const u32 off = offs[p];
        if (l >= DICT_CAP) {
            // Taken whole and measured only up to the cap: it may reach further.
            l = dict_match_len(page, dict, dict_len, p, off, DICT_MATCH_END - p);
        }
        const u32 lit = p - anchor;
        const u32 ml = l - MIN_MATCH;
        if (op + 1u + dict_ext(lit) + lit + 2u + dict_ext(ml) > cap) {
            return 0u;
        }
        blk[op++] = (u8)(((lit < 15u ? lit : 15u) << 4) | (ml < 15u ? ml : 15u));
        op += dict_put_ext(blk + op, lit);
        for (u32 b = 0u; b < lit; ++b) {
            blk[op + b] = page[anchor + b];
        }
        op += lit;
        blk[op++] = (u8)(off & 0xffu);
        blk[op++] = (u8)(off >> 8);
        op += dict_put_ext(blk + op, ml);
        p += l;
        anchor = p;
    }
    const u32 lit = PAGE_BYTES - anchor;
    if (op + 1u + dict_ext(lit) + lit > cap) {
        return 0u;
    }
    blk[op++] = (u8)((lit < 15u ? lit : 15u) << 4);
    op += dict_put_ext(blk + op, lit);
    for (u32 b = 0u; b < lit; ++b) {
        blk[op + b] = page[anchor + b];
    }
    return op + lit;
}

// The largest block a page may take: strictly shorter than `limit`, at most a page less 1.
__host__ __device__ __forceinline__ u32 dict_cap(u32 limit) {
    return limit == 0u ? 0u : (limit > PAGE_BYTES ? PAGE_BYTES : limit) - 1u;
}

extern "C" __global__ void __launch_bounds__(32)
uzram_lz4_dict_chains(const u8* __restrict__ dict, u32 dict_len, u16* __restrict__ dict_head,
                      u16* __restrict__ dict_prev)
{
    // The head table in shared memory: one thread's chain building reads back what it
    // just wrote at every position, which global memory would make a round trip to L2.
    __shared__ u16 s_head[1u << DICT_HASH_LOG];
    if (blockIdx.x != 0u) {
        return;
    }
    const u32 len = dict_len <= DICT_MAX_BYTES ? dict_len : 0u;
    if (threadIdx.x == 0u) {
        dict_chains(dict, len, s_head, dict_prev);
    }
    __syncthreads();
    for (u32 h = threadIdx.x; h < (1u << DICT_HASH_LOG); h += blockDim.x) {
        dict_head[h] = s_head[h];
    }
}

extern "C" __global__ void __launch_bounds__(DICT_THREADS)
uzram_lz4_dict(const uint4* __restrict__ in, const u8* __restrict__ dict,
               const u16* __restrict__ dict_head, const u16* __restrict__ dict_prev,
               u32 dict_len, uint4* __restrict__ out, u32* __restrict__ sizes,
               u32* __restrict__ crcs, u32 npages, u32 limit)
{
    // The page, with zeros after it for the 4-byte reads at its end.
    __shared__ __align__(16) u8 s_page[PAGE_BYTES + 16u];
    // The page's chains, then the price pass's costs, then the block.
    __shared__ __align__(16) u16 s_prev[PAGE_BYTES + 8u];
    // The page's hash heads, then each position's match length, then its choice.
    __shared__ __align__(16) u16 s_len[PAGE_BYTES];
    __shared__ __align__(16) u16 s_off[PAGE_BYTES];
    __shared__ u32 s_crc[256];
    __shared__ u32 s_size;

    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31u;
    const u32 warp = tid >> 5;
    const u32 lower_lanes = (1u << lane) - 1u;
    const u32 higher_lanes = lane == 31u ? 0u : (FULL_MASK << (lane + 1u));
    const u32 cap = dict_cap(limit);
    // A longer one is a caller bug; its offsets would not fit: no dictionary then.
    const u32 dlen = dict_len <= DICT_MAX_BYTES ? dict_len : 0u;
    for (u32 i = tid; i < 256u; i += DICT_THREADS) {
        s_crc[i] = CRC32C_TABLE[i];
    }
    __syncthreads();
    for (u32 page = blockIdx.x; page < npages; page += gridDim.x) {
        const uint4* src = in + (size_t)page * (PAGE_BYTES / 16u);
        uint4* const sp4 = (uint4*)s_page;
        for (u32 k = tid; k < PAGE_BYTES / 16u; k += DICT_THREADS) {
            sp4[k] = src[k];
        }
        if (tid == 0u) {
            sp4[PAGE_BYTES / 16u] = make_uint4(0u, 0u, 0u, 0u);
        }
        for (u32 h = tid; h < (1u << DICT_PAGE_HASH_LOG); h += DICT_THREADS) {
            s_len[h] = DICT_NO_POS;
        }
        u32 crc = 0u;
        if (warp == 0u) {
            crc = crc32c_page(src, s_crc, lane);
        }
        __syncthreads();

        // 1. Chains: a position links to the nearest earlier lane of its hash in its 32,
        //    else to the head; the last lane of each hash becomes the head.
        if (warp == 0u) {
            for (u32 base = 0u; base <= DICT_LAST_START; base += 32u) {
                const u32 p = base + lane;
                const bool active = p <= DICT_LAST_START;
                // Lanes past the end take a value no hash has, so they match no other lane.
                const u32 h = active ? dict_hash(dict_read32(s_page, p), DICT_PAGE_HASH_LOG)
                                     : (1u << DICT_PAGE_HASH_LOG) + lane;
                const u32 same = __match_any_sync(FULL_MASK, h);
                const u32 lower = same & lower_lanes;
                if (active) {
                    s_prev[p] = lower != 0u ? (u16)(base + 31u - __clz(lower)) : s_len[h];
                }
                __syncwarp();
                if (active && (same & higher_lanes) == 0u) {
                    s_len[h] = (u16)p;
                }
                __syncwarp();
            }
        }
        __syncthreads();

        // 2. Every position's match (the heads are no longer read: s_len takes lengths).
        for (u32 p = tid; p <= DICT_LAST_START; p += DICT_THREADS) {
            dict_search(s_page, s_prev, dict, dict_head, dict_prev, dlen, p, s_len, s_off);
        }
        __syncthreads();

        // 3. The parse and the block, thread 0 (the chains' room takes the costs, then the
        //    block).
        if (tid == 0u) {
            dict_price(s_len, s_prev);
            s_size = dict_emit(s_page, dict, dlen, s_len, s_off, (u8*)s_prev, cap);
        }
        __syncthreads();
        const u32 size = s_size;

        // 4. Out, in whole 16-byte words (the block is at most 4095 bytes).
        const uint4* blk = (const uint4*)s_prev;
        uint4* dst = out + (size_t)page * (PAGE_BYTES / 16u);
        for (u32 j = tid; j < (size + 15u) / 16u; j += DICT_THREADS) {
            dst[j] = blk[j];
        }
        if (tid == 0u) {
            sizes[page] = size;
            crcs[page] = crc;
        }
        __syncthreads();
    }
}
