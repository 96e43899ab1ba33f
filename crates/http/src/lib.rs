//! stoke-http: the one HTTP server of stoke, behind the training run's `/metrics` and the
//! scheduler's. A handler (a plain function from `Request` to `Response`) answers each request on
//! a bounded pool of worker threads, while one I/O thread (hyper on a tokio runtime) reads and
//! writes the connections, so idle or slow clients cost no worker and never delay a scrape. Every
//! connection has one deadline from accept to its last byte written; a malformed request is
//! answered 400 and the server keeps serving; `stop` (or dropping the server) stops accepting,
//! lets the answers under way finish, and returns once the port is released.
//!
//! ```
//! use stoke_http::{get, HttpServer, Response, ServerConfig};
//! let server = HttpServer::start("127.0.0.1", 0, ServerConfig::default(), |request| match request.path() {
//!     "/hello" => Response::new(200, "text/plain; charset=utf-8", "hello\n"),
//!     _ => Response::new(404, "text/plain; charset=utf-8", "not here\n"),
//! })
//! .unwrap();
//! let timeout = std::time::Duration::from_secs(10);
//! assert_eq!(get(server.addr(), "/hello", timeout).unwrap(), (200, "hello\n".to_string()));
//! assert_eq!(get(server.addr(), "/other", timeout).unwrap().0, 404);
//! server.stop();
//! ```

mod client;
mod server;

pub use client::get;
pub use server::{HttpServer, Request, Response, ServerConfig};

/// What can go wrong serving or fetching over HTTP. Every variant names the address.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("cannot start the HTTP server on {addr}: {source}")]
    Start { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("GET http://{addr}{path}: {source}")]
    Fetch { addr: std::net::SocketAddr, path: String, source: std::io::Error },
    #[error("GET http://{addr}{path}: malformed response: {why}")]
    BadResponse { addr: std::net::SocketAddr, path: String, why: String },
}
