//! Finds where a `Transfer-Encoding: chunked` message body ends (RFC 9112 section 7.1), so the
//! HTTP/1.1 forwarding path can pass chunked bodies through byte for byte without decoding them.
//! Every line it reads is bounded.

/// The longest chunk-size line (size, extensions) accepted.
pub const MAX_SIZE_LINE: usize = 4_096;
/// The most trailer bytes accepted after the last chunk.
pub const MAX_TRAILERS: usize = 16_384;

/// A malformed chunked body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed chunked body: {0}")]
pub struct ChunkedError(&'static str);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    /// Hex digits of a chunk size.
    Size,
    /// Whitespace after the size.
    SizeWs,
    /// A chunk extension, up to CR.
    Ext,
    /// The LF ending the size line.
    SizeLf,
    /// Chunk data.
    Data,
    /// The CR after chunk data.
    DataCr,
    /// The LF after chunk data.
    DataLf,
    /// The start of a trailer line (or of the final empty line).
    TrailerStart,
    /// Inside a trailer line.
    Trailer,
    /// The LF ending a trailer line.
    TrailerLf,
    /// The LF of the final empty line.
    EndLf,
    /// The body is complete.
    Done,
}

/// Scans a chunked body as its bytes pass.
#[derive(Debug, Clone)]
pub struct Chunked {
    st: St,
    size: u64,
    digits: u8,
    line: usize,
    trailers: usize,
}

impl Default for Chunked {
    fn default() -> Self {
        Self::new()
    }
}

impl Chunked {
    /// A scanner at the start of a body.
    pub fn new() -> Self {
        Self {
            st: St::Size,
            size: 0,
            digits: 0,
            line: 0,
            trailers: 0,
        }
    }

    /// Whether the whole body has been seen.
    pub fn is_done(&self) -> bool {
        self.st == St::Done
    }

    /// Scans `data`, the next bytes of the body. Returns how many of them belong to the body: all
    /// of them unless the body ends inside `data`.
    pub fn advance(&mut self, data: &[u8]) -> Result<usize, ChunkedError> {
        let mut i = 0;
        while i < data.len() {
            if self.st == St::Done {
                return Ok(i);
            }
            if self.st == St::Data {
                let take = usize::try_from(self.size)
                    .unwrap_or(usize::MAX)
                    .min(data.len() - i);
                i += take;
                self.size -= take as u64;
                if self.size == 0 {
                    self.st = St::DataCr;
                }
                continue;
            }
            self.step(data[i])?;
            i += 1;
        }
        Ok(i)
    }

    /// Decodes the next bytes of the body: scans `data` as [`Chunked::advance`] does, but stops
    /// after the first run of chunk data, so that the caller can pass on the data without the
    /// framing. The trailer section's bytes (up to and with the final empty line) are pointed out
    /// as they pass; they are bounded by [`MAX_TRAILERS`].
    pub fn decode(&mut self, data: &[u8]) -> Result<Decoded, ChunkedError> {
        let mut i = 0;
        let mut trailers_from = None;
        while i < data.len() && self.st != St::Done {
            if self.st == St::Data {
                let take = usize::try_from(self.size)
                    .unwrap_or(usize::MAX)
                    .min(data.len() - i);
                self.size -= take as u64;
                if self.size == 0 {
                    self.st = St::DataCr;
                }
                return Ok(Decoded {
                    consumed: i + take,
                    data: i..i + take,
                    trailers: i..i,
                });
            }
            if trailers_from.is_none()
                && matches!(
                    self.st,
                    St::TrailerStart | St::Trailer | St::TrailerLf | St::EndLf
                )
            {
                trailers_from = Some(i);
            }
            self.step(data[i])?;
            i += 1;
        }
        Ok(Decoded {
            consumed: i,
            data: i..i,
            trailers: trailers_from.unwrap_or(i)..i,
        })
    }

    /// Takes one byte of framing (anything but chunk data).
    fn step(&mut self, b: u8) -> Result<(), ChunkedError> {
        self.st = match self.st {
            St::Size => match b {
                b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                    if self.digits == 15 {
                        return Err(ChunkedError("chunk size too large"));
                    }
                    self.digits += 1;
                    self.line += 1;
                    self.size = self.size * 16 + u64::from(hex(b));
                    St::Size
                }
                _ if self.digits == 0 => return Err(ChunkedError("chunk size missing")),
                b' ' | b'\t' => St::SizeWs,
                b';' => St::Ext,
                b'\r' => St::SizeLf,
                _ => return Err(ChunkedError("invalid chunk size")),
            },
            St::SizeWs => match b {
                b' ' | b'\t' => {
                    self.line += 1;
                    if self.line > MAX_SIZE_LINE {
                        return Err(ChunkedError("chunk size line too long"));
                    }
                    St::SizeWs
                }
                b';' => St::Ext,
                b'\r' => St::SizeLf,
                _ => return Err(ChunkedError("invalid chunk size line")),
            },
            St::Ext => match b {
                b'\r' => St::SizeLf,
                b'\n' => return Err(ChunkedError("bare LF in chunk extension")),
                _ => {
                    self.line += 1;
                    if self.line > MAX_SIZE_LINE {
                        return Err(ChunkedError("chunk size line too long"));
                    }
                    St::Ext
                }
            },
            St::SizeLf => {
                if b != b'\n' {
                    return Err(ChunkedError("expected LF after chunk size"));
                }
                self.digits = 0;
                self.line = 0;
                if self.size == 0 {
                    St::TrailerStart
                } else {
                    St::Data
                }
            }
            St::DataCr => match b {
                b'\r' => St::DataLf,
                _ => return Err(ChunkedError("expected CR after chunk data")),
            },
            St::DataLf => match b {
                b'\n' => St::Size,
                _ => return Err(ChunkedError("expected LF after chunk data")),
            },
            St::TrailerStart | St::Trailer => {
                self.trailers += 1;
                if self.trailers > MAX_TRAILERS {
                    return Err(ChunkedError("trailers too long"));
                }
                match (self.st, b) {
                    (St::TrailerStart, b'\r') => St::EndLf,
                    (_, b'\r') => St::TrailerLf,
                    (_, b'\n') => return Err(ChunkedError("bare LF in trailers")),
                    _ => St::Trailer,
                }
            }
            St::TrailerLf => match b {
                b'\n' => St::TrailerStart,
                _ => return Err(ChunkedError("expected LF after trailer")),
            },
            St::EndLf => match b {
                b'\n' => St::Done,
                _ => return Err(ChunkedError("expected LF at the end of the body")),
            },
            // Chunk data is taken by the callers, and nothing comes after the end.
            St::Data | St::Done => return Err(ChunkedError("bytes after the end of the body")),
        };
        Ok(())
    }
}

/// What [`Chunked::decode`] took of its input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// Bytes of the input that belong to the body.
    pub consumed: usize,
    /// Where the chunk data among them is (empty when none).
    pub data: std::ops::Range<usize>,
    /// Where the trailer section's bytes among them are (empty when none).
    pub trailers: std::ops::Range<usize>,
}

fn hex(b: u8) -> u8 {
    match b {
        b'0'..=b'9' => b - b'0',
        b'a'..=b'f' => b - b'a' + 10,
        _ => b - b'A' + 10,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode(chunks: &[Vec<u8>], ext: bool, trailers: &[(String, String)]) -> Vec<u8> {
        let mut out = Vec::new();
        for c in chunks.iter().filter(|c| !c.is_empty()) {
            out.extend_from_slice(format!("{:x}", c.len()).as_bytes());
            if ext {
                out.extend_from_slice(b" ;name=\"v\"");
            }
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(c);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n");
        for (k, v) in trailers {
            out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out
    }

    fn scan(bytes: &[u8], splits: &[usize]) -> Result<(usize, bool), ChunkedError> {
        let mut c = Chunked::new();
        let mut at: usize = 0;
        for &s in splits.iter().chain(std::iter::once(&usize::MAX)) {
            let end = at.saturating_add(s).min(bytes.len());
            let n = c.advance(&bytes[at..end])?;
            at += n;
            if c.is_done() || end == bytes.len() {
                break;
            }
        }
        Ok((at, c.is_done()))
    }

    proptest! {
        #[test]
        fn finds_the_end_however_the_bytes_arrive(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..8),
            ext in any::<bool>(),
            trailers in prop::collection::vec(("[a-z]{1,8}", "[ -~]{0,12}"), 0..3),
            splits in prop::collection::vec(1usize..64, 0..40),
            tail in prop::collection::vec(any::<u8>(), 0..32),
        ) {
            let body = encode(&chunks, ext, &trailers);
            let mut stream = body.clone();
            stream.extend_from_slice(&tail);
            let (n, done) = scan(&stream, &splits).unwrap();
            prop_assert!(done);
            prop_assert_eq!(n, body.len(), "the bytes after the body are not part of it");
        }

        #[test]
        fn a_cut_body_is_not_done(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..100), 1..5),
            cut in any::<prop::sample::Index>(),
        ) {
            let body = encode(&chunks, false, &[]);
            let cut = cut.index(body.len());
            let (n, done) = scan(&body[..cut], &[]).unwrap();
            prop_assert!(!done);
            prop_assert_eq!(n, cut);
        }

        #[test]
        fn decodes_the_data_and_the_trailers_however_the_bytes_arrive(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..8),
            ext in any::<bool>(),
            trailers in prop::collection::vec(("[a-z]{1,8}", "[!-~]{0,12}"), 0..3),
            splits in prop::collection::vec(1usize..64, 0..40),
            tail in prop::collection::vec(any::<u8>(), 0..32),
        ) {
            let body = encode(&chunks, ext, &trailers);
            let mut stream = body.clone();
            stream.extend_from_slice(&tail);
            let mut c = Chunked::new();
            let (mut data, mut trailer_bytes) = (Vec::new(), Vec::new());
            // The bytes arrive in pieces; each piece is decoded until it is used up or the body
            // ends, what is left of it waiting for the next (as a connection's buffer does).
            let (mut at, mut pending) = (0usize, Vec::new());
            for &s in splits.iter().chain(std::iter::once(&usize::MAX)) {
                let end = at.saturating_add(s).min(stream.len());
                pending.extend_from_slice(&stream[at..end]);
                at = end;
                loop {
                    let d = c.decode(&pending).unwrap();
                    data.extend_from_slice(&pending[d.data.clone()]);
                    trailer_bytes.extend_from_slice(&pending[d.trailers.clone()]);
                    pending.drain(..d.consumed);
                    if d.consumed == 0 || c.is_done() {
                        break;
                    }
                }
                if c.is_done() || at == stream.len() {
                    break;
                }
            }
            prop_assert!(c.is_done());
            prop_assert_eq!(data, chunks.concat());
            prop_assert_eq!(&pending[..], &tail[..pending.len()], "the bytes after the body are left");
            let mut headers = [httparse::EMPTY_HEADER; 8];
            let parsed = httparse::parse_headers(&trailer_bytes, &mut headers).unwrap();
            let httparse::Status::Complete((n, fields)) = parsed else {
                panic!("the trailer section is cut: {trailer_bytes:?}");
            };
            prop_assert_eq!(n, trailer_bytes.len());
            let got: Vec<(String, String)> = fields
                .iter()
                .map(|h| (h.name.to_owned(), String::from_utf8_lossy(h.value).into_owned()))
                .collect();
            prop_assert_eq!(got, trailers);
        }

        #[test]
        fn never_panics_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = Chunked::new().advance(&bytes);
            let mut c = Chunked::new();
            let mut rest = &bytes[..];
            while let Ok(d) = c.decode(rest) {
                if d.consumed == 0 {
                    break;
                }
                rest = &rest[d.consumed..];
            }
        }
    }

    #[test]
    fn rejects_malformed_bodies() {
        for bad in [
            &b"\r\n"[..],
            b"zz\r\n",
            b"5\nhello\r\n",
            b"5\r\nhelloX\r\n",
            b"1234567890abcdef0\r\n",
            b"0\r\nx\n",
        ] {
            assert!(Chunked::new().advance(bad).is_err(), "{bad:?}");
        }
        let long_ext = [b"1;".as_slice(), &[b'a'; MAX_SIZE_LINE + 1]].concat();
        assert!(Chunked::new().advance(&long_ext).is_err());
        let long_trailers = [b"0\r\n".as_slice(), &[b'a'; MAX_TRAILERS + 1]].concat();
        assert!(Chunked::new().advance(&long_trailers).is_err());
    }
}
