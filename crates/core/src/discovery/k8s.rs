//! What a Kubernetes service id (`k8s://[MEMBER.]SERVICE.NAMESPACE[:PORT]`,
//! `k8s-env://NAME[:PORT]`) names, checked at load. The watches that resolve them are
//! ebb-kube's (`crates/kube/src/endpoints.rs`).

use super::id::ServiceId;

/// What a `k8s://` id names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The endpoint's hostname or pod name, when it names one.
    pub member: Option<String>,
    pub service: String,
    pub namespace: String,
    pub port: Option<u16>,
}

/// The parts of a `k8s://[MEMBER.]SERVICE.NAMESPACE[:PORT]` id.
pub fn parts(id: &ServiceId) -> Result<Target, String> {
    let host = id.host().ok_or_else(|| format!("{id}: no host"))?;
    let labels: Vec<&str> = host.split('.').collect();
    let bad = || format!("{id}: expected k8s://[MEMBER.]SERVICE.NAMESPACE[:PORT]");
    if labels.iter().any(|l| l.is_empty()) {
        return Err(bad());
    }
    let (member, service, namespace) = match labels[..] {
        [s, n] => (None, s, n),
        [m, s, n] => (Some(m.to_owned()), s, n),
        _ => return Err(bad()),
    };
    Ok(Target {
        member,
        service: service.to_owned(),
        namespace: namespace.to_owned(),
        port: id.port(),
    })
}

/// Checks a `k8s://` id's shape (at load).
pub fn check(id: &ServiceId) -> Result<(), String> {
    match id.scheme() {
        "k8s" => parts(id).map(|_| ()),
        "k8s-env" => env_names(id).map(|_| ()),
        _ => Ok(()),
    }
}

/// The environment variables (host, port) that a `k8s-env://NAME` id reads.
pub fn env_names(id: &ServiceId) -> Result<(String, String), String> {
    let host = id
        .host()
        .ok_or_else(|| format!("{id}: expected k8s-env://NAME[:PORT]"))?;
    let key = host.to_ascii_uppercase().replace(['-', '.'], "_");
    Ok((format!("{key}_SERVICE_HOST"), format!("{key}_SERVICE_PORT")))
}
