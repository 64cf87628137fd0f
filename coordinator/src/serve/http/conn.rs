//! The connections under the API. The server accepts them itself (rather than through
//! `axum::serve`) so that a client that never finishes its request cannot hold the server:
//! - a request head must arrive within `header_timeout`, counted from the connection (or
//!   from the end of the previous response on a kept-alive one); then the connection closes;
//! - at most `max_connections` are open. At the cap the oldest connection with no request in
//!   progress (still sending its head, or idle between requests) is closed to make room, so
//!   slow or idle clients give way to new ones; when every open connection is busy the new
//!   one gets a 503 and is closed;
//! - a failed accept (out of file descriptors) is logged and frees an idle connection the
//!   same way. `raise_open_files` lifts the process's open-file limit to its hard limit, and
//!   `Limits::fit` lowers the cap to what the limit allows.
//!
//! Warnings about the cap and accept failures are logged at most once per `LOG_EVERY`, with
//! the number of events since the last line.

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

/// How a server bounds its connections.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest wait for a request head.
    pub header_timeout: Duration,
}

/// File descriptors kept for everything but client connections (listener, runtime, model
/// file, ring links, standard streams).
const RESERVED_FDS: u64 = 64;
/// The fewest connections the cap is ever lowered to.
const MIN_CONNECTIONS: usize = 16;
/// At most one warning of each kind per this long.
const LOG_EVERY: Duration = Duration::from_secs(10);

impl Limits {
    /// `self` with the cap lowered, if need be, to fit `open_files` descriptors (a warning
    /// says so).
    pub fn fit(mut self, open_files: Option<u64>) -> Limits {
        let Some(limit) = open_files else {
            return self;
        };
        let room = limit
            .saturating_sub(RESERVED_FDS)
            .max(MIN_CONNECTIONS as u64);
        if (self.max_connections as u64) > room {
            tracing::warn!(
                "at most {room} connections at once, not {}: the open-file limit is {limit} \
                 (raise it with `ulimit -n`)",
                self.max_connections
            );
            self.max_connections = room as usize;
        }
        self
    }
}

/// Raises the soft open-file limit to the hard one (at most 2^20); returns the soft limit in
/// force after, if it can be read.
pub fn raise_open_files() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `r` is a valid, writable rlimit for getrlimit to fill.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
            return None;
        }
        let want = r.rlim_max.min(1 << 20);
        if r.rlim_cur < want {
            let raised = libc::rlimit {
                rlim_cur: want,
                rlim_max: r.rlim_max,
            };
            // SAFETY: `raised` is a valid rlimit that setrlimit only reads.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                tracing::debug!("open-file limit raised from {} to {want}", r.rlim_cur);
                r.rlim_cur = want;
            }
        }
        #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not everywhere
        Some(r.rlim_cur as u64)
    }
    #[cfg(not(unix))]
    None
}

/// One open connection.
struct Conn {
    /// Requests in progress (from the head's arrival to the end of the response body).
    busy: AtomicUsize,
    /// Notified to close the connection at once.
    evict: Notify,
    peer: SocketAddr,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Table {
    next: u64,
    open: BTreeMap<u64, Arc<Conn>>,
}

impl Table {
    /// Closes the oldest connection without a request in progress; its peer, if there was one.
    fn evict_idle(&mut self) -> Option<SocketAddr> {
        let id = self
            .open
            .iter()
            .find(|(_, c)| c.busy.load(Ordering::SeqCst) == 0)
            .map(|(id, _)| *id)?;
        let c = self.open.remove(&id)?;
        c.evict.notify_one();
        Some(c.peer)
    }
}

/// Marks a connection busy while it lives (a request, then its response body).
struct Busy(Arc<Conn>);

impl Busy {
    fn start(c: &Arc<Conn>) -> Busy {
        c.busy.fetch_add(1, Ordering::SeqCst);
        Busy(Arc::clone(c))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A warning logged at most once per `LOG_EVERY`.
struct Throttled {
    last: Option<Instant>,
    since: u64,
}

impl Throttled {
    fn new() -> Throttled {
        Throttled {
            last: None,
            since: 0,
        }
    }

    /// Logs `line()` unless a line went out less than `LOG_EVERY` ago.
    fn warn(&mut self, line: impl FnOnce() -> String) {
        self.since += 1;
        if self.last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            return;
        }
        let more = match self.since {
            1 => String::new(),
            n => format!(" ({n} times since the last such line)"),
        };
        tracing::warn!("{}{more}", line());
        self.last = Some(Instant::now());
        self.since = 0;
    }
}

/// Serves `app` on `listener` until `stop` completes; then stops accepting, lets each
/// connection finish the request it is serving, and returns when all are closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) {
    let table = Arc::new(Mutex::new(Table::default()));
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    // Every connection task holds a receiver: `closed()` resolves when the last one ends.
    let (done_tx, done_rx) = watch::channel(());
    let mut at_cap = Throttled::new();
    let mut refused = Throttled::new();
    let mut accept_failed = Throttled::new();
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            () = &mut stop => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                let open = lock(&table).open.len();
                accept_failed.warn(|| format!("accepting a connection failed: {e} ({open} open)"));
                if out_of_descriptors(&e) {
                    if lock(&table).evict_idle().is_none() {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    // The evicted connection's task closes its socket: let it run.
                    tokio::task::yield_now().await;
                }
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let conn = {
            let mut t = lock(&table);
            if t.open.len() >= limits.max_connections {
                match t.evict_idle() {
                    Some(old) => at_cap.warn(|| {
                        format!(
                            "{} connections open (the cap): closed the oldest idle one, from \
                             {old}, for a new one from {peer}",
                            limits.max_connections
                        )
                    }),
                    None => {
                        drop(t);
                        refused.warn(|| {
                            format!(
                                "{} connections open (the cap), all busy: refused {peer} \
                                 with a 503",
                                limits.max_connections
                            )
                        });
                        refuse(stream);
                        continue;
                    }
                }
            }
            let conn = Arc::new(Conn {
                busy: AtomicUsize::new(0),
                evict: Notify::new(),
                peer,
            });
            t.next += 1;
            let id = t.next;
            t.open.insert(id, Arc::clone(&conn));
            (id, conn)
        };
        tokio::spawn(connection(
            stream,
            conn,
            app.clone(),
            limits,
            Arc::clone(&table),
            shutdown_rx.clone(),
            done_rx.clone(),
        ));
    }
    drop(listener);
    let _ = shutdown_tx.send(true);
    drop(done_rx);
    done_tx.closed().await;
}

fn lock(t: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

fn out_of_descriptors(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    {
        matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
    }
    #[cfg(not(unix))]
    {
        let _ = e;
        false
    }
}

/// A 503 written without waiting (a full socket buffer just loses it), then the close once
/// the client's request is read (closing over unread bytes would reset the connection and
/// lose the answer), within half a second.
fn refuse(stream: TcpStream) {
    let body = r#"{"error":{"message":"the server has too many open connections; retry later","type":"server_error","param":null,"code":"too_many_connections"}}"#;
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.try_write(format!("{head}{body}").as_bytes());
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = stream;
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 4096];
        let drain = async { while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {} };
        let _ = tokio::time::timeout(Duration::from_millis(500), drain).await;
    });
}

/// Serves one connection until it ends, is evicted, or (after shutdown) finishes its request.
async fn connection(
    stream: TcpStream,
    (id, conn): (u64, Arc<Conn>),
    app: Router,
    limits: Limits,
    table: Arc<Mutex<Table>>,
    mut shutdown: watch::Receiver<bool>,
    _done: watch::Receiver<()>,
) {
    let inner = TowerToHyperService::new(app);
    let c = Arc::clone(&conn);
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = Busy::start(&c);
        let response = hyper::service::Service::call(&inner, req);
        async move {
            let response = response.await?;
            // The connection stays busy until the body is sent (or dropped).
            let tracked = response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _busy = &busy;
                    frame
                }))
            });
            Ok::<_, Infallible>(tracked)
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let served = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(served);
    let mut closing = *shutdown.borrow();
    if closing {
        served.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            r = served.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("connection from {}: {e}", conn.peer);
                }
                break;
            }
            () = conn.evict.notified() => break,
            _ = shutdown.changed(), if !closing => {
                closing = true;
                served.as_mut().graceful_shutdown();
            }
        }
    }
    lock(&table).open.remove(&id);
}
