//! Makes every gRPC client's `:authority` acceptable to the HTTP/2 server.
//!
//! Why: over a Unix socket a client has no host to name, and gRPC
//! implementations disagree on what to send. grpc-go, tonic and grpc-core up
//! to ~1.5x send `localhost`; newer grpc-core (Python's and Ruby's grpcio,
//! C++; seen with grpcio 1.85) sends the socket path percent-encoded, e.g.
//! `tmp%2Frivet%2Fsvc-ipam.sock`, and others send an empty one. h2 parses the
//! pseudo-header with `http::uri::Authority`, which refuses `%` outside the
//! userinfo (and an empty authority), and answers such a request with
//! RST_STREAM PROTOCOL_ERROR: the client sees `INTERNAL: Stream removed
//! (RST_STREAM ... error code 1)`. h2 has no option to relax that, and
//! vendored crates are not patched here.
//!
//! How: [`NormalizedAuthority`] sits between the accepted socket and h2 and
//! rewrites the client's bytes ([`AuthorityRewriter`]). It follows the
//! HTTP/2 framing and HPACK-decodes the first request's header block:
//! - if every `:authority` in it parses (all of Rivet's own clients), it
//!   forwards that block unchanged and passes the rest of the connection
//!   through untouched (no further parsing);
//! - otherwise it replaces each `:authority` that does not parse with
//!   `localhost` (what the other clients send; a Unix-socket server routes
//!   by path only, so the value means nothing to it) and from then on
//!   re-encodes every header block of the connection: HPACK is stateful, so
//!   once one block changed, h2 must see every later block encoded by us.
//!   The re-encoding uses literals without indexing only, so h2's dynamic
//!   table stays empty and never depends on the client's.
//!
//! Anything else (not HTTP/2, a header block HPACK cannot decode while only
//! inspecting) is passed through as it came, for h2 to answer as it would.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The HTTP/2 client connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Frame header length.
const FRAME_HEADER: usize = 9;

/// Frame types (RFC 9113 §6).
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;

/// Frame flags.
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// The largest frame payload every HTTP/2 peer accepts (the default and
/// minimum SETTINGS_MAX_FRAME_SIZE): re-encoded blocks are split to it.
const MAX_FRAME_PAYLOAD: usize = 16_384;

/// The HPACK dynamic table size the server advertises (h2's default
/// SETTINGS_HEADER_TABLE_SIZE; Rivet's servers do not change it).
const HEADER_TABLE_SIZE: usize = 4_096;

/// A header block (HEADERS and its CONTINUATIONs) larger than this is not
/// buffered: h2's own header list limit (16 KiB with hyper) is far below.
pub const MAX_HEADER_BLOCK: usize = 1 << 20;

/// What replaces an `:authority` h2 would refuse.
pub const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";

/// Where the rewriter is in the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Matching the client preface.
    Preface,
    /// Following frames until the first header block is judged.
    Inspect,
    /// Re-encoding every header block (one needed a new authority).
    Rewrite,
    /// Everything passes as it comes.
    Transparent,
}

/// The header block being collected: its HEADERS frame's stream, flags and
/// priority fields, the fragments so far, and the raw frames (to forward
/// them unchanged).
#[derive(Debug)]
struct PendingBlock {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    raw: Vec<u8>,
}

/// HTTP/2 framing the rewriter must understand and cannot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FramingViolation {
    /// A frame other than CONTINUATION inside a header block.
    #[error("a frame of type {kind:#x} inside the header block of stream {stream}")]
    FrameInsideBlock {
        /// The frame's type.
        kind: u8,
        /// The stream of the header block.
        stream: u32,
    },
    /// A header block larger than the rewriter buffers.
    #[error("a header block of stream {stream} over {MAX_HEADER_BLOCK} bytes")]
    BlockTooLarge {
        /// The stream.
        stream: u32,
    },
    /// A HEADERS frame whose padding or priority does not fit.
    #[error("a malformed HEADERS frame on stream {stream}")]
    MalformedHeaders {
        /// The stream.
        stream: u32,
    },
    /// HEADERS inside a block, or CONTINUATION outside one (or of another stream).
    #[error(
        "a {} frame on stream {stream} where {} was expected",
        if *headers { "HEADERS" } else { "CONTINUATION" },
        if *in_block { "a CONTINUATION" } else { "no header block" }
    )]
    UnexpectedFrame {
        /// The stream.
        stream: u32,
        /// HEADERS (else CONTINUATION).
        headers: bool,
        /// Whether a header block was open.
        in_block: bool,
    },
}

/// Why a connection is cut.
#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    /// Frames that break HTTP/2 framing where the rewriter must understand them.
    #[error("HTTP/2 framing: {0}")]
    Framing(#[from] FramingViolation),
    /// A header block HPACK cannot decode after the connection was rewritten.
    #[error("HPACK: header block of stream {stream}: {reason}")]
    Hpack {
        /// The stream.
        stream: u32,
        /// The decoder's error.
        reason: String,
    },
}

impl From<RewriteError> for io::Error {
    fn from(e: RewriteError) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// The pure core of [`NormalizedAuthority`]: bytes from the client in, bytes
/// for h2 out (see the module docs).
///
/// ```
/// use rivet_common::h2_authority::AuthorityRewriter;
/// let mut r = AuthorityRewriter::new();
/// // Not HTTP/2: passed through as it came.
/// assert_eq!(r.feed(b"GET / HTTP/1.1\r\n\r\n").unwrap(), b"GET / HTTP/1.1\r\n\r\n");
/// ```
pub struct AuthorityRewriter {
    mode: Mode,
    /// Input not consumed yet.
    input: Vec<u8>,
    /// Payload bytes of a frame being passed through that are still to come.
    passing: usize,
    block: Option<PendingBlock>,
    decoder: loona_hpack::Decoder<'static>,
    rewritten: u64,
}

impl std::fmt::Debug for AuthorityRewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthorityRewriter")
            .field("mode", &self.mode)
            .field("buffered", &self.input.len())
            .field("rewritten", &self.rewritten)
            .finish_non_exhaustive()
    }
}

impl Default for AuthorityRewriter {
    fn default() -> Self {
        Self::new()
    }
}

impl AuthorityRewriter {
    /// A rewriter at the start of a connection.
    pub fn new() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        Self {
            mode: Mode::Preface,
            input: Vec::new(),
            passing: 0,
            block: None,
            decoder,
            rewritten: 0,
        }
    }

    /// How many `:authority` values were replaced so far.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Whether the rest of the connection passes through untouched.
    pub fn is_transparent(&self) -> bool {
        self.mode == Mode::Transparent
    }

    /// Takes bytes read from the client; returns what h2 may read now (empty
    /// when more input is needed to finish a frame).
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<u8>, RewriteError> {
        let mut out = Vec::new();
        if self.mode == Mode::Transparent {
            out.extend_from_slice(bytes);
            return Ok(out);
        }
        self.input.extend_from_slice(bytes);
        let mut consumed = 0;
        let result = self.run(&mut consumed, &mut out);
        self.input.drain(..consumed);
        if self.mode == Mode::Transparent {
            out.append(&mut self.input);
        }
        result.map(|()| out)
    }

    /// The bytes still held when the client closed (a cut frame): given to
    /// h2 as they came, so it reports the truncation as it would.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = self.block.take().map(|b| b.raw).unwrap_or_default();
        out.append(&mut self.input);
        self.mode = Mode::Transparent;
        out
    }

    fn run(&mut self, consumed: &mut usize, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        loop {
            let available = &self.input[*consumed..];
            match self.mode {
                Mode::Transparent => return Ok(()),
                Mode::Preface => {
                    let n = available.len().min(PREFACE.len());
                    if available[..n] != PREFACE[..n] {
                        self.mode = Mode::Transparent;
                        return Ok(());
                    }
                    if n < PREFACE.len() {
                        return Ok(());
                    }
                    out.extend_from_slice(PREFACE);
                    *consumed += PREFACE.len();
                    self.mode = Mode::Inspect;
                }
                Mode::Inspect | Mode::Rewrite if self.passing > 0 => {
                    let n = available.len().min(self.passing);
                    if n == 0 {
                        return Ok(());
                    }
                    out.extend_from_slice(&available[..n]);
                    *consumed += n;
                    self.passing -= n;
                }
                Mode::Inspect | Mode::Rewrite => {
                    if available.len() < FRAME_HEADER {
                        return Ok(());
                    }
                    let length = u32::from_be_bytes([0, available[0], available[1], available[2]]) as usize;
                    let kind = available[3];
                    let flags = available[4];
                    let stream =
                        u32::from_be_bytes([available[5], available[6], available[7], available[8]]) & 0x7fff_ffff;
                    let in_block = self.block.is_some();
                    if kind != HEADERS && kind != CONTINUATION {
                        if in_block {
                            return self.framing(FramingViolation::FrameInsideBlock { kind, stream }, out);
                        }
                        out.extend_from_slice(&available[..FRAME_HEADER]);
                        *consumed += FRAME_HEADER;
                        self.passing = length;
                        continue;
                    }
                    let buffered = self.block.as_ref().map_or(0, |b| b.raw.len());
                    if buffered + FRAME_HEADER + length > MAX_HEADER_BLOCK {
                        return self.framing(FramingViolation::BlockTooLarge { stream }, out);
                    }
                    if available.len() < FRAME_HEADER + length {
                        return Ok(());
                    }
                    let frame = &available[..FRAME_HEADER + length];
                    let payload = &frame[FRAME_HEADER..];
                    match (kind, self.block.as_mut()) {
                        (HEADERS, None) => {
                            let (priority, fragment) = match split_headers_payload(flags, payload) {
                                Some(parts) => parts,
                                None => {
                                    return self.framing(FramingViolation::MalformedHeaders { stream }, out);
                                }
                            };
                            self.block = Some(PendingBlock {
                                stream,
                                end_stream: flags & END_STREAM != 0,
                                priority,
                                fragment: fragment.to_vec(),
                                raw: frame.to_vec(),
                            });
                        }
                        (CONTINUATION, Some(block)) if block.stream == stream => {
                            block.fragment.extend_from_slice(payload);
                            block.raw.extend_from_slice(frame);
                        }
                        _ => {
                            return self.framing(
                                FramingViolation::UnexpectedFrame {
                                    stream,
                                    headers: kind == HEADERS,
                                    in_block,
                                },
                                out,
                            );
                        }
                    }
                    *consumed += FRAME_HEADER + length;
                    if flags & END_HEADERS != 0 {
                        let block = self.block.take().expect("a block was just extended");
                        self.finish_block(block, out)?;
                    }
                }
            }
        }
    }

    /// Broken framing: while only inspecting, h2 gets the bytes and says so
    /// itself; once rewriting, the connection cannot go on.
    fn framing(&mut self, reason: FramingViolation, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        if self.mode == Mode::Inspect {
            tracing::debug!(%reason, "passing the connection to h2 as it came");
            out.extend(self.block.take().map(|b| b.raw).unwrap_or_default());
            self.mode = Mode::Transparent;
            return Ok(());
        }
        Err(RewriteError::Framing(reason))
    }

    fn finish_block(&mut self, block: PendingBlock, out: &mut Vec<u8>) -> Result<(), RewriteError> {
        let headers = match self.decoder.decode(&block.fragment) {
            Ok(headers) => headers,
            Err(e) if self.mode == Mode::Inspect => {
                tracing::debug!(stream = block.stream, error = ?e, "undecodable first header block; passing it to h2");
                out.extend_from_slice(&block.raw);
                self.mode = Mode::Transparent;
                return Ok(());
            }
            Err(e) => {
                return Err(RewriteError::Hpack {
                    stream: block.stream,
                    reason: format!("{e:?}"),
                });
            }
        };
        let refused = |(name, value): &(Vec<u8>, Vec<u8>)| {
            name.as_slice() == b":authority" && http::uri::Authority::try_from(value.as_slice()).is_err()
        };
        if self.mode == Mode::Inspect && !headers.iter().any(refused) {
            out.extend_from_slice(&block.raw);
            self.mode = Mode::Transparent;
            return Ok(());
        }
        if self.mode == Mode::Inspect {
            self.mode = Mode::Rewrite;
        }
        let mut encoded = Vec::new();
        for header in &headers {
            let value = if refused(header) {
                self.rewritten += 1;
                tracing::debug!(
                    stream = block.stream,
                    authority = %String::from_utf8_lossy(&header.1),
                    "replacing an :authority h2 would refuse with localhost"
                );
                REPLACEMENT_AUTHORITY
            } else {
                header.1.as_slice()
            };
            encode_literal(&header.0, value, &mut encoded);
        }
        write_header_block(block.stream, block.end_stream, block.priority, &encoded, out);
        Ok(())
    }
}

/// A HEADERS payload without its padding: the priority fields (when
/// flagged) and the header block fragment; `None` when the lengths do not
/// add up.
fn split_headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut rest = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        let (&length, tail) = rest.split_first()?;
        pad = usize::from(length);
        rest = tail;
    }
    let mut priority = None;
    if flags & PRIORITY != 0 {
        let (fields, tail) = rest.split_first_chunk::<5>()?;
        priority = Some(*fields);
        rest = tail;
    }
    let end = rest.len().checked_sub(pad)?;
    Some((priority, &rest[..end]))
}

/// HPACK "Literal Header Field without Indexing — New Name" (RFC 7541
/// §6.2.2), strings without Huffman coding: nothing enters h2's dynamic table.
fn encode_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    for text in [name, value] {
        loona_hpack::encoder::encode_integer_into(text.len(), 7, 0, out).expect("writing to a Vec cannot fail");
        out.extend_from_slice(text);
    }
}

/// A HEADERS frame carrying `block`, continued in CONTINUATION frames when
/// it does not fit in [`MAX_FRAME_PAYLOAD`].
fn write_header_block(stream: u32, end_stream: bool, priority: Option<[u8; 5]>, block: &[u8], out: &mut Vec<u8>) {
    let fields: &[u8] = priority.as_ref().map_or(&[], |p| p);
    let (first, mut rest) = block.split_at(block.len().min(MAX_FRAME_PAYLOAD - fields.len()));
    let mut flags = if end_stream { END_STREAM } else { 0 };
    if priority.is_some() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    write_frame(HEADERS, flags, stream, &[fields, first], out);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME_PAYLOAD));
        rest = tail;
        let flags = if rest.is_empty() { END_HEADERS } else { 0 };
        write_frame(CONTINUATION, flags, stream, &[chunk], out);
    }
}

fn write_frame(kind: u8, flags: u8, stream: u32, parts: &[&[u8]], out: &mut Vec<u8>) {
    let length: usize = parts.iter().map(|p| p.len()).sum();
    out.extend_from_slice(&(length as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    for part in parts {
        out.extend_from_slice(part);
    }
}

/// An accepted connection whose incoming bytes pass through an
/// [`AuthorityRewriter`] before h2 reads them; writes go straight through.
#[derive(Debug)]
pub struct NormalizedAuthority<S> {
    inner: S,
    rewriter: AuthorityRewriter,
    /// Rewritten bytes h2 has not read yet, and how far it read.
    ready: Vec<u8>,
    offset: usize,
}

impl<S> NormalizedAuthority<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: AuthorityRewriter::new(),
            ready: Vec::new(),
            offset: 0,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for NormalizedAuthority<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.offset < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.offset);
                buf.put_slice(&this.ready[this.offset..this.offset + n]);
                this.offset += n;
                return Poll::Ready(Ok(()));
            }
            this.ready.clear();
            this.offset = 0;
            if this.rewriter.is_transparent() {
                // Nothing held back any more: read straight into h2's buffer.
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if read.filled().is_empty() => {
                    this.ready = this.rewriter.finish();
                    if this.ready.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                }
                Poll::Ready(Ok(())) => this.ready = this.rewriter.feed(read.filled())?,
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for NormalizedAuthority<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
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

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for NormalizedAuthority<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's first flight: preface, SETTINGS, then one request per
    /// header block, each encoded with `encoder` (shared: HPACK state spans
    /// the connection, like a real client's).
    fn request(encoder: &mut loona_hpack::Encoder<'_>, stream: u32, authority: &[u8]) -> Vec<u8> {
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/rivet.daemon.v1.Daemon/GetInfo"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ];
        let block = encoder.encode(headers);
        let mut out = Vec::new();
        write_frame(HEADERS, END_HEADERS, stream, &[&block], &mut out);
        // An empty gRPC message ending the stream.
        write_frame(0x0, END_STREAM, stream, &[&[0, 0, 0, 0, 0]], &mut out);
        out
    }

    fn settings() -> Vec<u8> {
        let mut out = PREFACE.to_vec();
        write_frame(0x4, 0, 0, &[&[0, 3, 0, 0, 0, 100]], &mut out);
        out
    }

    /// A frame: type, flags, stream, payload.
    type Frame = (u8, u8, u32, Vec<u8>);
    /// A decoded header block.
    type Block = Vec<(Vec<u8>, Vec<u8>)>;

    /// Parses what h2 would read: the preface, then each frame, and the
    /// header blocks decoded with a fresh decoder (h2's), whose dynamic table
    /// must stay in step.
    fn parse_frames(bytes: &[u8]) -> (Vec<Frame>, Vec<Block>) {
        assert!(bytes.starts_with(PREFACE));
        let mut rest = &bytes[PREFACE.len()..];
        let mut frames = Vec::new();
        let mut blocks = Vec::new();
        let mut decoder = loona_hpack::Decoder::new();
        let mut fragment = Vec::new();
        while !rest.is_empty() {
            let length = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            let (kind, flags) = (rest[3], rest[4]);
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            let payload = rest[FRAME_HEADER..FRAME_HEADER + length].to_vec();
            rest = &rest[FRAME_HEADER + length..];
            if kind == HEADERS || kind == CONTINUATION {
                let (_, part) = if kind == HEADERS {
                    split_headers_payload(flags, &payload).unwrap()
                } else {
                    (None, payload.as_slice())
                };
                fragment.extend_from_slice(part);
                if flags & END_HEADERS != 0 {
                    blocks.push(decoder.decode(&fragment).unwrap());
                    fragment.clear();
                }
            }
            frames.push((kind, flags, stream, payload));
        }
        (frames, blocks)
    }

    fn authorities(blocks: &[Block]) -> Vec<String> {
        blocks
            .iter()
            .flat_map(|b| b.iter())
            .filter(|(n, _)| n == b":authority")
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .collect()
    }

    /// Feeds `input` one byte at a time and all at once: the output is the same.
    fn rewrite(input: &[u8]) -> Vec<u8> {
        let mut whole = AuthorityRewriter::new();
        let mut all = whole.feed(input).unwrap();
        all.extend(whole.finish());
        let mut bytewise = AuthorityRewriter::new();
        let mut out = Vec::new();
        for b in input {
            out.extend(bytewise.feed(std::slice::from_ref(b)).unwrap());
        }
        out.extend(bytewise.finish());
        assert_eq!(out, all, "the split of the input must not matter");
        all
    }

    #[test]
    fn a_percent_encoded_socket_path_becomes_localhost_on_every_request() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = settings();
        for stream in [1, 3, 5] {
            input.extend(request(&mut encoder, stream, b"tmp%2Frivet%2Fsvc-ipam.sock"));
        }
        let out = rewrite(&input);
        let (frames, blocks) = parse_frames(&out);
        assert_eq!(authorities(&blocks), ["localhost"; 3]);
        // Everything else is as the client sent it.
        let (_, sent) = parse_frames(&input);
        for (got, sent) in blocks.iter().zip(&sent) {
            let strip = |b: &Block| {
                b.iter()
                    .filter(|(n, _)| n != b":authority")
                    .cloned()
                    .collect::<Vec<_>>()
            };
            assert_eq!(strip(got), strip(sent));
        }
        let kinds: Vec<(u8, u8, u32)> = frames.iter().map(|f| (f.0, f.1, f.2)).collect();
        assert_eq!(
            kinds,
            [
                (0x4, 0, 0),
                (HEADERS, END_HEADERS, 1),
                (0x0, END_STREAM, 1),
                (HEADERS, END_HEADERS, 3),
                (0x0, END_STREAM, 3),
                (HEADERS, END_HEADERS, 5),
                (0x0, END_STREAM, 5),
            ]
        );
        let mut r = AuthorityRewriter::new();
        r.feed(&input).unwrap();
        assert_eq!(r.rewritten(), 3);
    }

    #[test]
    fn empty_authorities_are_replaced_and_valid_ones_kept_once_rewriting() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = settings();
        input.extend(request(&mut encoder, 1, b""));
        input.extend(request(&mut encoder, 3, b"localhost:50051"));
        let (_, blocks) = parse_frames(&rewrite(&input));
        assert_eq!(authorities(&blocks), ["localhost", "localhost:50051"]);
    }

    #[test]
    fn a_connection_whose_first_authority_is_valid_passes_untouched() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = settings();
        input.extend(request(&mut encoder, 1, b"rivet.invalid"));
        input.extend(request(&mut encoder, 3, b"rivet.invalid"));
        let mut r = AuthorityRewriter::new();
        assert_eq!(r.feed(&input).unwrap(), input);
        assert!(r.is_transparent());
        assert_eq!(rewrite(&input), input);
    }

    #[test]
    fn padding_priority_and_continuations_are_followed() {
        let mut encoder = loona_hpack::Encoder::new();
        let long = vec![b'x'; 20_000];
        let headers: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/x"),
            (b":authority", b"a%2Fb"),
            (b"x-long", &long),
        ];
        let block = encoder.encode(headers);
        let (one, two) = block.split_at(10);
        let mut input = settings();
        // HEADERS, padded (3 bytes) and with priority, then a CONTINUATION.
        let payload = [&[3u8][..], &[0, 0, 0, 0, 16], one, &[0, 0, 0]].concat();
        write_frame(HEADERS, PADDED | PRIORITY | END_STREAM, 7, &[&payload], &mut input);
        write_frame(CONTINUATION, END_HEADERS, 7, &[two], &mut input);
        let out = rewrite(&input);
        let (frames, blocks) = parse_frames(&out);
        assert_eq!(authorities(&blocks), ["localhost"]);
        assert_eq!(blocks[0].last().unwrap().1, long);
        // Priority and END_STREAM kept, padding dropped, split at 16 KiB.
        let (kind, flags, stream, payload) = &frames[1];
        assert_eq!((*kind, *flags, *stream), (HEADERS, PRIORITY | END_STREAM, 7));
        assert_eq!(payload.len(), MAX_FRAME_PAYLOAD);
        assert_eq!(&payload[..5], &[0, 0, 0, 0, 16]);
        assert_eq!((frames[2].0, frames[2].1), (CONTINUATION, END_HEADERS));
    }

    #[test]
    fn what_is_not_http2_or_not_decodable_goes_to_h2_as_it_came() {
        let http1 = b"POST / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(rewrite(&http1), http1);
        let mut bad = settings();
        write_frame(HEADERS, END_HEADERS, 1, &[&[0xff, 0xff, 0xff, 0xff]], &mut bad);
        assert_eq!(rewrite(&bad), bad);
        // A frame cut off by the client is handed on as it is.
        let mut cut = settings();
        write_frame(HEADERS, END_HEADERS, 1, &[&[0x82, 0x86]], &mut cut);
        cut.truncate(cut.len() - 1);
        assert_eq!(rewrite(&cut), cut);
    }

    #[test]
    fn after_a_rewrite_broken_framing_cuts_the_connection() {
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = settings();
        input.extend(request(&mut encoder, 1, b"a%2Fb"));
        // A CONTINUATION without a HEADERS before it.
        write_frame(CONTINUATION, END_HEADERS, 3, &[&[0x82]], &mut input);
        let err = AuthorityRewriter::new().feed(&input).unwrap_err();
        assert!(err.to_string().contains("CONTINUATION frame on stream 3"), "{err}");
        // An oversized header block.
        let mut encoder = loona_hpack::Encoder::new();
        let mut input = settings();
        input.extend(request(&mut encoder, 1, b"a%2Fb"));
        write_frame(HEADERS, 0, 3, &[&vec![0u8; MAX_HEADER_BLOCK]], &mut input);
        let err = AuthorityRewriter::new().feed(&input).unwrap_err();
        assert!(err.to_string().contains("over"), "{err}");
    }
}
