//! The HTTP/1.1 listener: an accept loop over hyper that bounds what a client can hold.
//!
//! - **Connection cap** (`--max-connections`): past it, a new connection is answered at once with a
//!   503 in the OpenAI envelope (`Retry-After: 1`) and closed, and counted in `/metrics`.
//! - **Header timeout** (`--client-timeout`): a connection must deliver a request's headers within
//!   it, counted from when it connects or its previous response ended, so it also closes idle
//!   keep-alive connections; the body's own timeout is in the `Body` extractor (a 408).
//! - **Stalled writes**: a response write that makes no progress for `--client-timeout` (a client
//!   that stopped reading) closes the connection.
//! - **Drain**: when `stop` turns true the loop stops accepting; every connection serves for a short
//!   linger (a request already on its way gets read), then finishes its request and closes;
//!   [`Connections::wait_closed`] waits for them.
//!
//! Invariant: every accepted socket is counted in [`Connections`] until its task ends, so the cap and
//! the drain see every connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::time::Sleep;

use crate::error::ApiError;

/// Limits a connection runs under.
#[derive(Debug, Clone, Copy)]
pub struct ListenConfig {
    pub max_connections: usize,
    pub client_timeout: Duration,
}

/// The open connections, and how many were refused at the cap.
#[derive(Default)]
pub struct Connections {
    open: AtomicUsize,
    refused: AtomicU64,
    closed: Notify,
}

impl Connections {
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    /// Wait until no connection is open.
    pub async fn wait_closed(&self) {
        loop {
            let notified = self.closed.notified();
            if self.open() == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Counts one connection as open for its lifetime.
struct Open(Arc<Connections>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
        self.0.closed.notify_waiters();
    }
}

/// At a stop, how long a connection keeps serving before it closes once its request is done.
const DRAIN_LINGER: Duration = Duration::from_millis(500);

/// Largest request head hyper buffers (request line + headers); a larger one is a 431.
const MAX_HEAD_BYTES: usize = 64 << 10;

/// Accept connections until `stop` turns true; then ask each open connection to close after its
/// current request. Returns when the listener is closed (the connections may still be draining).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    cfg: ListenConfig,
    conns: Arc<Connections>,
    mut stop: watch::Receiver<bool>,
) {
    let mut last_error_log: Option<std::time::Instant> = None;
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors and the like: say so (once a second) and go on.
                    if last_error_log.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                        eprintln!("warning: accepting a connection failed: {e}");
                        last_error_log = Some(std::time::Instant::now());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = stopped(&mut stop) => return,
        };
        let _ = stream.set_nodelay(true);
        if conns.open() >= cfg.max_connections {
            conns.refused.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(refuse(stream, cfg.max_connections));
            continue;
        }
        conns.open.fetch_add(1, Ordering::SeqCst);
        let open = Open(conns.clone());
        let app = app.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let _open = open;
            let io = TokioIo::new(StallTimeout::new(stream, cfg.client_timeout));
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(cfg.client_timeout)
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(io, TowerToHyperService::new(app));
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stopped(&mut stop) => {
                    // A request the client sent just before the stop may not be parsed yet, and
                    // closing an idle-looking connection would drop it unanswered: serve what
                    // arrives within the linger, then finish the request in flight and close.
                    if tokio::time::timeout(DRAIN_LINGER, conn.as_mut()).await.is_err() {
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    }
                }
            }
        });
    }
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|v| *v).await;
}

/// Answer a connection over the cap with a 503 and close it without a reset: write, shut down the
/// write side, read what the client sent until it closes (at most a second in all).
async fn refuse(mut s: TcpStream, cap: usize) {
    let mut err = ApiError::unavailable(format!(
        "the server has {cap} connections open, its limit (--max-connections); retry shortly"
    ));
    err.retry_after = Some(1);
    let body = err.to_json().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        s.shutdown().await?;
        let mut buf = [0u8; 4096];
        while s.read(&mut buf).await? > 0 {}
        io::Result::Ok(())
    })
    .await;
}

/// A stream whose writes fail with `TimedOut` once one has made no progress for `limit`.
struct StallTimeout<S> {
    inner: S,
    limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> StallTimeout<S> {
    fn new(inner: S, limit: Duration) -> Self {
        StallTimeout {
            inner,
            limit,
            stalled: None,
        }
    }

    /// After a write-side poll: clear the timer on progress; on `Pending`, fail once it fires.
    fn check<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if timer.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client stopped reading the response",
            )));
        }
        Poll::Pending
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StallTimeout<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallTimeout<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.check(cx, r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.check(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.check(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Raise the soft open-file limit to the hard one (sockets are files); returns the soft limit now.
pub fn raise_nofile_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write only the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
    }
    r.rlim_cur
}
