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

/// Descriptors kept free beside the HTTP connections for what health needs: reading
/// `/proc/self/fdinfo`, rotating the capture, reading `/proc` and the kubelet's files.
const FD_RESERVE: usize = 16;

/// The soft `RLIMIT_NOFILE`, when it is finite.
pub fn fd_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into our own struct.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// HTTP connections open at once, at most.
const MAX_CONNECTIONS: usize = 256;

/// Fewer than [`FD_RESERVE`] descriptors left under the limit (or none to count them with).
fn fds_short() -> bool {
    let Some(limit) = fd_limit() else {
        return false;
    };
    match std::fs::read_dir("/proc/self/fd") {
        Ok(d) => (d.count() as u64).saturating_add(FD_RESERVE as u64) > limit,
        Err(_) => true,
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    // Clients that hold connections open (idle, or slow on purpose) must not use up the fds a
    // scrape, a kubelet probe or the daemon's own work needs: when the fds left run short, a
    // new connection closes the oldest.
    let mut open: std::collections::VecDeque<tokio::task::AbortHandle> = Default::default();
    let mut warn = crate::shared::Throttle::new(Duration::from_secs(30));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                if let Some(failures) = warn.hit() {
                    tracing::warn!(
                        error = %e,
                        failures,
                        "accepting an HTTP connection failed (at most one warning per 30 s)"
                    );
                }
                // Make room, and back off instead of spinning.
                if let Some(oldest) = open.pop_front() {
                    oldest.abort();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        open.retain(|h| !h.is_finished());
        if open.len() >= MAX_CONNECTIONS || (!open.is_empty() && fds_short()) {
            if let Some(oldest) = open.pop_front() {
                oldest.abort();
            }
        }
        let state = state.clone();
        let task = tokio::spawn(async move {
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
        open.push_back(task.abort_handle());
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
