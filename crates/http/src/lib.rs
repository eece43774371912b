//! ebb's HTTP/1.x framing, with no IO: what the proxy's fast path and ebb's own endpoints read
//! of a message's head and body, on `httparse` and `http` alone.
//!
//! * [`head`]: the parts of a request head ebb routes by (one valid `Host`, the target's forms).
//! * [`h1`]: request and response heads parsed and rewritten for the other side.
//! * [`chunked`]: where a chunked body ends, without decoding it.
//! * [`request_id`]: `X-Request-Id`, kept or made.

pub mod chunked;
pub mod h1;
pub mod head;
pub mod request_id;
