//! HPACK's decoder (RFC 7541): field blocks into fields, with the static table, the dynamic
//! table the encoder fills and resizes, and Huffman-coded strings decoded a nibble at a time by
//! a table built once from the code (RFC 7541 Appendix B).
//!
//! No IO and no allocation per field beyond what the dynamic table keeps: names and values are
//! handed to the caller as slices, Huffman-decoded ones in buffers the decoder reuses.

use std::collections::VecDeque;
use std::sync::OnceLock;

/// Why a field block does not decode: a COMPRESSION_ERROR for an HTTP/2 connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HpackError {
    #[error("the block ends inside a representation")]
    Truncated,
    #[error("an integer larger than a field block can need")]
    IntegerOverflow,
    #[error("an index of no table entry")]
    BadIndex,
    #[error("a Huffman-coded string with EOS in it, or padding that is not EOS's first bits")]
    BadHuffman,
    #[error("a dynamic table size update past the size allowed")]
    TableTooLarge,
    #[error("a dynamic table size update after a field")]
    LateSizeUpdate,
}

/// The static table (RFC 7541 Appendix A): entries 1 to 61.
pub const STATIC_TABLE: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// What an entry costs in the dynamic table beyond its name and value (RFC 7541 4.1).
const ENTRY_OVERHEAD: usize = 32;

/// A dynamic table entry: its name and value.
type Entry = (Box<[u8]>, Box<[u8]>);

/// One connection's decoding state: the dynamic table, in step with the peer's encoder.
#[derive(Debug)]
pub struct Decoder {
    /// Newest first: index 62 is `table[0]`.
    table: VecDeque<Entry>,
    /// The table's size as RFC 7541 counts it.
    size: usize,
    /// The size the encoder set (at most `allowed`).
    max_size: usize,
    /// The size this side allows (its SETTINGS_HEADER_TABLE_SIZE).
    allowed: usize,
    name: Vec<u8>,
    value: Vec<u8>,
}

/// Where a string's bytes are: in the block, a table entry's name, or one of the decoder's
/// buffers.
#[derive(Clone, Copy)]
enum Str {
    Raw(usize, usize),
    NameOf(usize),
    Decoded,
}

impl Decoder {
    /// A decoder whose table may grow to `allowed` bytes (the size this side's SETTINGS say).
    pub fn new(allowed: usize) -> Self {
        Self {
            table: VecDeque::new(),
            size: 0,
            max_size: allowed,
            allowed,
            name: Vec::new(),
            value: Vec::new(),
        }
    }

    /// The dynamic table's size now, as RFC 7541 counts it.
    pub fn table_size(&self) -> usize {
        self.size
    }

    /// Decodes a whole field block, handing each field to `field` in order. After an error
    /// the table is out of step with the encoder: the connection cannot go on.
    pub fn decode(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        let mut at = 0;
        let mut fields_seen = false;
        while at < block.len() {
            let b = block[at];
            if b & 0x80 != 0 {
                // Indexed field.
                let index = integer(block, &mut at, 7)?;
                let (name, value) = self.entry(index)?;
                field(name, value);
                fields_seen = true;
            } else if b & 0x40 != 0 {
                // Literal with incremental indexing.
                let index = integer(block, &mut at, 6)?;
                let (name, value) = self.literal(block, &mut at, index)?;
                let (name, value) = (
                    self.bytes(block, name, true),
                    self.bytes(block, value, false),
                );
                field(name, value);
                let entry = (Box::<[u8]>::from(name), Box::<[u8]>::from(value));
                self.insert(entry);
                fields_seen = true;
            } else if b & 0x20 != 0 {
                // Dynamic table size update: only before the block's first field.
                if fields_seen {
                    return Err(HpackError::LateSizeUpdate);
                }
                let size = integer(block, &mut at, 5)?;
                if size > self.allowed {
                    return Err(HpackError::TableTooLarge);
                }
                self.max_size = size;
                self.evict(0);
            } else {
                // Literal without indexing, or never indexed (0001xxxx): the same to a decoder.
                let index = integer(block, &mut at, 4)?;
                let (name, value) = self.literal(block, &mut at, index)?;
                field(
                    self.bytes(block, name, true),
                    self.bytes(block, value, false),
                );
                fields_seen = true;
            }
        }
        Ok(())
    }

    /// Decodes a whole field block into its fields, or `None` when they pass `max_list_size`
    /// as SETTINGS_MAX_HEADER_LIST_SIZE counts (each name and value and 32 bytes): decoded all
    /// the same, so the table stays in step.
    #[allow(clippy::type_complexity)]
    pub fn decode_fields(
        &mut self,
        block: &[u8],
        max_list_size: u32,
    ) -> Result<Option<Vec<(Vec<u8>, Vec<u8>)>>, HpackError> {
        let max = u64::from(max_list_size);
        let mut size = 0u64;
        let mut fields = Vec::with_capacity(8);
        self.decode(block, |name, value| {
            size += (name.len() + value.len()) as u64 + ENTRY_OVERHEAD as u64;
            if size <= max {
                fields.push((name.to_vec(), value.to_vec()));
            }
        })?;
        Ok((size <= max).then_some(fields))
    }

    /// Entry `index` of the static table then the dynamic one.
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        match index {
            0 => Err(HpackError::BadIndex),
            1..=61 => Ok(STATIC_TABLE[index - 1]),
            _ => self
                .table
                .get(index - 62)
                .map(|(n, v)| (&n[..], &v[..]))
                .ok_or(HpackError::BadIndex),
        }
    }

    /// A literal's name (by `index`, or a string when 0) and value.
    fn literal(
        &mut self,
        block: &[u8],
        at: &mut usize,
        index: usize,
    ) -> Result<(Str, Str), HpackError> {
        let name = if index == 0 {
            self.string(block, at, true)?
        } else {
            self.entry(index)?;
            Str::NameOf(index)
        };
        let value = self.string(block, at, false)?;
        Ok((name, value))
    }

    /// A string literal: where its raw bytes are, or decoded into the name or value buffer.
    fn string(&mut self, block: &[u8], at: &mut usize, is_name: bool) -> Result<Str, HpackError> {
        let huffman = *block.get(*at).ok_or(HpackError::Truncated)? & 0x80 != 0;
        let len = integer(block, at, 7)?;
        let start = *at;
        let end = start.checked_add(len).filter(|&e| e <= block.len());
        let end = end.ok_or(HpackError::Truncated)?;
        *at = end;
        if !huffman {
            return Ok(Str::Raw(start, end));
        }
        let out = if is_name {
            &mut self.name
        } else {
            &mut self.value
        };
        out.clear();
        huffman_decode(&block[start..end], out)?;
        Ok(Str::Decoded)
    }

    fn bytes<'a>(&'a self, block: &'a [u8], s: Str, is_name: bool) -> &'a [u8] {
        match s {
            Str::Raw(start, end) => &block[start..end],
            Str::NameOf(index) => self.entry(index).map_or(&[][..], |(name, _)| name),
            Str::Decoded if is_name => &self.name,
            Str::Decoded => &self.value,
        }
    }

    /// Adds an entry, evicting the oldest ones to make room; one larger than the table empties
    /// it and is not kept (RFC 7541 4.4).
    fn insert(&mut self, entry: Entry) {
        let size = entry.0.len() + entry.1.len() + ENTRY_OVERHEAD;
        if size > self.max_size {
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.table.push_front(entry);
    }

    /// Evicts the oldest entries until `room` more bytes fit.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            let Some((n, v)) = self.table.pop_back() else {
                break;
            };
            self.size -= n.len() + v.len() + ENTRY_OVERHEAD;
        }
    }
}

/// An integer with an `n`-bit prefix (RFC 7541 5.1) at `*at`, which it moves past it. Values
/// past 2^28 are refused: no field block needs them.
fn integer(block: &[u8], at: &mut usize, n: u8) -> Result<usize, HpackError> {
    let mask = (1u8 << n) - 1;
    let first = *block.get(*at).ok_or(HpackError::Truncated)? & mask;
    *at += 1;
    if first < mask {
        return Ok(usize::from(first));
    }
    let mut value = usize::from(mask);
    let mut shift = 0u32;
    loop {
        let b = *block.get(*at).ok_or(HpackError::Truncated)?;
        *at += 1;
        value += usize::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            break;
        }
        shift += 7;
        if shift > 21 {
            return Err(HpackError::IntegerOverflow);
        }
    }
    if value > 1 << 28 {
        return Err(HpackError::IntegerOverflow);
    }
    Ok(value)
}

/// One nibble's step from a state of the Huffman decoder.
#[derive(Clone, Copy, Default)]
struct Step {
    /// The state after it (an internal node of the code's tree; 0 is the root).
    next: u8,
    /// The symbol it completed, when [`EMITS`].
    symbol: u8,
    flags: u8,
}

/// The step completed a symbol.
const EMITS: u8 = 1;
/// The step reached EOS: an error in a string.
const FAILS: u8 = 2;
/// The state after the step may end a string: the root, or up to 7 bits of EOS's code (all
/// ones) past the last symbol.
const MAY_END: u8 = 4;

/// The decoder's table: for each state (an internal node) and nibble, its step.
fn steps() -> &'static [[Step; 16]] {
    static STEPS: OnceLock<Vec<[Step; 16]>> = OnceLock::new();
    STEPS.get_or_init(build_steps)
}

/// A node's child: an internal node's index, or a symbol with [`LEAF`].
const LEAF: u16 = 0x8000;
const NONE: u16 = u16::MAX;

fn build_steps() -> Vec<[Step; 16]> {
    // The code's tree: 257 leaves, so 256 internal nodes, the root first.
    let mut nodes: Vec<[u16; 2]> = vec![[NONE, NONE]];
    for (symbol, &(code, len)) in CODES.iter().enumerate() {
        let mut node = 0usize;
        for i in (0..len).rev() {
            let bit = ((code >> i) & 1) as usize;
            if i == 0 {
                nodes[node][bit] = LEAF | symbol as u16;
            } else {
                if nodes[node][bit] == NONE {
                    nodes.push([NONE, NONE]);
                    nodes[node][bit] = (nodes.len() - 1) as u16;
                }
                node = usize::from(nodes[node][bit]);
            }
        }
    }
    // The nodes reached from the root by 1 to 7 one bits: where padding may stop.
    let mut may_end = vec![false; nodes.len()];
    may_end[0] = true;
    let mut node = 0usize;
    for _ in 0..7 {
        node = usize::from(nodes[node][1]);
        may_end[node] = true;
    }
    let mut steps = vec![[Step::default(); 16]; nodes.len()];
    for (state, row) in steps.iter_mut().enumerate() {
        for (nibble, step) in row.iter_mut().enumerate() {
            let mut node = state;
            for i in (0..4).rev() {
                let child = nodes[node][(nibble >> i) & 1];
                if child & LEAF != 0 {
                    let symbol = child & !LEAF;
                    if symbol == 256 {
                        step.flags |= FAILS;
                        break;
                    }
                    step.flags |= EMITS;
                    step.symbol = symbol as u8;
                    node = 0;
                } else {
                    node = usize::from(child);
                }
            }
            step.next = node as u8;
            if may_end[node] {
                step.flags |= MAY_END;
            }
        }
    }
    steps
}

/// Decodes a Huffman-coded string (RFC 7541 5.2) onto `out`.
pub fn huffman_decode(coded: &[u8], out: &mut Vec<u8>) -> Result<(), HpackError> {
    let steps = steps();
    out.reserve(coded.len() * 8 / 5);
    let mut state = 0usize;
    let mut may_end = true;
    for &b in coded {
        for nibble in [b >> 4, b & 0x0f] {
            let step = steps[state][usize::from(nibble)];
            if step.flags & FAILS != 0 {
                return Err(HpackError::BadHuffman);
            }
            if step.flags & EMITS != 0 {
                out.push(step.symbol);
            }
            state = usize::from(step.next);
            may_end = step.flags & MAY_END != 0;
        }
    }
    if may_end {
        Ok(())
    } else {
        Err(HpackError::BadHuffman)
    }
}

/// Each symbol's code (right-aligned) and its length in bits, symbols 0 to 255 and EOS (256):
/// RFC 7541 Appendix B.
const CODES: [(u32, u8); 257] = [
    (0x1ff8, 13),
    (0x7fffd8, 23),
    (0xfffffe2, 28),
    (0xfffffe3, 28),
    (0xfffffe4, 28),
    (0xfffffe5, 28),
    (0xfffffe6, 28),
    (0xfffffe7, 28),
    (0xfffffe8, 28),
    (0xffffea, 24),
    (0x3ffffffc, 30),
    (0xfffffe9, 28),
    (0xfffffea, 28),
    (0x3ffffffd, 30),
    (0xfffffeb, 28),
    (0xfffffec, 28),
    (0xfffffed, 28),
    (0xfffffee, 28),
    (0xfffffef, 28),
    (0xffffff0, 28),
    (0xffffff1, 28),
    (0xffffff2, 28),
    (0x3ffffffe, 30),
    (0xffffff3, 28),
    (0xffffff4, 28),
    (0xffffff5, 28),
    (0xffffff6, 28),
    (0xffffff7, 28),
    (0xffffff8, 28),
    (0xffffff9, 28),
    (0xffffffa, 28),
    (0xffffffb, 28),
    (0x14, 6),
    (0x3f8, 10),
    (0x3f9, 10),
    (0xffa, 12),
    (0x1ff9, 13),
    (0x15, 6),
    (0xf8, 8),
    (0x7fa, 11),
    (0x3fa, 10),
    (0x3fb, 10),
    (0xf9, 8),
    (0x7fb, 11),
    (0xfa, 8),
    (0x16, 6),
    (0x17, 6),
    (0x18, 6),
    (0x0, 5),
    (0x1, 5),
    (0x2, 5),
    (0x19, 6),
    (0x1a, 6),
    (0x1b, 6),
    (0x1c, 6),
    (0x1d, 6),
    (0x1e, 6),
    (0x1f, 6),
    (0x5c, 7),
    (0xfb, 8),
    (0x7ffc, 15),
    (0x20, 6),
    (0xffb, 12),
    (0x3fc, 10),
    (0x1ffa, 13),
    (0x21, 6),
    (0x5d, 7),
    (0x5e, 7),
    (0x5f, 7),
    (0x60, 7),
    (0x61, 7),
    (0x62, 7),
    (0x63, 7),
    (0x64, 7),
    (0x65, 7),
    (0x66, 7),
    (0x67, 7),
    (0x68, 7),
    (0x69, 7),
    (0x6a, 7),
    (0x6b, 7),
    (0x6c, 7),
    (0x6d, 7),
    (0x6e, 7),
    (0x6f, 7),
    (0x70, 7),
    (0x71, 7),
    (0x72, 7),
    (0xfc, 8),
    (0x73, 7),
    (0xfd, 8),
    (0x1ffb, 13),
    (0x7fff0, 19),
    (0x1ffc, 13),
    (0x3ffc, 14),
    (0x22, 6),
    (0x7ffd, 15),
    (0x3, 5),
    (0x23, 6),
    (0x4, 5),
    (0x24, 6),
    (0x5, 5),
    (0x25, 6),
    (0x26, 6),
    (0x27, 6),
    (0x6, 5),
    (0x74, 7),
    (0x75, 7),
    (0x28, 6),
    (0x29, 6),
    (0x2a, 6),
    (0x7, 5),
    (0x2b, 6),
    (0x76, 7),
    (0x2c, 6),
    (0x8, 5),
    (0x9, 5),
    (0x2d, 6),
    (0x77, 7),
    (0x78, 7),
    (0x79, 7),
    (0x7a, 7),
    (0x7b, 7),
    (0x7ffe, 15),
    (0x7fc, 11),
    (0x3ffd, 14),
    (0x1ffd, 13),
    (0xffffffc, 28),
    (0xfffe6, 20),
    (0x3fffd2, 22),
    (0xfffe7, 20),
    (0xfffe8, 20),
    (0x3fffd3, 22),
    (0x3fffd4, 22),
    (0x3fffd5, 22),
    (0x7fffd9, 23),
    (0x3fffd6, 22),
    (0x7fffda, 23),
    (0x7fffdb, 23),
    (0x7fffdc, 23),
    (0x7fffdd, 23),
    (0x7fffde, 23),
    (0xffffeb, 24),
    (0x7fffdf, 23),
    (0xffffec, 24),
    (0xffffed, 24),
    (0x3fffd7, 22),
    (0x7fffe0, 23),
    (0xffffee, 24),
    (0x7fffe1, 23),
    (0x7fffe2, 23),
    (0x7fffe3, 23),
    (0x7fffe4, 23),
    (0x1fffdc, 21),
    (0x3fffd8, 22),
    (0x7fffe5, 23),
    (0x3fffd9, 22),
    (0x7fffe6, 23),
    (0x7fffe7, 23),
    (0xffffef, 24),
    (0x3fffda, 22),
    (0x1fffdd, 21),
    (0xfffe9, 20),
    (0x3fffdb, 22),
    (0x3fffdc, 22),
    (0x7fffe8, 23),
    (0x7fffe9, 23),
    (0x1fffde, 21),
    (0x7fffea, 23),
    (0x3fffdd, 22),
    (0x3fffde, 22),
    (0xfffff0, 24),
    (0x1fffdf, 21),
    (0x3fffdf, 22),
    (0x7fffeb, 23),
    (0x7fffec, 23),
    (0x1fffe0, 21),
    (0x1fffe1, 21),
    (0x3fffe0, 22),
    (0x1fffe2, 21),
    (0x7fffed, 23),
    (0x3fffe1, 22),
    (0x7fffee, 23),
    (0x7fffef, 23),
    (0xfffea, 20),
    (0x3fffe2, 22),
    (0x3fffe3, 22),
    (0x3fffe4, 22),
    (0x7ffff0, 23),
    (0x3fffe5, 22),
    (0x3fffe6, 22),
    (0x7ffff1, 23),
    (0x3ffffe0, 26),
    (0x3ffffe1, 26),
    (0xfffeb, 20),
    (0x7fff1, 19),
    (0x3fffe7, 22),
    (0x7ffff2, 23),
    (0x3fffe8, 22),
    (0x1ffffec, 25),
    (0x3ffffe2, 26),
    (0x3ffffe3, 26),
    (0x3ffffe4, 26),
    (0x7ffffde, 27),
    (0x7ffffdf, 27),
    (0x3ffffe5, 26),
    (0xfffff1, 24),
    (0x1ffffed, 25),
    (0x7fff2, 19),
    (0x1fffe3, 21),
    (0x3ffffe6, 26),
    (0x7ffffe0, 27),
    (0x7ffffe1, 27),
    (0x3ffffe7, 26),
    (0x7ffffe2, 27),
    (0xfffff2, 24),
    (0x1fffe4, 21),
    (0x1fffe5, 21),
    (0x3ffffe8, 26),
    (0x3ffffe9, 26),
    (0xffffffd, 28),
    (0x7ffffe3, 27),
    (0x7ffffe4, 27),
    (0x7ffffe5, 27),
    (0xfffec, 20),
    (0xfffff3, 24),
    (0xfffed, 20),
    (0x1fffe6, 21),
    (0x3fffe9, 22),
    (0x1fffe7, 21),
    (0x1fffe8, 21),
    (0x7ffff3, 23),
    (0x3fffea, 22),
    (0x3fffeb, 22),
    (0x1ffffee, 25),
    (0x1ffffef, 25),
    (0xfffff4, 24),
    (0xfffff5, 24),
    (0x3ffffea, 26),
    (0x7ffff4, 23),
    (0x3ffffeb, 26),
    (0x7ffffe6, 27),
    (0x3ffffec, 26),
    (0x3ffffed, 26),
    (0x7ffffe7, 27),
    (0x7ffffe8, 27),
    (0x7ffffe9, 27),
    (0x7ffffea, 27),
    (0x7ffffeb, 27),
    (0xffffffe, 28),
    (0x7ffffec, 27),
    (0x7ffffed, 27),
    (0x7ffffee, 27),
    (0x7ffffef, 27),
    (0x7fffff0, 27),
    (0x3ffffee, 26),
    (0x3fffffff, 30),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, HpackError> {
        let mut out = Vec::new();
        d.decode(block, |n, v| {
            out.push((
                String::from_utf8(n.to_vec()).unwrap(),
                String::from_utf8(v.to_vec()).unwrap(),
            ))
        })?;
        Ok(out)
    }

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    /// RFC 7541 C.3: requests without Huffman coding, the table filled across them.
    #[test]
    fn the_rfcs_requests_without_huffman_decode() {
        let mut d = Decoder::new(4096);
        let first = hex("8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d");
        assert_eq!(
            fields(&mut d, &first).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com")
            ])
        );
        assert_eq!(d.table_size(), 57);
        let second = hex("8286 84be 5808 6e6f 2d63 6163 6865");
        assert_eq!(
            fields(&mut d, &second).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache")
            ])
        );
        assert_eq!(d.table_size(), 110);
        let third = hex("8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65");
        assert_eq!(
            fields(&mut d, &third).unwrap(),
            pairs(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value")
            ])
        );
        assert_eq!(d.table_size(), 164);
    }

    /// RFC 7541 C.4: the same requests Huffman-coded.
    #[test]
    fn the_rfcs_requests_with_huffman_decode() {
        let mut d = Decoder::new(4096);
        let first = hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff");
        assert_eq!(
            fields(&mut d, &first).unwrap()[3],
            (":authority".into(), "www.example.com".into())
        );
        let second = hex("8286 84be 5886 a8eb 1064 9cbf");
        assert_eq!(
            fields(&mut d, &second).unwrap()[4],
            ("cache-control".into(), "no-cache".into())
        );
        let third = hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf");
        assert_eq!(
            fields(&mut d, &third).unwrap()[4],
            ("custom-key".into(), "custom-value".into())
        );
        assert_eq!(d.table_size(), 164);
    }

    /// RFC 7541 C.5: responses through a table of 256 bytes, entries evicted as it fills.
    #[test]
    fn the_rfcs_responses_evict_the_oldest_entries() {
        let mut d = Decoder::new(256);
        let first = hex(
            "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 \
             2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 \
             6c65 2e63 6f6d",
        );
        assert_eq!(
            fields(&mut d, &first).unwrap()[0],
            (":status".into(), "302".into())
        );
        assert_eq!(d.table_size(), 222);
        let second = hex("4803 3330 37c1 c0bf");
        assert_eq!(
            fields(&mut d, &second).unwrap(),
            pairs(&[
                (":status", "307"),
                ("cache-control", "private"),
                ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
                ("location", "https://www.example.com")
            ])
        );
        assert_eq!(d.table_size(), 222);
    }

    #[test]
    fn every_byte_round_trips_through_the_code() {
        // Each symbol's code, packed and padded with ones, decodes to the symbol.
        let mut bits: u64 = 0;
        let mut n = 0u32;
        let mut coded = Vec::new();
        for &(code, len) in &CODES[..256] {
            bits = (bits << len) | u64::from(code);
            n += u32::from(len);
            while n >= 8 {
                n -= 8;
                coded.push((bits >> n) as u8);
            }
            bits &= (1 << n) - 1;
        }
        if n > 0 {
            coded.push(((bits << (8 - n)) | ((1 << (8 - n)) - 1)) as u8);
        }
        let mut out = Vec::new();
        huffman_decode(&coded, &mut out).unwrap();
        assert_eq!(out, (0..=255u8).collect::<Vec<_>>());
    }

    #[test]
    fn bad_huffman_and_bad_blocks_are_errors() {
        let mut out = Vec::new();
        // Padding of 8 ones (longer than 7 bits).
        assert_eq!(
            huffman_decode(&[0xff], &mut out),
            Err(HpackError::BadHuffman)
        );
        // EOS itself (30 ones).
        assert_eq!(
            huffman_decode(&[0xff, 0xff, 0xff, 0xfc], &mut out),
            Err(HpackError::BadHuffman)
        );
        // Padding that is not ones: '0' is 00000, then 000 of padding.
        assert_eq!(
            huffman_decode(&[0x00], &mut out),
            Err(HpackError::BadHuffman)
        );
        // '0' then 111 of padding.
        out.clear();
        huffman_decode(&[0x07], &mut out).unwrap();
        assert_eq!(out, b"0");

        let mut d = Decoder::new(4096);
        assert_eq!(fields(&mut d, &[0x80]), Err(HpackError::BadIndex));
        assert_eq!(fields(&mut d, &[0xbe]), Err(HpackError::BadIndex));
        assert_eq!(
            fields(&mut d, &[0x40, 0x05, b'a']),
            Err(HpackError::Truncated)
        );
        assert_eq!(fields(&mut d, &[0xff]), Err(HpackError::Truncated));
        assert_eq!(
            fields(&mut d, &[0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]),
            Err(HpackError::IntegerOverflow)
        );
        // A size update past the allowed size, and one after a field.
        assert_eq!(
            fields(&mut d, &hex("3fe2 1f")),
            Err(HpackError::TableTooLarge)
        );
        assert_eq!(
            fields(&mut d, &hex("8220")),
            Err(HpackError::LateSizeUpdate)
        );
        // Before the first field it is taken: the table empties.
        let mut d = Decoder::new(4096);
        fields(
            &mut d,
            &hex("400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65"),
        )
        .unwrap();
        assert_eq!(d.table_size(), 54);
        assert_eq!(
            fields(&mut d, &hex("2082")).unwrap(),
            pairs(&[(":method", "GET")])
        );
        assert_eq!(d.table_size(), 0);
        assert_eq!(fields(&mut d, &[0xbe]), Err(HpackError::BadIndex));
    }

    #[test]
    fn an_entry_larger_than_the_table_empties_it() {
        let mut d = Decoder::new(40);
        // custom-key: custom-value is 54 bytes with its overhead: more than 40.
        let block = hex("400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65");
        assert_eq!(
            fields(&mut d, &block).unwrap(),
            pairs(&[("custom-key", "custom-value")])
        );
        assert_eq!(d.table_size(), 0);
    }

    proptest::proptest! {
        /// Any bytes as a Huffman-coded string: the same answer as another decoder's.
        #[test]
        fn huffman_strings_decode_as_another_decoder_decodes_them(
            coded in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
        ) {
            let mut ours = Vec::new();
            let ours = huffman_decode(&coded, &mut ours).map(|()| ours);
            let theirs = loona_hpack::huffman::HuffmanDecoder::new().decode(&coded);
            proptest::prop_assert_eq!(ours.ok(), theirs.ok());
        }

        /// Fields encoded by another encoder (its dynamic table on) decode to the same fields,
        /// block after block, and any bytes decode as the other decoder decodes them.
        #[test]
        fn blocks_decode_as_another_decoder_decodes_them(
            blocks in proptest::collection::vec(
                proptest::collection::vec(
                    (proptest::sample::select(vec![
                        &b":path"[..], b"content-type", b"x-a", b"grpc-timeout", b"cookie",
                    ]), proptest::collection::vec(0x20u8..0x7f, 0..20)),
                    0..6,
                ),
                1..6,
            ),
            noise in proptest::collection::vec(proptest::num::u8::ANY, 0..30),
        ) {
            let mut encoder = loona_hpack::Encoder::new();
            let mut ours = Decoder::new(4096);
            let mut theirs = loona_hpack::Decoder::new();
            for fields in &blocks {
                let block = encoder.encode(fields.iter().map(|(n, v)| (*n, &v[..])));
                theirs.decode(&block).unwrap();
                let mut got = Vec::new();
                ours.decode(&block, |n, v| got.push((n.to_vec(), v.to_vec()))).unwrap();
                let want: Vec<(Vec<u8>, Vec<u8>)> =
                    fields.iter().map(|(n, v)| (n.to_vec(), v.clone())).collect();
                proptest::prop_assert_eq!(got, want);
            }
            let mut got = Vec::new();
            let ours = ours.decode(&noise, |n, v| got.push((n.to_vec(), v.to_vec())));
            let mut want = Vec::new();
            let theirs = theirs.decode_with_cb(&noise, |n, v| {
                want.push((n.into_owned(), v.into_owned()))
            });
            if ours.is_ok() && theirs.is_ok() {
                proptest::prop_assert_eq!(got, want);
            }
        }
    }
}
