//! The HPACK (RFC 7541) decoding that [`super::authority`] needs: integers, string
//! literals with Huffman coding, the static table, and a decoder that follows the client's
//! dynamic table entry by entry (sizes and which entries are `:authority`, not values).
//! Hand-written: the HPACK crates decode header lists but do not say where in the block
//! each literal lies, which the in-place rewrite of one value needs.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::OnceLock;

/// The dynamic table size the server allows (SETTINGS_HEADER_TABLE_SIZE): h2's
/// default, which hyper and tonic keep. A client asking for more is refused by h2;
/// this decoder then stops inspecting the connection.
pub(super) const HEADER_TABLE_SIZE: usize = 4096;

/// HPACK the decoder here cannot follow (h2 will refuse it too).
#[derive(Debug, PartialEq)]
pub(super) struct Malformed;

/// What the decoder keeps of a dynamic table entry.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    pub(super) name_len: usize,
    /// name + value + 32, as RFC 7541 counts it.
    pub(super) size: usize,
    pub(super) authority: bool,
    /// The value the server holds is not a valid authority.
    pub(super) bad: bool,
}

/// An HPACK decoder that follows the client's dynamic table (sizes and which
/// entries are `:authority`, not the values) and rewrites header blocks.
pub(super) struct Decoder {
    pub(super) table: VecDeque<Entry>,
    pub(super) size: usize,
    pub(super) max: usize,
}

impl Decoder {
    pub(super) fn new() -> Self {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max: HEADER_TABLE_SIZE,
        }
    }

    pub(super) fn entry(&self, index: usize) -> Result<Entry, Malformed> {
        match index {
            0 => Err(Malformed),
            1..=61 => {
                let name_len = STATIC_NAMES[index - 1].len();
                Ok(Entry {
                    name_len,
                    size: 0,
                    authority: index == 1,
                    // `:authority` with an empty value.
                    bad: index == 1,
                })
            }
            _ => self.table.get(index - 62).copied().ok_or(Malformed),
        }
    }

    pub(super) fn insert(&mut self, e: Entry) {
        while self.size + e.size > self.max {
            match self.table.pop_back() {
                Some(old) => self.size -= old.size,
                None => return, // larger than the whole table: not added
            }
        }
        self.size += e.size;
        self.table.push_front(e);
    }

    pub(super) fn resize(&mut self, max: usize) -> Result<(), Malformed> {
        if max > HEADER_TABLE_SIZE {
            return Err(Malformed);
        }
        self.max = max;
        while self.size > self.max {
            let old = self.table.pop_back().expect("size counts entries");
            self.size -= old.size;
        }
        Ok(())
    }

    /// Decodes one header block, keeping the table in step. `Ok(None)`: forward the
    /// block unchanged; `Ok(Some((block, value)))`: forward `block` instead, where an
    /// invalid `:authority` became `value` (the last one replaced).
    pub(super) fn rewrite(&mut self, block: &[u8]) -> Result<Option<(Vec<u8>, String)>, Malformed> {
        let mut out = Vec::with_capacity(block.len() + 16);
        let mut fixed = None;
        let mut pos = 0;
        while pos < block.len() {
            let start = pos;
            let first = block[pos];
            if first & 0x80 != 0 {
                // Indexed field.
                let e = self.entry(integer(block, &mut pos, 7)?)?;
                if e.authority && e.bad {
                    out.push(0x01); // literal without indexing, name: static :authority
                    string_literal(&mut out, LOCALHOST);
                    fixed = Some(LOCALHOST.to_vec());
                } else {
                    out.extend_from_slice(&block[start..pos]);
                }
                continue;
            }
            if first & 0xe0 == 0x20 {
                // Dynamic table size update.
                self.resize(integer(block, &mut pos, 5)?)?;
                out.extend_from_slice(&block[start..pos]);
                continue;
            }
            // A literal: with incremental indexing (01), without (0000) or never (0001).
            let indexing = first & 0xc0 == 0x40;
            let index = integer(block, &mut pos, if indexing { 6 } else { 4 })?;
            let (name_len, authority) = if index == 0 {
                let name = string(block, &mut pos)?;
                (name.len(), &*name == b":authority")
            } else {
                let e = self.entry(index)?;
                (e.name_len, e.authority)
            };
            let name_end = pos;
            let value = string(block, &mut pos)?;
            let mut bad = false;
            match authority.then(|| replacement(&value, indexing)).flatten() {
                Some(Ok(v)) => {
                    out.extend_from_slice(&block[start..name_end]);
                    string_literal(&mut out, &v);
                    fixed = Some(v);
                }
                Some(Err(())) => {
                    bad = true;
                    out.extend_from_slice(&block[start..pos]);
                }
                None => out.extend_from_slice(&block[start..pos]),
            }
            if indexing {
                self.insert(Entry {
                    name_len,
                    size: name_len + value.len() + 32,
                    authority,
                    bad,
                });
            }
        }
        Ok(fixed.map(|v| (out, String::from_utf8_lossy(&v).into_owned())))
    }
}

pub(super) const LOCALHOST: &[u8] = b"localhost";

/// For an `:authority` value: `None` when h2 accepts it; else `Some(Ok(value))` to
/// send instead, or `Some(Err(()))` when no replacement keeps the table in step.
pub(super) fn replacement(value: &[u8], indexing: bool) -> Option<Result<Vec<u8>, ()>> {
    if valid_authority(value) {
        return None;
    }
    if value.is_empty() {
        return Some(if indexing {
            Err(())
        } else {
            Ok(LOCALHOST.to_vec())
        });
    }
    let same_len: Vec<u8> = value
        .iter()
        .map(|&c| {
            if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                c
            } else {
                b'_'
            }
        })
        .collect();
    Some(if valid_authority(&same_len) {
        Ok(same_len)
    } else {
        Err(())
    })
}

/// h2's own test (it parses `:authority` into an `http::uri::Authority`).
pub(super) fn valid_authority(v: &[u8]) -> bool {
    http::uri::Authority::try_from(v).is_ok()
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
pub(super) fn integer(buf: &[u8], pos: &mut usize, n: u8) -> Result<usize, Malformed> {
    let mask = ((1u16 << n) - 1) as u8;
    let first = buf.get(*pos).ok_or(Malformed)? & mask;
    *pos += 1;
    if first < mask {
        return Ok(first as usize);
    }
    let mut value = mask as usize;
    let mut shift = 0;
    loop {
        let b = *buf.get(*pos).ok_or(Malformed)?;
        *pos += 1;
        value += ((b & 0x7f) as usize) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
        shift += 7;
        if shift > 28 {
            return Err(Malformed);
        }
    }
}

/// An HPACK string literal (RFC 7541 §5.2), Huffman-decoded when so encoded.
pub(super) fn string<'a>(buf: &'a [u8], pos: &mut usize) -> Result<Cow<'a, [u8]>, Malformed> {
    let huffman = buf.get(*pos).ok_or(Malformed)? & 0x80 != 0;
    let len = integer(buf, pos, 7)?;
    let raw = buf
        .get(*pos..pos.checked_add(len).ok_or(Malformed)?)
        .ok_or(Malformed)?;
    *pos += len;
    if huffman {
        huffman_decode(raw).map(Cow::Owned).ok_or(Malformed)
    } else {
        Ok(Cow::Borrowed(raw))
    }
}

/// Writes `s` as a plain (not Huffman) string literal.
pub(super) fn string_literal(out: &mut Vec<u8>, s: &[u8]) {
    let mut len = s.len();
    if len < 127 {
        out.push(len as u8);
    } else {
        out.push(127);
        len -= 127;
        while len >= 128 {
            out.push((len % 128) as u8 | 0x80);
            len /= 128;
        }
        out.push(len as u8);
    }
    out.extend_from_slice(s);
}

/// The static table's names (RFC 7541 Appendix A): only their lengths count here.
pub(super) const STATIC_NAMES: [&str; 61] = [
    ":authority",
    ":method",
    ":method",
    ":path",
    ":path",
    ":scheme",
    ":scheme",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "accept",
    "access-control-allow-origin",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-range",
    "content-type",
    "cookie",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "link",
    "location",
    "max-forwards",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "refresh",
    "retry-after",
    "server",
    "set-cookie",
    "strict-transport-security",
    "transfer-encoding",
    "user-agent",
    "vary",
    "via",
    "www-authenticate",
];

/// The Huffman code's lengths for bytes 0..=255 (RFC 7541 Appendix B); EOS (256)
/// has 30 bits. The code is canonical (codes ascend with length, then symbol), so
/// the lengths define it.
pub(super) const HUFFMAN_LENGTHS: [u8; 256] = [
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
];
pub(super) const EOS: u16 = 256;
pub(super) const MAX_CODE_LEN: usize = 30;

/// The canonical code laid out for decoding: for each length, its first code, how
/// many codes it has and where its symbols start in `symbols`.
pub(super) struct Huffman {
    pub(super) first: [u32; MAX_CODE_LEN + 1],
    pub(super) count: [u32; MAX_CODE_LEN + 1],
    pub(super) offset: [usize; MAX_CODE_LEN + 1],
    /// Symbols ordered by (length, symbol), i.e. by code.
    pub(super) symbols: Vec<u16>,
}

pub(super) fn huffman() -> &'static Huffman {
    static TABLE: OnceLock<Huffman> = OnceLock::new();
    TABLE.get_or_init(|| {
        let len_of = |s: u16| {
            if s == EOS {
                MAX_CODE_LEN
            } else {
                HUFFMAN_LENGTHS[s as usize] as usize
            }
        };
        let mut symbols: Vec<u16> = (0..=EOS).collect();
        symbols.sort_by_key(|&s| (len_of(s), s));
        let mut h = Huffman {
            first: [0; MAX_CODE_LEN + 1],
            count: [0; MAX_CODE_LEN + 1],
            offset: [0; MAX_CODE_LEN + 1],
            symbols,
        };
        for &s in &h.symbols {
            h.count[len_of(s)] += 1;
        }
        let (mut code, mut index) = (0u32, 0usize);
        for len in 1..=MAX_CODE_LEN {
            h.first[len] = code;
            h.offset[len] = index;
            code = (code + h.count[len]) << 1;
            index += h.count[len] as usize;
        }
        h
    })
}

/// Decodes a Huffman-coded string; `None` on an invalid code, EOS or bad padding.
pub(super) fn huffman_decode(src: &[u8]) -> Option<Vec<u8>> {
    let h = huffman();
    let mut out = Vec::with_capacity(src.len() * 8 / 5);
    let (mut code, mut len) = (0u32, 0usize);
    for &byte in src {
        for bit in (0..8).rev() {
            code = (code << 1) | ((byte >> bit) & 1) as u32;
            len += 1;
            if len > MAX_CODE_LEN {
                return None;
            }
            let k = code.wrapping_sub(h.first[len]);
            if code >= h.first[len] && k < h.count[len] {
                let s = h.symbols[h.offset[len] + k as usize];
                if s == EOS {
                    return None;
                }
                out.push(s as u8);
                code = 0;
                len = 0;
            }
        }
    }
    // Padding: at most 7 bits, all ones (a prefix of EOS).
    if len > 7 || code != (1u32 << len) - 1 {
        return None;
    }
    Some(out)
}
