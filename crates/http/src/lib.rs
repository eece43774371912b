//! ebb's HTTP/1.x framing and HTTP/2's frames, with no IO: what the proxy's fast path and ebb's own endpoints read
//! of a message's head and body, on `httparse` and `http` alone.
//!
//! * [`head`]: the parts of a request head ebb routes by (one valid `Host`, the target's forms).
//! * [`h1`]: request and response heads parsed and rewritten for the other side.
//! * [`chunked`]: where a chunked body ends, without decoding it.
//! * [`h2`]: HTTP/2 frames read and written, each type's rules checked.
//! * [`h2server`]: the server side of an HTTP/2 connection: streams, flow control, HPACK.
//! * [`request_id`]: `X-Request-Id`, kept or made.
//!
//! Its users are ebb's proxy (`crates/proxy`), the framing checks in front of hyper on ebb's own
//! endpoints (`src/strict.rs`) and the fuzz checks. It reads the route's settings, the limits and
//! the traffic policy's hash key from `ebb_core`, and nothing else of ebb.

pub mod chunked;
pub mod h1;
pub mod h2;
pub mod h2client;
pub mod h2server;
pub mod head;
pub mod hpack;
pub mod request_id;
