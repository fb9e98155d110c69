//! LZ4 block decoder for one 4 KiB page whose block was compressed with an external
//! dictionary (liblz4's `LZ4_decompress_safe_usingDict`): a match may reach back past the
//! page's first byte into the dictionary, as if the dictionary's bytes came just before
//! the page. Only the cold tier's dictionary recompressor writes such blocks. Safe Rust,
//! with `decode.rs`'s copies for what lies in the page; every other rule is `decode.rs`'s
//! too (the output is exactly one page, a corrupt block is an error, nothing is written
//! outside the page).

#![forbid(unsafe_code)]

use super::decode::{copy_literals, copy_match, read_len, DecodeError};
use crate::page::PAGE_SIZE;

type Page = [u8; PAGE_SIZE];

/// Decodes `src` into `out` with `dict` as the bytes before the page.
pub(super) fn decompress_with_dict(
    src: &[u8],
    dict: &[u8],
    out: &mut Page,
) -> Result<(), DecodeError> {
    let (mut ip, mut op) = (0usize, 0usize);
    loop {
        let token = usize::from(*src.get(ip).ok_or(DecodeError::Truncated)?);
        ip += 1;
        let mut lit = token >> 4;
        if lit == 15 {
            lit += read_len(src, &mut ip)?;
        }
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
            return if op == PAGE_SIZE {
                Ok(())
            } else {
                Err(DecodeError::TooShort(op))
            };
        }
        let off_bytes = src.get(ip..ip + 2).ok_or(DecodeError::Truncated)?;
        let off = usize::from(u16::from_le_bytes([off_bytes[0], off_bytes[1]]));
        ip += 2;
        if off == 0 || off > op + dict.len() {
            return Err(DecodeError::BadOffset {
                offset: off,
                position: op,
            });
        }
        let mut ml = token & 15;
        if ml == 15 {
            ml += read_len(src, &mut ip)?;
        }
        ml += 4;
        if op + ml > PAGE_SIZE {
            return Err(DecodeError::TooLong);
        }
        let mut done = 0;
        if off > op {
            // The match starts in the dictionary; what it takes from there is contiguous,
            // and whatever follows comes from the page's first bytes.
            let from = dict.len() - (off - op);
            let take = ml.min(dict.len() - from);
            out[op..op + take].copy_from_slice(&dict[from..from + take]);
            done = take;
        }
        // The rest lies in the page: one move where its source ends before it starts, else
        // byte by byte (an overlapping match repeats its last `off` bytes).
        if done < ml {
            // Past the dictionary's end the source is in the page (`op + done >= off`), and
            // `op + ml <= PAGE_SIZE` was checked: `copy_match`'s terms.
            copy_match(out, op + done, off, ml - done);
        }
        op += ml;
    }
}

#[cfg(test)]
mod tests {
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
