//! Request ids (`X-Request-Id`): the client's when it sent a usable one (1 to [`MAX_LEN`] visible
//! ASCII characters), otherwise one made here and added to the request the backend gets. ebb's
//! own lines about a request (held, woken, refused) carry it, so one request can be followed from
//! the client through the wake to the app's own logs.
//!
//! Made ids are 32 hex digits: a random 64-bit base per thread, then that thread's count. Making
//! one takes no lock and no system call.
//!
//! The HTTP/1.1 fast path ([`crate::h1`]) writes the id into the backend's head while rewriting
//! it (the client's first usable one, others dropped) and keeps its byte range, so the proxy has
//! the id without parsing the head again.

use std::cell::Cell;

/// The longest client id passed on; a longer one is replaced.
pub const MAX_LEN: usize = 128;

/// The header, lower case, as it is written to backends.
pub const HEADER: &str = "x-request-id";

thread_local! {
    static NEXT: Cell<(u64, u64)> = Cell::new((seed(), 0));
}

/// A random base for this thread: from the process's randomly keyed hasher, so two threads or two
/// processes do not share one.
fn seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish()
}

/// A new id: 32 lower-case hex digits.
pub fn make() -> [u8; 32] {
    let (base, n) = NEXT.with(|c| {
        let (base, n) = c.get();
        c.set((base, n.wrapping_add(1)));
        (base, n)
    });
    let mut out = [0u8; 32];
    hex(base, &mut out[..16]);
    hex(n, &mut out[16..]);
    out
}

fn hex(v: u64, out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in out.iter_mut().enumerate() {
        *b = DIGITS[((v >> (60 - 4 * i)) & 0xf) as usize];
    }
}

/// Whether a client's id is passed on as it is.
pub fn usable(value: &[u8]) -> bool {
    !value.is_empty() && value.len() <= MAX_LEN && value.iter().all(|b| b.is_ascii_graphic())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_ids_are_hex_and_differ() {
        let a = make();
        let b = make();
        assert_ne!(a, b);
        assert!(a.iter().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(a[..16], b[..16], "one base per thread");
        let other = std::thread::spawn(make).join().unwrap();
        assert_ne!(a[..16], other[..16], "another thread, another base");
    }

    #[test]
    fn only_short_visible_ids_are_kept() {
        assert!(usable(b"abc-123"));
        assert!(!usable(b""));
        assert!(!usable(b"has space"));
        assert!(!usable(&[b'a'; MAX_LEN + 1]));
    }
}
