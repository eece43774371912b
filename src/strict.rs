//! The HTTP/1 framing checks in front of hyper on ebb's endpoints: [`Strict`] is
//! `ebb_proxy::strict`'s, this is the admin address's plain listener.

use std::io;

pub use ebb_proxy::strict::Strict;

/// ebb's endpoints' plain listener: each connection checked, without Nagle's delay, and ended
/// if its first head is not in within the header-read timeout (the second field).
pub struct StrictListener(pub tokio::net::TcpListener, pub std::time::Duration);

impl axum::serve::Listener for StrictListener {
    type Io = Strict<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    return (Strict::new(stream).first_within(self.1), peer);
                }
                Err(e) => {
                    // Out of file descriptors, most likely: a moment's pause rather than a spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}
