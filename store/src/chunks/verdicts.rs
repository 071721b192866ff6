//! [`DeltaVerdicts`]: which regions rest from delta tries after a delta that did not pay.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::id::ChunkId;

/// Saves for which a chunk whose delta did not pay is not tried again (its successors at the
/// same region are stored plain without reading a base), before the next try.
const DELTA_SKIP_SAVES: u8 = 3;

/// Verdicts carried from a chunk to the chunk that replaces it at the same region in the next
/// save: a chunk present here with `n` is the base of a region whose delta did not pay, and the
/// next `n` saves of that region do not try one. Keyed by the chunk id, so no region names are
/// needed: the next save finds its base's id in it. Bounded: cleared when it grows past
/// [`DELTA_VERDICTS_MAX`] (a forgotten verdict costs one try).
#[derive(Debug, Default)]
pub(super) struct DeltaVerdicts(Mutex<HashMap<ChunkId, u8>>);

const DELTA_VERDICTS_MAX: usize = 1 << 20;

impl DeltaVerdicts {
    /// Whether a chunk on `base` should try a delta; `id` inherits the verdict.
    pub(super) fn try_on(&self, base: &ChunkId, id: &ChunkId) -> bool {
        let mut m = self.0.lock();
        match m.remove(base) {
            Some(n) if n > 0 => {
                m.insert(*id, n - 1);
                false
            }
            _ => true,
        }
    }

    /// Whether the next save of `id`'s region will not try a delta.
    pub(super) fn rests(&self, id: &ChunkId) -> bool {
        self.0.lock().get(id).is_some_and(|n| *n > 0)
    }

    /// `id`'s delta was tried and did not pay (or its base could not be read).
    pub(super) fn did_not_pay(&self, id: &ChunkId) {
        let mut m = self.0.lock();
        if m.len() >= DELTA_VERDICTS_MAX {
            m.clear();
        }
        m.insert(*id, DELTA_SKIP_SAVES);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_whose_delta_did_not_pay_rests_then_tries_again() {
        let v = DeltaVerdicts::default();
        let id = |n: u8| ChunkId::of(&[n]);
        // Save 1: chunk 1 on base 0 is tried and does not pay.
        assert!(v.try_on(&id(0), &id(1)));
        v.did_not_pay(&id(1));
        assert!(v.rests(&id(1)));
        // The next DELTA_SKIP_SAVES saves of that region do not try (nor keep a base).
        let mut last = 1;
        for n in 2..2 + DELTA_SKIP_SAVES {
            assert!(!v.try_on(&id(last), &id(n)), "save {n}");
            last = n;
        }
        assert!(
            !v.rests(&id(last)),
            "the save after the rest needs this base"
        );
        // Then it tries again; a chunk that paid leaves nothing behind.
        assert!(v.try_on(&id(last), &id(100)));
        assert!(v.0.lock().is_empty());
        // Other regions are not affected.
        v.did_not_pay(&id(1));
        assert!(v.try_on(&id(50), &id(51)));
    }
}
