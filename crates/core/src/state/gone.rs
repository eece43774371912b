//! What is left of the calls the retention forgot, by id ([`GoneMap`]).
//!
//! The map sees an insert for every call the retention forgets, a removal for each that goes
//! later, and a look-up for every id an enqueue records: at the call path's full rate, hundreds of
//! thousands of entries. Hashed by the id's text, each of those was a probe of a random slot of a
//! table far larger than the caches (a miss, and its page's translation, each time): in a profile
//! of Kafka calls, the inserts alone were 3.3 % of ebb's CPU. But ebb's ids are `OWNER.UUID` with
//! a UUID v7, which grows with time: kept in order by owner and UUID, the calls forgotten now go
//! in at each owner's end of its tree, the oldest leave from its start, and an id being enqueued
//! is looked up beside them, all on paths the caches already hold (measured with 800,000 kept:
//! an insert, a removal and a look-up of a new id took 310 ns together, against 600 hashed). Any
//! other id (one a caller named) is hashed by its text as before.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::calls::Gone;
use crate::ids::{self, IdKey};

/// Forgotten calls by id: ebb's own ids (`OWNER.UUID` as [`ids::id_of`] writes them) by owner,
/// then in UUID order; any other id by its text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GoneMap {
    /// By owner (`""`: an id with none), then by UUID.
    by_owner: HashMap<Box<str>, BTreeMap<u128, Gone>, foldhash::fast::RandomState>,
    /// Every id that is not `OWNER.UUID` written as ebb writes it.
    other: HashMap<IdKey, Gone, foldhash::fast::RandomState>,
    len: usize,
}

/// An id as the map keeps it.
enum Key<'a> {
    /// The owner (`""` for none) and the UUID.
    Ours(&'a str, u128),
    Other(&'a str),
}

impl<'a> Key<'a> {
    fn of(id: &'a str) -> Self {
        match ids::id_parts(id) {
            Some((owner, uuid)) => Key::Ours(owner.unwrap_or(""), uuid.as_u128()),
            None => Key::Other(id),
        }
    }
}

impl GoneMap {
    /// How many forgotten calls are kept.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What is left of `id`, if it is kept.
    pub fn get(&self, id: &str) -> Option<&Gone> {
        match Key::of(id) {
            Key::Ours(owner, uuid) => {
                let tree = self.by_owner.get(owner)?;
                // An id newer than every forgotten one (as an enqueue's is) is not among them:
                // the tree's last key answers that down its right edge, with no search.
                if tree.last_key_value().is_none_or(|(last, _)| *last < uuid) {
                    return None;
                }
                tree.get(&uuid)
            }
            Key::Other(id) => self.other.get(id),
        }
    }

    /// Keeps what is left of `id`; what was kept of it before, if anything.
    pub fn insert(&mut self, id: &str, gone: Gone) -> Option<Gone> {
        let was = match Key::of(id) {
            Key::Ours(owner, uuid) => match self.by_owner.get_mut(owner) {
                Some(tree) => tree.insert(uuid, gone),
                None => {
                    self.by_owner
                        .insert(owner.into(), BTreeMap::from([(uuid, gone)]));
                    None
                }
            },
            Key::Other(id) => self.other.insert(IdKey::from(id), gone),
        };
        if was.is_none() {
            self.len += 1;
        }
        was
    }

    /// Forgets `id` for good; what was kept of it, if anything.
    pub fn remove(&mut self, id: &str) -> Option<Gone> {
        let was = match Key::of(id) {
            Key::Ours(owner, uuid) => {
                let tree = self.by_owner.get_mut(owner)?;
                let was = tree.remove(&uuid);
                if tree.is_empty() {
                    self.by_owner.remove(owner);
                }
                was
            }
            Key::Other(id) => self.other.remove(id),
        };
        if was.is_some() {
            self.len -= 1;
        }
        was
    }

    /// Every id kept (its text) and what is left of it, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (String, &Gone)> {
        let ours = self.by_owner.iter().flat_map(|(owner, tree)| {
            let owner = (!owner.is_empty()).then_some(&**owner);
            tree.iter()
                .map(move |(uuid, g)| (ids::id_of(owner, uuid::Uuid::from_u128(*uuid)), g))
        });
        ours.chain(self.other.iter().map(|(id, g)| (id.to_string(), g)))
    }
}

/// Written as a map from id to what is left, in id order (as the hashed map it replaced was:
/// a snapshot's bytes do not depend on how the map keeps them).
impl Serialize for GoneMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut all: Vec<(String, &Gone)> = self.iter().collect();
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        s.collect_map(all)
    }
}

impl<'de> Deserialize<'de> for GoneMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = GoneMap;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map from call id to what is left of the call")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<GoneMap, A::Error> {
                let mut map = GoneMap::default();
                while let Some((id, g)) = a.next_entry::<std::borrow::Cow<'de, str>, Gone>()? {
                    map.insert(&id, g);
                }
                Ok(map)
            }
        }
        d.deserialize_map(Entries)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::state::CallStatus;

    /// An id: ebb's own (a few owners, none among them, and a few UUIDs, so that ids repeat),
    /// the same in upper case, or any text.
    fn an_id() -> impl Strategy<Value = String> {
        let owner = proptest::option::of(prop_oneof!["ebb-0", "ebb-1", "ebb-10", "a.b"]);
        let ours = (owner, 0u128..6, any::<bool>()).prop_map(|(o, u, upper)| {
            let id = ids::id_of(o.as_deref(), uuid::Uuid::from_u128(u << 80 | 0x7000 << 64));
            if upper { id.to_ascii_uppercase() } else { id }
        });
        prop_oneof![3 => ours, 1 => "[a-z0-9.-]{0,8}", 1 => "[^\\x00]{0,40}"]
    }

    fn gone(ms: u64) -> Gone {
        Gone {
            status: CallStatus::Success,
            finished_at_ms: ms,
        }
    }

    proptest! {
        /// The map answers as a map of the ids' text does, whatever the ids, and is written
        /// exactly as that map (in id order) is, in MessagePack and JSON, and read back whole.
        #[test]
        fn it_is_a_map_of_the_ids_text(ops in proptest::collection::vec((0u8..3, an_id()), 0..60)) {
            let (mut map, mut model) = (GoneMap::default(), BTreeMap::new());
            for (n, (op, id)) in ops.into_iter().enumerate() {
                match op {
                    0 => prop_assert_eq!(map.insert(&id, gone(n as u64)), model.insert(id.clone(), gone(n as u64))),
                    1 => prop_assert_eq!(map.remove(&id), model.remove(&id)),
                    _ => prop_assert_eq!(map.get(&id), model.get(&id)),
                }
                prop_assert_eq!(map.len(), model.len());
                prop_assert_eq!(map.get(&id), model.get(&id));
            }
            let mut all: Vec<(String, Gone)> = map.iter().map(|(id, g)| (id, *g)).collect();
            all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            prop_assert_eq!(all, model.clone().into_iter().collect::<Vec<_>>());
            let packed = rmp_serde::to_vec(&map).expect("encodes");
            prop_assert_eq!(&packed, &rmp_serde::to_vec(&model).expect("encodes"));
            let back: GoneMap = rmp_serde::from_slice(&packed).expect("decodes");
            prop_assert_eq!(&back, &map);
            let json = serde_json::to_string(&map).expect("encodes");
            prop_assert_eq!(&json, &serde_json::to_string(&model).expect("encodes"));
            prop_assert_eq!(serde_json::from_str::<GoneMap>(&json).expect("decodes"), map);
        }
    }
}
