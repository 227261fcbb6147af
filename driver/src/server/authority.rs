//! Makes the `:authority` that gRPC clients send on a unix socket acceptable to h2.
//!
//! gRPC's C core (Python `grpcio`, so csc-style tools in Python; Ruby, PHP, C++),
//! grpc-java and grpc-swift send the socket path as `:authority`, e.g. grpcio 1.85
//! sends `tmp%2Fcsi%2Fcsi.sock` for `unix:/tmp/csi/csi.sock`. That is not a URI
//! authority (`%` outside the user info, or `/`), and h2 turns the request into a
//! `RST_STREAM(PROTOCOL_ERROR)` before hyper or tonic see it; h2 has no setting to
//! relax this (hyperium/h2#487 is unmerged). Go clients send `localhost` and work.
//!
//! [`FixAuthority`] wraps each accepted connection and reads the client's HTTP/2
//! frames before h2 does. It decodes every header block with its own HPACK decoder
//! (mirroring the dynamic table the client's encoder fills) and, only where an
//! `:authority` value would be rejected, writes a valid one instead:
//! - a literal is given a value of the same length (each byte outside
//!   `A-Za-z0-9-._~` becomes `_`: `tmp_2Fcsi_2Fcsi.sock`), so an entry it adds to
//!   the dynamic table has the same size on both sides and every index the client
//!   uses later still names the same entry on the server (which now holds the
//!   valid value);
//! - an empty value, which has no same-length replacement, becomes `localhost`
//!   where that leaves the table alone (a literal not indexed, or an indexed field).
//!
//! Everything else passes byte for byte, so h2 still validates every frame and
//! header block itself: a header block with a valid authority (any Go or tonic
//! client) is forwarded unchanged, and anything this decoder cannot follow (not
//! HTTP/2, malformed frames or HPACK, a block over 1 MiB) switches the connection to
//! plain pass-through, which is exactly the behaviour without this wrapper.
//! The value the services see is never used for routing (gRPC routes by `:path`).

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

use super::hpack::*;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame every HTTP/2 peer accepts (the initial SETTINGS_MAX_FRAME_SIZE):
/// a rewritten header block is framed in pieces of at most this.
const SAFE_FRAME: usize = 16_384;
/// A header block (all its frames) longer than this is passed through untouched and
/// the connection is no longer inspected (h2 refuses header lists far smaller).
const MAX_BLOCK: usize = 1 << 20;

/// A connection whose client→server bytes have invalid `:authority` values replaced
/// (see the module docs). Writes go straight to the inner stream.
pub struct FixAuthority<T> {
    inner: T,
    rewriter: Rewriter,
    /// Bytes ready for the reader; `out[out_at..]` not yet read.
    out: Vec<u8>,
    out_at: usize,
    eof: bool,
}

impl<T> FixAuthority<T> {
    pub fn new(inner: T) -> Self {
        FixAuthority {
            inner,
            rewriter: Rewriter::new(),
            out: Vec::new(),
            out_at: 0,
            eof: false,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for FixAuthority<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.out_at < this.out.len() {
                let n = (this.out.len() - this.out_at).min(buf.remaining());
                buf.put_slice(&this.out[this.out_at..this.out_at + n]);
                this.out_at += n;
                if this.out_at == this.out.len() {
                    this.out.clear();
                    this.out_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if this.rewriter.is_passthrough() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                this.rewriter.finish(&mut this.out);
                this.eof = true;
            } else {
                this.rewriter.feed(read.filled(), &mut this.out);
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for FixAuthority<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<T: Connected> Connected for FixAuthority<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// The client→server byte stream's rewriter, independent of any IO.
pub(crate) struct Rewriter {
    mode: Mode,
    /// Received and not yet forwarded: a partial frame (always empty in pass-through).
    pending: Vec<u8>,
    hpack: Decoder,
    logged: bool,
}

enum Mode {
    /// Waiting for the connection preface.
    Preface,
    Frames {
        /// Payload bytes of the current (non-header) frame still to forward as they are.
        skip: usize,
        /// A header block waiting for its CONTINUATION frames.
        block: Option<Block>,
    },
    /// Not inspecting (any more): everything is forwarded as it comes.
    Passthrough,
}

/// A header block as received: its frames' bytes and its parts.
struct Block {
    stream: u32,
    /// The HEADERS frame's flags.
    flags: u8,
    priority: Option<[u8; 5]>,
    raw: Vec<u8>,
    fragment: Vec<u8>,
}

impl Block {
    /// The block from a whole HEADERS frame, or `None` when its padding is invalid.
    fn start(stream: u32, flags: u8, frame: &[u8]) -> Option<Block> {
        let mut p = &frame[FRAME_HEADER..];
        let mut pad = 0;
        if flags & PADDED != 0 {
            pad = *p.first()? as usize;
            p = &p[1..];
        }
        let mut priority = None;
        if flags & PRIORITY != 0 {
            priority = Some(p.get(..5)?.try_into().ok()?);
            p = &p[5..];
        }
        let fragment = p.get(..p.len().checked_sub(pad)?)?.to_vec();
        Some(Block {
            stream,
            flags,
            priority,
            raw: frame.to_vec(),
            fragment,
        })
    }

    /// Writes the block with `fragment` as its header block fragment: a HEADERS frame
    /// (same stream, END_STREAM and priority kept, padding dropped) and CONTINUATION
    /// frames as needed.
    fn emit(&self, fragment: &[u8], out: &mut Vec<u8>) {
        let priority: &[u8] = self.priority.as_ref().map_or(&[], |p| &p[..]);
        let (first, mut rest) =
            fragment.split_at((SAFE_FRAME - priority.len()).min(fragment.len()));
        let mut flags = self.flags & (END_STREAM | PRIORITY);
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        frame_header(
            out,
            priority.len() + first.len(),
            HEADERS,
            flags,
            self.stream,
        );
        out.extend_from_slice(priority);
        out.extend_from_slice(first);
        while !rest.is_empty() {
            let (piece, more) = rest.split_at(SAFE_FRAME.min(rest.len()));
            let flags = if more.is_empty() { END_HEADERS } else { 0 };
            frame_header(out, piece.len(), CONTINUATION, flags, self.stream);
            out.extend_from_slice(piece);
            rest = more;
        }
    }
}

fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

/// What the frame loop does next.
enum Step {
    /// Wait for more bytes.
    More,
    /// Stop inspecting: forward the unfinished block and all that follows as it is.
    GiveUp,
    /// `n` bytes were consumed.
    Consumed(usize),
}

impl Rewriter {
    pub(crate) fn new() -> Self {
        Rewriter {
            mode: Mode::Preface,
            pending: Vec::new(),
            hpack: Decoder::new(),
            logged: false,
        }
    }

    fn is_passthrough(&self) -> bool {
        matches!(self.mode, Mode::Passthrough)
    }

    /// Takes in bytes from the client; appends what may be forwarded to `out`.
    pub(crate) fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) {
        if self.is_passthrough() {
            out.extend_from_slice(input);
            return;
        }
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(input);
        let mut at = 0;
        loop {
            match self.step(&buf[at..], out) {
                Step::Consumed(n) => {
                    at += n;
                    // A step may have given up on the block it just took (and
                    // forwarded it): the rest passes through as it is.
                    if self.is_passthrough() {
                        out.extend_from_slice(&buf[at..]);
                        return;
                    }
                }
                Step::More => {
                    buf.drain(..at);
                    self.pending = buf;
                    return;
                }
                Step::GiveUp => {
                    if let Mode::Frames { block: Some(b), .. } = &self.mode {
                        out.extend_from_slice(&b.raw);
                    }
                    self.mode = Mode::Passthrough;
                    out.extend_from_slice(&buf[at..]);
                    return;
                }
            }
        }
    }

    /// The client closed its side: forwards whatever is held.
    pub(crate) fn finish(&mut self, out: &mut Vec<u8>) {
        if let Mode::Frames { block: Some(b), .. } = &self.mode {
            out.extend_from_slice(&b.raw);
        }
        out.append(&mut self.pending);
        self.mode = Mode::Passthrough;
    }

    fn step(&mut self, rest: &[u8], out: &mut Vec<u8>) -> Step {
        let (skip, block) = match &mut self.mode {
            Mode::Passthrough => unreachable!("feed handles pass-through"),
            Mode::Preface => {
                let n = rest.len().min(PREFACE.len());
                if rest[..n] != PREFACE[..n] {
                    return Step::GiveUp;
                }
                if n < PREFACE.len() {
                    return Step::More;
                }
                out.extend_from_slice(PREFACE);
                self.mode = Mode::Frames {
                    skip: 0,
                    block: None,
                };
                return Step::Consumed(n);
            }
            Mode::Frames { skip, block } => (skip, block),
        };
        if *skip > 0 {
            let n = (*skip).min(rest.len());
            if n == 0 {
                return Step::More;
            }
            out.extend_from_slice(&rest[..n]);
            *skip -= n;
            return Step::Consumed(n);
        }
        if rest.len() < FRAME_HEADER {
            return Step::More;
        }
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        let (kind, flags) = (rest[3], rest[4]);
        let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
        match block {
            None if kind != HEADERS => {
                out.extend_from_slice(&rest[..FRAME_HEADER]);
                *skip = len;
                return Step::Consumed(FRAME_HEADER);
            }
            // Anything but its CONTINUATION inside a header block is a connection
            // error: h2 reports it.
            Some(b) if kind != CONTINUATION || stream != b.stream => return Step::GiveUp,
            _ => {}
        }
        let held = block.as_ref().map_or(0, |b| b.raw.len());
        if held + FRAME_HEADER + len > MAX_BLOCK {
            return Step::GiveUp;
        }
        if rest.len() < FRAME_HEADER + len {
            return Step::More;
        }
        let frame = &rest[..FRAME_HEADER + len];
        match block {
            None => match Block::start(stream, flags, frame) {
                Some(b) => *block = Some(b),
                None => return Step::GiveUp,
            },
            Some(b) => {
                b.raw.extend_from_slice(frame);
                b.fragment.extend_from_slice(&frame[FRAME_HEADER..]);
            }
        }
        if flags & END_HEADERS != 0 {
            let b = block.take().expect("a block");
            match self.hpack.rewrite(&b.fragment) {
                Ok(None) => out.extend_from_slice(&b.raw),
                Ok(Some((fragment, fixed))) => {
                    if !self.logged {
                        self.logged = true;
                        tracing::debug!(authority = %fixed, "replaced a client's invalid :authority");
                    }
                    b.emit(&fragment, out);
                }
                Err(Malformed) => {
                    // Give up with the block forwarded as it came.
                    out.extend_from_slice(&b.raw);
                    self.mode = Mode::Passthrough;
                    return Step::Consumed(frame.len());
                }
            }
        }
        Step::Consumed(frame.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// The code of each symbol, as the canonical layout assigns it.
    fn codes() -> Vec<(u32, usize)> {
        let h = huffman();
        let mut codes = vec![(0, 0); 257];
        for len in 1..=MAX_CODE_LEN {
            for k in 0..h.count[len] {
                let s = h.symbols[h.offset[len] + k as usize];
                codes[s as usize] = (h.first[len] + k, len);
            }
        }
        codes
    }

    fn huffman_encode(s: &[u8]) -> Vec<u8> {
        let codes = codes();
        let (mut acc, mut bits, mut out) = (0u64, 0usize, Vec::new());
        for &c in s {
            let (code, len) = codes[c as usize];
            acc = (acc << len) | code as u64;
            bits += len;
            while bits >= 8 {
                out.push((acc >> (bits - 8)) as u8);
                bits -= 8;
            }
        }
        if bits > 0 {
            out.push(((acc << (8 - bits)) as u8) | (0xff >> bits));
        }
        out
    }

    #[test]
    fn huffman_code_is_rfc_7541() {
        let codes = codes();
        // A few codes from RFC 7541 Appendix B.
        assert_eq!(codes[b'0' as usize], (0x0, 5));
        assert_eq!(codes[b' ' as usize], (0x14, 6));
        assert_eq!(codes[b'a' as usize], (0x3, 5));
        assert_eq!(codes[b'%' as usize], (0x15, 6));
        assert_eq!(codes[b'/' as usize], (0x18, 6));
        assert_eq!(codes[0], (0x1ff8, 13));
        assert_eq!(codes[255], (0x3ffffee, 26));
        assert_eq!(codes[EOS as usize], (0x3fffffff, 30));
        // RFC 7541 C.4.1: "www.example.com".
        assert_eq!(
            huffman_encode(b"www.example.com"),
            [0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff]
        );
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(huffman_decode(&huffman_encode(&all)).unwrap(), all);
        assert_eq!(huffman_decode(&[0xff, 0xff]), None, "padding over 7 bits");
        assert_eq!(huffman_decode(&[0x00]), None, "padding not ones");
        assert_eq!(huffman_decode(&[0xff, 0xff, 0xff, 0xfc]), None, "EOS");
    }

    fn literal(out: &mut Vec<u8>, first: u8, name: &[u8], value: &[u8], huffman: bool) {
        out.push(first);
        if first & 0x3f == 0 || (first & 0xc0 != 0x40 && first & 0x0f == 0) {
            string_literal(out, name);
        }
        if huffman {
            let v = huffman_encode(value);
            let at = out.len();
            string_literal(out, &v);
            out[at] |= 0x80;
        } else {
            string_literal(out, value);
        }
    }

    /// Decodes a block fully (names and values) with the static table and a
    /// dynamic table, as the server would.
    fn decode_all(block: &[u8], table: &mut VecDeque<(Vec<u8>, Vec<u8>)>) -> Vec<(String, String)> {
        let mut pos = 0;
        let mut fields = Vec::new();
        let lookup = |table: &VecDeque<(Vec<u8>, Vec<u8>)>, i: usize| -> (Vec<u8>, Vec<u8>) {
            match i {
                1 => (b":authority".to_vec(), Vec::new()),
                2..=61 => (STATIC_NAMES[i - 1].as_bytes().to_vec(), b"?".to_vec()),
                _ => table[i - 62].clone(),
            }
        };
        while pos < block.len() {
            let first = block[pos];
            let field = if first & 0x80 != 0 {
                let i = integer(block, &mut pos, 7).unwrap();
                lookup(table, i)
            } else if first & 0xe0 == 0x20 {
                integer(block, &mut pos, 5).unwrap();
                continue;
            } else {
                let indexing = first & 0xc0 == 0x40;
                let i = integer(block, &mut pos, if indexing { 6 } else { 4 }).unwrap();
                let name = if i == 0 {
                    string(block, &mut pos).unwrap().into_owned()
                } else {
                    lookup(table, i).0
                };
                let value = string(block, &mut pos).unwrap().into_owned();
                if indexing {
                    table.push_front((name.clone(), value.clone()));
                }
                (name, value)
            };
            fields.push((
                String::from_utf8(field.0).unwrap(),
                String::from_utf8(field.1).unwrap(),
            ));
        }
        fields
    }

    fn authority(fields: &[(String, String)]) -> Option<&str> {
        fields
            .iter()
            .find(|(n, _)| n == ":authority")
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn grpcio_authority_is_replaced_and_table_stays_in_step() {
        // What grpcio 1.85 sends for `unix:/tmp/x.sock`, then a second request
        // that refers to it through the dynamic table.
        let mut first = Vec::new();
        literal(&mut first, 0x40, b":path", b"/csi.v1.Identity/Probe", false);
        literal(&mut first, 0x40, b":authority", b"tmp%2Fx.sock", false);
        first.push(0x83); // :method POST
        literal(&mut first, 0x40, b"te", b"trailers", true);
        let second = [0xbe, 0xbf, 0x83, 0xc0]; // te, :authority, POST, :path

        let mut d = Decoder::new();
        let mut server = VecDeque::new();
        let (out, fixed) = d.rewrite(&first).unwrap().expect("rewritten");
        assert_eq!(fixed, "tmp_2Fx.sock");
        let fields = decode_all(&out, &mut server);
        assert_eq!(authority(&fields), Some("tmp_2Fx.sock"));
        assert_eq!(fields.len(), 4);
        assert_eq!(d.table.len(), 3);
        assert_eq!(d.rewrite(&second).unwrap(), None, "indexed fields pass");
        let fields = decode_all(&second, &mut server);
        assert_eq!(authority(&fields), Some("tmp_2Fx.sock"));
        assert_eq!(fields[0], ("te".into(), "trailers".into()));
        assert_eq!(fields[3].1, "/csi.v1.Identity/Probe");
    }

    #[test]
    fn other_forms_are_replaced() {
        // grpc-java: the raw path, Huffman-coded, literal without indexing, name
        // indexed (static 1).
        let mut b = Vec::new();
        literal(&mut b, 0x01, b"", b"/var/run/csi.sock", true);
        let (out, _) = Decoder::new().rewrite(&b).unwrap().unwrap();
        let fields = decode_all(&out, &mut VecDeque::new());
        assert_eq!(authority(&fields), Some("_var_run_csi.sock"));

        // Never indexed, empty value: localhost.
        let mut b = Vec::new();
        literal(&mut b, 0x11, b"", b"", false);
        let (out, _) = Decoder::new().rewrite(&b).unwrap().unwrap();
        assert_eq!(
            authority(&decode_all(&out, &mut VecDeque::new())),
            Some("localhost")
        );

        // The static entry itself (empty value).
        let (out, _) = Decoder::new().rewrite(&[0x81]).unwrap().unwrap();
        assert_eq!(
            authority(&decode_all(&out, &mut VecDeque::new())),
            Some("localhost")
        );

        // Indexed, empty: cannot be replaced in the literal (the entry's size must
        // stay), but its later uses are.
        let mut d = Decoder::new();
        let mut b = Vec::new();
        literal(&mut b, 0x41, b"", b"", false);
        assert_eq!(d.rewrite(&b).unwrap(), None);
        let (out, _) = d.rewrite(&[0xbe]).unwrap().unwrap();
        assert_eq!(
            authority(&decode_all(&out, &mut VecDeque::new())),
            Some("localhost")
        );
    }

    #[test]
    fn valid_authorities_and_other_fields_pass_unchanged() {
        let mut d = Decoder::new();
        for value in [
            &b"localhost"[..],
            b"fencecsi.invalid",
            b"127.0.0.1:80",
            b"[::1]:5",
        ] {
            let mut b = Vec::new();
            literal(&mut b, 0x41, b"", value, true);
            literal(&mut b, 0x40, b"x-path", b"/a/b%2F", false);
            assert_eq!(d.rewrite(&b).unwrap(), None, "{value:?}");
        }
        // Eviction: the table stays within its size.
        assert!(d.size <= HEADER_TABLE_SIZE);
        assert_eq!(
            d.rewrite(&[0x3f, 0xe2, 0x1f]),
            Err(Malformed),
            "size update over 4096"
        );
        assert_eq!(d.rewrite(&[0x80]), Err(Malformed), "index 0");
        assert_eq!(
            d.rewrite(&[0xff, 0x7f]),
            Err(Malformed),
            "index past the table"
        );
    }

    #[test]
    fn eviction_follows_the_client() {
        let mut d = Decoder::new();
        // 100 entries of 10 + 32 + 32 bytes: the oldest are evicted past 4096.
        let size = 10 + 32 + 32;
        for i in 0..100 {
            let mut b = Vec::new();
            literal(
                &mut b,
                0x40,
                b":authority",
                format!("tmp%2Fs{i:025}").as_bytes(),
                false,
            );
            d.rewrite(&b).unwrap().unwrap();
        }
        assert_eq!(d.table.len(), 4096 / size);
        assert_eq!(d.size, size * (4096 / size));
        d.rewrite(&[0x20]).unwrap(); // size update to 0
        assert!(d.table.is_empty());
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::new();
        frame_header(&mut f, payload.len(), kind, flags, stream);
        f.extend_from_slice(payload);
        f
    }

    /// Splits a byte stream into frames (after the preface).
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert!(b.starts_with(PREFACE));
        b = &b[PREFACE.len()..];
        let mut v = Vec::new();
        while !b.is_empty() {
            let len = u32::from_be_bytes([0, b[0], b[1], b[2]]) as usize;
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            v.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        v
    }

    fn run(input: &[u8], chunk: usize) -> Vec<u8> {
        let mut r = Rewriter::new();
        let mut out = Vec::new();
        for c in input.chunks(chunk) {
            r.feed(c, &mut out);
        }
        r.finish(&mut out);
        out
    }

    /// A header block the decoder cannot follow (index 0) in the middle of the stream:
    /// everything, that block and what follows it, passes through as it came, in any
    /// chunking, and nothing panics (h2 then answers the malformed block itself).
    #[test]
    fn an_undecodable_block_and_everything_after_it_pass_through() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &[0x80]));
        input.extend(frame(HEADERS, END_HEADERS, 3, &[0x82, 0x86]));
        input.extend(frame(0x0, END_STREAM, 3, b"data"));
        for chunk in [1, 3, 7, 64, input.len()] {
            assert_eq!(run(&input, chunk), input, "chunk {chunk}");
        }
    }

    #[test]
    fn frames_are_rewritten_in_any_chunking() {
        let mut block = Vec::new();
        literal(&mut block, 0x40, b":authority", b"tmp%2Fx.sock", false);
        block.push(0x83);
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 0]));
        // Padded, with priority, split into a CONTINUATION.
        let mut payload = vec![2u8, 0, 0, 0, 0, 16];
        payload.extend_from_slice(&block[..5]);
        payload.extend_from_slice(&[0, 0]);
        input.extend(frame(HEADERS, PADDED | PRIORITY | END_STREAM, 1, &payload));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, &block[5..]));
        input.extend(frame(0x0, END_STREAM, 3, &[0; 40]));
        for chunk in [1, 2, 7, 9, 1000] {
            let out = run(&input, chunk);
            let f = frames(&out);
            assert_eq!(f.len(), 3, "chunk {chunk}");
            assert_eq!(f[0], (0x4, 0, 0, vec![0, 3, 0, 0, 0, 0]));
            let (kind, flags, stream, payload) = &f[1];
            assert_eq!(
                (*kind, *flags, *stream),
                (HEADERS, PRIORITY | END_STREAM | END_HEADERS, 1)
            );
            assert_eq!(&payload[..5], &[0, 0, 0, 0, 16]);
            let fields = decode_all(&payload[5..], &mut VecDeque::new());
            assert_eq!(authority(&fields), Some("tmp_2Fx.sock"));
            assert_eq!(f[2], (0x0, END_STREAM, 3, vec![0; 40]));
        }
    }

    #[test]
    fn valid_streams_pass_byte_for_byte() {
        let mut block = Vec::new();
        literal(&mut block, 0x41, b"", b"localhost", true);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        input.extend(frame(0x0, END_STREAM, 1, &[7; 20000]));
        for chunk in [1, 13, 16384] {
            assert_eq!(run(&input, chunk), input);
        }
        // Not HTTP/2, a truncated frame, a bad CONTINUATION: passed through as they are.
        assert_eq!(run(b"GET / HTTP/1.1\r\n\r\n", 3), b"GET / HTTP/1.1\r\n\r\n");
        let mut cut = PREFACE.to_vec();
        cut.extend(&frame(HEADERS, 0, 1, &block)[..8]);
        assert_eq!(run(&cut, 5), cut);
        let mut bad = PREFACE.to_vec();
        bad.extend(frame(HEADERS, 0, 1, &block));
        bad.extend(frame(CONTINUATION, END_HEADERS, 3, &[0x83]));
        bad.extend(frame(0x0, 0, 1, &[1, 2, 3]));
        assert_eq!(run(&bad, 4), bad);
    }

    #[test]
    fn large_rewritten_blocks_are_split() {
        let mut block = Vec::new();
        literal(&mut block, 0x40, b":authority", b"tmp%2Fx.sock", false);
        literal(&mut block, 0x00, b"x-big", &[b'a'; 40000], false);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, 0, 5, &block[..20000]));
        input.extend(frame(CONTINUATION, END_HEADERS, 5, &block[20000..]));
        let f = frames(&run(&input, 4096));
        assert_eq!(f.len(), 3);
        assert!(f
            .iter()
            .all(|(_, _, s, p)| *s == 5 && p.len() <= SAFE_FRAME));
        assert_eq!((f[0].0, f[0].1), (HEADERS, 0));
        assert_eq!((f[1].0, f[1].1), (CONTINUATION, 0));
        assert_eq!((f[2].0, f[2].1), (CONTINUATION, END_HEADERS));
        let all: Vec<u8> = f.iter().flat_map(|x| x.3.clone()).collect();
        let fields = decode_all(&all, &mut VecDeque::new());
        assert_eq!(authority(&fields), Some("tmp_2Fx.sock"));
        assert_eq!(fields[1].1.len(), 40000);
    }
}
