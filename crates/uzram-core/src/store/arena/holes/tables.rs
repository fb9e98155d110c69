//! Per segment, where its holes are: a private table of (first granule, granules, list
//! node), sorted.

use super::chunked::Chunked;
use super::NotFreed;

/// A hole in a segment: its first granule and its granules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) start: u16,
    pub(super) len: u16,
    /// Its node on its list ([`super::lists::NO_NODE`]: on none).
    pub(super) node: u32,
}

impl Run {
    pub(super) fn end(self) -> usize {
        usize::from(self.start) + usize::from(self.len)
    }
}

/// Per segment, its holes, in chunks of [`TABLE_CHUNK`] segments: a segment more adds a
/// chunk at most ([`Holes::growth_bytes`](super::Holes::growth_bytes)).
#[derive(Debug, Default)]
pub(super) struct Tables {
    pub(super) chunks: Chunked<Vec<Run>, TABLE_CHUNK>,
}

pub(super) const TABLE_CHUNK: usize = 64;

impl Tables {
    pub(super) fn get(&self, seg: usize) -> Option<&Vec<Run>> {
        self.chunks.get(seg)
    }

    pub(super) fn get_mut(&mut self, seg: usize) -> Option<&mut Vec<Run>> {
        self.chunks.get_mut(seg)
    }

    /// Makes room for segment `seg`'s table.
    pub(super) fn reach(&mut self, seg: usize) -> Result<(), NotFreed> {
        while self.chunks.len() <= seg {
            if !self.chunks.add_chunk(|_| Vec::new()) {
                return Err(NotFreed::NoMemory);
            }
        }
        Ok(())
    }

    /// Memory the chunks take (not the tables in them).
    pub(super) fn bytes(&self) -> usize {
        self.chunks.bytes()
    }

    /// The most [`Tables::bytes`] grows by when segment `seg` gets its table.
    pub(super) fn growth_bytes(&self, seg: usize) -> usize {
        if seg < self.chunks.len() {
            return 0;
        }
        self.chunks.chunk_growth_bytes()
    }

    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Vec<Run>)> {
        self.chunks.iter().enumerate()
    }
}
