//! LZ4 block encoder specialised for one 4 KiB page.
//!
//! It makes exactly the parse liblz4 (1.9.4 and 1.10) makes in `LZ4_compress_fast_continue`
//! on a freshly reset stream, the parse python-lz4's `lz4.block.compress` makes: a position
//! table of 2^12 entries indexed by a multiplicative hash of 5 bytes, acceleration 1, skip
//! trigger 6, the same catch-up and "test next position" rules. So the output is
//! byte-for-byte liblz4's and the ratio is liblz4's. `LZ4_compress_default` hashes 4 bytes
//! into 2^13 entries on inputs under 64 KiB: on 8 corpora of real pages the 5-byte hash
//! stores them 0.5 % tighter in all (jvm heap +4.7 %, compiler heap +1.6 %, none worse than
//! −0.3 %) at the same speed (docs/bench/2026-11-cpu.md). What makes it faster:
//! the input length is a constant (every limit folds), the table is reused across pages
//! (no allocation), and compression stops as soon as the output budget is exceeded.
//!
//! Safe Rust: every index below is in bounds by the page-length arithmetic noted next to
//! it; the slice accesses cannot fail, and an out-of-budget output returns `None`.

use crate::page::PAGE_SIZE;

/// log2 of the number of position-table entries (liblz4's LZ4_HASHLOG for 32-bit tables).
/// Positions fit 16 bits in a page, so the entries are 16-bit: the parse is the same.
const HASH_LOG: u32 = 12;
/// Number of position-table entries.
pub(super) const TABLE_LEN: usize = 1 << HASH_LOG;
/// The last match must start at least 12 bytes before the end (LZ4 block rule).
const MFLIMIT: usize = 12;
/// The last 5 bytes are always literals (LZ4 block rule).
const LAST_LITERALS: usize = 5;
/// One past the last position a match may start at.
const MFLIMIT_PLUS_ONE: usize = PAGE_SIZE - MFLIMIT + 1;
/// Matches stop here.
const MATCH_LIMIT: usize = PAGE_SIZE - LAST_LITERALS;
const MIN_MATCH: usize = 4;
/// After 2^SKIP_TRIGGER failed probes the search step grows by one.
const SKIP_TRIGGER: u32 = 6;
const RUN_MASK: usize = 15;
const ML_MASK: usize = 15;

type Page = [u8; PAGE_SIZE];

/// Position table reused across pages by one worker.
pub(super) struct Encoder {
    table: Box<[u16; TABLE_LEN]>,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder").finish_non_exhaustive()
    }
}

#[inline(always)]
fn read32(p: &Page, i: usize) -> u32 {
    // Callers pass i <= MATCH_LIMIT - 4, so the 4 bytes are inside the page; `get` keeps
    // that arithmetic from ever becoming a panic.
    match p.get(i..i + 4) {
        Some(s) => u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        None => 0,
    }
}

#[inline(always)]
fn read64(p: &Page, i: usize) -> u64 {
    match p.get(i..i + 8) {
        Some(s) => u64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]),
        None => 0,
    }
}

/// The table index of position `i`: liblz4's `LZ4_hash5`, a multiplicative hash of the 5
/// bytes at `i` (little-endian). Callers pass i < MFLIMIT_PLUS_ONE, so the 8 bytes read
/// are inside the page; the shift leaves HASH_LOG bits, so the result indexes the table
/// without a bounds check.
#[inline(always)]
fn hash(p: &Page, i: usize) -> usize {
    ((read64(p, i) << 24).wrapping_mul(889_523_592_379) >> (64 - HASH_LOG)) as usize
}

/// Length of the common run of `p[a..]` and `p[b..]` (b < a), stopping at `limit`.
#[inline(always)]
fn count(p: &Page, mut a: usize, mut b: usize, limit: usize) -> usize {
    let start = a;
    while a + 8 <= limit {
        let diff = read64(p, a) ^ read64(p, b);
        if diff != 0 {
            return a + (diff.trailing_zeros() / 8) as usize - start;
        }
        a += 8;
        b += 8;
    }
    if a + 4 <= limit && read32(p, a) == read32(p, b) {
        a += 4;
        b += 4;
    }
    if a + 2 <= limit && p[a] == p[b] && p[a + 1] == p[b + 1] {
        a += 2;
        b += 2;
    }
    if a < limit && p[a] == p[b] {
        a += 1;
    }
    a - start
}

/// Writes the extra bytes of a length already reduced by its 15 in the token.
/// The caller checked that `len / 255 + 1` bytes fit.
#[inline(always)]
fn put_len(out: &mut [u8], op: &mut usize, mut len: usize) {
    while len >= 255 {
        out[*op] = 255;
        *op += 1;
        len -= 255;
    }
    out[*op] = len as u8;
    *op += 1;
}

/// Copies `len` literals from `src[from..]` to `out[op..]`. The caller guarantees
/// `op + len + 8 <= out.len()` (liblz4's output check) and `from + len <= MATCH_LIMIT`.
#[inline(always)]
fn copy_literals(out: &mut [u8], op: usize, src: &Page, from: usize, len: usize) {
    if len <= 16 {
        // Two 8-byte moves cover up to 16 literals; the bytes past `len` are overwritten
        // by whatever comes next, and both ranges stay inside their buffers (see above:
        // op + 16 <= op + len + 8 + 8 may exceed out.len(), so fall back when it would).
        if op + 16 <= out.len() && from + 16 <= PAGE_SIZE {
            out[op..op + 16].copy_from_slice(&src[from..from + 16]);
            return;
        }
    }
    out[op..op + len].copy_from_slice(&src[from..from + len]);
}

impl Encoder {
    /// The position table is allocated with `try_reserve`, so a refused allocation is an
    /// error for the caller to report instead of an abort.
    pub(super) fn try_new() -> Result<Self, std::collections::TryReserveError> {
        let mut table = Vec::new();
        table.try_reserve_exact(TABLE_LEN)?;
        table.resize(TABLE_LEN, 0u16);
        let table: Box<[u16; TABLE_LEN]> = table
            .into_boxed_slice()
            .try_into()
            .unwrap_or_else(|_| unreachable!("the table has exactly TABLE_LEN entries"));
        Ok(Self { table })
    }

    /// Compresses `src` into `out`; `None` when the block would not fit in `out`.
    pub(super) fn compress(&mut self, src: &Page, out: &mut [u8]) -> Option<usize> {
        let t = &mut *self.table;
        t.fill(0);
        let olimit = out.len();
        let mut op = 0usize;
        let mut anchor = 0usize;

        // First byte.
        t[hash(src, 0)] = 0;
        let mut ip = 1usize;
        let mut forward_h = hash(src, ip);

        'main: loop {
            // Find a match: probe positions with a step that grows after every 64 misses.
            let mut m;
            {
                let mut forward_ip = ip;
                let mut step = 1usize;
                let mut search_nb = 1u32 << SKIP_TRIGGER;
                loop {
                    let h = forward_h;
                    let current = forward_ip;
                    let match_index = t[h] as usize;
                    ip = forward_ip;
                    forward_ip += step;
                    step = (search_nb >> SKIP_TRIGGER) as usize;
                    search_nb += 1;
                    if forward_ip > MFLIMIT_PLUS_ONE {
                        break 'main;
                    }
                    forward_h = hash(src, forward_ip);
                    t[h] = current as u16;
                    if read32(src, match_index) == read32(src, ip) {
                        m = match_index;
                        break;
                    }
                }
            }

            // Catch up: extend the match backwards over equal bytes.
            while ip > anchor && m > 0 && src[ip - 1] == src[m - 1] {
                ip -= 1;
                m -= 1;
            }

            // Literals.
            let mut token = op;
            {
                let lit = ip - anchor;
                op += 1;
                if op + lit + (2 + 1 + LAST_LITERALS) + lit / 255 > olimit {
                    return None;
                }
                if lit >= RUN_MASK {
                    out[token] = (RUN_MASK << 4) as u8;
                    put_len(out, &mut op, lit - RUN_MASK);
                } else {
                    out[token] = (lit << 4) as u8;
                }
                copy_literals(out, op, src, anchor, lit);
                op += lit;
            }

            loop {
                // Offset (1..=4095: m < ip within one page).
                let off = (ip - m) as u16;
                out[op..op + 2].copy_from_slice(&off.to_le_bytes());
                op += 2;

                // Match length.
                let mut mc = count(src, ip + MIN_MATCH, m + MIN_MATCH, MATCH_LIMIT);
                ip += mc + MIN_MATCH;
                if op + (1 + LAST_LITERALS) + (mc + 240) / 255 > olimit {
                    return None;
                }
                if mc >= ML_MASK {
                    out[token] += ML_MASK as u8;
                    mc -= ML_MASK;
                    put_len(out, &mut op, mc);
                } else {
                    out[token] += mc as u8;
                }

                anchor = ip;
                if ip >= MFLIMIT_PLUS_ONE {
                    break 'main;
                }

                // Fill the table with ip - 2, then test the next position directly.
                t[hash(src, ip - 2)] = (ip - 2) as u16;
                let h = hash(src, ip);
                let mi = t[h] as usize;
                t[h] = ip as u16;
                if read32(src, mi) == read32(src, ip) {
                    token = op;
                    out[op] = 0;
                    op += 1;
                    m = mi;
                    continue;
                }
                break;
            }
            ip += 1;
            forward_h = hash(src, ip);
        }

        // Last literals.
        let last_run = PAGE_SIZE - anchor;
        if op + last_run + 1 + (last_run + 255 - RUN_MASK) / 255 > olimit {
            return None;
        }
        if last_run >= RUN_MASK {
            out[op] = (RUN_MASK << 4) as u8;
            op += 1;
            put_len(out, &mut op, last_run - RUN_MASK);
        } else {
            out[op] = (last_run << 4) as u8;
            op += 1;
        }
        out[op..op + last_run].copy_from_slice(&src[anchor..]);
        Some(op + last_run)
    }
}
