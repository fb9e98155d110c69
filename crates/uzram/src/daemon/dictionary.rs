//! The store's recompression dictionary in the daemon (`uzram_core::store` has what it is):
//! trained at the first pass of the `lz4-gpu-dict` recompressor that finds enough idle pages,
//! kept in the store segment (`takeover/dictionary.rs`) before the store takes it, and given
//! back to the store by a takeover before the device serves.

use uzram_core::codec::{train_dictionary, MAX_DICTIONARY_BYTES};
use uzram_core::store::{Candidates, Priority};
use uzram_core::{CoreError, PageStore};

use crate::takeover::dictionary::KeptDictionary;
use crate::takeover::store_segment::StoreSegment;

/// Pages a dictionary is trained on (16 MiB), spread over the device.
const SAMPLE_PAGES: usize = 4096;
/// Fewest idle pages a dictionary is trained on: it is the device's for good, so one
/// learned from a handful of pages would cost every page recompressed after.
pub const MIN_SAMPLE_PAGES: usize = 1024;

/// Gives a taken-over store the dictionary its region keeps; a damaged one is never used:
/// the store is told it is lost.
pub fn restore(store: &PageStore, region: &StoreSegment) {
    let lost = |why: &str| {
        tracing::error!(
            why,
            "the store's recompression dictionary is damaged: pages recompressed with it fail \
             their reads until they are written again, and the device recompresses no more \
             pages with a dictionary"
        );
        store.lose_dictionary();
    };
    let area = region.dictionary_area();
    match area.read() {
        Ok(None) => {}
        Ok(Some(dict)) => match store.set_dictionary(&dict) {
            Ok(()) => {
                area.confirm();
                tracing::info!(bytes = dict.len(), "recompression dictionary taken over");
            }
            Err(e) => lost(&e.to_string()),
        },
        Err(why) => lost(&why),
    }
}

/// The dictionary a pass over `candidates` (at least `threshold` stored bytes) uses: the
/// store's, or one trained now on its pages, kept in `keep` (when the store lives in a
/// region) and then set. `None` while fewer than [`MIN_SAMPLE_PAGES`] pages qualify.
/// `priority` raises the thread while the sampling takes the store's locks, as it does a
/// pass's (`Recompress::priority`): the tier thread runs at nice 19, and one preempted
/// under a shard's lock stalls the writers. The training runs at the thread's own.
pub fn for_pass(
    store: &PageStore,
    candidates: Candidates,
    threshold: usize,
    keep: Option<KeptDictionary>,
    priority: Option<&dyn Priority>,
) -> Result<Option<Vec<u8>>, CoreError> {
    if let Some(dict) = store.dictionary() {
        return Ok(Some(dict.to_vec()));
    }
    if !store.may_take_dictionary() {
        return Err(CoreError::Config(
            "the store's recompression dictionary was lost (damaged in its segment): \
             lz4-gpu-dict cannot recompress more pages; recreate the device to start over"
                .into(),
        ));
    }
    let samples = store.dictionary_samples(candidates, threshold, SAMPLE_PAGES, priority)?;
    if samples.len() < MIN_SAMPLE_PAGES * uzram_core::PAGE_SIZE {
        tracing::debug!(
            sample_pages = samples.len() / uzram_core::PAGE_SIZE,
            need = MIN_SAMPLE_PAGES,
            "too few idle pages to train the recompression dictionary on yet"
        );
        return Ok(None);
    }
    let dict = train_dictionary(&samples, MAX_DICTIONARY_BYTES).map_err(CoreError::Compress)?;
    if let Some(area) = keep {
        area.keep(&dict).map_err(CoreError::Config)?;
    }
    store.set_dictionary(&dict)?;
    tracing::info!(
        bytes = dict.len(),
        sample_pages = samples.len() / uzram_core::PAGE_SIZE,
        "recompression dictionary trained on the device's idle pages"
    );
    Ok(Some(dict))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use uzram_core::codec::Algorithm;
    use uzram_core::StoreConfig;

    use super::*;
    use crate::footprint::{Sizes, MIN_ROOM};
    use crate::takeover::store_segment;

    fn store() -> PageStore {
        PageStore::new(StoreConfig::new(16, Algorithm::Lz4)).unwrap()
    }

    /// A takeover gives the store the dictionary its region keeps, and never a damaged one:
    /// the store is then told it is lost and takes no other.
    #[test]
    fn a_takeover_gives_back_the_kept_dictionary_and_never_a_damaged_one() {
        let region =
            match StoreSegment::create(Sizes::of(16, MIN_ROOM).unwrap(), "lz4", true, 9, true) {
                Ok(r) => r,
                Err(e) => {
                    println!("SKIP: {e}");
                    return;
                }
            };
        let none = store();
        restore(&none, &region);
        assert!(none.dictionary().is_none() && none.may_take_dictionary());
        let dict: Vec<u8> = (0..5000u32).map(|i| (i % 253) as u8).collect();
        region.dictionary_area().keep(&dict).unwrap();
        let kept = store();
        restore(&kept, &region);
        assert_eq!(kept.dictionary(), Some(&dict[..]));
        // Its tag gone: damaged, not absent.
        region.dictionary_area().words()[0].store(0, Ordering::Relaxed);
        let damaged = store();
        restore(&damaged, &region);
        assert!(damaged.dictionary().is_none());
        assert!(
            !damaged.may_take_dictionary(),
            "a new dictionary over the lost one"
        );
        store_segment::remove(region.id());
    }

    /// Checks that it is used in pairs; counts its raises.
    #[derive(Debug, Default)]
    struct Counted {
        raised: std::cell::Cell<bool>,
        raises: std::cell::Cell<u64>,
    }

    impl Priority for Counted {
        fn raise(&self) {
            assert!(!self.raised.replace(true), "raised twice");
            self.raises.set(self.raises.get() + 1);
        }

        fn lower(&self) {
            assert!(self.raised.replace(false), "lowered unraised");
        }
    }

    /// The sampling for a dictionary runs raised by the priority it is given, once a batch
    /// of pages, and ends lowered (uzram-core's `dictionary_tests` check that it takes
    /// every lock raised); a store that has its dictionary takes no lock for it.
    #[test]
    fn the_sampling_runs_raised_by_the_priority_given_and_ends_lowered() {
        let pages = 256;
        let store = PageStore::new(StoreConfig::new(pages, Algorithm::Lz4)).unwrap();
        let text: Vec<u8> = (0..pages as usize * uzram_core::PAGE_SIZE)
            .map(|i| b"cold sample "[i % 12] ^ (i / 4096) as u8)
            .collect();
        store.write(0, &text).unwrap();
        store.mark_idle(None);
        let idle = Candidates::Idle { min_age: 0 };
        let counted = Counted::default();
        let dict = for_pass(&store, idle, 0, None, Some(&counted)).unwrap();
        assert!(dict.is_none(), "a dictionary from {pages} pages");
        let raises = counted.raises.get();
        assert!(
            (1..=pages.div_ceil(32) + 1).contains(&raises),
            "{raises} raises sampling {pages} pages"
        );
        assert!(!counted.raised.get(), "the sampling ended raised");
        let dict: Vec<u8> = (0..5000u32).map(|i| (i % 253) as u8).collect();
        store.set_dictionary(&dict).unwrap();
        let had = for_pass(&store, idle, 0, None, Some(&counted)).unwrap();
        assert_eq!(had, Some(dict));
        assert_eq!(
            counted.raises.get(),
            raises,
            "raised for a dictionary it had"
        );
    }
}
