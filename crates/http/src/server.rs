//! The server: one I/O thread running hyper's HTTP/1.1 connections on a tokio runtime, and a
//! bounded pool of worker threads (the runtime's blocking pool) that runs the handler.

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::StatusCode;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::sync::{oneshot, Semaphore};

use crate::HttpError;

/// After `stop`, how long the answers under way may take to finish; a connection still open then
/// (a client that sent half a request) is dropped.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// How the server treats its clients.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Threads that run the handler: at most this many requests are answered at once, the others
    /// wait for one. Default 2.
    pub workers: usize,
    /// The most one connection may take, from accept to its response written (one request per
    /// connection): a client idle or slow past it is dropped. Default 10 s.
    pub connection_timeout: Duration,
    /// Connections open at once; more wait in the listen backlog until one closes. Default 256.
    pub max_connections: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig { workers: 2, connection_timeout: Duration::from_secs(10), max_connections: 256 }
    }
}

/// A request as the handler sees it: its method and target.
#[derive(Debug, Clone)]
pub struct Request {
    method: String,
    path: String,
    query: Option<String>,
}

impl Request {
    /// `GET`, `POST`, ...
    pub fn method(&self) -> &str {
        &self.method
    }

    /// The target's path (`/metrics`), without its query.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The target's query (what follows `?`), if it has one.
    pub fn query(&self) -> Option<&str> {
        self.query.as_deref()
    }
}

/// A handler's answer: a status, a content type and a body.
#[derive(Debug, Clone)]
pub struct Response {
    status: u16,
    content_type: String,
    body: String,
}

impl Response {
    pub fn new(status: u16, content_type: &str, body: impl Into<String>) -> Response {
        Response { status, content_type: content_type.to_string(), body: body.into() }
    }
}

type Handler = dyn Fn(&Request) -> Response + Send + Sync + 'static;

/// A running server; `stop` or drop it to stop.
pub struct HttpServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpServer {
    /// Binds `host:port` (port 0 picks a free one) and answers every request with `handler` until
    /// stopped. Errors here are the only ones: once started, a failing client or handler (a panic
    /// answers 500) never stops the server.
    pub fn start(
        host: &str,
        port: u16,
        config: ServerConfig,
        handler: impl Fn(&Request) -> Response + Send + Sync + 'static,
    ) -> Result<HttpServer, HttpError> {
        let bind = |source| HttpError::Bind { addr: format!("{host}:{port}"), source };
        let listener = TcpListener::bind((host, port)).map_err(bind)?;
        let addr = listener.local_addr().map_err(bind)?;
        let start = |source| HttpError::Start { addr, source };
        listener.set_nonblocking(true).map_err(start)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .max_blocking_threads(config.workers.max(1))
            .thread_name("stoke-http-worker")
            .build()
            .map_err(start)?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(start)?
        };
        let (stop, stopped) = oneshot::channel();
        let handler: Arc<Handler> = Arc::new(handler);
        let thread = std::thread::Builder::new()
            .name(format!("stoke-http-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(serve(listener, stopped, config, handler));
                runtime.shutdown_timeout(STOP_GRACE);
            })
            .map_err(start)?;
        Ok(HttpServer { addr, stop: Some(stop), thread: Some(thread) })
    }

    /// The address it listens on (with the port the system picked when asked for 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes the idle connections, lets the answers under way finish (for a
    /// short grace, then drops what is left) and returns once the port is released.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            // An error means the I/O thread is gone already: nothing left to stop.
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The accept loop: one task per connection, at most `max_connections` at once, until `stopped`.
async fn serve(
    listener: tokio::net::TcpListener,
    mut stopped: oneshot::Receiver<()>,
    config: ServerConfig,
    handler: Arc<Handler>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.keep_alive(false).timer(TokioTimer::new()).header_read_timeout(config.connection_timeout);
    let graceful = GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(config.max_connections.max(1)));
    loop {
        let permit = tokio::select! {
            _ = &mut stopped => break,
            permit = Arc::clone(&open).acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let stream = tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    // Out of descriptors, or a client gone before accept: try again shortly
                    // rather than spin.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let handler = Arc::clone(&handler);
        let service = service_fn(move |request| answer(Arc::clone(&handler), request));
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        let deadline = config.connection_timeout;
        tokio::spawn(async move {
            // A client past its deadline is dropped; a failed connection concerns that client only.
            let _ = tokio::time::timeout(deadline, connection).await;
            drop(permit);
        });
    }
    // The port is released here, before the connections under way finish.
    drop(listener);
    let _ = tokio::time::timeout(STOP_GRACE.min(config.connection_timeout), graceful.shutdown()).await;
}

/// Runs the handler on a worker thread and turns its answer into hyper's.
async fn answer(
    handler: Arc<Handler>,
    request: hyper::Request<Incoming>,
) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
    let request = Request {
        method: request.method().as_str().to_string(),
        path: request.uri().path().to_string(),
        query: request.uri().query().map(str::to_string),
    };
    let response = tokio::task::spawn_blocking(move || handler(&request))
        .await
        .unwrap_or_else(|_| Response::new(500, "text/plain; charset=utf-8", "the handler failed\n"));
    let status = StatusCode::from_u16(response.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let content_type = HeaderValue::from_str(&response.content_type)
        .unwrap_or_else(|_| HeaderValue::from_static("application/octet-stream"));
    let mut out = hyper::Response::new(Full::new(Bytes::from(response.body)));
    *out.status_mut() = status;
    out.headers_mut().insert(CONTENT_TYPE, content_type);
    Ok(out)
}
