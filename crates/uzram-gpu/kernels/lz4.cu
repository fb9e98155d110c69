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
//
// uzram_lz4_fast: each block is one warp and compresses whole pages (grid-stride). The page
// (plus 16 bytes of zero padding) and a 2048-entry u16 hash table live in shared memory
// (8.2 KB per warp: 25 warps per SM on Hopper; a 4096-entry table gives 17 warps, a 0.4 %
// better ratio and a 20 % slower kernel; see docs/gpu-notes.md).
// The parse is LZ4's parse with LZ4's insertion rule (every position tested outside a match
// is inserted; inside a match only end-2), but every position is tested (no skip
// acceleration), 32 at a time: lane i tests position ip+i against the most recent earlier
// position with the same hash (an earlier lane of the same group, else the table), and the
// first lane that finds a 4-byte match wins; then up to LAZY lazy steps (as LZ4HC) move the
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
// The packed total is counted in ctrl[2].
// Each warp builds its block in its page's 4096-byte slot of `scratch` (device only), then
// reserves room in `packed` with one atomicAdd and copies it there, so the host copies back
// only the compressed bytes. Packed order is arbitrary; the offsets say where each page is.
// End-of-block rules of the LZ4 format: the last 5 bytes are literals, the last match starts
// at least 12 bytes before the end, matches are >= 4 bytes, offsets <= 65535.
//
// Regenerate the embedded PTX with scripts/gpu-ptx after any change to this file.
//
// uzram_lz4_verify: one warp per page. It decodes each block the way uzram's CPU decoder
// does (same acceptance rules: literal-only last sequence, offsets inside the page, exactly
// 4096 bytes out) and compares every byte with the input page; a same-filled page's word
// is compared with every word of the page. Results that pass are copied into the host's
// pinned buffers (mapped into the device's address space, so this is also the copy back);
// a block that fails is reported as SIZE_REJECTED and the host compresses that page on
// the CPU. A block is never trusted because the compressor wrote it.

#define PAGE_BYTES 4096u
#ifndef HASH_LOG
#define HASH_LOG 11u
#endif
// LAZY n: up to n lazy-match steps per match (0: plain greedy); see docs/gpu-notes.md.
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

// Four bytes at byte offset `pos` of the page, little-endian.
__device__ __forceinline__ u32 read32(const u32* words, u32 pos) {
    const u32 i = pos >> 2;
    return __funnelshift_r(words[i], words[i + 1], (pos & 3u) * 8u);
}

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

// Copies this warp's `len`-byte block from its page slot `src` (16-byte aligned) to `dst`
// (any alignment), warp-wide: whole 4-byte words where the destination word lies inside the
// block, single bytes at the two ends (neighbouring blocks own the other bytes there).
// (No __restrict__ here: `src` was written earlier in this kernel, so its loads must not be
// turned into read-only-cache loads.)
__device__ __forceinline__ void copy_block(u8* dst, const u8* src, u32 len, u32 lane) {
    const u32 mis = (u32)((size_t)dst & 3u);
    u32* dw = (u32*)(dst - mis);
    const u32* sw = (const u32*)src;
    const u32 words = (mis + len + 3u) >> 2;
    for (u32 j = lane; j < words; j += 32u) {
        const int start = (int)(j * 4u) - (int)mis;   // block byte at this word's byte 0
        if (start >= 0 && (u32)start + 4u <= len) {
            const u32 s = (u32)start;
            dw[j] = __funnelshift_r(sw[s >> 2], sw[(s >> 2) + 1u], (s & 3u) * 8u);
        } else {
            for (u32 b = 0; b < 4u; ++b) {
                const int idx = start + (int)b;
                if (idx >= 0 && (u32)idx < len) {
                    ((u8*)dw)[j * 4u + b] = src[idx];
                }
            }
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
        u8* o = scratch + (size_t)page * PAGE_BYTES;

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
                const u32 off = atomicAdd(total, 8u);
                u8* d = packed + off;
                const u32 w[2] = {first.x, first.y};
                for (u32 b = 0; b < 8u; ++b) {
                    d[b] = (u8)(w[b >> 2] >> ((b & 3u) * 8u));
                }
                sizes[page] = SIZE_SAME_FILLED;
                offsets[page] = off;
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
            const bool hit = active && cand < p && read32(s_page, cand) == v;
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
            off = len != 0u ? atomicAdd(total, len) : 0u;
            sizes[page] = len;
            offsets[page] = off;
        }
        off = __shfl_sync(FULL_MASK, off, 0);
        __syncwarp();
        copy_block(packed + off, o, len, lane);
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

extern "C" __global__ void __launch_bounds__(32)
uzram_lz4_verify(const uint4* __restrict__ in, const u8* __restrict__ packed,
                 const u32* __restrict__ meta, const u32* __restrict__ ctrl,
                 u8* __restrict__ out_packed, u32* __restrict__ out_meta)
{
    const u32 npages = ctrl[0];
    const u32 limit = ctrl[1];
    const u32 lane = threadIdx.x;
    __shared__ __align__(16) u32 s_page[PAGE_BYTES / 4u + 4u];
    __shared__ __align__(16) u32 s_blk[PAGE_BYTES / 4u + 4u];
    if (blockIdx.x == 0u && lane == 0u) {
        out_meta[2u * (size_t)npages] = ctrl[2];
    }
    for (u32 page = blockIdx.x; page < npages; page += gridDim.x) {
        const u32 size = meta[page];
        const u32 off = meta[npages + page];
        u32 result = size;
        if (size == SIZE_RAW) {
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
                if (lane < 8u) {
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
            if (block_matches(s_blk, size, (const u8*)s_page, lane)) {
                copy_block(out_packed + off, (const u8*)s_blk, size, lane);
            } else {
                result = SIZE_REJECTED;
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
// One block of HIGH_THREADS (4 warps) per page, grid-stride over the slot's pages:
//  1. warp 0 builds hash chains over every position (prev[p]: the last earlier position
//     with the same 4-byte hash), 32 positions at a time;
//  2. all threads find each position's best match: walk its chain up to HIGH_DEPTH
//     candidates, compare up to HIGH_CAP bytes, keep the longest (nearest on ties);
//  3. warp 0 runs a backward price DP over the positions (bytes to encode the rest of the
//     page): a literal costs 1, a match of length L at p costs 3 + its length extension +
//     cost[p + L], for L = 4..18 and L = the whole match (lanes try one L each); then it
//     walks the choices forward and emits the sequences warp-wide.
// Matches longer than HIGH_CAP are measured in full for the DP (incrementally: a match at p
// with the offset of the match at p+1 is one byte longer).
// Shared memory per block: the page, a u16 table that holds the hash heads and then the DP
// costs, a u16 table that holds the chains and then the choices, and the best matches.
// ---------------------------------------------------------------------------------------

#ifndef HIGH_DEPTH
#define HIGH_DEPTH 64u
#endif
#define HIGH_CAP 64u
#define HIGH_THREADS 128u
#define HIGH_HASH_LOG 11u
#define NO_POS 0xffffu

__device__ __forceinline__ u32 hash_high(u32 v) {
    return (v * 2654435761u) >> (32u - HIGH_HASH_LOG);
}

// Bytes that match from positions a and b (a < b) onward, up to `limit` bytes.
__device__ __forceinline__ u32 match_len(const u32* words, u32 a, u32 b, u32 limit) {
    u32 l = 0u;
    while (l < limit) {
        const u32 d = read32(words, a + l) ^ read32(words, b + l);
        if (d != 0u) {
            l += (u32)(__ffs(d) - 1) >> 3;
            return l < limit ? l : limit;
        }
        l += 4u;
    }
    return limit;
}

extern "C" __global__ void __launch_bounds__(HIGH_THREADS)
uzram_lz4_high(const uint4* __restrict__ in, u8* __restrict__ scratch,
               u8* __restrict__ packed, u32* __restrict__ meta, u32* __restrict__ ctrl)
{
    const u32 npages = ctrl[0];
    const u32 limit = ctrl[1];
    u32* const sizes = meta;
    u32* const offsets = meta + npages;
    u32* const total = ctrl + 2;
    __shared__ __align__(16) u32 s_page[PAGE_BYTES / 4u + 4u];
    __shared__ __align__(16) u16 s_a[PAGE_BYTES + 8u];      // hash heads, then DP costs
    __shared__ __align__(16) u16 s_b[PAGE_BYTES + 8u];      // chains, then DP choices
    __shared__ __align__(16) u32 s_best[PAGE_BYTES];        // (len << 16) | offset
    __shared__ u32 s_flag;

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
        u8* o = scratch + (size_t)page * PAGE_BYTES;

        // Load the page; same-filled test; clear the hash heads.
        const uint4 first = src[0];
        bool same = true;
        uint4* dst = (uint4*)s_page;
        for (u32 k = tid; k < PAGE_BYTES / 16u; k += HIGH_THREADS) {
            const uint4 v = src[k];
            dst[k] = v;
            same = same && v.x == first.x && v.y == first.y && v.z == first.x && v.w == first.y;
        }
        if (tid < 4u) {
            s_page[PAGE_BYTES / 4u + tid] = 0u;
        }
        for (u32 k = tid; k < (1u << HIGH_HASH_LOG); k += HIGH_THREADS) {
            s_a[k] = NO_POS;
        }
        if (tid == 0u) {
            s_flag = 1u;
        }
        __syncthreads();
        if (!same) {
            s_flag = 0u;   // any thread may clear it; all write the same value
        }
        __syncthreads();
        if (s_flag != 0u) {
            if (tid == 0u) {
                const u32 off = atomicAdd(total, 8u);
                u8* d = packed + off;
                const u32 w[2] = {first.x, first.y};
                for (u32 b = 0; b < 8u; ++b) {
                    d[b] = (u8)(w[b >> 2] >> ((b & 3u) * 8u));
                }
                sizes[page] = SIZE_SAME_FILLED;
                offsets[page] = off;
            }
            __syncthreads();
            continue;
        }

        // 1. Hash chains, 32 positions at a time (warp 0).
        if (warp == 0u) {
            for (u32 base = 0u; base <= last_start; base += 32u) {
                const u32 p = base + lane;
                const bool active = p <= last_start;
                const u32 h = active ? hash_high(read32(s_page, p)) : (1u << HIGH_HASH_LOG) + lane;
                const u32 peers = __match_any_sync(FULL_MASK, h);
                const u32 earlier = peers & lower_lanes;
                if (active) {
                    s_b[p] = earlier != 0u ? (u16)(base + (31u - __clz(earlier))) : s_a[h];
                }
                __syncwarp();
                if (active && (peers & higher_lanes) == 0u) {
                    s_a[h] = (u16)p;
                }
                __syncwarp();
            }
        }
        __syncthreads();

        // 2. The best match of every position.
        for (u32 p = tid; p <= last_start; p += HIGH_THREADS) {
            const u32 room = match_end - p;
            const u32 lim = room < HIGH_CAP ? room : HIGH_CAP;
            u32 best = 0u, boff = 0u;
            u32 c = s_b[p];
            for (u32 d = 0u; d < HIGH_DEPTH && c != NO_POS; ++d) {
                const u32 l = match_len(s_page, c, p, lim);
                if (l > best) {
                    best = l;
                    boff = p - c;
                    if (l >= lim) {
                        break;
                    }
                }
                c = s_b[c];
            }
            s_best[p] = best >= MIN_MATCH ? ((best << 16) | boff) : 0u;
        }
        __syncthreads();

        // 3. Backward price DP and the emission, warp 0.
        if (warp == 0u) {
            u16* cost = s_a;     // cost[p]: bytes to encode page[p..]
            u16* choice = s_b;   // 0: literal; else the match length taken at p
            if (lane == 0u) {
                cost[PAGE_BYTES] = 1u;   // the last sequence's token
            }
            for (u32 p = last_start + 1u + lane; p < PAGE_BYTES; p += 32u) {
                cost[p] = (u16)(PAGE_BYTES - p + 1u);
                choice[p] = 0u;
            }
            __syncwarp();
            u32 run_off = 0u, run_len = 0u;   // the full match at p + 1, for incremental lengths
            for (int pi = (int)last_start; pi >= 0; --pi) {
                const u32 p = (u32)pi;
                const u32 b = s_best[p];
                const u32 lit = (u32)cost[p + 1u] + 1u;
                if (b == 0u) {
                    if (lane == 0u) {
                        cost[p] = (u16)lit;
                        choice[p] = 0u;
                    }
                    run_len = 0u;
                    __syncwarp();
                    continue;
                }
                const u32 off = b & 0xffffu;
                u32 maxl = b >> 16;
                if (maxl >= HIGH_CAP) {
                    if (run_len != 0u && run_off == off) {
                        maxl = run_len + 1u;
                    } else {
                        maxl = extend_match(s_page, p + MIN_MATCH, p - off + MIN_MATCH, match_end, lane) - p;
                    }
                }
                run_off = off;
                run_len = maxl;
                // Lane i tries L = 4 + i (i < 15); lane 15 the whole match.
                u32 L = lane < 15u ? MIN_MATCH + lane : (lane == 15u ? maxl : 0u);
                u32 c = 0xffffffffu;
                if (L >= MIN_MATCH && L <= maxl && (lane < 15u || maxl > MIN_MATCH + 14u)) {
                    c = 3u + ext_bytes(L - MIN_MATCH) + (u32)cost[p + L];
                }
                // Warp minimum of (cost, L), smaller L on ties.
                u32 key = c == 0xffffffffu ? 0xffffffffu : ((c << 13) | L);
                for (u32 s = 16u; s > 0u; s >>= 1) {
                    const u32 other = __shfl_xor_sync(FULL_MASK, key, s);
                    key = other < key ? other : key;
                }
                if (lane == 0u) {
                    const u32 mc = key >> 13;
                    if (key != 0xffffffffu && mc < lit) {
                        cost[p] = (u16)mc;
                        choice[p] = (u16)(key & 0x1fffu);
                    } else {
                        cost[p] = (u16)lit;
                        choice[p] = 0u;
                    }
                }
                __syncwarp();
            }

            // Forward: emit the chosen sequences.
            u32 anchor = 0u, p = 0u, op = 0u;
            bool fits = true;
            while (p <= last_start) {
                const u32 q = p + lane;
                const bool m = q <= last_start && choice[q] != 0u;
                const u32 hits = __ballot_sync(FULL_MASK, m);
                if (hits == 0u) {
                    p += 32u;
                    continue;
                }
                const u32 mp = p + (u32)(__ffs(hits) - 1);
                const u32 mlen = choice[mp];
                const u32 off = s_best[mp] & 0xffffu;
                const u32 lit = mp - anchor;
                const u32 ml = mlen - MIN_MATCH;
                const u32 need = 1u + ext_bytes(lit) + lit + 2u + ext_bytes(ml);
                if (op + need > cap) {
                    fits = false;
                    break;
                }
                if (lane == 0u) {
                    o[op] = (u8)(((lit < 15u ? lit : 15u) << 4) | (ml < 15u ? ml : 15u));
                }
                u32 w = op + 1u;
                if (lit >= 15u) {
                    write_ext(o + w, lit, lane);
                    w += ext_bytes(lit);
                }
                for (u32 i = lane; i < lit; i += 32u) {
                    o[w + i] = sp[anchor + i];
                }
                w += lit;
                if (lane == 0u) {
                    o[w] = (u8)(off & 0xffu);
                    o[w + 1u] = (u8)(off >> 8);
                }
                w += 2u;
                if (ml >= 15u) {
                    write_ext(o + w, ml, lane);
                }
                op += need;
                anchor = mp + mlen;
                p = anchor;
                __syncwarp();
            }
            if (fits) {
                const u32 lit = PAGE_BYTES - anchor;
                const u32 need = 1u + ext_bytes(lit) + lit;
                if (op + need > cap) {
                    fits = false;
                } else {
                    if (lane == 0u) {
                        o[op] = (u8)((lit < 15u ? lit : 15u) << 4);
                    }
                    u32 w = op + 1u;
                    if (lit >= 15u) {
                        write_ext(o + w, lit, lane);
                        w += ext_bytes(lit);
                    }
                    for (u32 i = lane; i < lit; i += 32u) {
                        o[w + i] = sp[anchor + i];
                    }
                    op += need;
                }
            }
            const u32 len = fits ? op : 0u;
            u32 off = 0u;
            if (lane == 0u) {
                off = len != 0u ? atomicAdd(total, len) : 0u;
                sizes[page] = len;
                offsets[page] = off;
            }
            off = __shfl_sync(FULL_MASK, off, 0);
            __syncwarp();
            copy_block(packed + off, o, len, lane);
        }
        __syncthreads();
    }
}
