//! A vector of fixed-size chunks: grown a chunk at a time, never by doubling one vector of
//! everything, so that what one more chunk costs is known (and small) when the arena checks
//! its limit before it grows.

/// Items `0..len()`, in boxed chunks of `N`.
#[derive(Debug)]
pub(super) struct Chunked<T, const N: usize> {
    chunks: Vec<Box<[T]>>,
}

impl<T, const N: usize> Default for Chunked<T, N> {
    fn default() -> Self {
        Self { chunks: Vec::new() }
    }
}

impl<T, const N: usize> Chunked<T, N> {
    /// Items the chunks hold.
    pub(super) fn len(&self) -> usize {
        self.chunks.len() * N
    }

    pub(super) fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i / N)?.get(i % N)
    }

    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.chunks.get_mut(i / N)?.get_mut(i % N)
    }

    /// Adds a chunk, item `i` of it made by `item(i)` (`i` counted from the first chunk);
    /// false, changing nothing, without memory for it.
    pub(super) fn add_chunk(&mut self, item: impl FnMut(usize) -> T) -> bool {
        let first = self.len();
        let mut chunk = Vec::new();
        if self.chunks.try_reserve(1).is_err() || chunk.try_reserve_exact(N).is_err() {
            return false;
        }
        chunk.extend((first..first + N).map(item));
        self.chunks.push(chunk.into_boxed_slice());
        true
    }

    /// Memory the chunks take (not what their items own).
    pub(super) fn bytes(&self) -> usize {
        self.chunks.capacity() * std::mem::size_of::<Box<[T]>>()
            + self.len() * std::mem::size_of::<T>()
    }

    /// The most [`Chunked::bytes`] grows by with one more chunk.
    pub(super) fn chunk_growth_bytes(&self) -> usize {
        let top = if self.chunks.len() == self.chunks.capacity() {
            self.chunks.capacity().max(4) * std::mem::size_of::<Box<[T]>>()
        } else {
            0
        };
        top + N * std::mem::size_of::<T>()
    }

    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flat_map(|c| c.iter())
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.chunks.iter_mut().flat_map(|c| c.iter_mut())
    }
}
