//! A small key-value store over TCP for rendezvous (what torch's TCPStore does): rank 0 serves it
//! on MASTER_ADDR:MASTER_PORT, every rank (rank 0 too) is a client. Keys are written once; a `get`
//! blocks on the server until the key exists or its timeout passes.
//!
//! Wire format, both directions little-endian: request `[op u8][key_len u32][key][val_len u32][val]`
//! (op 1 = set, 2 = get with the timeout in milliseconds as a u64 value); reply
//! `[status u8][val_len u32][val]` (status 0 = ok, 1 = timed out).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;

#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// Starts the server on `addr` in background threads; it lives until the process ends.
pub(crate) fn serve(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let local = listener.local_addr()?;
    let table = Arc::new(Table::default());
    std::thread::Builder::new().name("stoke-comm-store".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            let table = table.clone();
            let _ = std::thread::Builder::new().name("stoke-comm-store-conn".into()).spawn(move || {
                let _ = serve_connection(stream, &table);
            });
        }
    })?;
    Ok(local)
}

/// The rendezvous on MASTER_ADDR:MASTER_PORT: rank 0 serves the store there, then every rank
/// (rank 0 too) connects to it, retrying until `deadline`.
pub(crate) fn rendezvous(addr: &str, port: u16, rank: usize, deadline: Instant) -> crate::Result<StoreClient> {
    let failed = |rank, reason| crate::CommError::Rendezvous { rank, place: format!("{addr}:{port}"), reason };
    if rank == 0 {
        let bind = (addr, port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| crate::CommError::Environment(format!("MASTER_ADDR={addr} does not resolve")))?;
        serve(bind).map_err(|e| failed(0, format!("cannot serve the store: {e}")))?;
    }
    StoreClient::connect(addr, port, deadline).map_err(|reason| failed(rank, reason))
}

fn serve_connection(mut stream: TcpStream, table: &Table) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    loop {
        let mut op = [0u8; 1];
        if stream.read(&mut op)? == 0 {
            return Ok(()); // the client closed the connection
        }
        let key = String::from_utf8_lossy(&read_blob(&mut stream)?).into_owned();
        let value = read_blob(&mut stream)?;
        match op[0] {
            OP_SET => {
                table.values.lock().unwrap_or_else(|e| e.into_inner()).insert(key, value);
                table.changed.notify_all();
                write_reply(&mut stream, 0, &[])?;
            }
            OP_GET => {
                let millis = u64::from_le_bytes(value.get(..8).and_then(|b| b.try_into().ok()).unwrap_or([0; 8]));
                let deadline = Instant::now() + Duration::from_millis(millis);
                let mut values = table.values.lock().unwrap_or_else(|e| e.into_inner());
                let found = loop {
                    if let Some(v) = values.get(&key) {
                        break Some(v.clone());
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        break None;
                    }
                    values = table.changed.wait_timeout(values, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
                };
                drop(values);
                match found {
                    Some(v) => write_reply(&mut stream, 0, &v)?,
                    None => write_reply(&mut stream, 1, &[])?,
                }
            }
            other => {
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unknown store op {other}")));
            }
        }
    }
}

fn read_blob(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    let mut blob = vec![0u8; len];
    stream.read_exact(&mut blob)?;
    Ok(blob)
}

fn write_reply(stream: &mut TcpStream, status: u8, value: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(5 + value.len());
    out.push(status);
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
    stream.write_all(&out)
}

/// A connection to the store.
pub(crate) struct StoreClient {
    stream: TcpStream,
    pub(crate) place: String,
}

impl StoreClient {
    /// Connects to `host:port`, retrying while the server is not up yet, until `deadline`.
    pub(crate) fn connect(host: &str, port: u16, deadline: Instant) -> Result<StoreClient, String> {
        let place = format!("{host}:{port}");
        let mut last_error = String::from("no address");
        loop {
            let addrs: Vec<SocketAddr> = match (host, port).to_socket_addrs() {
                Ok(addrs) => addrs.collect(),
                Err(e) => return Err(format!("cannot resolve {place}: {e}")),
            };
            for addr in &addrs {
                match TcpStream::connect_timeout(addr, Duration::from_millis(500)) {
                    Ok(stream) => {
                        stream.set_nodelay(true).map_err(|e| e.to_string())?;
                        return Ok(StoreClient { stream, place });
                    }
                    Err(e) => last_error = e.to_string(),
                }
            }
            if Instant::now() >= deadline {
                return Err(format!("no store answered at {place} before the timeout: {last_error}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn request(&mut self, op: u8, key: &str, value: &[u8], io_timeout: Duration) -> std::io::Result<(u8, Vec<u8>)> {
        let mut out = Vec::with_capacity(9 + key.len() + value.len());
        out.push(op);
        out.extend_from_slice(&(key.len() as u32).to_le_bytes());
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(value);
        self.stream.set_read_timeout(Some(io_timeout))?;
        self.stream.write_all(&out)?;
        let mut status = [0u8; 1];
        self.stream.read_exact(&mut status)?;
        let value = read_blob(&mut self.stream)?;
        Ok((status[0], value))
    }

    pub(crate) fn set(&mut self, key: &str, value: &[u8]) -> Result<(), String> {
        self.request(OP_SET, key, value, Duration::from_secs(60))
            .map(|_| ())
            .map_err(|e| format!("store set `{key}` at {}: {e}", self.place))
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    pub(crate) fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, String> {
        let millis = timeout.as_millis().min(u64::MAX as u128) as u64;
        match self.request(OP_GET, key, &millis.to_le_bytes(), timeout + Duration::from_secs(10)) {
            Ok((0, value)) => Ok(value),
            Ok(_) => Err(format!("key `{key}` was not set at {} within the timeout", self.place)),
            Err(e) => Err(format!("store get `{key}` at {}: {e}", self.place)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_waits_for_a_later_set() {
        let addr = serve("127.0.0.1:0".parse().unwrap()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let setter = std::thread::spawn(move || {
            let mut client = StoreClient::connect("127.0.0.1", addr.port(), deadline).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            client.set("k", b"value").unwrap();
        });
        let mut client = StoreClient::connect("127.0.0.1", addr.port(), deadline).unwrap();
        assert_eq!(client.get("k", Duration::from_secs(10)).unwrap(), b"value");
        assert!(client.get("absent", Duration::from_millis(10)).is_err());
        setter.join().unwrap();
    }
}
