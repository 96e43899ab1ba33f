//! A real S3-compatible server on loopback for the tests that store or read through `s3://`
//! URLs (the checkpoint mirror, remote training data): moto's server mode, installed into the
//! project's Python when missing, started on a free port and stopped when dropped.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, stoke};

/// moto's S3 server on a free loopback port, with one bucket; killed on drop.
pub struct S3Server {
    child: Child,
    pub port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The project's Python (`cargo xtask setup` makes it), with moto's server installed into it
/// when it is missing.
fn python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".stoke/venv/bin/python");
    assert!(python.exists(), "{} is missing: run `cargo xtask setup`", python.display());
    let has_moto = |python: &Path| {
        Command::new(python)
            .args(["-c", "import moto.server, flask"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has_moto(&python) {
        let out = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "moto[server]==5.2.5"])
            .output()
            .expect("pip runs");
        assert!(out.status.success(), "cannot install moto's S3 server: {}", String::from_utf8_lossy(&out.stderr));
    }
    python
}

/// An HTTP request to the server with `body`; the status code.
fn request(port: u16, method: &str, path: &str, body: &[u8]) -> u16 {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("the S3 server accepts");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .unwrap();
    stream.write_all(body).unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response);
    response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// An HTTP request without a body to the server; the status code.
pub fn http(port: u16, method: &str, path: &str) -> u16 {
    request(port, method, path, &[])
}

/// Stores `body` as the object at `path` (`/bucket/key`); the status code.
pub fn put_object(port: u16, path: &str, body: &[u8]) -> u16 {
    request(port, "PUT", path, body)
}

/// Starts the server and creates `bucket` in it.
pub fn start_s3(bucket: &str) -> S3Server {
    let python = python();
    let port = free_port();
    let child = Command::new(python)
        .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("moto's server starts");
    let server = S3Server { child, port };
    let deadline = Instant::now() + Duration::from_secs(120);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the S3 server did not listen on port {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(http(port, "PUT", &format!("/{bucket}")), 200, "cannot create bucket {bucket}");
    server
}

/// `stoke` with an S3 endpoint on loopback `port` and test credentials in the `AWS_*` variables.
pub fn stoke_s3(port: u16, args: &[&str], overrides: &[&str]) -> Command {
    let mut cmd = stoke(args, overrides);
    cmd.env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .stdin(Stdio::null());
    cmd
}
