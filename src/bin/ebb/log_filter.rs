//! `EBB_LOG`, the tracing filter, names ebb's modules by their paths in the `ebb` library
//! (`ebb::proxy`, `ebb::orchestrator::kube`, `ebb::log`, ...), as the README documents. Much of
//! that code lives in the workspace's other crates, whose events carry those crates' targets
//! (`ebb_proxy`, `ebb_kube::orchestrator`, `ebb_storage::log`). [`translate`] keeps each
//! directive and adds the same directive for the targets its path now has, so a filter written
//! for the library's paths selects what it always did.

/// The library's paths whose code moved, each with the targets its events carry now. A path
/// that names one module moved whole (one target) keeps its sub-paths (`ebb::proxy::h1` is
/// `ebb_proxy::h1`); one whose code is in several crates, this one among them, is translated
/// when named whole.
const MOVED: &[(&str, &[&str])] = &[
    ("ebb::proxy", &["ebb_proxy"]),
    ("ebb::discovery::k8s", &["ebb_kube::endpoints"]),
    ("ebb::discovery::client", &["ebb_proxy::discovery::client"]),
    ("ebb::discovery::dns", &["ebb_proxy::discovery::dns"]),
    (
        "ebb::discovery",
        &[
            "ebb_proxy::discovery",
            "ebb_kube::endpoints",
            "ebb_core::discovery",
        ],
    ),
    (
        "ebb::orchestrator::kube_coordinator",
        &["ebb_kube::coordinator"],
    ),
    (
        "ebb::orchestrator::kube_functions",
        &["ebb_kube::functions"],
    ),
    (
        "ebb::orchestrator::kube_templates",
        &["ebb_kube::templates"],
    ),
    // A tracing target matches as a string prefix: `ebb::orchestrator::kube` was also the
    // prefix of the three modules above.
    (
        "ebb::orchestrator::kube",
        &[
            "ebb_kube::orchestrator",
            "ebb_kube::coordinator",
            "ebb_kube::functions",
            "ebb_kube::templates",
        ],
    ),
    (
        "ebb::orchestrator",
        &[
            "ebb_core::orchestrator",
            "ebb_kube::orchestrator",
            "ebb_kube::coordinator",
            "ebb_kube::functions",
            "ebb_kube::templates",
        ],
    ),
    ("ebb::cleaner::kube", &["ebb_kube::cleaner"]),
    ("ebb::cleaner::runtime", &["ebb_cleaner::runtime"]),
    ("ebb::cleaner::local", &["ebb_cleaner::local"]),
    (
        "ebb::cleaner",
        &["ebb_cleaner", "ebb_kube::cleaner", "ebb_core::cleaner"],
    ),
    ("ebb::log", &["ebb_storage::log", "ebb_core::log"]),
    ("ebb::queue", &["ebb_storage::queue", "ebb_core::queue"]),
    // Split: the runtimes are still the library's own.
    ("ebb::calls", &["ebb::calls", "ebb_core::calls"]),
    ("ebb::functions", &["ebb::functions", "ebb_core::functions"]),
    ("ebb::sim", &["ebb_sim"]),
    ("ebb::clock", &["ebb_core::clock"]),
    ("ebb::config", &["ebb_core::config"]),
    ("ebb::event", &["ebb_core::event"]),
    ("ebb::ids", &["ebb_core::ids"]),
    ("ebb::limits", &["ebb_core::limits"]),
    ("ebb::mutation", &["ebb_core::mutation"]),
    ("ebb::scaler", &["ebb_core::scaler"]),
    ("ebb::state", &["ebb_core::state"]),
    ("ebb::story", &["ebb_core::story"]),
    ("ebb::timing", &["ebb_core::timing"]),
    ("ebb::waiting", &["ebb_core::waiting"]),
    ("ebb::warm", &["ebb_core::warm"]),
];

/// The Kubernetes client logs an ERROR for every request that fails while the API server is
/// away, and its watcher a WARN for every failed (re)list, a refusal included; ebb says each
/// once itself (`ebb_kube::health`: the API server away, a watch refused). Each is left out
/// unless a filter names its crate.
pub const QUIET: [(&str, &str); 2] = [
    ("kube_client", "kube_client::client::builder=off"),
    ("kube_runtime", "kube_runtime::watcher=error"),
];

/// `spec` with [`QUIET`]'s directives added, each unless `spec` names its crate.
pub fn quiet(spec: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    if !spec.trim().is_empty() {
        out.push(spec);
    }
    for (krate, directive) in QUIET {
        if !spec.contains(krate) {
            out.push(directive);
        }
    }
    out.join(",")
}

/// `spec` (an `EnvFilter` directive list) with each directive whose target is a moved path
/// followed by the same directive for the path's targets now. Anything else is left as it is,
/// for `EnvFilter` to take or refuse.
pub fn translate(spec: &str) -> String {
    let mut out = Vec::new();
    for directive in directives(spec) {
        let end = directive.find(['[', '=']).unwrap_or(directive.len());
        let (target, rest) = directive.split_at(end);
        let moved = MOVED
            .iter()
            .filter_map(|(old, new)| {
                let tail = target.strip_prefix(old)?;
                (tail.is_empty() || tail.starts_with("::")).then_some((old.len(), tail, new))
            })
            .max_by_key(|(len, ..)| *len);
        match moved {
            Some((_, tail, new)) if tail.is_empty() || new.len() == 1 => {
                let new = new
                    .iter()
                    .filter(|n| **n != target)
                    .map(|n| format!("{n}{tail}{rest}"));
                out.extend(std::iter::once(directive.to_owned()).chain(new));
            }
            _ => out.push(directive.to_owned()),
        }
    }
    out.join(",")
}

/// The directives of `spec`: split at the commas outside a span's `[...]` and its `{...}`.
fn directives(spec: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (i, c) in spec.char_indices() {
        match c {
            '[' | '{' => depth += 1,
            ']' | '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(spec[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(spec[start..].trim());
    out.retain(|d| !d.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use super::{quiet, translate};

    #[test]
    fn a_moved_path_selects_its_crates_targets_too() {
        assert_eq!(
            translate("info,ebb::proxy=debug"),
            "info,ebb::proxy=debug,ebb_proxy=debug"
        );
        assert_eq!(
            translate("ebb::proxy::h1=trace"),
            "ebb::proxy::h1=trace,ebb_proxy::h1=trace"
        );
        assert_eq!(
            translate("ebb::orchestrator::kube_functions=debug"),
            "ebb::orchestrator::kube_functions=debug,ebb_kube::functions=debug"
        );
        assert_eq!(
            translate("warn,ebb::calls=debug"),
            "warn,ebb::calls=debug,ebb_core::calls=debug"
        );
        assert_eq!(
            translate("ebb::log[append{seq=1,n=2}]=debug"),
            "ebb::log[append{seq=1,n=2}]=debug,ebb_storage::log[append{seq=1,n=2}]=debug,\
             ebb_core::log[append{seq=1,n=2}]=debug"
        );
    }

    #[test]
    fn the_kube_clients_per_request_errors_are_left_out_unless_named() {
        assert_eq!(
            quiet("warn"),
            "warn,kube_client::client::builder=off,kube_runtime::watcher=error"
        );
        assert_eq!(
            quiet(""),
            "kube_client::client::builder=off,kube_runtime::watcher=error"
        );
        assert_eq!(
            quiet("info,kube_client=debug"),
            "info,kube_client=debug,kube_runtime::watcher=error"
        );
        assert_eq!(
            quiet("info,kube_runtime=debug"),
            "info,kube_runtime=debug,kube_client::client::builder=off"
        );
    }

    #[test]
    fn what_did_not_move_is_left_as_it_is() {
        for spec in [
            "info",
            "ebb=debug",
            "ebb::calls::runner=debug",
            "ebb::functions::runtime=debug",
            "ebb::orchestrator::process=debug",
            "ebb::proxyish=debug",
            "hyper=warn",
            "",
        ] {
            assert_eq!(translate(spec), spec);
        }
    }
}
