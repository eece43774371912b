//! TCP routes' relay on io_uring: the bytes of every open TCP route connection are moved by a
//! relay thread of its own, through one io_uring ring, instead of by the proxy thread that
//! accepted the connection through epoll ([`super::splice::splice_tcp`], which stays the
//! fallback).
//!
//! Why: a user-space copy between two sockets makes four socket calls per request and answer
//! (two receives, two sends), whatever loop makes them; through epoll each is a syscall of its
//! own, plus the waits. A ring takes every connection's receives and sends at once in one
//! `io_uring_enter`, which also waits, and the kernel runs the completions in that call
//! (`DEFER_TASKRUN`), so the more connections are busy the fewer syscalls a request costs.
//! Measured with `benches/tcp.sh` (redis-benchmark, 50 clients, 2 cores kept awake, 5 rounds, in
//! the same runs as HAProxy's `mode tcp` with 2 threads): two relay threads served 0.96-1.05x
//! HAProxy's throughput unpipelined (three runs) at 0.85-0.92x its CPU per request and p99
//! 0.88-1.05x, and 1.03x at 0.92x with pipeline 16; one relay thread, 0.83-0.92x and 0.94x (it
//! serialises the proxy's half of the kernel's TCP work while client and server wait on it),
//! hence one thread per core by default. (An earlier measure that favoured one thread was taken
//! with the cores free to halt, where rounds flip between a slow and a fast mode: see
//! `benches/lib.sh`.)
//!
//! How:
//! * A connection is handed over once the replica is connected ([`Relays::splice`]): its two
//!   sockets go to a relay thread (a channel and an eventfd the ring reads), and the connection's
//!   task waits for how it ended, as it waited for the copy loop.
//! * Each way has at most one operation in flight: a receive, then the send of what it received,
//!   then the next receive, so bytes stay in order and a peer that does not read stops the other
//!   side being read (the kernel's socket buffers are the only ones filled).
//! * A receive takes its buffer from a ring of buffers provided to the kernel (`BUFFER_SELECT`)
//!   only when bytes arrive, and the buffer goes back once they are sent on: an open connection
//!   that moves nothing holds none, as in the copy loop. When the ring is empty (many sends
//!   waiting on slow readers) a receive gets a buffer of its own from the heap instead, so one
//!   connection's slow reader never stalls another connection.
//! * A connection ends as in the copy loop: each way ends with its reader's end of stream
//!   (passed on with a shutdown for writing), the pair when both have; an error on either side, or
//!   nothing moved for the route's `connection_idle_timeout_ms`, or the connection's task
//!   dropped, shuts both sockets down, which completes whatever is in flight, and the pair closes
//!   once nothing is.
//!
//! Where io_uring cannot be had (a kernel without it or with `kernel.io_uring_disabled` set, a
//! container whose seccomp profile refuses it, as Docker's and containerd's defaults do), the
//! relay does not start and TCP routes copy on the proxy threads.
//!
//! The module uses `unsafe` for what io_uring is: the kernel reads and writes memory named by
//! raw pointers in submission entries, after the call that submitted them returned. Each `unsafe`
//! says what keeps that memory alive and unaliased until the completion arrives.
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use io_uring::{IoUring, cqueue, opcode, squeue, types};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::clock::Clock;
use crate::splice::{Ended, FLOW_BUF};

/// Buffers in a relay thread's provided ring (a power of two): `RING_BUFS` x [`FLOW_BUF`] = 4 MiB
/// a thread. Only bytes in flight hold one; past them receives use heap buffers.
const RING_BUFS: u16 = 256;

/// The provided buffers' group id (one group per ring).
const GROUP: u16 = 0;

/// Submission queue entries; a connection has at most two operations in flight.
const SQ_ENTRIES: u32 = 1024;

/// Completion queue entries: room for every operation of 8,192 connections at once (the kernel
/// keeps overflow beyond it rather than drop it).
const CQ_ENTRIES: u32 = 16 * 1024;

/// Heap buffers kept for reuse by a relay thread; more are freed.
const SPARE_HEAP: usize = 64;

/// The longest a relay waits for a completion at once: a deadline further off is waited for in
/// turns (the kernel's absolute time would overflow on one centuries away).
const MAX_WAIT: Duration = Duration::from_secs(3600);

/// `user_data` of the eventfd read that wakes a relay for new connections.
const WAKE: u64 = u64::MAX;

/// A relay thread's share of the work: what it is sent.
enum Msg {
    /// Relay these two sockets until they end, then say how.
    Start {
        sockets: [OwnedFd; 2],
        idle_ms: Option<u64>,
        done: oneshot::Sender<io::Result<Ended>>,
    },
    /// A connection's task went away: end the connections nobody waits for.
    Abandoned,
}

/// A relay thread, as the proxy threads see it.
struct Handle {
    /// Taken when the handle is dropped: the thread hears its channel closed.
    tx: Option<mpsc::Sender<Msg>>,
    wake: Arc<OwnedFd>,
}

impl Handle {
    /// Sends `msg` and wakes the thread; gives it back when the thread is gone.
    fn send(&self, msg: Msg) -> Result<(), Msg> {
        match &self.tx {
            Some(tx) => tx.send(msg).map_err(|e| e.0)?,
            None => return Err(msg),
        }
        self.wake();
        Ok(())
    }

    fn wake(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd this handle keeps open (the
        // thread holds it too). It cannot fail: the counter would need 2^64 - 1 wakes unread.
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                std::ptr::from_ref(&one).cast(),
                std::mem::size_of::<u64>(),
            );
        }
    }
}

impl Stats {
    const fn new() -> Stats {
        Stats {
            open: AtomicU64::new(0),
            heap_receives: AtomicU64::new(0),
            dry_waits: AtomicU64::new(0),
            running: AtomicUsize::new(0),
        }
    }
}

/// The counts of every relay of the process.
static TOTALS: Stats = Stats::new();

/// What the TCP relay threads of this process counted, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    /// Connections on the relay threads now.
    pub open: u64,
    /// Receives that found a thread's buffer ring empty and waited for bytes before looking
    /// again.
    pub dry_waits: u64,
    /// Receives made into a heap buffer: bytes waiting with the ring still empty.
    pub heap_receives: u64,
}

/// [`Totals`] now.
pub fn totals() -> Totals {
    Totals {
        open: TOTALS.open.load(Ordering::Relaxed),
        dry_waits: TOTALS.dry_waits.load(Ordering::Relaxed),
        heap_receives: TOTALS.heap_receives.load(Ordering::Relaxed),
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // The thread ends once its channel is closed and its connections are over; the wake
        // has it look.
        drop(self.tx.take());
        self.wake();
    }
}

/// The relay threads: each connection goes to the next one in turn.
pub struct Relays {
    threads: Vec<Handle>,
    next: AtomicUsize,
    /// These threads' own counts: the tests read them (`/metrics` reads the process's,
    /// [`totals`], which tests running side by side share).
    #[cfg_attr(not(test), allow(dead_code))]
    stats: Arc<Stats>,
}

/// What the relay threads counted: each [`Relays`]' own, and the process's ([`totals`]).
struct Stats {
    /// Connections on the threads now.
    open: AtomicU64,
    /// Receives made into a heap buffer because the provided ring had none left.
    heap_receives: AtomicU64,
    /// Receives that found the ring empty and wait for bytes before they look again.
    dry_waits: AtomicU64,
    /// Relay threads running.
    running: AtomicUsize,
}

impl Relays {
    /// Starts `threads` relay threads (at least one), each with its ring; fails, with the
    /// kernel's reason, when a ring cannot be had, so the caller falls back to the copy loop.
    pub fn start(threads: usize, clock: Arc<dyn Clock>) -> io::Result<Relays> {
        Self::start_with(threads, clock, RING_BUFS)
    }

    /// [`Relays::start`] with `ring_bufs` (a power of two) buffers in each thread's ring.
    fn start_with(threads: usize, clock: Arc<dyn Clock>, ring_bufs: u16) -> io::Result<Relays> {
        let stats = Arc::new(Stats::new());
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (tx, rx) = mpsc::channel();
            let (ready_tx, ready_rx) = mpsc::sync_channel(1);
            let clock = clock.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name(format!("ebb-tcp-relay-{i}"))
                .spawn(move || {
                    // The ring is made on the thread that submits to it (a single issuer).
                    match Relay::new(rx, clock, stats.clone(), ring_bufs) {
                        Ok((mut relay, wake)) => {
                            stats.running.fetch_add(1, Ordering::Relaxed);
                            let _ = ready_tx.send(Ok(wake));
                            relay.run();
                            stats.running.fetch_sub(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                })?;
            let wake = ready_rx.recv().map_err(|_| {
                io::Error::other("the relay thread ended before its ring was made")
            })??;
            handles.push(Handle { tx: Some(tx), wake });
        }
        Ok(Relays {
            threads: handles,
            next: AtomicUsize::new(0),
            stats,
        })
    }

    /// Moves bytes both ways between `a` and `b` until both are done, or until nothing moved
    /// for `idle` (none: no bound); [`super::splice::splice_tcp`]'s contract, on a relay thread.
    /// Dropping the future ends the connection.
    pub async fn splice(
        &self,
        a: TcpStream,
        b: TcpStream,
        idle: Option<Duration>,
        clock: &dyn Clock,
    ) -> io::Result<Ended> {
        let sockets = [blocking(a)?, blocking(b)?];
        let (done, ended) = oneshot::channel();
        let msg = Msg::Start {
            sockets,
            idle_ms: idle.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            done,
        };
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.threads.len();
        let handle = &self.threads[i];
        if let Err(Msg::Start { sockets, .. }) = handle.send(msg) {
            // The relay thread is gone (it never is but by a bug): copy on this thread.
            tracing::warn!("the TCP relay thread is gone; copying on the proxy thread");
            let [a, b] = sockets;
            return crate::splice::splice_tcp(nonblocking(a)?, nonblocking(b)?, idle, clock).await;
        }
        let mut waiting = Waiting {
            handle,
            ended: Some(ended),
        };
        let ended = waiting.ended.as_mut().expect("set above");
        let result = ended.await;
        waiting.ended = None;
        result.unwrap_or_else(|_| Err(io::Error::other("the TCP relay thread ended")))
    }
}

/// The wait for a relayed connection's end; dropped before it came, it tells the relay.
struct Waiting<'a> {
    handle: &'a Handle,
    ended: Option<oneshot::Receiver<io::Result<Ended>>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(mut ended) = self.ended.take() {
            ended.close();
            let _ = self.handle.send(Msg::Abandoned);
        }
    }
}

/// A tokio stream's socket, out of tokio's reactor, in blocking mode. The ring's own path does
/// not look at the mode (it tries a receive or send without waiting, then waits for the socket's
/// readiness); a kernel that hands an operation to its worker threads instead has them wait
/// there, rather than fail with `EAGAIN`, in blocking mode.
fn blocking(s: TcpStream) -> io::Result<OwnedFd> {
    let s = s.into_std()?;
    s.set_nonblocking(false)?;
    Ok(OwnedFd::from(s))
}

/// The reverse of [`blocking`].
fn nonblocking(fd: OwnedFd) -> io::Result<TcpStream> {
    let s = std::net::TcpStream::from(fd);
    s.set_nonblocking(true)?;
    TcpStream::from_std(s)
}

/// Where a buffer of bytes in flight lives.
enum Buf {
    /// The provided ring's buffer of this id.
    Ring(u16),
    /// A buffer of its own, taken when the ring had none.
    Heap(Box<[u8]>),
}

/// One way of a connection: from socket `d` to socket `1 - d`.
enum Way {
    /// A receive is in flight.
    Reading(RecvInto),
    /// A send of `buf[sent..len]` is in flight.
    Writing { buf: Buf, sent: usize, len: usize },
    /// The reader ended and the writer was shut down for writing.
    Done,
}

/// Where a receive puts the bytes.
enum RecvInto {
    /// A buffer the kernel takes from the ring (at once: with none there it fails `ENOBUFS`).
    Ring,
    /// The same, once the socket has bytes: the receive after one that found the ring empty
    /// waits for bytes before it looks again, so a quiet connection holds no buffer meanwhile.
    RingWhenReadable,
    /// A buffer of its own: the ring was still empty with bytes waiting.
    Heap(Box<[u8]>),
}

/// `IORING_RECVSEND_POLL_FIRST` (`linux/io_uring.h`, in a receive's `ioprio`): wait for the
/// socket's readiness before receiving.
const RECVSEND_POLL_FIRST: u16 = 1;

/// How a connection is being ended.
enum Ending {
    Idle,
    Failed(io::Error),
    Abandoned,
}

struct Conn {
    sockets: [OwnedFd; 2],
    ways: [Way; 2],
    moved: [u64; 2],
    idle_ms: Option<u64>,
    last_ms: u64,
    /// Tells idle timers of a slot's earlier connections from this one's.
    serial: u64,
    done: oneshot::Sender<io::Result<Ended>>,
    ending: Option<Ending>,
    /// Operations submitted and not completed: the sockets close only once this is 0.
    in_flight: u8,
}

/// The kernel's provided-buffer ring and the buffers it names. Both are raw allocations that no
/// Rust reference covers: the kernel reads the entries and writes the buffers while they live.
struct BufRing {
    /// `count` entries, page-aligned (the kernel's rule), read by the kernel.
    entries: *mut types::BufRingEntry,
    /// `count` x `FLOW_BUF` bytes, written by the kernel into the buffer it picks.
    bufs: *mut u8,
    count: u16,
    tail: u16,
}

impl BufRing {
    fn layouts(count: u16) -> (Layout, Layout) {
        // SAFETY: sysconf reads a constant of the system.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let entries = usize::from(count) * std::mem::size_of::<types::BufRingEntry>();
        (
            Layout::from_size_align(entries, page).expect("a valid layout"),
            Layout::from_size_align(usize::from(count) * FLOW_BUF, page).expect("a valid layout"),
        )
    }

    /// A ring of `count` buffers, a power of two (the kernel's rule).
    fn new(count: u16) -> BufRing {
        assert!(count.is_power_of_two());
        let (entries, bufs) = Self::layouts(count);
        // SAFETY: non-zero sizes; freed in Drop with the same layouts.
        let (e, b) = unsafe { (std::alloc::alloc_zeroed(entries), std::alloc::alloc(bufs)) };
        if e.is_null() {
            std::alloc::handle_alloc_error(entries);
        }
        if b.is_null() {
            std::alloc::handle_alloc_error(bufs);
        }
        BufRing {
            entries: e.cast::<types::BufRingEntry>(),
            bufs: b,
            count,
            tail: 0,
        }
    }

    /// Gives buffer `bid` (back) to the kernel.
    fn give(&mut self, bid: u16) {
        let mask = self.count - 1;
        // SAFETY: the index is below count, inside the allocation; the kernel reads entries
        // only between its head and the tail published below, and this one is past the tail.
        // (The first entry's last field is the tail, which only this thread writes.)
        let entry = unsafe { &mut *self.entries.add(usize::from(self.tail & mask)) };
        entry.set_addr(self.addr(bid) as u64);
        entry.set_len(FLOW_BUF as u32);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: the tail is a u16 inside the first entry, which the kernel reads atomically;
        // the release store publishes the entry written above before the new tail.
        unsafe {
            let tail = types::BufRingEntry::tail(self.entries).cast::<AtomicU16>();
            (*tail).store(self.tail, Ordering::Release);
        }
    }

    /// Buffer `bid`'s first byte.
    fn addr(&self, bid: u16) -> *const u8 {
        debug_assert!(bid < self.count);
        // SAFETY: bid < count: inside the allocation.
        unsafe { self.bufs.add(usize::from(bid) * FLOW_BUF) }
    }
}

impl Drop for BufRing {
    fn drop(&mut self) {
        let (entries, bufs) = Self::layouts(self.count);
        // SAFETY: allocated in new with these layouts. The ring that uses them is dropped first
        // (Relay's field order).
        unsafe {
            std::alloc::dealloc(self.entries.cast(), entries);
            std::alloc::dealloc(self.bufs, bufs);
        }
    }
}

/// A relay thread's state.
struct Relay {
    // Dropped first: the kernel stops using the buffers below once the ring is gone.
    ring: IoUring,
    bufs: BufRing,
    spare: Vec<Box<[u8]>>,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    serial: u64,
    /// Idle deadlines: (when, slot, serial); a stale one is skipped or moved when it comes.
    timers: BinaryHeap<Reverse<(u64, usize, u64)>>,
    /// Live connections with an idle bound (each has one deadline in `timers`).
    timed: usize,
    rx: mpsc::Receiver<Msg>,
    wake: Arc<OwnedFd>,
    /// The eventfd read's 8 bytes, written by the kernel.
    wake_buf: Box<u64>,
    /// Entries made and not yet in the submission queue.
    pending: Vec<squeue::Entry>,
    clock: Arc<dyn Clock>,
    stats: Arc<Stats>,
}

/// What `io_uring_enter` may answer that a later call does not: a signal (`EINTR`), a deadline
/// (`ETIME`), or no room for now (`EAGAIN`, `EBUSY`: completions to read first).
fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::ETIME | libc::EAGAIN | libc::EBUSY)
    )
}

fn ud(slot: usize, op: u64) -> u64 {
    ((slot as u64) << 2) | op
}

impl Relay {
    fn new(
        rx: mpsc::Receiver<Msg>,
        clock: Arc<dyn Clock>,
        stats: Arc<Stats>,
        ring_bufs: u16,
    ) -> io::Result<(Relay, Arc<OwnedFd>)> {
        let ring = IoUring::builder()
            .setup_cqsize(CQ_ENTRIES)
            .setup_single_issuer()
            .setup_coop_taskrun()
            .setup_defer_taskrun()
            .build(SQ_ENTRIES)?;
        let mut bufs = BufRing::new(ring_bufs);
        // SAFETY: the entries stay allocated and unmoved while the ring lives (BufRing is
        // dropped after the ring).
        unsafe {
            ring.submitter().register_buf_ring_with_flags(
                bufs.entries as u64,
                ring_bufs,
                GROUP,
                0,
            )?;
        }
        for bid in 0..ring_bufs {
            bufs.give(bid);
        }
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor nobody else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut relay = Relay {
            ring,
            bufs,
            spare: Vec::new(),
            conns: Vec::new(),
            free: Vec::new(),
            serial: 0,
            timers: BinaryHeap::new(),
            timed: 0,
            rx,
            wake: wake.clone(),
            wake_buf: Box::new(0),
            pending: Vec::new(),
            clock,
            stats,
        };
        relay.read_wake();
        Ok((relay, wake))
    }

    fn read_wake(&mut self) {
        let buf = std::ptr::from_mut(&mut *self.wake_buf).cast::<u8>();
        let e = opcode::Read::new(types::Fd(self.wake.as_raw_fd()), buf, 8)
            .build()
            .user_data(WAKE);
        self.pending.push(e);
    }

    /// Serves until every handle is gone and no connection is left.
    fn run(&mut self) {
        let mut handles_gone = false;
        loop {
            if handles_gone && self.conns.iter().all(Option::is_none) {
                return;
            }
            if let Err(e) = self.submit_and_wait() {
                tracing::error!(error = %e, "TCP relay: the ring failed; its connections end");
                return;
            }
            let now = self.clock.now_ms();
            let done: Vec<(u64, i32, u32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result(), c.flags()))
                .collect();
            for (user_data, result, flags) in done {
                if user_data == WAKE {
                    handles_gone |= self.take_messages(now);
                    self.read_wake();
                } else {
                    self.completed(user_data, result, flags, now);
                }
            }
            self.expire(now);
        }
    }

    /// Puts the entries made into the submission queue, submitting when it is full (what still
    /// does not fit, the kernel being busy, waits for the next turn, once completions are read),
    /// then submits and waits for one completion, or for the next idle deadline.
    fn submit_and_wait(&mut self) -> io::Result<()> {
        let mut from = 0;
        while from < self.pending.len() {
            {
                let mut sq = self.ring.submission();
                while from < self.pending.len() {
                    // SAFETY: every entry's buffers are held by self (ring buffers, heap buffers
                    // in their Way, the wake buffer) until its completion is read.
                    if unsafe { sq.push(&self.pending[from]) }.is_err() {
                        break;
                    }
                    from += 1;
                }
            }
            if from < self.pending.len() {
                match self.ring.submit() {
                    Ok(_) => {}
                    Err(e) if transient(&e) => break,
                    Err(e) => return Err(e),
                }
            }
        }
        self.pending.drain(..from);
        let wait = self.timers.peek().map(|Reverse((due, _, _))| {
            Duration::from_millis(due.saturating_sub(self.clock.now_ms())).min(MAX_WAIT)
        });
        let result = match wait {
            None => self.ring.submit_and_wait(1),
            Some(wait) => {
                let ts = types::Timespec::from(wait);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
        };
        match result {
            Ok(_) => Ok(()),
            Err(e) if transient(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Takes the connections sent; true when every handle is gone. Connections abandoned are
    /// looked for once, however many said so.
    fn take_messages(&mut self, now: u64) -> bool {
        let mut abandoned = false;
        let gone = loop {
            match self.rx.try_recv() {
                Ok(Msg::Start {
                    sockets,
                    idle_ms,
                    done,
                }) => self.start(sockets, idle_ms, done, now),
                Ok(Msg::Abandoned) => abandoned = true,
                Err(mpsc::TryRecvError::Empty) => break false,
                Err(mpsc::TryRecvError::Disconnected) => break true,
            }
        };
        if abandoned {
            for slot in 0..self.conns.len() {
                if let Some(c) = &self.conns[slot]
                    && c.done.is_closed()
                {
                    self.end(slot, Ending::Abandoned);
                }
            }
        }
        gone
    }

    fn start(
        &mut self,
        sockets: [OwnedFd; 2],
        idle_ms: Option<u64>,
        done: oneshot::Sender<io::Result<Ended>>,
        now: u64,
    ) {
        self.serial += 1;
        let conn = Conn {
            sockets,
            ways: [Way::Reading(RecvInto::Ring), Way::Reading(RecvInto::Ring)],
            moved: [0, 0],
            idle_ms,
            last_ms: now,
            serial: self.serial,
            done,
            ending: None,
            in_flight: 0,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.conns[slot] = Some(conn);
                slot
            }
            None => {
                self.conns.push(Some(conn));
                self.conns.len() - 1
            }
        };
        if let Some(idle) = idle_ms {
            self.timed += 1;
            self.timers
                .push(Reverse((now.saturating_add(idle), slot, self.serial)));
            // The deadlines of connections that closed stay until they come: when they are
            // most of the heap (many short connections, a long bound), they go.
            if self.timers.len() > 2 * self.timed + 64 {
                let conns = &self.conns;
                self.timers.retain(|Reverse((_, slot, serial))| {
                    conns[*slot].as_ref().is_some_and(|c| c.serial == *serial)
                });
            }
        }
        self.count(|s| &s.open, true);
        for d in 0..2 {
            self.receive(slot, d, RecvInto::Ring);
        }
    }

    /// Counts one up (or down) in this relay's stats and the process's.
    fn count(&self, counter: impl Fn(&Stats) -> &AtomicU64, up: bool) {
        for stats in [&*self.stats, &TOTALS] {
            if up {
                counter(stats).fetch_add(1, Ordering::Relaxed);
            } else {
                counter(stats).fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    fn conn(&mut self, slot: usize) -> &mut Conn {
        self.conns[slot].as_mut().expect("a live slot")
    }

    /// Submits way `d`'s receive, `into` where it says.
    fn receive(&mut self, slot: usize, d: usize, into: RecvInto) {
        let conn = self.conn(slot);
        let fd = types::Fd(conn.sockets[d].as_raw_fd());
        conn.ways[d] = Way::Reading(into);
        let entry = match &mut conn.ways[d] {
            // The pointer is taken from the buffer where it stays until the completion.
            Way::Reading(RecvInto::Heap(buf)) => {
                opcode::Recv::new(fd, buf.as_mut_ptr(), FLOW_BUF as u32).build()
            }
            Way::Reading(ring) => {
                let ioprio = match ring {
                    RecvInto::RingWhenReadable => RECVSEND_POLL_FIRST,
                    _ => 0,
                };
                opcode::Recv::new(fd, std::ptr::null_mut(), FLOW_BUF as u32)
                    .buf_group(GROUP)
                    .ioprio(ioprio)
                    .build()
                    .flags(squeue::Flags::BUFFER_SELECT)
            }
            _ => unreachable!("set just above"),
        };
        conn.in_flight += 1;
        self.pending.push(entry.user_data(ud(slot, d as u64)));
    }

    /// Submits the send of way `d`'s unsent bytes.
    fn send(&mut self, slot: usize, d: usize) {
        let conn = self.conns[slot].as_mut().expect("a live slot");
        let Way::Writing { buf, sent, len } = &conn.ways[d] else {
            unreachable!("a send is made only for a way with bytes to write");
        };
        let from = match buf {
            Buf::Ring(bid) => self.bufs.addr(*bid),
            Buf::Heap(b) => b.as_ptr(),
        };
        // SAFETY: sent < len <= FLOW_BUF, inside the buffer.
        let from = unsafe { from.add(*sent) };
        let entry = opcode::Send::new(
            types::Fd(conn.sockets[1 - d].as_raw_fd()),
            from,
            (*len - *sent) as u32,
        )
        .flags(libc::MSG_NOSIGNAL)
        .build()
        .user_data(ud(slot, 2 + d as u64));
        conn.in_flight += 1;
        self.pending.push(entry);
    }

    fn release(&mut self, buf: Buf) {
        match buf {
            Buf::Ring(bid) => self.bufs.give(bid),
            Buf::Heap(b) => {
                if self.spare.len() < SPARE_HEAP {
                    self.spare.push(b);
                }
            }
        }
    }

    fn completed(&mut self, user_data: u64, result: i32, flags: u32, now: u64) {
        let slot = (user_data >> 2) as usize;
        let op = user_data & 3;
        let d = (op & 1) as usize;
        let Some(conn) = self.conns.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        conn.in_flight -= 1;
        let ending = conn.ending.is_some();
        if op < 2 {
            // A receive.
            let into = match std::mem::replace(&mut conn.ways[d], Way::Done) {
                Way::Reading(into) => into,
                _ => unreachable!("a receive completes on a reading way"),
            };
            let waited = matches!(into, RecvInto::RingWhenReadable);
            let buf = match (cqueue::buffer_select(flags), into) {
                (Some(bid), _) => Some(Buf::Ring(bid)),
                (None, RecvInto::Heap(h)) => Some(Buf::Heap(h)),
                (None, _) => None,
            };
            if ending || result <= 0 {
                if let Some(buf) = buf {
                    self.release(buf);
                }
                if ending {
                    self.finish_if_quiet(slot);
                } else if result == 0 {
                    self.end_of_stream(slot, d);
                } else if -result == libc::ENOBUFS && !waited {
                    self.count(|s| &s.dry_waits, true);
                    self.receive(slot, d, RecvInto::RingWhenReadable);
                } else if -result == libc::ENOBUFS {
                    self.count(|s| &s.heap_receives, true);
                    let heap = self
                        .spare
                        .pop()
                        .unwrap_or_else(|| vec![0; FLOW_BUF].into_boxed_slice());
                    self.receive(slot, d, RecvInto::Heap(heap));
                } else {
                    self.end(slot, Ending::Failed(io::Error::from_raw_os_error(-result)));
                }
                return;
            }
            let conn = self.conn(slot);
            conn.last_ms = now;
            conn.ways[d] = Way::Writing {
                buf: buf.expect("bytes received were received into a buffer"),
                sent: 0,
                len: result as usize,
            };
            self.send(slot, d);
        } else {
            // A send.
            let Way::Writing { buf, sent, len } = std::mem::replace(&mut conn.ways[d], Way::Done)
            else {
                unreachable!("a send completes on a writing way");
            };
            if ending {
                self.release(buf);
                self.finish_if_quiet(slot);
                return;
            }
            match result {
                n if n > 0 => {
                    let sent = sent + n as usize;
                    let conn = self.conn(slot);
                    conn.moved[d] += n as u64;
                    if sent < len {
                        conn.ways[d] = Way::Writing { buf, sent, len };
                        self.send(slot, d);
                    } else {
                        self.release(buf);
                        self.receive(slot, d, RecvInto::Ring);
                    }
                }
                0 => {
                    self.release(buf);
                    self.end(slot, Ending::Failed(io::ErrorKind::WriteZero.into()));
                }
                e => {
                    self.release(buf);
                    self.end(slot, Ending::Failed(io::Error::from_raw_os_error(-e)));
                }
            }
        }
    }

    /// Way `d`'s reader ended: the end is passed on (a shutdown for writing), and the way is
    /// done.
    fn end_of_stream(&mut self, slot: usize, d: usize) {
        let conn = self.conn(slot);
        // SAFETY: shutdown on a descriptor this connection owns.
        let r = unsafe { libc::shutdown(conn.sockets[1 - d].as_raw_fd(), libc::SHUT_WR) };
        if r < 0 {
            let e = io::Error::last_os_error();
            // The writer's peer may have reset it first: the other way's error ends the pair.
            if e.raw_os_error() != Some(libc::ENOTCONN) {
                self.end(slot, Ending::Failed(e));
                return;
            }
        }
        self.finish_if_quiet(slot);
    }

    /// Starts ending a connection: both sockets are shut down, which completes what is in
    /// flight; it closes once nothing is. The first reason stands.
    fn end(&mut self, slot: usize, why: Ending) {
        let conn = self.conn(slot);
        if conn.ending.is_none() {
            conn.ending = Some(why);
            for s in &conn.sockets {
                // SAFETY: shutdown on descriptors this connection owns. It fails only on a socket
                // already disconnected, which has nothing in flight to complete.
                unsafe { libc::shutdown(s.as_raw_fd(), libc::SHUT_RDWR) };
            }
        }
        self.finish_if_quiet(slot);
    }

    /// Closes the connection and says how it ended, when nothing is in flight and it is ending
    /// or both its ways are done.
    fn finish_if_quiet(&mut self, slot: usize) {
        let conn = self.conn(slot);
        let both_done = matches!(conn.ways, [Way::Done, Way::Done]);
        if conn.in_flight > 0 || (conn.ending.is_none() && !both_done) {
            return;
        }
        let conn = self.conns[slot].take().expect("a live slot");
        self.free.push(slot);
        self.count(|s| &s.open, false);
        if conn.idle_ms.is_some() {
            self.timed -= 1;
        }
        let ended = match conn.ending {
            None => Ok(Ended::Closed {
                up: conn.moved[0],
                down: conn.moved[1],
            }),
            Some(Ending::Idle) => Ok(Ended::Idle),
            Some(Ending::Failed(e)) => Err(e),
            Some(Ending::Abandoned) => Err(io::Error::other("abandoned")),
        };
        let _ = conn.done.send(ended);
        // The sockets close here, with conn.
    }

    /// Ends the connections that moved nothing for their idle bound.
    fn expire(&mut self, now: u64) {
        while let Some(&Reverse((due, slot, serial))) = self.timers.peek() {
            if due > now {
                return;
            }
            self.timers.pop();
            let Some(conn) = self.conns[slot].as_ref() else {
                continue;
            };
            if conn.serial != serial || conn.ending.is_some() {
                continue;
            }
            let Some(idle) = conn.idle_ms else { continue };
            let due = conn.last_ms.saturating_add(idle);
            if due <= now {
                self.end(slot, Ending::Idle);
            } else {
                self.timers.push(Reverse((due, slot, serial)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::splice::checks::{self, tcp_pair};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn ring_of(bufs: u16) -> Relays {
        Relays::start_with(1, Arc::new(crate::clock::SystemClock), bufs).unwrap()
    }

    /// Polls `done` until it holds, for 60 s at most.
    async fn until(what: &str, done: impl Fn() -> bool) {
        let poll = async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), poll)
            .await
            .unwrap_or_else(|_| panic!("{what}"));
    }

    #[tokio::test]
    async fn dropped_relays_end_their_threads() {
        let relays = relays();
        let stats = relays.stats.clone();
        assert_eq!(stats.running.load(Ordering::Relaxed), 1);
        drop(relays);
        until("the relay thread ended", || {
            stats.running.load(Ordering::Relaxed) == 0
        })
        .await;
    }

    /// A connection whose reader does not read holds the ring's one buffer; a receive then
    /// finds the ring empty. A quiet connection waits for bytes without a buffer; bytes waiting
    /// with the ring still empty go into a heap buffer.
    #[tokio::test]
    async fn a_dry_ring_gives_a_quiet_connection_no_buffer() {
        let relays = Arc::new(ring_of(1));
        let stats = relays.stats.clone();
        let mut open = Vec::new();
        let mut relay = |a, b| {
            let r = relays.clone();
            open.push(tokio::spawn(async move {
                r.splice(a, b, None, &crate::clock::SystemClock).await
            }));
        };
        // Stalled: 8 MB towards a server that never reads.
        let (a, mut client) = tcp_pair().await;
        let (server, b) = tcp_pair().await;
        relay(a, b);
        let stalled = tokio::spawn(async move {
            let _ = client.write_all(&vec![7u8; 8 << 20]).await;
            (client, server)
        });
        // Probes, one byte each, until one goes through a heap buffer: the ring is dry from
        // then on (the stalled send keeps its buffer).
        let mut probes = Vec::new();
        while stats.heap_receives.load(Ordering::Relaxed) == 0 {
            let (a, mut client) = tcp_pair().await;
            let (mut server, b) = tcp_pair().await;
            relay(a, b);
            client.write_all(b"p").await.unwrap();
            let mut got = [0u8; 1];
            tokio::time::timeout(Duration::from_secs(60), server.read_exact(&mut got))
                .await
                .expect("the probe's byte went through")
                .unwrap();
            probes.push((client, server));
        }
        let dry = stats.dry_waits.load(Ordering::Relaxed);
        let heap = stats.heap_receives.load(Ordering::Relaxed);
        let (a, mut client) = tcp_pair().await;
        let (mut server, b) = tcp_pair().await;
        relay(a, b);
        until("both ways of the quiet pair wait for bytes", || {
            stats.dry_waits.load(Ordering::Relaxed) >= dry + 2
        })
        .await;
        assert_eq!(
            stats.heap_receives.load(Ordering::Relaxed),
            heap,
            "no buffer for a connection with nothing to read"
        );
        client.write_all(b"q").await.unwrap();
        let mut got = [0u8; 1];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"q");
        assert_eq!(stats.heap_receives.load(Ordering::Relaxed), heap + 1);
        stalled.abort();
        for t in open {
            t.abort();
        }
    }

    fn relays() -> Relays {
        Relays::start(1, Arc::new(crate::clock::SystemClock)).expect("io_uring on this machine")
    }

    #[tokio::test]
    async fn a_relayed_pair_carries_small_exchanges_and_bulk_both_ways() {
        let relays = Arc::new(relays());
        let (a, client) = tcp_pair().await;
        let (server, b) = tcp_pair().await;
        let r = relays.clone();
        let splice = tokio::spawn(async move {
            r.splice(
                a,
                b,
                Some(Duration::from_secs(60)),
                &crate::clock::SystemClock,
            )
            .await
        });
        checks::exchanges_and_bulk(client, server, || {}).await;
        assert_eq!(splice.await.unwrap().unwrap(), checks::EXCHANGED_AND_BULK);
    }

    #[tokio::test]
    async fn an_idle_relayed_pair_ends_and_closes_both_sides() {
        let relays = relays();
        let (a, client) = tcp_pair().await;
        let (server, b) = tcp_pair().await;
        let splice = relays.splice(a, b, Some(checks::IDLE), &crate::clock::SystemClock);
        checks::ends_idle_and_closes(splice, client, server).await;
    }

    #[tokio::test]
    async fn a_reset_peer_ends_the_pair_with_its_error() {
        let relays = relays();
        let (a, client) = tcp_pair().await;
        let (mut server, b) = tcp_pair().await;
        // The client goes away with a reset (SO_LINGER 0): the relay's receive fails.
        let client = client.into_std().unwrap();
        socket_linger_zero(&client);
        drop(client);
        let ended = tokio::time::timeout(
            Duration::from_secs(30),
            relays.splice(a, b, None, &crate::clock::SystemClock),
        )
        .await
        .expect("the splice ended");
        assert!(ended.is_err(), "a reset is an error: {ended:?}");
        let mut rest = Vec::new();
        let _ = server.read_to_end(&mut rest).await;
        assert!(rest.is_empty());
    }

    /// Sets the socket option `name` (at `SOL_SOCKET`) of `s` to `value`.
    fn set_socket_option<T>(s: &impl std::os::fd::AsRawFd, name: libc::c_int, value: &T) {
        // SAFETY: passes a live value of its own size.
        let r = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                std::ptr::from_ref(value).cast(),
                std::mem::size_of::<T>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0);
    }

    fn socket_linger_zero(s: &std::net::TcpStream) {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        set_socket_option(s, libc::SO_LINGER, &linger);
    }

    /// Fixes `s`'s send buffer at 64 KiB (the kernel then no longer grows it).
    fn small_send_buffer(s: &tokio::net::TcpStream) {
        let size: libc::c_int = 64 * 1024;
        set_socket_option(s, libc::SO_SNDBUF, &size);
    }

    #[tokio::test]
    async fn dropping_the_wait_closes_both_sides() {
        let relays = relays();
        let (a, client) = tcp_pair().await;
        let (server, b) = tcp_pair().await;
        let mut wait = Box::pin(relays.splice(a, b, None, &crate::clock::SystemClock));
        // Polled once (the sockets are handed over), then dropped.
        let first = std::future::poll_fn(|cx| std::task::Poll::Ready(wait.as_mut().poll(cx))).await;
        assert!(first.is_pending(), "nothing ends the pair on its own");
        drop(wait);
        checks::both_closed(client, server).await;
    }

    /// More connections move bytes at once than the ring has buffers, to readers that do not
    /// read yet: each relayed send waits on its reader's full socket holding a ring buffer, the
    /// ring runs dry, and the receives after go on in heap buffers. Then the readers read, and
    /// every pair's bytes arrive whole.
    #[tokio::test]
    async fn more_stalled_pairs_than_ring_buffers_all_carry_their_bytes() {
        let relays =
            Arc::new(Relays::start_with(1, Arc::new(crate::clock::SystemClock), 8).unwrap());
        let pairs = 12;
        let size = 4_000_000u32;
        let (go_tx, go) = tokio::sync::watch::channel(false);
        let mut tasks = Vec::new();
        for p in 0..pairs {
            let (a, mut client) = tcp_pair().await;
            let (mut server, b) = tcp_pair().await;
            // The relay's sends to a server that does not read stall once the server's receive
            // buffer and this one are full, holding their ring buffers. Left to the kernel, the
            // send buffer grows with the flow (up to `tcp_wmem`'s 4 MiB here), and a pair's
            // whole 4 MB could fit in it without a stall: the ring then never ran dry (seen once).
            small_send_buffer(&b);
            let r = relays.clone();
            let splice =
                tokio::spawn(async move { r.splice(a, b, None, &crate::clock::SystemClock).await });
            let mut go = go.clone();
            tasks.push(tokio::spawn(async move {
                let data: Vec<u8> = (0..size).map(|i| ((i as usize + p) % 253) as u8).collect();
                let write = async {
                    client.write_all(&data).await.unwrap();
                    client.shutdown().await.unwrap();
                };
                let read = async {
                    go.wait_for(|go| *go).await.unwrap();
                    let mut got = Vec::new();
                    server.read_to_end(&mut got).await.unwrap();
                    server.shutdown().await.unwrap();
                    got
                };
                let ((), got) = tokio::join!(write, read);
                assert!(
                    got == data,
                    "pair {p}: the bytes arrived whole and in order"
                );
                splice.await.unwrap().unwrap()
            }));
        }
        until("the ring ran dry and a receive took a heap buffer", || {
            relays.stats.heap_receives.load(Ordering::Relaxed) > 0
        })
        .await;
        go_tx.send(true).unwrap();
        let all = async {
            for t in tasks {
                assert_eq!(
                    t.await.unwrap(),
                    Ended::Closed {
                        up: u64::from(size),
                        down: 0
                    }
                );
            }
        };
        tokio::time::timeout(Duration::from_secs(120), all)
            .await
            .expect("every pair went through");
    }
}
