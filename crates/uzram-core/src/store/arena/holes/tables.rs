//! Per segment, where its holes are: a private table of (first granule, granules, list
//! node), sorted.

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
/// chunk at most, never a doubling of one vector of them all, so the memory it takes is
/// bounded when the arena checks its limit before growing ([`Holes::growth_bytes`]).
#[derive(Debug, Default)]
pub(super) struct Tables {
    pub(super) chunks: Vec<Box<[Vec<Run>]>>,
}

pub(super) const TABLE_CHUNK: usize = 64;
impl Tables {
    pub(super) fn get(&self, seg: usize) -> Option<&Vec<Run>> {
        self.chunks.get(seg / TABLE_CHUNK)?.get(seg % TABLE_CHUNK)
    }

    pub(super) fn get_mut(&mut self, seg: usize) -> Option<&mut Vec<Run>> {
        self.chunks
            .get_mut(seg / TABLE_CHUNK)?
            .get_mut(seg % TABLE_CHUNK)
    }

    /// Makes room for segment `seg`'s table.
    pub(super) fn reach(&mut self, seg: usize) -> Result<(), NotFreed> {
        while self.chunks.len() <= seg / TABLE_CHUNK {
            self.chunks.try_reserve(1).map_err(|_| NotFreed::NoMemory)?;
            let mut chunk = Vec::new();
            chunk
                .try_reserve_exact(TABLE_CHUNK)
                .map_err(|_| NotFreed::NoMemory)?;
            chunk.resize_with(TABLE_CHUNK, Vec::new);
            self.chunks.push(chunk.into_boxed_slice());
        }
        Ok(())
    }

    /// Memory the chunks take (not the tables in them).
    pub(super) fn bytes(&self) -> usize {
        self.chunks.capacity() * std::mem::size_of::<Box<[Vec<Run>]>>()
            + self.chunks.len() * TABLE_CHUNK * std::mem::size_of::<Vec<Run>>()
    }

    /// The most [`Tables::bytes`] grows by when segment `seg` gets its table.
    pub(super) fn growth_bytes(&self, seg: usize) -> usize {
        if seg / TABLE_CHUNK < self.chunks.len() {
            return 0;
        }
        let top = if self.chunks.len() == self.chunks.capacity() {
            self.chunks.capacity().max(4) * std::mem::size_of::<Box<[Vec<Run>]>>()
        } else {
            0
        };
        top + TABLE_CHUNK * std::mem::size_of::<Vec<Run>>()
    }

    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Vec<Run>)> {
        self.chunks.iter().flat_map(|c| c.iter()).enumerate()
    }
}
