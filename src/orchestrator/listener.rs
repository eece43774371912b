//! Who holds the listener on a replica's port, as this machine's `/proc` tells it.
//!
//! A replica's port is picked free from the kernel and let go for the app to bind. Until the app
//! has bound it, any process on the machine may be given the same port (another ebb's replica,
//! another program binding port 0), and the replica's readiness probe then reaches that process.
//! The process backend asks [`holder`] once the probe has passed: a listener on the port that no
//! process of the replica's group holds is not the replica.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};

use procfs::net::TcpState;
use procfs::process::FDTarget;

/// Who listens on a port that loopback reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// A process of the process group asked about.
    Group,
    /// Only processes outside the group: the first found, by pid and name (none when their file
    /// descriptors cannot be read, a process of another user).
    Other(Option<(i32, String)>),
    /// Cannot be told: no listener on the port in this network namespace's tables, or `/proc`
    /// cannot be read (another system).
    Unknown,
}

impl Holder {
    /// Why a replica whose probe reached this holder is not ready, or `None` when it may be.
    pub fn refusal(&self, port: u16) -> Option<String> {
        match self {
            Holder::Group | Holder::Unknown => None,
            Holder::Other(Some((pid, name))) => Some(format!(
                "port {port} is held by another process (pid {pid}, {name}), not the replica"
            )),
            Holder::Other(None) => Some(format!(
                "port {port} is held by a process outside the replica's group"
            )),
        }
    }
}

/// Whether an address a listener is bound to takes connections to 127.0.0.1.
fn takes_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_unspecified() || v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6 == Ipv6Addr::UNSPECIFIED || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// The inodes of the sockets listening on `port` that loopback connections reach.
fn listeners(port: u16) -> procfs::ProcResult<BTreeSet<u64>> {
    let mut entries = procfs::net::tcp()?;
    // A machine without IPv6 has no tcp6 table.
    entries.extend(procfs::net::tcp6().unwrap_or_default());
    Ok(entries
        .into_iter()
        .filter(|e| {
            e.state == TcpState::Listen
                && e.local_address.port() == port
                && takes_loopback(e.local_address.ip())
        })
        .map(|e| e.inode)
        .collect())
}

/// Whether process `p` has one of `inodes` open.
fn holds(p: &procfs::process::Process, inodes: &BTreeSet<u64>) -> bool {
    p.fd().is_ok_and(|fds| {
        fds.flatten()
            .any(|fd| matches!(fd.target, FDTarget::Socket(i) if inodes.contains(&i)))
    })
}

/// Who listens on `port` (on loopback or every address): a process of group `pgid`, another
/// process, or unknown. Reads the TCP tables, then the file descriptors of the group's processes
/// (the group's leader first), and only when none holds the listener, the other processes'.
pub fn holder(port: u16, pgid: i32) -> Holder {
    let Ok(inodes) = listeners(port) else {
        return Holder::Unknown;
    };
    if inodes.is_empty() {
        return Holder::Unknown;
    }
    if procfs::process::Process::new(pgid).is_ok_and(|p| holds(&p, &inodes)) {
        return Holder::Group;
    }
    let Ok(all) = procfs::process::all_processes() else {
        return Holder::Unknown;
    };
    let (group, others): (Vec<_>, Vec<_>) = all
        .flatten()
        .filter_map(|p| p.stat().ok().map(|s| (p, s)))
        .partition(|(_, s)| s.pgrp == pgid);
    // The leader was asked above.
    if group
        .iter()
        .any(|(p, _)| p.pid != pgid && holds(p, &inodes))
    {
        return Holder::Group;
    }
    Holder::Other(
        others
            .into_iter()
            .find(|(p, _)| holds(p, &inodes))
            .map(|(p, s)| (p.pid, s.comm)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_is_its_groups_and_no_other_groups() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let me = nix::unistd::getpgrp().as_raw();
        assert_eq!(holder(port, me), Holder::Group);
        // A process in a group of its own that listens on nothing: the port is another's, and
        // the holder found is this test's process.
        let mut other = {
            use std::os::unix::process::CommandExt;
            std::process::Command::new("sleep")
                .arg("60")
                .process_group(0)
                .spawn()
                .unwrap()
        };
        let theirs = holder(port, other.id() as i32);
        let _ = other.kill();
        let _ = other.wait();
        assert_eq!(
            theirs,
            Holder::Other(Some((std::process::id() as i32, own_name())))
        );
        assert!(theirs.refusal(port).unwrap().contains("another process"));
        assert_eq!(Holder::Group.refusal(port), None);
    }

    /// This test process's name as `/proc/self/stat` gives it.
    fn own_name() -> String {
        procfs::process::Process::myself()
            .unwrap()
            .stat()
            .unwrap()
            .comm
    }

    #[test]
    fn listeners_on_every_address_take_loopback_and_others_do_not() {
        assert!(takes_loopback("0.0.0.0".parse().unwrap()));
        assert!(takes_loopback("127.0.0.1".parse().unwrap()));
        assert!(takes_loopback("::".parse().unwrap()));
        assert!(takes_loopback("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!takes_loopback("10.0.0.1".parse().unwrap()));
        assert!(!takes_loopback("::1".parse().unwrap()));
    }
}
