//! A map keyed by call id, kept in the ids' order where they are ebb's own ([`IdMap`]): what is
//! left of the calls the retention forgot is one.
//!
//! That map sees an insert for every call the retention forgets, a removal for each that goes
//! later, and a look-up for every id an enqueue records: at the call path's full rate, hundreds of
//! thousands of entries. Hashed by the id's text, each of those was a probe of a random slot of a
//! table far larger than the caches (a miss, and its page's translation, each time): in a profile
//! of Kafka calls, the inserts alone were 3.3 % of ebb's CPU. But ebb's ids are `OWNER.UUID` with
//! a UUID v7, which grows with time: kept in order by owner and UUID, the calls forgotten now go
//! in at each owner's end of its tree, the oldest leave from its start, and an id being enqueued
//! is looked up beside them, all on paths the caches already hold (measured with 800,000 kept:
//! an insert, a removal and a look-up of a new id took 260-280 ns together, against 605-610
//! hashed). Any other id (one a caller named) is hashed by its text.
//!
//! Not for the calls themselves: their map is smaller (the ended calls the retention keeps, and
//! those under way), each call is looked up more often than it goes in or out, and measured the
//! same way a B-tree's look-ups (a search down the tree, the id read each time) cost about twice
//! what the hashed map's did.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::ids::{self, IdKey};

/// Values by call id: ebb's own ids (`OWNER.UUID` as [`ids::id_of`] writes them) by owner, then
/// in UUID order; any other id by its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdMap<V> {
    /// By owner (`""`: an id with none), then by UUID. No owner's tree is empty.
    by_owner: HashMap<Box<str>, BTreeMap<u128, V>, foldhash::fast::RandomState>,
    /// Every id that is not `OWNER.UUID` written as ebb writes it.
    other: HashMap<IdKey, V, foldhash::fast::RandomState>,
    len: usize,
}

impl<V> Default for IdMap<V> {
    fn default() -> Self {
        Self {
            by_owner: HashMap::default(),
            other: HashMap::default(),
            len: 0,
        }
    }
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

impl<V> IdMap<V> {
    /// How many ids the map holds.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The value of `id`.
    pub fn get(&self, id: &str) -> Option<&V> {
        match Key::of(id) {
            Key::Ours(owner, uuid) => self.by_owner.get(owner)?.get(&uuid),
            Key::Other(id) => self.other.get(id),
        }
    }

    /// Sets the value of `id`; the value it had, if any.
    pub fn insert(&mut self, id: &str, value: V) -> Option<V> {
        let was = match Key::of(id) {
            Key::Ours(owner, uuid) => match self.by_owner.get_mut(owner) {
                Some(tree) => tree.insert(uuid, value),
                None => {
                    self.by_owner
                        .insert(owner.into(), BTreeMap::from([(uuid, value)]));
                    None
                }
            },
            Key::Other(id) => self.other.insert(IdKey::from(id), value),
        };
        if was.is_none() {
            self.len += 1;
        }
        was
    }

    /// Takes `id` out; its value, if the map held it.
    pub fn remove(&mut self, id: &str) -> Option<V> {
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

    /// Every id (its text) and its value, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (String, &V)> {
        let ours = self.by_owner.iter().flat_map(|(owner, tree)| {
            let owner = (!owner.is_empty()).then_some(&**owner);
            tree.iter()
                .map(move |(uuid, v)| (ids::id_of(owner, uuid::Uuid::from_u128(*uuid)), v))
        });
        ours.chain(self.other.iter().map(|(id, v)| (id.to_string(), v)))
    }
}

/// Written as a map from id to value, in id order (as the hashed maps it replaced were: a
/// snapshot's bytes do not depend on how the map keeps them).
impl<V: Serialize> Serialize for IdMap<V> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut all: Vec<(String, &V)> = self.iter().collect();
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        s.collect_map(all)
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for IdMap<V> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Entries<V> {
            type Value = IdMap<V>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map from call id to value")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<IdMap<V>, A::Error> {
                let mut map = IdMap::default();
                while let Some((id, v)) = a.next_entry::<std::borrow::Cow<'de, str>, V>()? {
                    map.insert(&id, v);
                }
                Ok(map)
            }
        }
        d.deserialize_map(Entries(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

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

    proptest! {
        /// The map answers as a map of the ids' text does, whatever the ids, and is written
        /// exactly as that map (in id order) is, in MessagePack and JSON, and read back whole.
        #[test]
        fn it_is_a_map_of_the_ids_text(ops in proptest::collection::vec((0u8..3, an_id()), 0..60)) {
            let (mut map, mut model) = (IdMap::<(u8, u64)>::default(), BTreeMap::new());
            for (n, (op, id)) in ops.into_iter().enumerate() {
                let v = (op, n as u64);
                match op {
                    0 => prop_assert_eq!(map.insert(&id, v), model.insert(id.clone(), v)),
                    1 => prop_assert_eq!(map.remove(&id), model.remove(&id)),
                    _ => prop_assert_eq!(map.get(&id), model.get(&id)),
                }
                prop_assert_eq!(map.len(), model.len());
                prop_assert_eq!(map.get(&id), model.get(&id));
            }
            let mut all: Vec<(String, (u8, u64))> = map.iter().map(|(id, v)| (id, *v)).collect();
            all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            prop_assert_eq!(all, model.clone().into_iter().collect::<Vec<_>>());
            let packed = rmp_serde::to_vec(&map).expect("encodes");
            prop_assert_eq!(&packed, &rmp_serde::to_vec(&model).expect("encodes"));
            let back: IdMap<(u8, u64)> = rmp_serde::from_slice(&packed).expect("decodes");
            prop_assert_eq!(&back, &map);
            let json = serde_json::to_string(&map).expect("encodes");
            prop_assert_eq!(&json, &serde_json::to_string(&model).expect("encodes"));
            prop_assert_eq!(serde_json::from_str::<IdMap<(u8, u64)>>(&json).expect("decodes"), map);
        }
    }
}
