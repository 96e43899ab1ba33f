//! A plain HTTP/1.1 GET over one connection, for scrapes from tests and self-checks.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::HttpError;

/// Fetches `http://addr{path}` with one GET (`Connection: close`) and returns the status and the
/// body. `timeout` bounds the connect and each read and write, so a server that does not answer
/// is an error, not a hang.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, String), HttpError> {
    let fetch = |source: std::io::Error| HttpError::Fetch { addr, path: path.to_string(), source };
    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(fetch)?;
    stream.set_read_timeout(Some(timeout)).map_err(fetch)?;
    stream.set_write_timeout(Some(timeout)).map_err(fetch)?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").map_err(fetch)?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).map_err(fetch)?;
    let bad = |why: String| HttpError::BadResponse { addr, path: path.to_string(), why };
    let response = String::from_utf8(response).map_err(|e| bad(format!("not UTF-8: {e}")))?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or_else(|| bad("no end of the head".into()))?;
    let status_line = head.lines().next().unwrap_or("");
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| status_line.strip_prefix("HTTP/1.0 "))
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| bad(format!("status line {status_line:?}")))?;
    Ok((status, body.to_string()))
}
