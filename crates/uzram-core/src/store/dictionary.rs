//! The store's LZ4 dictionary (`codec/dictionary.rs` has why), and the objects written with
//! it. Such an object is a recompressed one (its entry says so, as for a zstd frame) whose
//! first byte is [`DICT_MARK`], a byte no zstd frame starts with (a frame's first byte is
//! its magic number's, 0x28), followed by an LZ4 block that decodes with the dictionary as
//! the bytes before the page.
//!
//! A store's dictionary is set once and never changes while it lives (a takeover included:
//! the caller keeps it where the store's memory is kept and sets it again before serving),
//! because every object written with it needs it to decode. Set it only after it is kept
//! there: a page may be written with it as soon as it is set. A store that had one and
//! cannot get it back is told so ([`PageStore::lose_dictionary`]): it never takes another,
//! its pages written with the lost one fail their reads (they are I/O errors, never other
//! data), and the rest read as before.
//!
//! Without checksums, a block decoded with another dictionary than its own could decode to
//! other bytes with nothing to tell; so a store without checksums takes no dictionary.

use std::sync::OnceLock;

use super::recompress::Held;
use super::tier::{Candidates, Priority};
use super::{read_lock, try_vec, PageStore, Slot};
use crate::codec::{Lz4Codec, PageCodec, MAX_DICTIONARY_BYTES};
use crate::page::{same_filled_word, PAGE_SIZE};
use crate::CoreError;

/// Objects the sampling copies out under one raise of its thread ([`Held`]): a raise and its
/// lowering are two system calls, about what copying out a few pages costs.
pub(super) const SAMPLE_BATCH: usize = 32;
/// Look-ups of the sampling's count under one raise.
const COUNT_RUN: u64 = 4096;

/// The first byte of an object written with the store's dictionary.
pub(crate) const DICT_MARK: u8 = 0xd1;

/// The store's dictionary, once set or lost.
#[derive(Debug, Default)]
pub(crate) struct Dictionary(OnceLock<Option<Box<[u8]>>>);

impl Dictionary {
    fn bytes(&self) -> Option<&[u8]> {
        self.0.get().and_then(|d| d.as_deref())
    }
}

impl PageStore {
    /// Sets the dictionary pages are recompressed with (at most
    /// [`MAX_DICTIONARY_BYTES`]); once per store. Setting the same bytes again is a no-op;
    /// other bytes, or any after [`PageStore::lose_dictionary`], are refused.
    pub fn set_dictionary(&self, dict: &[u8]) -> Result<(), CoreError> {
        if !self.checksums {
            return Err(CoreError::Config(
                "a recompression dictionary needs a store with checksums (checksums = on)".into(),
            ));
        }
        if dict.is_empty() || dict.len() > MAX_DICTIONARY_BYTES {
            return Err(CoreError::Config(format!(
                "a recompression dictionary of {} bytes: 1 to {MAX_DICTIONARY_BYTES}",
                dict.len()
            )));
        }
        let set = self.dictionary.0.get_or_init(|| Some(dict.into()));
        match set {
            Some(d) if **d == *dict => Ok(()),
            Some(_) => Err(CoreError::Config(
                "the store already has another recompression dictionary".into(),
            )),
            None => Err(CoreError::Config(
                "the store's recompression dictionary was lost; it takes no other".into(),
            )),
        }
    }

    /// The store's dictionary, if it has one.
    pub fn dictionary(&self) -> Option<&[u8]> {
        self.dictionary.bytes()
    }

    /// Tells a store that had a dictionary (a taken-over one) that it is gone: see the
    /// module docs. Returns false if it already has one (which it keeps).
    pub fn lose_dictionary(&self) -> bool {
        self.dictionary.0.get_or_init(|| None).is_none()
    }

    /// Whether the store can take a dictionary now (it has none and never lost one).
    pub fn may_take_dictionary(&self) -> bool {
        self.checksums && self.dictionary.0.get().is_none()
    }

    /// Up to `max_pages` pages that a pass would take (`candidates`, at least `threshold`
    /// stored bytes), spread over the device, decoded and checked, one after another: what
    /// a dictionary is trained on. Raw (huge), same-filled and recompressed pages are left
    /// out: a dictionary is for the pages LZ4 compresses. With `priority`, the calling
    /// thread is raised while it looks pages up, as a pass's is ([`Recompress::priority`]):
    /// it copies a batch of objects out raised and decodes them at its own priority.
    ///
    /// [`Recompress::priority`]: super::Recompress::priority
    pub fn dictionary_samples(
        &self,
        candidates: Candidates,
        threshold: usize,
        max_pages: usize,
        priority: Option<&dyn Priority>,
    ) -> Result<Vec<u8>, CoreError> {
        // Which pages qualify, and how many: the stride spreads the samples over them
        // (counting all stored pages instead would take too few where most are zero or
        // young).
        let qualifies = |index: u64, shard: &super::shard::Shard, idx: u64| match shard.get(idx) {
            Some(Slot::Stored {
                handle,
                len,
                recompressed: false,
            }) => {
                let len = usize::from(len);
                let idle = match candidates {
                    Candidates::Idle { min_age } => self.ages.age(index) >= min_age,
                    Candidates::Huge | Candidates::HugeIdle { .. } => true,
                };
                (len < PAGE_SIZE && len >= threshold && idle).then_some((handle, len))
            }
            _ => None,
        };
        let held = Held::new(priority);
        // The count does nothing between two look-ups: one raise for a run of them, as a
        // pass's look-ups of pages it skips share one; lowered between runs, so that a large
        // device's count is not one long stretch at the I/O path's priority.
        let mut qualifying = 0u64;
        for index in 0..self.pages {
            if index % COUNT_RUN == 0 {
                held.work();
                held.locks();
            }
            let (shard, idx) = self.locate(index);
            if qualifies(index, &read_lock(shard), idx).is_some() {
                qualifying += 1;
            }
        }
        let stride = (qualifying / max_pages.max(1) as u64).max(1);
        let mut out = try_vec(max_pages.min(qualifying as usize) * PAGE_SIZE)?;
        let mut objects = try_vec(SAMPLE_BATCH * PAGE_SIZE)?;
        objects.resize(SAMPLE_BATCH * PAGE_SIZE, 0u8);
        // Each copied object's page, length and checksum.
        let mut copied = [(0u64, 0usize, 0u32); SAMPLE_BATCH];
        let mut page = [0u8; PAGE_SIZE];
        let mut seen = 0u64;
        let mut index = 0;
        while index < self.pages && out.len() < max_pages * PAGE_SIZE {
            // No more copied than still wanted: the pages taken are those a look-up at a
            // time would take.
            let want = SAMPLE_BATCH.min(max_pages - out.len() / PAGE_SIZE);
            let mut n = 0;
            held.locks();
            while index < self.pages && n < want {
                let (shard, idx) = self.locate(index);
                let shard = read_lock(shard);
                let Some((handle, len)) = qualifies(index, &shard, idx) else {
                    index += 1;
                    continue;
                };
                seen += 1;
                if (seen - 1).is_multiple_of(stride) {
                    let object = &mut objects[n * PAGE_SIZE..][..len];
                    if let Some(checksum) = self.load_stored(index, handle, len, object) {
                        copied[n] = (index, len, checksum);
                        n += 1;
                    }
                }
                index += 1;
            }
            held.work();
            for (k, &(index, len, checksum)) in copied[..n].iter().enumerate() {
                let object = &objects[k * PAGE_SIZE..][..len];
                if self.decode(index, object, false, &mut page).is_err()
                    || (self.checksums && self.checksum_of(&page) != checksum)
                    || same_filled_word(&page).is_some()
                {
                    continue;
                }
                out.extend_from_slice(&page);
            }
        }
        Ok(out)
    }

    /// Decodes a recompressed object `body` of page `index`: with the dictionary after
    /// [`DICT_MARK`], else as a zstd frame with `zstd`.
    pub(crate) fn decode_recompressed(
        &self,
        index: u64,
        body: &[u8],
        zstd: &mut dyn PageCodec,
        page: &mut [u8; PAGE_SIZE],
    ) -> Result<(), CoreError> {
        let corrupt = |source| CoreError::Corrupt { index, source };
        match body.split_first() {
            Some((&DICT_MARK, block)) => match self.dictionary.bytes() {
                Some(dict) => Lz4Codec::decompress_with_dict(block, dict, page).map_err(corrupt),
                None => Err(super::corrupt(
                    index,
                    "it was recompressed with the device's dictionary, which this store does \
                     not have",
                )),
            },
            _ => zstd.decompress(body, page).map_err(corrupt),
        }
    }
}
