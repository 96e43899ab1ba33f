//! One TCP stream to one peer of one group, and the framing of the messages on it.
//!
//! Every message is a 16-byte header, `[kind u8][0 u8; 3][sequence u32][bytes u64]` little-endian,
//! then `bytes` of payload. Each side counts the messages it sent and received on the stream, so
//! a receiver that expects a different kind, size or sequence number than what arrives reports
//! [`CommError::Mismatch`] instead of reading garbage. A header of kind `Abort` carries, in its
//! byte count, the world rank whose loss made the sender give up.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use crate::dtype::{self, DType};
use crate::error::{CommError, Result};
use crate::work::Kind;

pub(super) const HEADER_BYTES: usize = 16;

/// Payload bytes read per reduction pass: the receiver reduces out of a scratch buffer this big.
const SCRATCH_BYTES: usize = 1 << 20;

/// Who is calling and for what: what an error on a link names.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ctx {
    /// This process's world rank.
    pub rank: usize,
    pub op: &'static str,
    pub timeout_s: f64,
}

/// What a received payload does to the caller's memory.
pub(super) enum Inbound<'a> {
    /// Copied into the slice (which has exactly the payload's length).
    Copy(&'a mut [u8]),
    /// Added element-wise into the slice (of `dtype`, exactly the payload's length).
    Reduce(&'a mut [u8], DType),
}

impl Inbound<'_> {
    fn len(&self) -> usize {
        match self {
            Inbound::Copy(dst) | Inbound::Reduce(dst, _) => dst.len(),
        }
    }
}

/// A stream to one peer. Its methods take `&self` so that one thread may send on it while
/// another receives (a ring of two ranks sends to and receives from the same peer).
pub(super) struct Link {
    stream: TcpStream,
    /// The peer's world rank.
    pub peer: usize,
    sent: AtomicU32,
    received: AtomicU32,
    /// A write failed, possibly halfway through a message: nothing more may be written.
    broken: AtomicBool,
}

impl Link {
    /// Wraps a connected stream: no Nagle delay, every read and write bounded by `timeout`.
    pub(super) fn new(stream: TcpStream, peer: usize, timeout: Duration, ctx: Ctx) -> Result<Link> {
        let setup = || -> std::io::Result<()> {
            stream.set_nonblocking(false)?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(timeout))?;
            stream.set_write_timeout(Some(timeout))
        };
        setup().map_err(|e| io_failed(ctx, peer, e))?;
        Ok(Link { stream, peer, sent: AtomicU32::new(0), received: AtomicU32::new(0), broken: AtomicBool::new(false) })
    }

    /// The header of this link's next message, counting it as sent.
    pub(super) fn next_header(&self, kind: Kind, bytes: usize) -> [u8; HEADER_BYTES] {
        let seq = self.sent.fetch_add(1, Ordering::Relaxed);
        header(kind, seq, bytes as u64)
    }

    /// Writes a message whose header came from `next_header`.
    pub(super) fn write_message(&self, ctx: Ctx, header: &[u8; HEADER_BYTES], payload: &[u8]) -> Result<()> {
        let written = if payload.len() <= 4096 {
            // One segment for small messages (the header alone would go out as its own packet).
            let mut joined = Vec::with_capacity(HEADER_BYTES + payload.len());
            joined.extend_from_slice(header);
            joined.extend_from_slice(payload);
            self.write_all(ctx, &joined)
        } else {
            self.write_all(ctx, header).and_then(|_| self.write_all(ctx, payload))
        };
        if written.is_err() {
            self.broken.store(true, Ordering::Relaxed);
        }
        written
    }

    /// Sends a whole message.
    pub(super) fn send(&self, ctx: Ctx, kind: Kind, payload: &[u8]) -> Result<()> {
        let header = self.next_header(kind, payload.len());
        self.write_message(ctx, &header, payload)
    }

    /// Tells the peer, best effort, that this rank gave up because `lost_rank` was lost; skipped
    /// when an earlier write stopped inside a message (the header would land in its payload).
    pub(super) fn abort(&self, lost_rank: usize) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        let _ = self.stream.set_write_timeout(Some(Duration::from_millis(200)));
        let _ = (&self.stream).write_all(&header(Kind::Abort, 0, lost_rank as u64));
        self.broken.store(true, Ordering::Relaxed);
    }

    /// Receives the next message, which must be of `kind` and exactly fill `inbound`.
    pub(super) fn recv(&self, ctx: Ctx, kind: Kind, inbound: Inbound<'_>, scratch: &mut Vec<u8>) -> Result<()> {
        let bytes = inbound.len();
        self.recv_header(ctx, kind, bytes)?;
        match inbound {
            Inbound::Copy(dst) => self.read_exact(ctx, dst),
            Inbound::Reduce(dst, dtype) => {
                let step = SCRATCH_BYTES / dtype.size() * dtype.size();
                scratch.resize(step.min(bytes), 0);
                for piece in dst.chunks_mut(step) {
                    let got = &mut scratch[..piece.len()];
                    self.read_exact(ctx, got)?;
                    // SAFETY: both hold piece.len() bytes, a whole number of elements of dtype
                    // (the payload size was checked against the caller's slice); scratch is ours,
                    // so they do not overlap.
                    unsafe { dtype::add_into(dtype, piece.as_mut_ptr(), got.as_ptr(), piece.len() / dtype.size()) };
                }
                Ok(())
            }
        }
    }

    fn recv_header(&self, ctx: Ctx, kind: Kind, bytes: usize) -> Result<()> {
        let mut raw = [0u8; HEADER_BYTES];
        self.read_exact(ctx, &mut raw)?;
        let got_kind = raw[0];
        let got_seq = u32::from_le_bytes(raw[4..8].try_into().expect("4 bytes"));
        let got_bytes = u64::from_le_bytes(raw[8..16].try_into().expect("8 bytes"));
        if got_kind == Kind::Abort as u8 {
            return Err(CommError::PeerLost { rank: ctx.rank, lost_rank: got_bytes as usize, op: ctx.op });
        }
        let seq = self.received.fetch_add(1, Ordering::Relaxed);
        if got_kind != kind as u8 || got_seq != seq || got_bytes != bytes as u64 {
            return Err(CommError::Mismatch {
                rank: ctx.rank,
                peer: self.peer,
                op: ctx.op,
                reason: format!(
                    "expected {kind:?} message #{seq} of {bytes} bytes over tcp, got kind {got_kind} message \
                     #{got_seq} of {got_bytes} bytes (ranks called different operations or sizes)"
                ),
            });
        }
        Ok(())
    }

    fn read_exact(&self, ctx: Ctx, mut buf: &mut [u8]) -> Result<()> {
        while !buf.is_empty() {
            match (&self.stream).read(buf) {
                Ok(0) => return Err(io_failed(ctx, self.peer, ErrorKind::UnexpectedEof.into())),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_failed(ctx, self.peer, e)),
            }
        }
        Ok(())
    }

    fn write_all(&self, ctx: Ctx, mut buf: &[u8]) -> Result<()> {
        while !buf.is_empty() {
            match (&self.stream).write(buf) {
                Ok(0) => return Err(io_failed(ctx, self.peer, ErrorKind::WriteZero.into())),
                Ok(n) => buf = &buf[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_failed(ctx, self.peer, e)),
            }
        }
        Ok(())
    }
}

fn header(kind: Kind, seq: u32, bytes: u64) -> [u8; HEADER_BYTES] {
    let mut raw = [0u8; HEADER_BYTES];
    raw[0] = kind as u8;
    raw[4..8].copy_from_slice(&seq.to_le_bytes());
    raw[8..16].copy_from_slice(&bytes.to_le_bytes());
    raw
}

/// Names what an I/O error on the stream to world rank `peer` means: a timeout, a lost peer, or
/// another failure of the socket.
pub(super) fn io_failed(ctx: Ctx, peer: usize, err: std::io::Error) -> CommError {
    match err.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            CommError::Timeout { rank: ctx.rank, peer, op: ctx.op, timeout_s: ctx.timeout_s }
        }
        ErrorKind::UnexpectedEof
        | ErrorKind::WriteZero
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::ConnectionRefused
        | ErrorKind::BrokenPipe
        | ErrorKind::NotConnected => CommError::PeerLost { rank: ctx.rank, lost_rank: peer, op: ctx.op },
        _ => CommError::Backend {
            backend: "tcp",
            op: ctx.op,
            rank: ctx.rank,
            reason: format!("the stream to rank {peer} failed: {err}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (Link, Link) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        let ctx = Ctx { rank: 0, op: "test", timeout_s: 1.0 };
        let t = Duration::from_secs(1);
        (Link::new(a, 1, t, ctx).unwrap(), Link::new(b, 0, t, Ctx { rank: 1, ..ctx }).unwrap())
    }

    #[test]
    fn a_message_of_another_size_or_kind_is_a_mismatch() {
        let (a, b) = pair();
        let ctx = Ctx { rank: 0, op: "send", timeout_s: 1.0 };
        a.send(ctx, Kind::Send, &[1, 2, 3]).unwrap();
        let mut scratch = Vec::new();
        let mut got = [0u8; 4];
        let err = b.recv(Ctx { rank: 1, ..ctx }, Kind::Send, Inbound::Copy(&mut got), &mut scratch).unwrap_err();
        assert!(matches!(err, CommError::Mismatch { rank: 1, peer: 0, .. }), "{err}");
        assert!(err.to_string().contains("4 bytes"), "{err}");
    }

    #[test]
    fn reduce_adds_into_the_destination_and_abort_names_the_lost_rank() {
        let (a, b) = pair();
        let ctx = Ctx { rank: 0, op: "all_reduce", timeout_s: 1.0 };
        let values = [1.5f32, 2.0, -1.0];
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        a.send(ctx, Kind::AllReduce, &bytes).unwrap();
        let mut dst: Vec<u8> = [1.0f32; 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut scratch = Vec::new();
        b.recv(ctx, Kind::AllReduce, Inbound::Reduce(&mut dst, DType::F32), &mut scratch).unwrap();
        let sums: Vec<f32> = dst.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(sums, [2.5, 3.0, 0.0]);
        a.abort(7);
        let err = b.recv(ctx, Kind::AllReduce, Inbound::Copy(&mut [0u8; 4]), &mut scratch).unwrap_err();
        assert!(matches!(err, CommError::PeerLost { lost_rank: 7, .. }), "{err}");
    }

    #[test]
    fn a_silent_peer_times_out_and_a_closed_one_is_lost() {
        let (a, b) = pair();
        let ctx = Ctx { rank: 1, op: "recv", timeout_s: 1.0 };
        let mut scratch = Vec::new();
        let err = b.recv(ctx, Kind::Send, Inbound::Copy(&mut [0u8; 4]), &mut scratch).unwrap_err();
        assert!(matches!(err, CommError::Timeout { peer: 0, .. }), "{err}");
        drop(a);
        let err = b.recv(ctx, Kind::Send, Inbound::Copy(&mut [0u8; 4]), &mut scratch).unwrap_err();
        assert!(matches!(err, CommError::PeerLost { lost_rank: 0, op: "recv", .. }), "{err}");
    }
}
