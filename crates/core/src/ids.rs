//! Ids and names: who owns an id (`OWNER.UUID`, the owner a replica's name), what may name a
//! replica, a function or a route's domain, and how a `Host` finds its route. Also what forwarding
//! a request to an id's owner can fail with, shared by the calls and the replicas' API.

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

/// The id of `uuid` owned by `owner`.
pub fn qualify(owner: Option<&str>, uuid: &str) -> String {
    match owner {
        Some(o) => format!("{o}.{uuid}"),
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

/// Looks a `Host` up in a table of domains: the port and case are ignored; an exact domain wins
/// over a wildcard (`*.suffix`), and a longer wildcard suffix over a shorter one.
pub fn match_host<T>(host: &str, mut get: impl FnMut(&str) -> Option<T>) -> Option<T> {
    let host = host_without_port(host);
    let lower: std::borrow::Cow<'_, str> = if host.bytes().any(|b| b.is_ascii_uppercase()) {
        host.to_ascii_lowercase().into()
    } else {
        host.into()
    };
    let host = lower.trim_end_matches('.');
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

/// `example.com:8080` -> `example.com`; `[::1]:80` -> `[::1]`.
pub fn host_without_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.rfind(':') {
        Some(i) if host[i + 1..].bytes().all(|b| b.is_ascii_digit()) => &host[..i],
        _ => host,
    }
}
