//! Ids and names: who owns an id (`OWNER.UUID`, the owner a replica's name), what may name a
//! replica, a function or a route's domain, and how a `Host` finds its route. Also what forwarding
//! a request to an id's owner can fail with, shared by the calls and the replicas' API.

use std::borrow::Cow;
use std::collections::HashMap;

/// The header a forwarded request carries: the replica that forwarded it.
pub const FORWARDED_BY: &str = "x-ebb-forwarded-by";

/// How long a client is told to wait before asking again when an owner is down, in seconds.
pub const RETRY_AFTER_S: u64 = 2;

/// Whether `name` may name a replica: a DNS label (1 to 63 of `a-z`, `0-9`, `-`, starting and
/// ending with a letter or digit), as a StatefulSet pod's hostname is.
pub fn valid_replica(name: &str) -> bool {
    check_name("replica", name).is_ok()
}

/// The owner an id names (`None`: no owner, this replica's).
pub fn owner_of(id: &str) -> Option<&str> {
    id.rsplit_once('.').map(|(owner, _)| owner)
}

/// The UUID part of an id.
pub fn uuid_part(id: &str) -> &str {
    id.rsplit_once('.').map_or(id, |(_, u)| u)
}

/// Checks an id: an optional owner (a replica name) and a UUID.
pub fn parse_id(id: &str) -> Result<(Option<&str>, uuid::Uuid), String> {
    let owner = owner_of(id);
    if let Some(o) = owner
        && !valid_replica(o)
    {
        return Err(format!(
            "id {id:?}: the owner {o:?} is not a replica name (a DNS label)"
        ));
    }
    let u = uuid::Uuid::parse_str(uuid_part(id))
        .map_err(|e| format!("id {id:?} is not a UUID (or OWNER.UUID): {e}"))?;
    Ok((owner, u))
}

/// Whether replica `me` decides for `id`: it owns it, or the id names no owner. (The
/// simulator's `decide-for-others` mutation makes every replica decide for every id.)
pub fn decides_here(me: Option<&str>, id: &str) -> bool {
    owner_of(id).is_none_or(|o| Some(o) == me)
        || crate::mutation::active(crate::mutation::Mutation::DecideForOthers)
}

/// The id of `uuid` owned by `owner`, the UUID written in place (hyphenated, lower case).
pub fn id_of(owner: Option<&str>, uuid: uuid::Uuid) -> String {
    qualify(
        owner,
        uuid.hyphenated()
            .encode_lower(&mut uuid::Uuid::encode_buffer()),
    )
}

/// The owner and UUID of an id [`id_of`] writes exactly that way (the UUID hyphenated in lower
/// case, an owner not empty); `None` for any other text, so the two stand for each other one to
/// one. Read in one pass over the UUID's 36 bytes at the id's end, each byte's digit from a table
/// (the log's index and the forgotten calls' map read every call's id this way, several times in
/// its life).
pub fn id_parts(id: &str) -> Option<(Option<&str>, uuid::Uuid)> {
    // (A UUID has no '.': the owner is all before the last one, as `owner_of` reads it.)
    let cut = id.len().checked_sub(36)?;
    let (head, t) = (id.get(..cut)?, &id.as_bytes()[cut..]);
    let owner = match head {
        "" => None,
        _ => Some(head.strip_suffix('.').filter(|o| !o.is_empty())?),
    };
    if [t[8], t[13], t[18], t[23]] != [b'-'; 4] {
        return None;
    }
    let (high, bad_high) = hex_digits(t[..8].iter().chain(&t[9..13]).chain(&t[14..18]));
    let (low, bad_low) = hex_digits(t[19..23].iter().chain(&t[24..]));
    if (bad_high | bad_low) & 0x80 != 0 {
        return None;
    }
    Some((owner, uuid::Uuid::from_u64_pair(high, low)))
}

/// The value of up to sixteen lower-case hex digits, and a byte whose high bit is set if any of
/// them is none.
fn hex_digits<'a>(digits: impl Iterator<Item = &'a u8>) -> (u64, u8) {
    digits.fold((0, 0), |(value, bad), &c| {
        let d = HEX_DIGIT[usize::from(c)];
        (value << 4 | u64::from(d & 0xf), bad | d)
    })
}

/// Each byte's value as a lower-case hex digit, `0x80` for a byte that is none.
const HEX_DIGIT: [u8; 256] = {
    let mut table = [0x80u8; 256];
    let mut i = 0;
    while i < 16 {
        table[b"0123456789abcdef"[i] as usize] = i as u8;
        i += 1;
    }
    table
};

/// The id of `uuid` (its text) owned by `owner`.
pub fn qualify(owner: Option<&str>, uuid: &str) -> String {
    match owner {
        Some(o) => {
            let mut id = String::with_capacity(o.len() + 1 + uuid.len());
            id.push_str(o);
            id.push('.');
            id.push_str(uuid);
            id
        }
        None => uuid.to_owned(),
    }
}

/// Why a request could not be forwarded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// The owner is not reachable now (down, restarting, not ready): ask again later.
    #[error("replica {0} owns this and cannot be reached now: {1}")]
    Unavailable(String, String),
    /// No replica of that name is known.
    #[error("no replica named {0:?} is known")]
    Unknown(String),
    /// The request named another owner and came forwarded: refused rather than forwarded again.
    #[error("replica {0} does not own this (it was forwarded here by {1})")]
    Misdirected(String, String),
    /// The body to send does not encode (a fault of the sender's types, never sent).
    #[error("a request body that does not encode: {0}")]
    Unencodable(String),
}

/// Whether `name` may name a function: 1 to 63 characters of `a-z`, `0-9` and `-`, starting and
/// ending with a letter or digit (a DNS label, so it can name a workload and a host).
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !ok {
        return Err(format!(
            "{what} {name:?} is not a valid name: 1 to 63 of a-z, 0-9 and '-', starting and ending with a letter or digit"
        ));
    }
    Ok(())
}

/// Whether `domain` is a route's host name: letters, digits, '-' and '.', optionally after a
/// leading `*.` (a wildcard for the names under it).
pub fn valid_domain(domain: &str) -> bool {
    let bare = domain.strip_prefix("*.").unwrap_or(domain);
    !bare.is_empty()
        && bare
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// A table of domains that a request's `Host` is looked up in, by [`match_host`]'s rule, made for
/// the proxy's hot path: a wildcard's suffix is a key of its own, so a lookup builds no string,
/// and a table without wildcards tries the exact name only. Keys are hashed with FNV: they are
/// the configuration's domains, and a lookup inserts nothing, so a client's Host cannot flood it.
#[derive(Debug, Clone)]
pub struct Domains<T> {
    exact: HashMap<Box<str>, T, fnv::FnvBuildHasher>,
    /// `*.suffix` entries, by their suffix.
    wildcard: HashMap<Box<str>, T, fnv::FnvBuildHasher>,
}

impl<T> Default for Domains<T> {
    fn default() -> Self {
        Domains {
            exact: HashMap::default(),
            wildcard: HashMap::default(),
        }
    }
}

impl<T> Domains<T> {
    /// Adds `domain` (a name, or `*.suffix`; its case ignored), returning the value it had.
    pub fn insert(&mut self, domain: &str, value: T) -> Option<T> {
        let domain = domain.to_ascii_lowercase();
        match domain.strip_prefix("*.") {
            Some(suffix) => self.wildcard.insert(suffix.into(), value),
            None => self.exact.insert(domain.into(), value),
        }
    }

    /// The value a `Host` leads to: the port, the case and a trailing dot are ignored; an exact
    /// domain wins over a wildcard, and a longer wildcard suffix over a shorter one.
    pub fn get(&self, host: &str) -> Option<&T> {
        let key = host_key(host);
        let host = &*key;
        if let Some(v) = self.exact.get(host) {
            return Some(v);
        }
        if self.wildcard.is_empty() {
            return None;
        }
        let mut rest = host;
        while let Some(dot) = rest.find('.') {
            rest = &rest[dot + 1..];
            if let Some(v) = self.wildcard.get(rest) {
                return Some(v);
            }
        }
        None
    }

    /// Whether the table has no domain.
    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.wildcard.is_empty()
    }
}

/// Looks a `Host` up in a table of domains: the port and case are ignored; an exact domain wins
/// over a wildcard (`*.suffix`), and a longer wildcard suffix over a shorter one.
pub fn match_host<T>(host: &str, mut get: impl FnMut(&str) -> Option<T>) -> Option<T> {
    let key = host_key(host);
    let host = &*key;
    if let Some(v) = get(host) {
        return Some(v);
    }
    let mut rest = host;
    let mut wildcard = String::with_capacity(host.len() + 1);
    while let Some(dot) = rest.find('.') {
        rest = &rest[dot + 1..];
        wildcard.clear();
        wildcard.push_str("*.");
        wildcard.push_str(rest);
        if let Some(v) = get(&wildcard) {
            return Some(v);
        }
    }
    None
}

/// A `Host` as a table of domains keys it: without its port or a trailing dot, in lower case
/// (copied only when it has a capital).
pub fn host_key(host: &str) -> Cow<'_, str> {
    lower(host_without_port(host).trim_end_matches('.'))
}

/// A `Host` as a meta service's rules match its authority: without its port, in lower case
/// (copied only when it has a capital).
pub fn authority(host: &str) -> Cow<'_, str> {
    lower(host_without_port(host))
}

/// `s` in ASCII lower case, copied only when it has a capital.
fn lower(s: &str) -> Cow<'_, str> {
    if s.bytes().any(|b| b.is_ascii_uppercase()) {
        s.to_ascii_lowercase().into()
    } else {
        s.into()
    }
}

/// `example.com:8080` -> `example.com`; `[::1]:80` -> `[::1]`.
pub fn host_without_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    // The digits at the end, then a colon: a byte scan from the end (this runs for every
    // request, and most Hosts end in a letter).
    let bytes = host.as_bytes();
    let digits = bytes
        .iter()
        .rev()
        .take_while(|b| b.is_ascii_digit())
        .count();
    match bytes.len().checked_sub(digits + 1) {
        Some(i) if bytes[i] == b':' => &host[..i],
        _ => host,
    }
}

/// An id kept in its map's slot: up to [`IdKey::INLINE`] bytes in place (an `OWNER.UUID` whose
/// owner has up to 11 characters, as a StatefulSet's `ebb-0` .. `ebb-99999`), a longer one on
/// the heap. The projection keys its calls by it: a lookup in a table of a million calls then
/// compares the probed key where it already reads the slot, instead of following a `String`'s
/// pointer to memory that is rarely in the cache (a miss for every lookup of every call), and
/// inserting or removing a call allocates and frees no key.
///
/// It hashes, compares and orders as its text (`Borrow<str>`: a map keyed by it is searched with
/// a `&str`), and is serialized as its text, so a snapshot is the same bytes as with `String`.
#[derive(Clone)]
pub struct IdKey(Repr);

#[derive(Clone)]
enum Repr {
    Inline(arrayvec::ArrayString<{ IdKey::INLINE }>),
    Heap(Box<str>),
}

impl IdKey {
    /// The longest id kept in place, in bytes.
    pub const INLINE: usize = 48;

    /// The id's text.
    pub fn as_str(&self) -> &str {
        match &self.0 {
            Repr::Inline(s) => s.as_str(),
            Repr::Heap(s) => s,
        }
    }
}

impl From<&str> for IdKey {
    fn from(id: &str) -> Self {
        IdKey(match arrayvec::ArrayString::from(id) {
            Ok(s) => Repr::Inline(s),
            Err(_) => Repr::Heap(id.into()),
        })
    }
}

impl From<&String> for IdKey {
    fn from(id: &String) -> Self {
        IdKey::from(id.as_str())
    }
}

impl From<String> for IdKey {
    fn from(id: String) -> Self {
        if id.len() <= IdKey::INLINE {
            IdKey::from(id.as_str())
        } else {
            IdKey(Repr::Heap(id.into_boxed_str()))
        }
    }
}

impl std::ops::Deref for IdKey {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::borrow::Borrow<str> for IdKey {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

// Equal, ordered and hashed as its text, whichever way it is kept.
impl PartialEq for IdKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for IdKey {}

impl PartialOrd for IdKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for IdKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::hash::Hash for IdKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As `str` hashes: `Borrow<str>` requires it.
        self.as_str().hash(state)
    }
}

impl std::fmt::Debug for IdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for IdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for IdKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for IdKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(IdKey::from(
            <std::borrow::Cow<'de, str>>::deserialize(d)?.as_ref(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn domains_prefer_exact_then_the_longest_wildcard() {
        let mut d = Domains::default();
        d.insert("API.example.com", "exact");
        d.insert("*.example.com", "wild");
        d.insert("*.eu.example.com", "deep");
        assert_eq!(d.get("api.Example.com.:8080"), Some(&"exact"));
        assert_eq!(d.get("www.example.com"), Some(&"wild"));
        assert_eq!(d.get("a.eu.example.com:80"), Some(&"deep"));
        assert_eq!(d.get("example.com"), None);
        assert_eq!(d.get("other.org"), None);
        assert_eq!(d.get(""), None);
        let plain: Domains<u8> = Domains::default();
        assert!(plain.is_empty() && plain.get("a.b").is_none());
    }

    proptest! {
        /// `id_parts` gives back what `id_of` wrote, and nothing for another spelling of it.
        #[test]
        fn id_parts_undoes_id_of(owner in proptest::option::of("[a-z0-9.-]{1,12}"), u in any::<u128>()) {
            let uuid = uuid::Uuid::from_u128(u);
            let id = id_of(owner.as_deref(), uuid);
            prop_assert_eq!(id_parts(&id), Some((owner.as_deref(), uuid)));
            let upper = id.to_uppercase();
            prop_assert_eq!(id_parts(&upper).is_some(), upper == id);
        }
    }

    /// `id_parts` as it was first written: by `owner_of`, `uuid_part` and the `uuid` crate's
    /// parser.
    fn id_parts_by_the_uuid_crate(id: &str) -> Option<(Option<&str>, uuid::Uuid)> {
        let text = uuid_part(id);
        let owner = owner_of(id);
        if text.len() != 36 || owner == Some("") || text.bytes().any(|b| b.is_ascii_uppercase()) {
            return None;
        }
        Some((owner, uuid::Uuid::try_parse(text).ok()?))
    }

    proptest! {
        /// `id_parts` answers as the `uuid` crate's parser does, for ids and near misses alike.
        #[test]
        fn id_parts_reads_as_the_uuid_crate_does(
            owner in proptest::option::of("[a-z0-9.-]{0,6}|[^\\x00]{0,4}"),
            u in any::<u128>(),
            cut in 0usize..40,
            with in "[0-9a-fA-F.g{}-]|[^\\x00]",
        ) {
            let id = id_of(owner.as_deref(), uuid::Uuid::from_u128(u));
            prop_assert_eq!(id_parts(&id), id_parts_by_the_uuid_crate(&id));
            // One character changed, or the id cut short, at any place.
            let at = id.len().saturating_sub(cut);
            if id.is_char_boundary(at) && at < id.len() {
                let next = at + id[at..].chars().next().map_or(0, char::len_utf8);
                let changed = format!("{}{with}{}", &id[..at], &id[next..]);
                prop_assert_eq!(id_parts(&changed), id_parts_by_the_uuid_crate(&changed), "{}", changed);
                prop_assert_eq!(id_parts(&id[at..]), id_parts_by_the_uuid_crate(&id[at..]));
                prop_assert_eq!(id_parts(&id[..at]), id_parts_by_the_uuid_crate(&id[..at]));
            }
        }
    }

    #[test]
    fn id_parts_refuses_what_id_of_does_not_write() {
        let u = "01938c52-7a1b-7c3d-8e4f-0123456789ab";
        assert!(id_parts(u).is_some_and(|(o, _)| o.is_none()));
        for other in [
            format!(".{u}"),
            format!("ebb-0{u}"),
            u.to_uppercase(),
            u.replace('-', ""),
            "call-1".to_owned(),
        ] {
            assert_eq!(id_parts(&other), None, "{other}");
        }
    }

    proptest! {
        /// A `Domains` table answers every Host as `match_host` does over the same domains.
        #[test]
        fn domains_agree_with_match_host(
            domains in proptest::collection::vec("(\\*\\.)?([a-c]{1,2}\\.){0,2}[a-c]{1,2}", 0..8),
            host in "[a-cA-C.]{0,8}(:[0-9]{1,3})?",
        ) {
            let mut table = Domains::default();
            let mut map = std::collections::HashMap::new();
            for (i, d) in domains.iter().enumerate() {
                table.insert(d, i);
                map.insert(d.to_ascii_lowercase(), i);
            }
            prop_assert_eq!(table.get(&host).copied(), match_host(&host, |d| map.get(d).copied()));
        }
    }

    proptest! {
        /// An `IdKey` is its text: the same text back, the same hash as the `str` (a map keyed
        /// by it is searched with a `&str`), the same order as `String`'s, the same bytes in
        /// MessagePack and JSON; in place up to `INLINE` bytes, on the heap past them.
        #[test]
        fn an_id_key_is_its_text(a in "[a-z0-9.-]{0,60}|[^\\x00]{0,60}", b in "[a-z0-9.-]{0,60}") {
            use std::hash::BuildHasher;
            let (ka, kb) = (IdKey::from(a.as_str()), IdKey::from(b.clone()));
            prop_assert_eq!(ka.as_str(), a.as_str());
            prop_assert_eq!(&*kb, b.as_str());
            prop_assert_eq!(ka.cmp(&kb), a.cmp(&b));
            prop_assert_eq!(ka == kb, a == b);
            let h = foldhash::fast::FixedState::with_seed(7);
            prop_assert_eq!(h.hash_one(&ka), h.hash_one(a.as_str()));
            prop_assert_eq!(
                rmp_serde::to_vec(&ka).expect("encodes"),
                rmp_serde::to_vec(&a).expect("encodes")
            );
            prop_assert_eq!(serde_json::to_string(&kb).expect("encodes"), serde_json::to_string(&b).expect("encodes"));
            let back: IdKey = rmp_serde::from_slice(&rmp_serde::to_vec(&a).expect("encodes")).expect("decodes");
            prop_assert_eq!(back, ka.clone());
            prop_assert_eq!(matches!(ka.0, Repr::Inline(_)), a.len() <= IdKey::INLINE);
        }
    }

    #[test]
    fn an_id_key_is_kept_in_a_slot_of_56_bytes() {
        assert_eq!(std::mem::size_of::<IdKey>(), 56);
        let mut m: HashMap<IdKey, u8> = HashMap::new();
        m.insert(IdKey::from("ebb-0.0190d3c4-7a1e-7c3a-9b1e-0a1b2c3d4e5f"), 1);
        assert_eq!(
            m.get("ebb-0.0190d3c4-7a1e-7c3a-9b1e-0a1b2c3d4e5f"),
            Some(&1)
        );
        assert_eq!(m.get("ebb-1.0190d3c4-7a1e-7c3a-9b1e-0a1b2c3d4e5f"), None);
    }
}
