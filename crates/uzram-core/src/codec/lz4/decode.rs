//! LZ4 block decoder specialised for one 4 KiB page, in safe Rust.
//!
//! Accepts every valid LZ4 block whose output is exactly one page (from liblz4, lz4_flex,
//! the GPU kernel or uzram's own encoder) and refuses everything else with an error: a
//! truncated or corrupt block, an offset of zero or reaching before the page, or output
//! longer or shorter than the page. It never writes outside the page (all writes are
//! bounds-checked slice operations). Speed comes from liblz4's own shortcut: a sequence
//! with short literal and match lengths is copied with fixed 16-byte moves, which may
//! write past the sequence's end but never past the page; later sequences overwrite
//! those bytes before anything reads them.
//!
//! With the `unsafe-lz4` feature, `decode_fast.rs` decodes the bulk of a block with
//! unchecked pointer copies and hands the last sequences to [`decompress_from`] here; this
//! whole decoder stays the reference the fast one is tested against.
//!
//! The same loop decodes a block compressed with an external dictionary (liblz4's
//! `LZ4_decompress_safe_usingDict`; the cold tier's dictionary recompressor writes them): a
//! match may then reach back past the page's first byte into the dictionary, as if its
//! bytes came just before the page. Without one such an offset is an error, as before.

#![forbid(unsafe_code)]

use crate::page::PAGE_SIZE;

type Page = [u8; PAGE_SIZE];

/// Why a block was refused; turned into a `CodecError` by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum DecodeError {
    /// The input ended inside a sequence.
    Truncated,
    /// A match offset is zero or points before the start of the page.
    BadOffset { offset: usize, position: usize },
    /// The block writes past the end of the page.
    TooLong,
    /// The block ended after this many bytes, not a whole page.
    TooShort(usize),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Truncated => f.write_str("input ends inside a sequence"),
            Self::BadOffset { offset, position } => {
                write!(
                    f,
                    "match offset {offset} at output byte {position} is invalid"
                )
            }
            Self::TooLong => f.write_str("output would exceed one page"),
            Self::TooShort(n) => write!(f, "block ends after {n} of 4096 bytes"),
        }
    }
}

/// Reads the extra bytes of a length whose 4-bit field was 15.
#[inline(always)]
fn read_len(src: &[u8], ip: &mut usize) -> Result<usize, DecodeError> {
    let mut len = 0usize;
    loop {
        let b = *src.get(*ip).ok_or(DecodeError::Truncated)?;
        *ip += 1;
        len += b as usize;
        if b != 255 {
            return Ok(len);
        }
        // A page needs at most 4096 / 255 + 1 continuation bytes; stop runaway lengths
        // early (this also keeps `len` far from overflow).
        if len > PAGE_SIZE {
            return Err(DecodeError::TooLong);
        }
    }
}

/// Copies a match of `len` bytes starting `off` bytes back, where `1 <= off <= op` and
/// `op + len <= PAGE_SIZE` were checked by the caller.
#[inline(always)]
fn copy_match(out: &mut Page, op: usize, off: usize, len: usize) {
    let from = op - off;
    if op + len + 16 > PAGE_SIZE {
        if off >= 8 && len >= 8 {
            // The page's last bytes, exactly: chunks of 8 (each chunk's source ends at or
            // before its destination starts), then one chunk ending at `len`.
            let mut i = 0;
            while i + 8 <= len {
                out.copy_within(from + i..from + i + 8, op + i);
                i += 8;
            }
            if i < len {
                out.copy_within(from + len - 8..from + len, op + len - 8);
            }
        } else {
            // One at a time, the definition of an overlapping copy.
            for i in 0..len {
                out[op + i] = out[from + i];
            }
        }
    } else if off >= 16 {
        // Chunks of 16: each chunk's source ends at or before its destination starts,
        // so it reads only final bytes. Bytes past `len` are overwritten later.
        let mut i = 0;
        while i < len {
            out.copy_within(from + i..from + i + 16, op + i);
            i += 16;
        }
    } else {
        // A short period (runs of one byte, repeated words): gather the `off` final
        // bytes one at a time (single-byte loads always forward from earlier stores),
        // widen them to a 16-byte window of the pattern in a register, and store that
        // window every `step` bytes, the largest multiple of `off` that fits in 16. No
        // load depends on a store of this match, so nothing waits.
        let mut v = 0u128;
        for i in 0..off {
            v |= u128::from(out[from + i]) << (8 * i);
        }
        let mut have = off;
        while have < 16 {
            v |= v << (8 * have);
            have *= 2;
        }
        let pat = v.to_le_bytes();
        let step = 16 - 16 % off;
        let mut i = 0;
        while i < len {
            out[op + i..op + i + 16].copy_from_slice(&pat);
            i += step;
        }
    }
}

/// Copies `len` literals; the caller checked both ranges. Far from the ends it moves
/// 32-byte chunks (the bytes past `len` are overwritten by the next sequence).
#[inline(always)]
fn copy_literals(out: &mut Page, op: usize, src: &[u8], ip: usize, len: usize) {
    if op + len + 32 <= PAGE_SIZE && ip + len + 32 <= src.len() {
        let mut i = 0;
        while i < len {
            out[op + i..op + i + 32].copy_from_slice(&src[ip + i..ip + i + 32]);
            i += 32;
        }
    } else if (8..=16).contains(&len) {
        // A short run near an end (the block's last literals): two 8-byte moves that
        // may overlap, the second ending exactly at `len`; cheaper than a memcpy call.
        out[op..op + 8].copy_from_slice(&src[ip..ip + 8]);
        out[op + len - 8..op + len].copy_from_slice(&src[ip + len - 8..ip + len]);
    } else {
        out[op..op + len].copy_from_slice(&src[ip..ip + len]);
    }
}

/// Output room the literal shortcut needs: 16 bytes of literals, then an 18-byte match.
const SHORT_ROOM: usize = 16 + 18;

/// Decodes `src` into `out`, which it fills completely on success.
pub(super) fn decompress(src: &[u8], out: &mut Page) -> Result<(), DecodeError> {
    decompress_from(src, out, 0, 0, &[])
}

/// Decodes `src` into `out` with `dict` as the bytes before the page.
pub(super) fn decompress_with_dict(
    src: &[u8],
    dict: &[u8],
    out: &mut Page,
) -> Result<(), DecodeError> {
    decompress_from(src, out, 0, 0, dict)
}

/// Goes on decoding from a sequence boundary: the token at `src[ip]`, output byte `op`,
/// with `out[..op]` already decoded (by this loop or the fast one), `dict` the bytes before
/// the page (empty: none). Any `ip`, `op` are safe to pass (out-of-range ones end in an
/// error); the result is the same as decoding from the start of the block when they are a
/// real boundary.
pub(super) fn decompress_from(
    src: &[u8],
    out: &mut Page,
    mut ip: usize,
    mut op: usize,
    dict: &[u8],
) -> Result<(), DecodeError> {
    if op > PAGE_SIZE {
        return Err(DecodeError::TooLong);
    }
    loop {
        let token = *src.get(ip).ok_or(DecodeError::Truncated)? as usize;
        ip += 1;

        // Literals. Shortcut (liblz4's): fewer than 15 of them, with 16 bytes to spare in
        // the input (so this is not the last sequence) and room in the page: one 16-byte
        // move covers them.
        let lit = token >> 4;
        if lit != 15 && ip + 17 <= src.len() && op <= PAGE_SIZE - SHORT_ROOM {
            out[op..op + 16].copy_from_slice(&src[ip..ip + 16]);
            ip += lit;
            op += lit;
        } else {
            let lit = if lit == 15 {
                15 + read_len(src, &mut ip)?
            } else {
                lit
            };
            let lit_end = ip.checked_add(lit).ok_or(DecodeError::Truncated)?;
            if lit_end > src.len() {
                return Err(DecodeError::Truncated);
            }
            if op + lit > PAGE_SIZE {
                return Err(DecodeError::TooLong);
            }
            copy_literals(out, op, src, ip, lit);
            ip = lit_end;
            op += lit;
            if ip == src.len() {
                // The last sequence has literals only.
                return if op == PAGE_SIZE {
                    Ok(())
                } else {
                    Err(DecodeError::TooShort(op))
                };
            }
        }

        // Match.
        let off_bytes = src.get(ip..ip + 2).ok_or(DecodeError::Truncated)?;
        let off = u16::from_le_bytes([off_bytes[0], off_bytes[1]]) as usize;
        ip += 2;
        if off == 0 || off > op + dict.len() {
            return Err(DecodeError::BadOffset {
                offset: off,
                position: op,
            });
        }
        let ml = token & 15;
        if off > op {
            // Only with a dictionary: the match starts in it.
            let ml = match_len(src, &mut ip, ml)?;
            if op + ml > PAGE_SIZE {
                return Err(DecodeError::TooLong);
            }
            copy_dict_match(out, dict, op, off, ml);
            op += ml;
            continue;
        }
        if ml != 15 && off >= 8 && op <= PAGE_SIZE - 18 {
            // Shortcut: at most 18 bytes from at least 8 back, in three fixed moves, each
            // reading only bytes already final.
            let from = op - off;
            out.copy_within(from..from + 8, op);
            out.copy_within(from + 8..from + 16, op + 8);
            out.copy_within(from + 16..from + 18, op + 16);
            op += ml + 4;
            continue;
        }
        let ml = match_len(src, &mut ip, ml)?;
        if op + ml > PAGE_SIZE {
            return Err(DecodeError::TooLong);
        }
        copy_match(out, op, off, ml);
        op += ml;
    }
}

/// A match's length from its token's 4 bits `ml` (and the extra bytes after the offset
/// when they are 15).
#[inline(always)]
fn match_len(src: &[u8], ip: &mut usize, ml: usize) -> Result<usize, DecodeError> {
    Ok(if ml == 15 {
        15 + read_len(src, ip)?
    } else {
        ml
    } + 4)
}

/// Copies a match of `len` bytes starting `off` bytes back where that is before the page:
/// from the dictionary's end, then (if it runs on past it) from the page's first bytes.
/// The caller checked `op < off <= op + dict.len()` and `op + len <= PAGE_SIZE`.
fn copy_dict_match(out: &mut Page, dict: &[u8], op: usize, off: usize, len: usize) {
    let from = dict.len() - (off - op);
    let take = len.min(off - op);
    out[op..op + take].copy_from_slice(&dict[from..from + take]);
    if take < len {
        // Past the dictionary's end the source is the page's start (`op + take == off`):
        // `copy_match`'s terms.
        copy_match(out, op + take, off, len - take);
    }
}

#[cfg(test)]
mod dict_tests {
    use super::*;

    /// A block of one literal run: the page itself.
    fn literal_block(page: &[u8]) -> Vec<u8> {
        let mut b = vec![0xf0];
        let mut n = page.len() - 15;
        while n >= 255 {
            b.push(255);
            n -= 255;
        }
        b.push(n as u8);
        b.extend_from_slice(page);
        b
    }

    #[test]
    fn a_match_into_the_dictionary_and_across_its_end_decodes() {
        let dict: Vec<u8> = (0..64u8).collect();
        // 8 literals, then a 20-byte match 16 bytes back from output byte 8: 8 bytes
        // of the dictionary's end, then the page's own first 12 bytes.
        let mut block = vec![0x8f, 1, 2, 3, 4, 5, 6, 7, 8, 16, 0];
        block.push(20 - 4 - 15);
        // The rest literals: PAGE_SIZE - 28 of them.
        let tail = PAGE_SIZE - 28;
        let mut last = literal_block(&vec![9u8; tail]);
        block.append(&mut last);
        let mut page = [0u8; PAGE_SIZE];
        decompress_with_dict(&block, &dict, &mut page).unwrap();
        assert_eq!(&page[..8], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&page[8..16], &dict[56..64]);
        assert_eq!(&page[16..28], &[1, 2, 3, 4, 5, 6, 7, 8, 56, 57, 58, 59]);
        assert!(page[28..].iter().all(|&b| b == 9));
    }

    #[test]
    fn an_offset_past_the_dictionary_is_refused_and_no_dictionary_is_plain_lz4() {
        let dict = [7u8; 16];
        // A match at output byte 0 reaching 17 back: one before the dictionary's start.
        let mut block = vec![0x00, 17, 0];
        block.append(&mut literal_block(&vec![1u8; PAGE_SIZE - 4]));
        let mut page = [0u8; PAGE_SIZE];
        assert_eq!(
            decompress_with_dict(&block, &dict, &mut page),
            Err(DecodeError::BadOffset {
                offset: 17,
                position: 0
            })
        );
        block[1] = 16;
        decompress_with_dict(&block, &dict, &mut page).unwrap();
        assert_eq!(&page[..4], &[7, 7, 7, 7]);
        assert!(decompress_with_dict(&block, &[], &mut page).is_err());
        let plain = literal_block(&[3u8; PAGE_SIZE]);
        decompress_with_dict(&plain, &[], &mut page).unwrap();
        assert!(page.iter().all(|&b| b == 3));
    }

    #[test]
    fn truncated_and_short_blocks_are_errors() {
        let page_block = literal_block(&[5u8; PAGE_SIZE]);
        let mut page = [0u8; PAGE_SIZE];
        for cut in [0, 1, 5, page_block.len() - 1] {
            assert!(decompress_with_dict(&page_block[..cut], b"dict", &mut page).is_err());
        }
        let short = literal_block(&[5u8; 100]);
        assert_eq!(
            decompress_with_dict(&short, b"dict", &mut page),
            Err(DecodeError::TooShort(100))
        );
    }
}
