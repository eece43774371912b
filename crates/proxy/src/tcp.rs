//! TCP routes: a route with a `listen` address is a port instead of a Host. ebb accepts each
//! connection there, wakes the workload from zero and holds the connection (through the same
//! hold-and-wake as a request: one wake however many connections wait, `hold_timeout_ms`,
//! `hold_queue_max`, a slot taken through `Proxy::endpoint`), then connects to the replica the
//! route's policy picks (a refused connect is retried once, after a wake) and splices bytes both
//! ways: on a relay thread through io_uring ([`super::relay`]), or where that cannot be had on
//! this thread ([`super::splice::splice_tcp`]). An open connection is in flight (the workload is never idle under it)
//! and its end is the route's last use ([`super::traffic::RouteTraffic::touch`]), so the workload
//! goes idle `idle_after_ms` after its last connection closed.
//! `connection_idle_timeout_ms` closes a connection that moves no byte for that long.
//!
//! Each route's port is served on every proxy thread ([`Proxy::spawn_workers`]), as the HTTP
//! listener is: one `SO_REUSEPORT` listener per thread, so a connection and both its sockets stay
//! on the thread that accepted it and no byte it moves wakes another thread.
//!
//! The listeners follow the routes: [`run`] opens them per TCP route in the log and closes them
//! when the route goes or moves elsewhere, looking again whenever the routes change (the route
//! store's `changed_at_seq` moves).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::Proxy;
use super::table::Entry;

/// How often the listeners are compared with the routes.
const RECONCILE_MS: u64 = 200;

/// A route's listeners: one per proxy thread, on one address.
pub type Listeners = (SocketAddr, Vec<std::net::TcpListener>);

/// Binds the listeners of every TCP route in the log now, one per proxy thread; an address that
/// cannot be had stops ebb's start with the reason.
pub fn bind_all(proxy: &Proxy) -> std::io::Result<BTreeMap<String, Listeners>> {
    let mut out = BTreeMap::new();
    for (route, addr) in tcp_routes(proxy) {
        let listeners = proxy.listeners_for_workers(addr).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("TCP route {route}: listening on {addr}: {e}"),
            )
        })?;
        out.insert(route, (addr, listeners));
    }
    Ok(out)
}

/// Serves a route's listeners, each on a proxy thread of its own.
fn serve_route(
    proxy: &Arc<Proxy>,
    route: &str,
    listeners: Vec<std::net::TcpListener>,
    stop: &watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    proxy.accept_on_workers(listeners, route, |listener| {
        accept(proxy.clone(), route.to_string(), listener, stop.clone())
    })
}

/// The TCP routes in the log, with their addresses.
fn tcp_routes(proxy: &Proxy) -> BTreeMap<String, SocketAddr> {
    proxy.log.read(|s| {
        s.routes
            .by_name
            .values()
            .filter_map(|r| {
                let addr = r.spec.listen.as_deref()?.parse().ok()?;
                Some((r.spec.name.clone(), addr))
            })
            .collect()
    })
}

/// Serves the TCP routes until `stop`: the listeners `bound` at start, then one per TCP route
/// the log gains, each closed when its route goes or changes address. A listener that cannot be
/// opened later (the address is taken) is logged and tried again when the routes next change.
pub async fn run(
    proxy: Arc<Proxy>,
    bound: BTreeMap<String, Listeners>,
    mut stop: watch::Receiver<bool>,
) {
    let mut open: BTreeMap<String, (SocketAddr, Vec<tokio::task::JoinHandle<()>>)> =
        BTreeMap::new();
    for (route, (addr, listeners)) in bound {
        let tasks = serve_route(&proxy, &route, listeners, &stop);
        open.insert(route, (addr, tasks));
    }
    let mut seen_seq = proxy.log.read(|s| s.routes.changed_at_seq);
    let mut tick = tokio::time::interval(Duration::from_millis(RECONCILE_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => break,
        }
        let seq = proxy.log.read(|s| s.routes.changed_at_seq);
        if seq == seen_seq {
            continue;
        }
        seen_seq = seq;
        let wanted = tcp_routes(&proxy);
        open.retain(|route, (addr, tasks)| {
            let keep = wanted.get(route) == Some(addr) && !tasks.iter().any(|t| t.is_finished());
            if !keep {
                tracing::info!(%route, %addr, "TCP route closed");
                tasks.iter().for_each(|t| t.abort());
            }
            keep
        });
        for (route, addr) in wanted {
            if open.contains_key(&route) {
                continue;
            }
            match proxy.listeners_for_workers(addr) {
                Ok(listeners) => {
                    tracing::info!(%route, %addr, "TCP route listening");
                    let tasks = serve_route(&proxy, &route, listeners, &stop);
                    open.insert(route, (addr, tasks));
                }
                Err(e) => tracing::warn!(%route, %addr, error = %e, "TCP route cannot listen"),
            }
        }
    }
    for (_, (_, tasks)) in open {
        tasks.iter().for_each(|t| t.abort());
    }
}

/// Accepts a route's connections until `stop`.
async fn accept(
    proxy: Arc<Proxy>,
    route: String,
    listener: TcpListener,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(%route, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let _ = stream.set_nodelay(true);
        let Some(entry) = proxy.table().named(&route) else {
            continue;
        };
        let max = proxy.options.limits.max_connections;
        let connections = proxy.connections.clone();
        if connections.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= max {
            connections.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            crate::limits::Limit::Connections.hit();
            tracing::warn!(%route, %peer, limit = max, "refused: too many connections");
            continue;
        }
        let counted = super::ConnectionSlot(connections);
        let proxy = proxy.clone();
        tokio::spawn(async move {
            connection(&proxy, &entry, stream, peer).await;
            drop(counted);
        });
    }
}

/// One client connection: held until a replica is ready, then spliced to it.
async fn connection(proxy: &Proxy, entry: &Entry, client: TcpStream, peer: SocketAddr) {
    let route = &entry.spec;
    let in_flight = entry.traffic.begin(proxy.clock.now_ms());
    let _tunnel = proxy.tunnel_guard();
    let id = super::request_id::make();
    let mut avoid: Option<SocketAddr> = None;
    let backend = loop {
        let slot = match proxy.endpoint(entry, avoid, None, &id, false, None).await {
            Ok(slot) => slot,
            Err(refusal) => {
                tracing::warn!(route = %route.name, %peer, code = refusal.code, "TCP connection refused: {}", refusal.message);
                entry.traffic.answered(refusal.status.as_u16(), None);
                return;
            }
        };
        let addr = slot.addr();
        let timeout = Duration::from_millis(proxy.options.connect_timeout_ms);
        match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                slot.answered(200, None);
                break (stream, slot);
            }
            // The replica is stopping or gone: nothing of the client's was read yet, so wake
            // the workload again and try once more on another replica.
            Ok(Err(e)) if super::retry_after_miss(super::BackendMiss::Refused, avoid.is_some()) => {
                tracing::debug!(route = %route.name, %addr, error = %e, "replica refused; retrying");
                slot.failed();
                avoid = Some(addr);
            }
            Ok(Err(e)) => {
                slot.failed();
                tracing::warn!(route = %route.name, %addr, error = %e, "cannot connect to the replica");
                entry.traffic.answered(502, None);
                return;
            }
            Err(_) => {
                slot.failed();
                tracing::warn!(route = %route.name, %addr, "connecting to the replica timed out");
                entry.traffic.answered(504, None);
                return;
            }
        }
    };
    let (stream, slot) = backend;
    entry.traffic.answered(200, None);
    let idle = (route.connection_idle_timeout_ms > 0)
        .then(|| Duration::from_millis(route.connection_idle_timeout_ms));
    let ended = match proxy.relays() {
        Some(relays) => relays.splice(client, stream, idle, &*proxy.clock).await,
        None => super::splice::splice_tcp(client, stream, idle, &*proxy.clock).await,
    };
    match ended {
        Ok(super::splice::Ended::Idle) => {
            entry
                .traffic
                .timed_out(super::traffic::Timeout::ConnectionIdle);
            tracing::debug!(route = %route.name, %peer, "TCP connection idle; closed");
        }
        Ok(super::splice::Ended::Closed { up, down }) => {
            tracing::debug!(route = %route.name, %peer, up, down, "TCP connection closed");
        }
        Err(e) => tracing::debug!(route = %route.name, %peer, error = %e, "TCP connection ended"),
    }
    // Its end is the route's last use: idleness counts from here.
    entry.traffic.touch(proxy.clock.now_ms());
    drop((slot, in_flight));
}
