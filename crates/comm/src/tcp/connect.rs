//! Making a group's links: for each pair of members the higher world rank connects to the lower
//! one's listener and sends a hello naming the group and itself. The listener side accepts on the
//! communication thread; a hello for a group this rank has not asked for yet (a faster peer is
//! already building a later group) waits in a stash until it is.
//!
//! Hello: `[b"STKC"][key_len u32][key][world rank u64]`, little-endian.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};

use super::rendezvous::describe_ranks;
use super::wire::{io_failed, Ctx, Link};

const MAGIC: &[u8; 4] = b"STKC";

/// Longest group key a hello may carry (keys are short paths such as `world/2/1`).
const MAX_KEY: usize = 4096;

/// This rank's listener, every rank's address, and the accepted streams not claimed yet.
pub(super) struct Switchboard {
    listener: TcpListener,
    addrs: Vec<SocketAddr>,
    stash: HashMap<(String, usize), TcpStream>,
    /// This process's world rank.
    rank: usize,
    timeout: Duration,
}

impl Switchboard {
    pub(super) fn new(listener: TcpListener, addrs: Vec<SocketAddr>, rank: usize, timeout: Duration) -> Switchboard {
        Switchboard { listener, addrs, stash: HashMap::new(), rank, timeout }
    }

    /// The links of group `key` whose members are `world_ranks` (this process is member `me`):
    /// `None` at `me`. Collective over the members; fails after `timeout_s` naming who never
    /// connected.
    pub(super) fn links(
        &mut self,
        key: &str,
        world_ranks: &[usize],
        me: usize,
        op: &'static str,
    ) -> Result<Vec<Option<Link>>> {
        let deadline = Instant::now() + self.timeout;
        let ctx = Ctx { rank: self.rank, op, timeout_s: self.timeout.as_secs_f64() };
        let mut streams: Vec<Option<TcpStream>> = world_ranks.iter().map(|_| None).collect();
        // Lower ranks first: their listeners exist (they were published), and the kernel completes
        // a connection before it is accepted, so nobody waits on anybody here.
        for (member, &peer) in world_ranks.iter().enumerate().filter(|&(m, _)| m < me) {
            streams[member] = Some(self.dial(key, peer, deadline, ctx)?);
        }
        for (member, &peer) in world_ranks.iter().enumerate().filter(|&(m, _)| m > me) {
            streams[member] = Some(self.answer(key, peer, world_ranks, me, deadline, ctx)?);
        }
        streams
            .into_iter()
            .zip(world_ranks)
            .map(|(stream, &peer)| stream.map(|s| Link::new(s, peer, self.timeout, ctx)).transpose())
            .collect()
    }

    fn dial(&self, key: &str, peer: usize, deadline: Instant, ctx: Ctx) -> Result<TcpStream> {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let stream = TcpStream::connect_timeout(&self.addrs[peer], left).map_err(|e| io_failed(ctx, peer, e))?;
        let mut hello = Vec::with_capacity(16 + key.len());
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(key.len() as u32).to_le_bytes());
        hello.extend_from_slice(key.as_bytes());
        hello.extend_from_slice(&(self.rank as u64).to_le_bytes());
        stream.set_write_timeout(Some(left)).map_err(|e| io_failed(ctx, peer, e))?;
        (&stream).write_all(&hello).map_err(|e| io_failed(ctx, peer, e))?;
        Ok(stream)
    }

    /// The stream `peer` opened for group `key`, from the stash or from new connections.
    fn answer(
        &mut self,
        key: &str,
        peer: usize,
        world_ranks: &[usize],
        me: usize,
        deadline: Instant,
        ctx: Ctx,
    ) -> Result<TcpStream> {
        let wanted = (key.to_string(), peer);
        self.listener.set_nonblocking(true).map_err(|e| io_failed(ctx, peer, e))?;
        loop {
            if let Some(stream) = self.stash.remove(&wanted) {
                return Ok(stream);
            }
            match self.listener.accept() {
                Ok((stream, from)) => match read_hello(&stream, deadline) {
                    Ok(hello) => {
                        self.stash.insert(hello, stream);
                    }
                    // A stray connection (a port scanner, a peer that died mid-hello) is dropped.
                    Err(reason) => {
                        eprintln!("stoke-comm tcp: rank {} ignored a connection from {from}: {reason}", self.rank)
                    }
                },
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = world_ranks[me + 1..]
                            .iter()
                            .copied()
                            .filter(|&r| r >= peer && !self.stash.contains_key(&(key.to_string(), r)))
                            .collect();
                        return Err(CommError::Rendezvous {
                            rank: self.rank,
                            place: self.listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
                            reason: format!(
                                "{} never connected for group `{key}` in `{}` within {} s (timeout_s)",
                                describe_ranks(&missing, |_| None),
                                ctx.op,
                                ctx.timeout_s
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_micros(500));
                }
                Err(e) => return Err(io_failed(ctx, peer, e)),
            }
        }
    }
}

/// Reads a hello: the group key and the sender's world rank.
fn read_hello(stream: &TcpStream, deadline: Instant) -> std::io::Result<(String, usize)> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(left))?;
    let mut reader = stream;
    let mut head = [0u8; 8];
    reader.read_exact(&mut head)?;
    if &head[..4] != MAGIC {
        return Err(std::io::Error::new(ErrorKind::InvalidData, "not a stoke-comm hello"));
    }
    let key_len = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
    if key_len > MAX_KEY {
        return Err(std::io::Error::new(ErrorKind::InvalidData, format!("a group key of {key_len} bytes")));
    }
    let mut key = vec![0u8; key_len];
    reader.read_exact(&mut key)?;
    let mut rank = [0u8; 8];
    reader.read_exact(&mut rank)?;
    Ok((String::from_utf8_lossy(&key).into_owned(), u64::from_le_bytes(rank) as usize))
}
