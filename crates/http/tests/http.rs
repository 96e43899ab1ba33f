//! The server over real sockets on loopback: slow and idle clients beside a scrape, a malformed
//! request, a failing handler, and a stop that releases the port. The server runs one worker
//! thread, so a client that held a worker would make the scrape wait past its timeout and fail.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use stoke_http::{get, HttpServer, Response, ServerConfig};

/// Long enough never to fail a healthy run on a loaded machine; a scrape that waits on another
/// client waits for the server's connection deadline, longer still, and fails on this.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(20);

fn server() -> HttpServer {
    let config = ServerConfig { workers: 1, connection_timeout: Duration::from_secs(120), ..ServerConfig::default() };
    HttpServer::start("127.0.0.1", 0, config, |request| match (request.method(), request.path()) {
        ("GET", "/metrics") => Response::new(200, "text/plain; version=0.0.4", "up 1\n"),
        ("GET", "/panic") => panic!("a handler that fails"),
        _ => Response::new(404, "text/plain; charset=utf-8", "only /metrics is served here\n"),
    })
    .expect("the server starts on a free port")
}

fn check_scrape(addr: SocketAddr) {
    assert_eq!(get(addr, "/metrics", CLIENT_TIMEOUT).unwrap(), (200, "up 1\n".to_string()));
}

/// Sends `bytes` on a fresh connection and reads the answer to its end.
fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(CLIENT_TIMEOUT)).unwrap();
    stream.write_all(bytes).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn a_scrape_succeeds_while_five_clients_send_half_a_request() {
    let server = server();
    let slow: Vec<TcpStream> = (0..5)
        .map(|_| {
            let mut stream = TcpStream::connect(server.addr()).unwrap();
            stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: loopback\r\n").unwrap();
            stream
        })
        .collect();
    check_scrape(server.addr());
    check_scrape(server.addr());
    drop(slow);
}

#[test]
fn a_scrape_succeeds_beside_twenty_idle_connections() {
    let server = server();
    let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(server.addr()).unwrap()).collect();
    check_scrape(server.addr());
    drop(idle);
}

#[test]
fn a_malformed_request_is_answered_400_and_the_server_still_serves() {
    let server = server();
    for garbage in
        [&b"THIS IS NOT HTTP\r\n\r\n"[..], b"GET /metrics HTTP/1.1\r\nNo colon here\r\n\r\n", b"\x00\x01\x02\r\n\r\n"]
    {
        let answer = raw(server.addr(), garbage);
        assert!(answer.starts_with("HTTP/1.1 400"), "{garbage:?}: {answer:?}");
        check_scrape(server.addr());
    }
    assert_eq!(get(server.addr(), "/elsewhere", CLIENT_TIMEOUT).unwrap().0, 404);
    assert_eq!(get(server.addr(), "/metrics?name=up", CLIENT_TIMEOUT).unwrap().0, 200);
}

#[test]
fn a_failing_handler_is_answered_500_and_the_server_still_serves() {
    let server = server();
    assert_eq!(get(server.addr(), "/panic", CLIENT_TIMEOUT).unwrap().0, 500);
    check_scrape(server.addr());
}

#[test]
fn stop_returns_with_clients_connected_and_releases_the_port() {
    let server = server();
    let addr = server.addr();
    check_scrape(addr);
    let idle = TcpStream::connect(addr).unwrap();
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
    server.stop();
    // The port is free again: a new listener takes it, and the old server answers nothing.
    let again = TcpListener::bind(addr).expect("the stopped server's port is released");
    drop(again);
    assert!(get(addr, "/metrics", CLIENT_TIMEOUT).is_err());
    drop((idle, slow));
}

#[test]
fn dropping_the_server_stops_it() {
    let addr = server().addr();
    TcpListener::bind(addr).expect("the dropped server's port is released");
}
