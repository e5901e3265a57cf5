//! The daemon's HTTP endpoints: `/metrics` (Prometheus text format), `/healthz` (the process
//! answers) and `/readyz` (probes attached and events flowing; 503 with the reason otherwise).
//! HTTP/1 only, on hyper: Prometheus and kubelet probes need nothing more.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn, Method, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::sinks::metrics::Metrics;

/// Prometheus' text format ([`Metrics::encode`] converts prometheus-client's OpenMetrics).
const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// What the endpoints read: the metrics, and why the daemon is not ready (None: ready).
pub struct State {
    pub metrics: Arc<Metrics>,
    not_ready: Mutex<Option<String>>,
}

impl State {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            not_ready: Mutex::new(Some("starting".into())),
        }
    }

    /// `None`: ready; `Some(reason)`: `/readyz` answers 503 with it.
    pub fn set_not_ready(&self, why: Option<String>) {
        *self.not_ready.lock().unwrap_or_else(|e| e.into_inner()) = why;
    }

    pub fn not_ready(&self) -> Option<String> {
        self.not_ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Binds `addr` now (so a taken port fails the start), and serves in a task.
pub async fn start(addr: SocketAddr, state: Arc<State>) -> Result<SocketAddr, ServeError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| ServeError::Bind { addr, source })?;
    tokio::spawn(accept_loop(listener, state));
    Ok(local)
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    // Out of fds, a failure repeats at every retry: one warning per period, with a count.
    const WARN_EVERY: Duration = Duration::from_secs(30);
    let mut warned: Option<tokio::time::Instant> = None;
    let mut since_warned = 0u64;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                since_warned += 1;
                if warned.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                    tracing::warn!(
                        error = %e,
                        failures = since_warned,
                        "accepting an HTTP connection failed (at most one warning per {} s)",
                        WARN_EVERY.as_secs()
                    );
                    warned = Some(tokio::time::Instant::now());
                    since_warned = 0;
                }
                // Back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(&req, &state)) }
            });
            let conn = http1::Builder::new()
                // A slow or idle client must not hold a connection open forever.
                .header_read_timeout(Duration::from_secs(10))
                .timer(hyper_util::rt::TokioTimer::new())
                .serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
        });
    }
}

fn text(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::OK);
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

const PLAIN: &str = "text/plain; charset=utf-8";

fn handle(req: &Request<Incoming>, state: &State) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(405, PLAIN, "only GET\n");
    }
    match req.uri().path() {
        "/metrics" => match state.metrics.encode() {
            Ok(body) => text(200, METRICS_CONTENT_TYPE, body),
            Err(e) => text(500, PLAIN, format!("encoding the metrics failed: {e}\n")),
        },
        "/healthz" => text(200, PLAIN, "ok\n"),
        "/readyz" => match state.not_ready() {
            None => text(200, PLAIN, "ready\n"),
            Some(why) => text(503, PLAIN, format!("not ready: {why}\n")),
        },
        "/" => text(200, PLAIN, "xtlock daemon: /metrics /healthz /readyz\n"),
        _ => text(404, PLAIN, "not found; try /metrics /healthz /readyz\n"),
    }
}
