//! The store's recompression dictionary (`uzram_core::store` has why it never changes), kept
//! in the store segment's header unit so that the next daemon reads the pages written with
//! it: a tag word, the length, a checksum of the bytes, a "kept" word, then the bytes. The
//! tag is written after the rest, so a daemon killed while it wrote leaves none (and no page
//! was written with it: the store takes it only after). The kept word is written after the
//! tag and never cleared: an area whose tag is gone but whose kept word is set held a
//! dictionary pages may have been written with, and reads as damaged, not as none (else a
//! new dictionary would be trained over it). A region of an older daemon has zeros there:
//! no dictionary.
//!
//! The segment is root's alone (checked on every attach); what is read back is still data
//! from outside: a tag other than ours or zero, a length past the area or a checksum that
//! does not match is a damaged dictionary, never used (the store is told it is lost, and
//! its pages written with it fail their reads).

use std::sync::atomic::{AtomicU64, Ordering};

use uzram_core::codec::MAX_DICTIONARY_BYTES;

const TAG: u64 = u64::from_le_bytes(*b"LZ4DICT1");
/// The kept word's value once a dictionary was kept.
const KEPT: u64 = u64::from_le_bytes(*b"DICTKEPT");
/// Words before the bytes: the tag, the length, the checksum, the kept word.
const HEAD_WORDS: usize = 4;
/// Words of the area.
pub const WORDS: usize = HEAD_WORDS + MAX_DICTIONARY_BYTES / 8;

/// The dictionary's area of a store segment (`StoreSegment::dictionary_area`).
#[derive(Debug, Clone, Copy)]
pub struct KeptDictionary {
    words: &'static [AtomicU64],
}

/// FNV-1a, 64 bit, of the dictionary's bytes: finds an area damaged or half written.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl KeptDictionary {
    /// The area over `words` ([`WORDS`] of them, or more).
    pub fn over(words: &'static [AtomicU64]) -> Self {
        assert!(
            words.len() >= WORDS,
            "a dictionary area of {} words",
            words.len()
        );
        Self { words }
    }

    /// Keeps `dict` (1 to `MAX_DICTIONARY_BYTES` bytes) for the next daemon. Call it before
    /// the store takes it (`PageStore::set_dictionary`): a page may be written with it then.
    pub fn keep(&self, dict: &[u8]) -> Result<(), String> {
        if dict.is_empty() || dict.len() > MAX_DICTIONARY_BYTES {
            return Err(format!("a dictionary of {} bytes", dict.len()));
        }
        let w = self.words;
        w[0].store(0, Ordering::Release);
        for (i, chunk) in dict.chunks(8).enumerate() {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            w[HEAD_WORDS + i].store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
        w[1].store(dict.len() as u64, Ordering::Relaxed);
        w[2].store(checksum(dict), Ordering::Relaxed);
        w[0].store(TAG, Ordering::Release);
        self.confirm();
        Ok(())
    }

    /// The area's words, for tests that damage them.
    #[cfg(test)]
    pub fn words(&self) -> &'static [AtomicU64] {
        self.words
    }

    /// Sets the kept word: a dictionary is here for good. A takeover calls it for one it
    /// found (the daemon that kept it may have died between the tag and this word).
    pub fn confirm(&self) {
        self.words[3].store(KEPT, Ordering::Release);
    }

    /// The dictionary kept here: `Ok(None)` when there is none, `Err` (why) when the area
    /// is damaged.
    pub fn read(&self) -> Result<Option<Vec<u8>>, String> {
        let w = self.words;
        let kept = w[3].load(Ordering::Acquire);
        if kept != 0 && kept != KEPT {
            return Err(format!("its kept word is {kept:#018x}"));
        }
        match w[0].load(Ordering::Acquire) {
            0 if kept == KEPT => return Err("it was kept, and its tag is gone".into()),
            0 => return Ok(None),
            TAG => {}
            other => return Err(format!("its tag is {other:#018x}")),
        }
        let len = w[1].load(Ordering::Relaxed);
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| (1..=MAX_DICTIONARY_BYTES).contains(&n))
            .ok_or_else(|| format!("its length is {len}"))?;
        let mut dict = Vec::with_capacity(len);
        for word in &w[HEAD_WORDS..HEAD_WORDS + len.div_ceil(8)] {
            dict.extend_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        dict.truncate(len);
        if checksum(&dict) != w[2].load(Ordering::Relaxed) {
            return Err("its checksum does not match its bytes".into());
        }
        Ok(Some(dict))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn area() -> KeptDictionary {
        KeptDictionary::over(Box::leak((0..WORDS).map(|_| AtomicU64::new(0)).collect()))
    }

    /// A daemon killed between the tag and the kept word left a whole dictionary: it is
    /// read, and confirmed; killed before the tag, it left none.
    #[test]
    fn a_keep_cut_short_reads_as_what_it_left() {
        let dict = b"a dictionary of some bytes".to_vec();
        let a = area();
        a.keep(&dict).unwrap();
        a.words[3].store(0, Ordering::Relaxed);
        assert_eq!(a.read(), Ok(Some(dict.clone())));
        a.confirm();
        assert_eq!(a.read(), Ok(Some(dict)));
        let b = area();
        b.words[1].store(5, Ordering::Relaxed);
        assert_eq!(b.read(), Ok(None), "no tag, nothing kept: none");
    }

    #[test]
    fn a_kept_dictionary_reads_back_and_an_empty_area_has_none() {
        let a = area();
        assert_eq!(a.read(), Ok(None));
        let dict: Vec<u8> = (0..1001u32).map(|i| (i * 7) as u8).collect();
        a.keep(&dict).unwrap();
        assert_eq!(a.read(), Ok(Some(dict.clone())));
        let full = vec![0xabu8; MAX_DICTIONARY_BYTES];
        a.keep(&full).unwrap();
        assert_eq!(a.read(), Ok(Some(full)));
        assert!(a.keep(&[]).is_err());
        assert!(a.keep(&vec![0u8; MAX_DICTIONARY_BYTES + 1]).is_err());
    }

    /// What someone who could write the area might leave there: none of it is used.
    #[test]
    fn a_damaged_area_is_refused() {
        let dict = b"a dictionary of some bytes".to_vec();
        type Damage = fn(&[AtomicU64]);
        let cases: [(&str, Damage); 6] = [
            ("a flipped byte", |w| {
                w[HEAD_WORDS].fetch_xor(1, Ordering::Relaxed);
            }),
            ("another tag", |w| w[0].store(7, Ordering::Relaxed)),
            ("a length past the area", |w| {
                w[1].store((MAX_DICTIONARY_BYTES + 1) as u64, Ordering::Relaxed)
            }),
            ("a shorter length", |w| w[1].store(3, Ordering::Relaxed)),
            ("the kept word changed", |w| {
                w[3].store(1, Ordering::Relaxed)
            }),
            ("the tag zeroed", |w| w[0].store(0, Ordering::Relaxed)),
        ];
        for (what, damage) in cases {
            let a = area();
            a.keep(&dict).unwrap();
            damage(a.words);
            assert!(a.read().is_err(), "{what} was taken");
        }
    }
}
