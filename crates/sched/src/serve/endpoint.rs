//! The endpoint that serves the server's latest metrics text at `GET /metrics` (stoke-http's
//! server) while the loop goes on.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use crate::SchedError;

/// `GET /metrics` with the latest text the server published; none without a port.
pub(super) struct MetricsEndpoint {
    text: Arc<Mutex<String>>,
    server: Option<stoke_http::HttpServer>,
}

impl MetricsEndpoint {
    /// Serves on 127.0.0.1:`port` (0: a free port) when a port is given.
    pub(super) fn start(port: Option<u16>) -> Result<MetricsEndpoint, SchedError> {
        let text = Arc::new(Mutex::new(String::new()));
        let server = match port {
            Some(port) => {
                let latest = Arc::clone(&text);
                let config = stoke_http::ServerConfig::default();
                let server = stoke_http::HttpServer::start("127.0.0.1", port, config, move |request| {
                    if request.method() == "GET" && request.path() == "/metrics" {
                        let body = latest.lock().expect("metrics lock").clone();
                        stoke_http::Response::new(200, "text/plain; version=0.0.4", body)
                    } else {
                        stoke_http::Response::new(404, "text/plain; version=0.0.4", "only /metrics is served here\n")
                    }
                })
                .map_err(|source| SchedError::Metrics { source })?;
                Some(server)
            }
            None => None,
        };
        Ok(MetricsEndpoint { text, server })
    }

    /// Where it listens, when it does.
    pub(super) fn addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(stoke_http::HttpServer::addr)
    }

    /// Replaces the text served.
    pub(super) fn publish(&self, text: String) {
        *self.text.lock().expect("metrics lock") = text;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_serves_the_latest_text_published() {
        let timeout = std::time::Duration::from_secs(20);
        assert!(MetricsEndpoint::start(None).unwrap().addr().is_none());
        let endpoint = MetricsEndpoint::start(Some(0)).unwrap();
        let addr = endpoint.addr().expect("a port was asked for");
        assert_eq!(stoke_http::get(addr, "/metrics", timeout).unwrap(), (200, String::new()));
        endpoint.publish("stoke_sched_slots 2\n".into());
        assert_eq!(stoke_http::get(addr, "/metrics", timeout).unwrap(), (200, "stoke_sched_slots 2\n".into()));
        assert_eq!(stoke_http::get(addr, "/other", timeout).unwrap().0, 404);
        drop(endpoint);
        std::net::TcpListener::bind(addr).expect("the endpoint's port is released when it is dropped");
    }
}
