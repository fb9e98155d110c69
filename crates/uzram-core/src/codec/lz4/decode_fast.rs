//! The `unsafe-lz4` page decoder: the bulk of a block is decoded with unchecked pointer
//! loads and stores, the last sequences by the safe decoder (`decode.rs`).
//!
//! The fast loop is liblz4's `LZ4_decompress_generic` fast loop cut down to one page. It
//! runs only while a sequence starts at least [`IN_MARGIN`] bytes before the end of the
//! input and [`OUT_MARGIN`] bytes before the end of the page; every length read from the
//! input is then checked once against those ends, so each fixed-size copy (16 or 32
//! bytes, which may run past the sequence's end) stays inside both buffers. A run of
//! literals that does not fit those checks is not decoded here: the safe decoder starts
//! again at that sequence's token (and decodes the block's last sequences). The fast loop
//! makes the safe decoder's checks in the safe decoder's order and returns the same
//! errors, so the result (the error, or the page) is the safe decoder's for every input;
//! `tests/codec_lz4_fast.rs` and the fuzz target `fuzz_lz4_decode_diff` check that.

use super::decode::{decompress_from, DecodeError};
use crate::page::PAGE_SIZE;

type Page = [u8; PAGE_SIZE];

/// The fast loop starts a sequence only with this much input left (token included): a
/// short-literal sequence reads the token and 16 bytes (up to 14 literals and the 2-byte
/// offset among them). Longer lengths are checked where they are read.
const IN_MARGIN: usize = 1 + 16;
/// ... and this much page left: 16 bytes of literals (14 used), then a short match whose
/// stores end at most [`SHORT_MATCH_ROOM`] bytes after its start.
const OUT_MARGIN: usize = 14 + SHORT_MATCH_ROOM;
/// A match of at most 18 bytes is written by stores ending at most this far past its
/// start: 8 + 8 + 2 bytes when the offset is at least 8, else two 16-byte pattern stores,
/// the second starting at most 16 bytes in.
const SHORT_MATCH_ROOM: usize = 32;

/// Decodes `src` into `out`, which it fills completely on success. Same result as
/// `decode::decompress` for every input.
#[inline]
pub(super) fn decompress(src: &[u8], out: &mut Page) -> Result<(), DecodeError> {
    let (ip, op) = fast_loop(src, out)?;
    decompress_from(src, out, ip, op, &[])
}

/// Decodes sequences while both margins hold; returns where the safe loop takes over
/// (the token of the first sequence it did not decode, and the output position).
#[inline(always)]
fn fast_loop(src: &[u8], out: &mut Page) -> Result<(usize, usize), DecodeError> {
    if src.len() < IN_MARGIN {
        return Ok((0, 0));
    }
    let ibase = src.as_ptr();
    let obase = out.as_mut_ptr();
    // SAFETY: `src.len() - IN_MARGIN` and `PAGE_SIZE - OUT_MARGIN` are at most the
    // lengths of `src` and `out`, so both pointers stay inside (or one past) their buffer.
    let (ilimit, olimit, iend) = unsafe {
        (
            ibase.add(src.len() - IN_MARGIN),
            obase.add(PAGE_SIZE - OUT_MARGIN),
            ibase.add(src.len()),
        )
    };
    let mut ip = ibase;
    let mut op = obase;
    // Invariants at the top of the loop: ibase <= ip <= ilimit, obase <= op <= olimit, so
    // at least IN_MARGIN input bytes are readable at ip and OUT_MARGIN page bytes writable
    // at op; out[..op] holds the decoded bytes (everything after op is scratch).
    while ip <= ilimit && op <= olimit {
        // SAFETY: ip <= ilimit, so ip is inside `src` with IN_MARGIN bytes from it on.
        let token = usize::from(unsafe { *ip });
        let lit = token >> 4;
        if lit != 15 {
            // SAFETY: ip + 1 + 16 <= iend (IN_MARGIN), op + 16 <= oend (OUT_MARGIN); the
            // buffers are distinct (`src` is borrowed shared, `out` mutably). Only
            // `lit` <= 14 of the bytes are literals; the rest is scratch past the output
            // position. Afterwards ip + 2 <= iend and op + 32 <= oend.
            unsafe {
                copy16(op, ip.add(1));
                ip = ip.add(1 + lit);
                op = op.add(lit);
            }
        } else {
            // SAFETY: ip + 1 <= iend.
            let (n, lit_ip) = read_len(unsafe { ip.add(1) }, iend)?;
            let lit = 15 + n;
            // The literals, plus the 32-byte copy's overrun (which also leaves room for
            // the offset and a short match), must end inside both buffers; otherwise the
            // safe loop takes this sequence, from its token (and errs or ends the block).
            if lit + 32 > offset(iend, lit_ip) || lit + 32 > PAGE_SIZE - offset(op, obase) {
                break;
            }
            // SAFETY: just checked: lit_ip + lit + 32 <= iend and op + lit + 32 <= oend;
            // the copy reads and writes at most 31 bytes past lit.
            unsafe {
                wild_copy32(op, lit_ip, lit);
                ip = lit_ip.add(lit);
                op = op.add(lit);
            }
        }
        // Here ip + 2 <= iend and op + SHORT_MATCH_ROOM <= oend (from either branch).

        // SAFETY: ip + 2 <= iend (above).
        let off = usize::from(u16::from_le_bytes(unsafe { ip.cast::<[u8; 2]>().read() }));
        // SAFETY: ip + 2 <= iend.
        ip = unsafe { ip.add(2) };
        let pos = offset(op, obase);
        // off == 0 || off > pos, in one compare.
        if off.wrapping_sub(1) >= pos {
            return Err(DecodeError::BadOffset {
                offset: off,
                position: pos,
            });
        }
        // SAFETY: 1 <= off <= pos, so `from` is inside the page, before op.
        let from = unsafe { op.sub(off) };

        let ml = token & 15;
        if ml != 15 {
            // A match of at most 18 bytes; op + SHORT_MATCH_ROOM <= oend.
            if off >= 8 {
                // SAFETY: three load-then-store moves of 8, 8 and 2 bytes inside the page
                // (op + 18 <= oend; from < op). Each move reads bytes already final: with
                // off >= 8, the k-th move's source ends at or before its destination
                // starts (earlier moves of this match included).
                unsafe {
                    let a = from.cast::<u64>().read_unaligned();
                    op.cast::<u64>().write_unaligned(a);
                    let b = from.add(8).cast::<u64>().read_unaligned();
                    op.add(8).cast::<u64>().write_unaligned(b);
                    let c = from.add(16).cast::<u16>().read_unaligned();
                    op.add(16).cast::<u16>().write_unaligned(c);
                }
            } else {
                // SAFETY: 1 <= off <= pos, off < 8; len = ml + 4 <= 18, and the pattern
                // stores end by op + 32 <= oend (step <= 16, two stores at most).
                unsafe { copy_short_period(op, from, off, ml + 4) };
            }
            // SAFETY: ml + 4 <= 18 and op + 32 <= oend.
            op = unsafe { op.add(ml + 4) };
            continue;
        }

        let (n, nip) = read_len(ip, iend)?;
        ip = nip;
        let ml = 19 + n;
        let room = PAGE_SIZE - pos;
        if ml > room {
            return Err(DecodeError::TooLong);
        }
        if ml + 16 <= room {
            if off >= 16 {
                // SAFETY: op + ml + 16 <= oend (just checked); from < op. 16-byte moves
                // every 16 bytes below ml (overrunning by < 16): each move's source ends
                // at or before its destination starts, so it reads final bytes.
                unsafe { copy_far_match(op, from, ml) };
            } else {
                // SAFETY: 1 <= off <= pos, off < 16; the stores start below ml and end
                // by op + ml + 15 < oend (checked above).
                unsafe { copy_short_period(op, from, off, ml) };
            }
        } else {
            // SAFETY: 1 <= off <= pos, ml >= 19, and op + ml <= oend (checked above).
            unsafe { copy_match_exact(op, from, off, ml) };
        }
        // SAFETY: op + ml <= oend.
        op = unsafe { op.add(ml) };
    }
    Ok((offset(ip, ibase), offset(op, obase)))
}

/// Bytes from `base` to `p`, both in (or one past) the same buffer with `base <= p`.
#[inline(always)]
fn offset(p: *const u8, base: *const u8) -> usize {
    p as usize - base as usize
}

/// Reads the extra bytes of a 15 length field at `ip`, never at or past `iend`, with the
/// safe decoder's checks and errors: the input ends first (`Truncated`), or the length
/// has passed a page and goes on (`TooLong`, which also keeps it far from overflow).
#[inline(always)]
fn read_len(mut ip: *const u8, iend: *const u8) -> Result<(usize, *const u8), DecodeError> {
    let mut len = 0usize;
    loop {
        if ip >= iend {
            return Err(DecodeError::Truncated);
        }
        // SAFETY: ip < iend, inside `src`.
        let b = usize::from(unsafe { *ip });
        // SAFETY: ip < iend, so ip + 1 <= iend.
        ip = unsafe { ip.add(1) };
        len += b;
        if b != 255 {
            return Ok((len, ip));
        }
        if len > PAGE_SIZE {
            return Err(DecodeError::TooLong);
        }
    }
}

/// Copies 16 bytes from `src` to `dst`.
///
/// # Safety
/// `src..src + 16` readable, `dst..dst + 16` writable, the two not overlapping.
#[inline(always)]
unsafe fn copy16(dst: *mut u8, src: *const u8) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, 16) }
}

/// Copies `len` literals in 32-byte moves (overrunning `len` by up to 31 bytes).
///
/// # Safety
/// `src..src + len + 32` readable, `dst..dst + len + 32` writable, not overlapping.
#[inline(always)]
unsafe fn wild_copy32(dst: *mut u8, src: *const u8, len: usize) {
    let mut i = 0;
    while i < len {
        // SAFETY: i < len, so both 32-byte ranges end before `len + 32`; the caller
        // keeps the buffers apart.
        unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), 32) };
        i += 32;
    }
}

/// Copies a match whose offset is at least 16, in 16-byte load-then-store moves
/// (overrunning `len` by up to 15 bytes).
///
/// # Safety
/// `from = dst - off` with `off >= 16`, both in one buffer, and `dst..dst + len + 16`
/// inside it.
#[inline(always)]
unsafe fn copy_far_match(dst: *mut u8, from: *const u8, len: usize) {
    let mut i = 0;
    while i + 16 < len {
        // SAFETY: two moves as below (i + 16 < len): sources end at or before their
        // destinations start, and both destinations end before dst + len + 16.
        unsafe {
            std::ptr::copy_nonoverlapping(from.add(i), dst.add(i), 16);
            std::ptr::copy_nonoverlapping(from.add(i + 16), dst.add(i + 16), 16);
        }
        i += 32;
    }
    if i < len {
        // SAFETY: the source range ends at from + i + 16 <= dst + i (off >= 16), so the
        // two ranges do not overlap; the destination ends before dst + len + 16.
        unsafe { std::ptr::copy_nonoverlapping(from.add(i), dst.add(i), 16) };
    }
}

/// Copies a match of `len >= 16` bytes without writing past its end (a match that ends
/// the page, or nearly): whole 16-byte moves or pattern stores, then for `off >= 16` one
/// 16-byte move ending exactly at `len`, for `off < 16` the last bytes one at a time.
///
/// # Safety
/// `from = dst - off` with `off >= 1`, both in one buffer, `len >= 16`, and
/// `dst..dst + len` inside it.
#[inline(always)]
unsafe fn copy_match_exact(dst: *mut u8, from: *const u8, off: usize, len: usize) {
    let whole = len & !15;
    if off >= 16 {
        // SAFETY: whole <= len: the moves end by dst + whole; same reasoning as in
        // `copy_far_match`.
        unsafe { copy_far_match(dst, from, whole) };
        if whole < len {
            // SAFETY: len >= 16, so the move covers dst + len - 16 .. dst + len inside
            // the buffer; its source ends off >= 16 bytes earlier, at or before the
            // destination's start, and reads bytes already final.
            unsafe { std::ptr::copy_nonoverlapping(from.add(len - 16), dst.add(len - 16), 16) };
        }
    } else {
        // The pattern stores of `copy_short_period` every `step` bytes below
        // `whole - 15`: each ends by `whole` <= len. Then bytes one at a time.
        let step = usize::from(STEP[off]);
        let done = ((whole - 16) / step + 1) * step;
        // SAFETY: the stores start at multiples of step below done, the last at
        // (whole - 16) / step * step <= whole - 16, so they end by whole <= len.
        unsafe { copy_short_period(dst, from, off, done) };
        for k in done..len {
            // SAFETY: k < len, inside the buffer; k - off >= 0 since from = dst - off
            // is inside it, and that byte is final (k - off < k).
            unsafe { *dst.add(k) = *from.add(k) };
        }
    }
}

/// Copies a match with a short period (`off < 16`): gathers the `off` final bytes one at a
/// time (single-byte loads forward from the recent stores that wrote them), widens them to
/// a 16-byte window of the pattern, and stores that window every `step` bytes, the largest
/// multiple of `off` that fits in 16 (overrunning `len` by up to 15 bytes).
///
/// # Safety
/// `from = dst - off` with `1 <= off < 16`, both in one buffer, and every store inside it:
/// they start at multiples of `step` (<= 16) below `len` and are 16 bytes long.
#[inline(always)]
unsafe fn copy_short_period(dst: *mut u8, from: *const u8, off: usize, len: usize) {
    // The common periods load their bytes in one move (from a recent store that covers
    // them whole, so the load forwards) and broadcast them by multiplication.
    const ONES: u128 = u128::MAX / 0xFF;
    let pat = if off == 1 {
        // SAFETY: from < dst, inside the buffer.
        u128::from(unsafe { *from }) * ONES
    } else if off == 2 {
        // SAFETY: from + 2 = dst, inside the buffer.
        u128::from(unsafe { from.cast::<u16>().read_unaligned() }) * (ONES / 0x101)
    } else if off == 4 {
        // SAFETY: from + 4 = dst, inside the buffer.
        u128::from(unsafe { from.cast::<u32>().read_unaligned() }) * (ONES / 0x0101_0101)
    } else if off == 8 {
        // SAFETY: from + 8 = dst, inside the buffer.
        u128::from(unsafe { from.cast::<u64>().read_unaligned() }) * ((1u128 << 64) | 1)
    } else {
        let mut v = 0u128;
        for i in 0..off {
            // SAFETY: from + i < dst, inside the buffer.
            v |= u128::from(unsafe { *from.add(i) }) << (8 * i);
        }
        let mut have = off;
        while have < 16 {
            v |= v << (8 * have);
            have *= 2;
        }
        v
    }
    .to_le_bytes();
    let step = usize::from(STEP[off & 15]);
    let mut i = 0;
    while i < len {
        // SAFETY: i < len, so this is one of the stores the caller allows.
        unsafe { dst.add(i).cast::<[u8; 16]>().write_unaligned(pat) };
        i += step;
    }
}

/// `16 - 16 % off` for `off` in 1..16: the largest multiple of `off` that fits in 16.
const STEP: [u8; 16] = {
    let mut t = [16u8; 16];
    let mut off = 1;
    while off < 16 {
        t[off] = (16 - 16 % off) as u8;
        off += 1;
    }
    t
};
