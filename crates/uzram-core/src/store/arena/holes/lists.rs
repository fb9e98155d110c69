//! Lists of holes by class, in the arena's own memory: a pool of nodes, each naming a hole
//! and its neighbours on its list, so that a hole merged away leaves its list at once.

use super::super::{BITMAP_WORDS, CLASSES};
use super::chunked::Chunked;

/// No node: the end of a list, or a hole on none.
pub(super) const NO_NODE: u32 = u32::MAX;
/// Nodes added at once when the pool runs out.
const NODE_CHUNK: usize = 64;
/// Bytes a node takes.
pub(super) const NODE_BYTES: usize = std::mem::size_of::<Node>();
/// Bytes a chunk of nodes takes.
#[cfg(test)]
pub(super) const CHUNK_BYTES: usize = NODE_CHUNK * NODE_BYTES;

/// A hole on a list: where it starts, and its neighbours on the list.
#[derive(Debug, Clone, Copy)]
struct Node {
    at: u64,
    next: u32,
    prev: u32,
}

const EMPTY: Node = Node {
    at: 0,
    next: NO_NODE,
    prev: NO_NODE,
};

/// See the module docs.
#[derive(Debug)]
pub(super) struct Lists {
    /// Per list: its first node.
    heads: [u32; CLASSES],
    /// Bit `c` set when list `c` is not empty.
    nonempty: [u64; BITMAP_WORDS],
    /// The nodes, in chunks of [`NODE_CHUNK`].
    chunks: Chunked<Node, NODE_CHUNK>,
    /// The first unused node (chained through `next`).
    spare: u32,
}

impl Lists {
    pub(super) fn new() -> Self {
        Self {
            heads: [NO_NODE; CLASSES],
            nonempty: [0; BITMAP_WORDS],
            chunks: Chunked::default(),
            spare: NO_NODE,
        }
    }

    /// Memory the nodes take.
    pub(super) fn bytes(&self) -> usize {
        self.chunks.bytes()
    }

    /// The most [`Lists::bytes`] grows by when [`Lists::reserve`] is asked for `nodes`.
    pub(super) fn growth_bytes(&self, nodes: usize) -> usize {
        if nodes <= self.chunks.len() {
            return 0;
        }
        self.chunks.chunk_growth_bytes()
    }

    /// Makes the pool hold at least `nodes` nodes (best effort).
    pub(super) fn reserve(&mut self, nodes: usize) {
        while self.chunks.len() < nodes && self.add_chunk() {}
    }

    /// Empties every list, keeping the nodes.
    pub(super) fn forget(&mut self) {
        self.heads = [NO_NODE; CLASSES];
        self.nonempty = [0; BITMAP_WORDS];
        let len = self.chunks.len();
        for (i, node) in self.chunks.iter_mut().enumerate() {
            *node = Node {
                next: if i + 1 < len { (i + 1) as u32 } else { NO_NODE },
                ..EMPTY
            };
        }
        self.spare = if len > 0 { 0 } else { NO_NODE };
    }

    /// Adds a chunk of nodes to the pool, all spare.
    fn add_chunk(&mut self) -> bool {
        let first = self.chunks.len();
        let spare = self.spare;
        if first + NODE_CHUNK > NO_NODE as usize
            || !self.chunks.add_chunk(|i| Node {
                next: if i + 1 < first + NODE_CHUNK {
                    (i + 1) as u32
                } else {
                    spare
                },
                ..EMPTY
            })
        {
            return false;
        }
        self.spare = first as u32;
        true
    }

    fn node(&self, n: u32) -> Option<&Node> {
        self.chunks.get(n as usize)
    }

    fn node_mut(&mut self, n: u32) -> Option<&mut Node> {
        self.chunks.get_mut(n as usize)
    }

    /// Puts the hole at `at` first on `list`; its node, or [`NO_NODE`] when the pool is out
    /// of nodes and has no memory for more (the hole is then on no list).
    pub(super) fn push(&mut self, list: usize, at: u64) -> u32 {
        if self.spare == NO_NODE && !self.add_chunk() {
            return NO_NODE;
        }
        let n = self.spare;
        let old = self.heads[list];
        let Some(node) = self.node_mut(n) else {
            return NO_NODE;
        };
        let spare = node.next;
        *node = Node {
            at,
            next: old,
            prev: NO_NODE,
        };
        self.spare = spare;
        if let Some(old) = self.node_mut(old) {
            old.prev = n;
        }
        self.heads[list] = n;
        self.nonempty[list / 64] |= 1 << (list % 64);
        n
    }

    /// Takes node `n` off `list` and back to the pool.
    pub(super) fn unlink(&mut self, list: usize, n: u32) {
        let Some(&Node { next, prev, .. }) = self.node(n) else {
            return;
        };
        match self.node_mut(prev) {
            Some(p) => p.next = next,
            None => {
                self.heads[list] = next;
                if next == NO_NODE {
                    self.nonempty[list / 64] &= !(1 << (list % 64));
                }
            }
        }
        if let Some(nx) = self.node_mut(next) {
            nx.prev = prev;
        }
        let spare = self.spare;
        if let Some(node) = self.node_mut(n) {
            *node = Node {
                next: spare,
                ..EMPTY
            };
        }
        self.spare = n;
    }

    /// The first node on `list` and its hole's start.
    pub(super) fn first(&self, list: usize) -> Option<(u32, u64)> {
        let n = self.heads[list];
        Some((n, self.node(n)?.at))
    }

    /// The smallest class above `class` whose list is not empty.
    pub(super) fn larger(&self, class: usize) -> Option<usize> {
        let start = class + 1;
        let mut word = start / 64;
        let mut bits = self.nonempty.get(word)? & (!0u64 << (start % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            bits = *self.nonempty.get(word)?;
        }
    }

    /// Every list's holes, first to last, and whether each node's back link holds.
    #[cfg(test)]
    pub(super) fn walk(&self, list: usize) -> Result<Vec<(u32, u64)>, String> {
        let mut out = Vec::new();
        let (mut n, mut prev) = (self.heads[list], NO_NODE);
        while let Some(node) = self.node(n) {
            if node.prev != prev {
                return Err(format!("node {n} on list {list}: its back link is wrong"));
            }
            out.push((n, node.at));
            if out.len() > self.chunks.len() {
                return Err(format!("list {list} has a cycle"));
            }
            (prev, n) = (n, node.next);
        }
        let bit = self.nonempty[list / 64] >> (list % 64) & 1 == 1;
        if bit == out.is_empty() {
            return Err(format!("list {list}'s bit is wrong"));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn starts(lists: &Lists, list: usize) -> Vec<u64> {
        lists
            .walk(list)
            .unwrap()
            .into_iter()
            .map(|(_, at)| at)
            .collect()
    }

    #[test]
    fn holes_leave_their_list_from_anywhere_and_their_nodes_are_used_again() {
        let mut lists = Lists::new();
        let nodes: Vec<u32> = (0..5).map(|i| lists.push(7, i * 64)).collect();
        assert_eq!(starts(&lists, 7), [256, 192, 128, 64, 0]);
        lists.unlink(7, nodes[2]);
        lists.unlink(7, nodes[4]);
        lists.unlink(7, nodes[0]);
        assert_eq!(starts(&lists, 7), [192, 64]);
        assert_eq!(lists.first(7), Some((nodes[3], 192)));
        assert_eq!(lists.larger(3), Some(7));
        assert_eq!(lists.larger(7), None);
        // The pool's first chunk serves every push: nodes given back are taken again.
        for i in 0..(3 * NODE_CHUNK as u64) {
            let n = lists.push(9, i);
            lists.unlink(9, n);
        }
        assert_eq!(lists.chunks.len(), NODE_CHUNK);
        assert_eq!(starts(&lists, 9), Vec::<u64>::new());
        lists.unlink(7, nodes[1]);
        lists.unlink(7, nodes[3]);
        assert_eq!(lists.first(7), None);
        assert_eq!(lists.larger(3), None);
    }

    #[test]
    fn forgetting_empties_every_list_and_keeps_the_nodes() {
        let mut lists = Lists::new();
        for i in 0..(NODE_CHUNK as u64 + 1) {
            lists.push((i % 5) as usize + 2, i * 8);
        }
        assert_eq!(lists.chunks.len(), 2 * NODE_CHUNK);
        lists.forget();
        for list in 0..CLASSES {
            assert_eq!(lists.walk(list).unwrap(), []);
        }
        for i in 0..(2 * NODE_CHUNK as u64) {
            assert_ne!(lists.push(3, i), NO_NODE);
        }
        assert_eq!(lists.chunks.len(), 2 * NODE_CHUNK);
    }
}
