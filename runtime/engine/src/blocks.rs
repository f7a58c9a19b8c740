//! The KV block pool as the scheduler sees it: which blocks are free, which sequences hold each
//! block, and the prefix cache (vLLM's automatic prefix caching, by block).
//!
//! A full block (all [`KV_BLOCK`] positions written) is registered under the key (its
//! predecessor's key, its tokens): the key names the whole prefix up to the block's end, because
//! the KV entries of a position depend on every token before it. A new sequence walks its prompt's
//! full blocks and takes every registered one in a row (`lookup`); it then writes only into blocks
//! of its own, so a shared block is never written while others read it.
//!
//! States of a block: held (`refs > 0`), cached (unheld, registered: evictable, least recently
//! released first) or free (unheld, unregistered). `alloc` takes a free block, else evicts the
//! least recently released cached one.
//!
//! Invariants: every block is in exactly one state; `available()` is what `alloc` can still hand
//! out; a registered block's key is unique (a second block with the same contents stays
//! unregistered); keys compare the tokens exactly (no hash collision can share wrong entries).

use metrale_backend::KV_BLOCK;
use std::collections::{BTreeMap, HashMap};

/// Key of a full block: the previous block's key and this block's tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockKey {
    parent: u64,
    tokens: [u32; KV_BLOCK],
}

impl BlockKey {
    /// The key of a block holding `tokens` (exactly `KV_BLOCK`) after the prefix whose last block
    /// has key id `parent` (0 for the first block).
    pub fn new(parent: u64, tokens: &[u32]) -> BlockKey {
        let mut t = [0u32; KV_BLOCK];
        t.copy_from_slice(tokens);
        BlockKey { parent, tokens: t }
    }

    /// A 64-bit id of the key, used as the next block's `parent` (never 0).
    pub fn id(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        // DefaultHasher::new() has fixed keys: the same id in every process
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.hash(&mut h);
        h.finish() | 1
    }
}

/// The pool (see the module docs).
#[derive(Debug)]
pub struct BlockPool {
    refs: Vec<u32>,
    free: Vec<u32>,
    /// Unheld registered blocks by release stamp (oldest first) and each one's stamp.
    cached: BTreeMap<u64, u32>,
    stamp_of: Vec<u64>,
    stamp: u64,
    key_of: Vec<Option<BlockKey>>,
    by_key: HashMap<BlockKey, u32>,
}

impl BlockPool {
    pub fn new(blocks: usize) -> BlockPool {
        BlockPool {
            refs: vec![0; blocks],
            free: (0..blocks as u32).rev().collect(),
            cached: BTreeMap::new(),
            stamp_of: vec![0; blocks],
            stamp: 0,
            key_of: vec![None; blocks],
            by_key: HashMap::new(),
        }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks `alloc` can hand out now (free + cached).
    pub fn available(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    /// Blocks some sequence holds.
    pub fn held(&self) -> usize {
        self.total() - self.available()
    }

    /// A block for one holder: a free one, else the least recently released cached one (its
    /// registration dropped). `None` when every block is held.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.cached.pop_first()?;
                if let Some(k) = self.key_of[b as usize].take() {
                    self.by_key.remove(&k);
                }
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// One more holder of `b` (a cached block is taken out of the evictable set).
    pub fn acquire(&mut self, b: u32) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.cached.remove(&self.stamp_of[i]);
        }
        self.refs[i] += 1;
    }

    /// One holder fewer: an unheld block becomes cached (registered) or free.
    pub fn release(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.refs[i] > 0, "block {b} released more often than held");
        self.refs[i] = self.refs[i].saturating_sub(1);
        if self.refs[i] == 0 {
            if self.key_of[i].is_some() {
                self.stamp += 1;
                self.stamp_of[i] = self.stamp;
                self.cached.insert(self.stamp, b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Register held block `b` as holding `key` (its positions are all written). A key already
    /// registered (another block with the same prefix) leaves `b` unregistered.
    pub fn register(&mut self, b: u32, key: BlockKey) {
        if self.key_of[b as usize].is_some() || self.by_key.contains_key(&key) {
            return;
        }
        self.by_key.insert(key.clone(), b);
        self.key_of[b as usize] = Some(key);
    }

    /// The registered blocks holding `tokens`' first full blocks, in order, at most `max_blocks`:
    /// each is acquired for the caller. Also returns each taken block's key id.
    pub fn lookup(&mut self, tokens: &[u32], max_blocks: usize) -> (Vec<u32>, Vec<u64>) {
        let mut blocks = Vec::new();
        let mut ids = Vec::new();
        let mut parent = 0u64;
        for chunk in tokens.chunks_exact(KV_BLOCK).take(max_blocks) {
            let key = BlockKey::new(parent, chunk);
            let Some(&b) = self.by_key.get(&key) else {
                break;
            };
            self.acquire(b);
            parent = key.id();
            blocks.push(b);
            ids.push(parent);
        }
        (blocks, ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(start: u32) -> Vec<u32> {
        (start..start + 3 * KV_BLOCK as u32).collect()
    }

    #[test]
    fn states_and_eviction_order() {
        let mut p = BlockPool::new(4);
        let a = p.alloc().unwrap();
        let b = p.alloc().unwrap();
        assert_eq!(p.available(), 2);
        let t = toks(0);
        let ka = BlockKey::new(0, &t[..KV_BLOCK]);
        let kb = BlockKey::new(ka.id(), &t[KV_BLOCK..2 * KV_BLOCK]);
        p.register(a, ka.clone());
        p.register(b, kb);
        p.release(b);
        p.release(a);
        // both cached, still available; b was released first so it is evicted first
        assert_eq!(p.available(), 4);
        let (got, _) = p.lookup(&t, 3);
        assert_eq!(got, vec![a, b]);
        assert_eq!(p.available(), 2);
        p.release(a);
        p.release(b);
        let _c = p.alloc().unwrap();
        let _d = p.alloc().unwrap();
        let e = p.alloc().unwrap();
        assert_eq!(e, a, "a was released first the second time");
        // a's registration is gone: the prefix no longer matches from the first block
        assert_eq!(p.lookup(&t, 3).0, Vec::<u32>::new());
        let f = p.alloc().unwrap();
        assert_eq!(f, b);
        assert_eq!(p.alloc(), None);
        assert_eq!(p.held(), 4);
    }

    #[test]
    fn keys_chain_and_duplicates_stay_unregistered() {
        let mut p = BlockPool::new(4);
        let t = toks(100);
        let k0 = BlockKey::new(0, &t[..KV_BLOCK]);
        // the same tokens after another prefix are another key
        assert_ne!(BlockKey::new(7, &t[..KV_BLOCK]), k0);
        let a = p.alloc().unwrap();
        let dup = p.alloc().unwrap();
        p.register(a, k0.clone());
        p.register(dup, k0);
        p.release(dup);
        assert_eq!(
            p.available(),
            3,
            "the duplicate went back to free, not cached"
        );
        // a lookup limited to 0 blocks takes nothing
        assert!(p.lookup(&t, 0).0.is_empty());
        let (got, ids) = p.lookup(&t, 3);
        assert_eq!((got.len(), ids.len()), (1, 1));
        assert_eq!(p.total(), 4);
    }
}
