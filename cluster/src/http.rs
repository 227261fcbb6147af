//! The HTTP endpoint of every fencecsi binary (`--http-endpoint`): `/metrics`, `/healthz`
//! and `/readyz` over plain HTTP/1 (hyper), one server for the driver, the attacher and
//! podgc.
//!
//! - `/metrics`: the binary's Prometheus metrics in the OpenMetrics text format.
//! - `/healthz` (liveness): 200 while the process can do its job; 503 with the reason when
//!   a restart is the remedy (a stalled loop, an election the API server does not answer).
//! - `/readyz` (readiness): 200 while the process is up to its job (past its start-up,
//!   not stopping, where the binary tells those apart; else as `/healthz`). For a binary
//!   that elects a leader, ready means running, not leading: a standby is ready, so that
//!   pod readiness does not flap with leadership and a rollout does not wait for a Lease.
//!
//! Each binary says what those mean for it through [`Report`]; anything else is 404, and
//! methods other than GET and HEAD are 405.
//!
//! The endpoint is given in the form the upstream CSI sidecars take ([`HttpEndpoint`]):
//! `:9812` (all interfaces), `127.0.0.1:8080`, `[::1]:8080`. Without the flag no HTTP is
//! served.

use std::convert::Infallible;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// Content type of `/metrics` (prometheus-client's OpenMetrics text encoder).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// An `--http-endpoint` value: `:PORT` (every interface, IPv6 and IPv4), `IPv4:PORT` or
/// `[IPv6]:PORT`. Port 0 picks a free port. The host must be an IP address: a DNS name
/// would be resolved at start, to whichever address it named then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HttpEndpoint {
    /// `None`: every interface.
    pub host: Option<IpAddr>,
    pub port: u16,
}

impl HttpEndpoint {
    /// Every interface, this port (`:PORT`).
    pub const fn any(port: u16) -> Self {
        HttpEndpoint { host: None, port }
    }
}

impl From<SocketAddr> for HttpEndpoint {
    fn from(a: SocketAddr) -> Self {
        HttpEndpoint {
            host: Some(a.ip()),
            port: a.port(),
        }
    }
}

impl fmt::Display for HttpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host {
            None => write!(f, ":{}", self.port),
            Some(IpAddr::V4(ip)) => write!(f, "{ip}:{}", self.port),
            Some(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
        }
    }
}

const FORMS: &str = ":PORT (all interfaces), IPv4:PORT or [IPv6]:PORT";

impl FromStr for HttpEndpoint {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{s:?} is not an HTTP endpoint: {why} (use {FORMS})");
        if s.is_empty() {
            return Err(bad("it is empty; leave the flag out to serve no HTTP"));
        }
        if s.contains("://") || s.contains('/') {
            return Err(bad("give an address, not a URL"));
        }
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let (ip, port) = rest
                .split_once("]:")
                .ok_or_else(|| bad("an IPv6 address in brackets needs a port after \"]:\""))?;
            let ip: Ipv6Addr = ip
                .parse()
                .map_err(|_| bad(&format!("{ip:?} is not an IPv6 address")))?;
            (Some(IpAddr::V6(ip)), port)
        } else {
            let (host, port) = match s.rsplit_once(':') {
                Some(hp) => hp,
                None if s.bytes().all(|b| b.is_ascii_digit()) => {
                    return Err(bad(&format!("a port alone is written \":{s}\"")))
                }
                None => return Err(bad("no port")),
            };
            let host = match host {
                "" => None,
                h if h.contains(':') => {
                    return Err(bad("put an IPv6 address in brackets, as in [::1]:8080"))
                }
                h => Some(IpAddr::V4(h.parse::<Ipv4Addr>().map_err(|_| {
                    bad(&format!(
                        "{h:?} is not an IP address (names are not resolved)"
                    ))
                })?)),
            };
            (host, port)
        };
        if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(&format!("{port:?} is not a port number")));
        }
        let port = port
            .parse::<u16>()
            .map_err(|_| bad(&format!("port {port} is above 65535")))?;
        Ok(HttpEndpoint { host, port })
    }
}

/// What a binary reports on its endpoints. Called for every request.
pub trait Report: Send + Sync + 'static {
    /// `/metrics`: OpenMetrics text. Runs on a blocking thread, so it may ask the kernel.
    fn metrics(&self) -> String;
    /// `/healthz`: `Err(reason)` when the process cannot do its job and wants a restart.
    fn healthz(&self) -> Result<(), String>;
    /// `/readyz`: `Err(reason)` while it has not started or is stopping. Defaults to
    /// [`Report::healthz`].
    fn readyz(&self) -> Result<(), String> {
        self.healthz()
    }
}

/// A running HTTP endpoint. Dropping it stops it; [`HttpServer::stop`] also waits until
/// the port is closed.
#[derive(Debug)]
pub struct HttpServer {
    local: SocketAddr,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl HttpServer {
    /// The address bound (the real port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stops serving (open connections are dropped) and waits until the listener is closed.
    pub async fn stop(mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// Binds `endpoint` and serves `report` on it in a task, until the returned server is
/// stopped or dropped. A bind error is returned, so a taken port fails the start.
pub async fn start(
    endpoint: &HttpEndpoint,
    report: Arc<dyn Report>,
) -> std::io::Result<HttpServer> {
    let listener = bind(endpoint).await?;
    let local = listener.local_addr()?;
    tracing::info!(endpoint = %endpoint, addr = %local, "serving /metrics, /healthz and /readyz");
    Ok(HttpServer {
        local,
        task: Some(tokio::spawn(serve(listener, report))),
    })
}

async fn bind(endpoint: &HttpEndpoint) -> std::io::Result<TcpListener> {
    match endpoint.host {
        Some(ip) => TcpListener::bind(SocketAddr::new(ip, endpoint.port)).await,
        // Every interface of both families, as a Go sidecar's ":PORT" listens; on a host
        // without IPv6, every IPv4 interface.
        // Only a host without IPv6 falls back; any other error (the port taken, say)
        // is the answer, rather than a listener on half the interfaces.
        None => match bind_dual_stack(endpoint.port) {
            Ok(l) => Ok(l),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
                ) =>
            {
                tracing::warn!(error = %e, port = endpoint.port, "no IPv6 on this host: serving HTTP on IPv4 only");
                TcpListener::bind((Ipv4Addr::UNSPECIFIED, endpoint.port)).await
            }
            Err(e) => Err(e),
        },
    }
}

/// `[::]:port` that also takes IPv4 connections, whatever the host's default
/// (net.ipv6.bindv6only) says.
fn bind_dual_stack(port: u16) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, SockAddr, Socket, Type};
    let s = Socket::new(Domain::IPV6, Type::STREAM, Some(Protocol::TCP))?;
    s.set_only_v6(false)?;
    // As tokio's own bind: a restarted process may take the port over from TIME_WAIT.
    s.set_reuse_address(true)?;
    s.bind(&SockAddr::from(SocketAddr::new(
        IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        port,
    )))?;
    s.listen(1024)?;
    s.set_nonblocking(true)?;
    TcpListener::from_std(s.into())
}

/// Serves until dropped; the connections are owned by this future and end with it.
async fn serve(listener: TcpListener, report: Arc<dyn Report>) {
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: pass, rather than spin.
                tracing::warn!(error = %e, "accepting an HTTP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let report = report.clone();
        conns.spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let report = report.clone();
                async move { Ok::<_, Infallible>(respond(&req, report).await) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
}

fn reply(code: StatusCode, ctype: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, ctype)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

fn check(r: Result<(), String>) -> Response<Full<Bytes>> {
    match r {
        Ok(()) => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        Err(why) => reply(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            format!("{}\n", why.trim_end()),
        ),
    }
}

async fn respond(req: &Request<Incoming>, report: Arc<dyn Report>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    if !matches!(path, "/metrics" | "/healthz" | "/readyz") {
        return reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics, /healthz or /readyz\n".into(),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        );
    }
    match path {
        "/healthz" => check(report.healthz()),
        "/readyz" => check(report.readyz()),
        _ => match tokio::task::spawn_blocking(move || report.metrics()).await {
            Ok(text) => reply(StatusCode::OK, METRICS_CONTENT_TYPE, text),
            Err(e) => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                format!("encoding metrics failed: {e}\n"),
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn endpoints_in_the_sidecars_form() {
        let ok = |s: &str| s.parse::<HttpEndpoint>().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok(":9812"), HttpEndpoint::any(9812));
        assert_eq!(ok(":0"), HttpEndpoint::any(0));
        assert_eq!(
            ok("127.0.0.1:8080"),
            HttpEndpoint::from(SocketAddr::from(([127, 0, 0, 1], 8080)))
        );
        assert_eq!(
            ok("0.0.0.0:9809"),
            HttpEndpoint::from(SocketAddr::from(([0, 0, 0, 0], 9809)))
        );
        assert_eq!(
            ok("[::1]:65535"),
            HttpEndpoint::from("[::1]:65535".parse::<SocketAddr>().unwrap())
        );
        assert_eq!(
            ok("[::]:9811").host,
            Some(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
        );
        // Display gives back the same form, so a value can be passed on as a flag.
        for s in [":9812", "127.0.0.1:8080", "[::1]:80", "[fe80::1]:0"] {
            assert_eq!(ok(s).to_string(), s);
        }
    }

    #[test]
    fn anything_else_is_refused_with_the_forms_named() {
        for (bad, says) in [
            ("", "empty"),
            ("9812", "\":9812\""),
            ("127.0.0.1", "no port"),
            ("localhost:8080", "not an IP address"),
            ("example.com:80", "not an IP address"),
            ("::1:8080", "brackets"),
            ("[::1]", "port"),
            ("[::1]8080", "port"),
            ("[127.0.0.1]:80", "not an IPv6 address"),
            ("127.0.0.1:", "not a port number"),
            (":", "not a port number"),
            (":http", "not a port number"),
            (":-1", "not a port number"),
            (":+80", "not a port number"),
            (": 80", "not a port number"),
            (":65536", "above 65535"),
            (":99999999999999999999", "above 65535"),
            ("256.0.0.1:80", "not an IP address"),
            ("http://127.0.0.1:8080", "not a URL"),
            (":8080/metrics", "not a URL"),
        ] {
            let e = bad
                .parse::<HttpEndpoint>()
                .expect_err(&format!("{bad:?} accepted"));
            assert!(e.contains(says), "{bad:?}: {e}");
            assert!(
                e.contains(":PORT"),
                "{bad:?}: the error names the forms: {e}"
            );
        }
    }

    #[test]
    fn clap_takes_it_as_a_flag_value() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[arg(long)]
            http_endpoint: Option<HttpEndpoint>,
        }
        let t = T::try_parse_from(["t", "--http-endpoint=:9809"]).unwrap();
        assert_eq!(t.http_endpoint, Some(HttpEndpoint::any(9809)));
        assert_eq!(T::try_parse_from(["t"]).unwrap().http_endpoint, None);
        let e = T::try_parse_from(["t", "--http-endpoint", "localhost:1"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not an IP address"), "{e}");
    }

    struct Fake {
        alive: AtomicBool,
        ready: AtomicBool,
    }

    impl Report for Fake {
        fn metrics(&self) -> String {
            "# TYPE fake_up gauge\nfake_up 1\n# EOF\n".into()
        }
        fn healthz(&self) -> Result<(), String> {
            if self.alive.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("loop stalled".into())
            }
        }
        fn readyz(&self) -> Result<(), String> {
            if self.ready.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("starting".into())
            }
        }
    }

    /// (status, content type, body) of `METHOD path` over a fresh connection.
    async fn call(addr: SocketAddr, method: &str, path: &str) -> (u16, String, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        let code = head.split(' ').nth(1).unwrap().parse().unwrap();
        let ctype = head
            .lines()
            .find_map(|l| l.strip_prefix("content-type: "))
            .unwrap_or_default()
            .to_string();
        (code, ctype, body.to_string())
    }

    #[tokio::test]
    async fn the_three_endpoints_answer() {
        let fake = Arc::new(Fake {
            alive: AtomicBool::new(true),
            ready: AtomicBool::new(false),
        });
        let server = start(&"127.0.0.1:0".parse().unwrap(), fake.clone())
            .await
            .unwrap();
        let addr = server.local_addr();
        assert_ne!(addr.port(), 0);

        let (code, ctype, body) = call(addr, "GET", "/metrics").await;
        assert_eq!((code, ctype.as_str()), (200, METRICS_CONTENT_TYPE));
        assert!(body.contains("fake_up 1"), "{body}");
        assert_eq!(
            call(addr, "GET", "/healthz").await,
            (200, "text/plain".into(), "ok\n".into())
        );
        assert_eq!(
            call(addr, "GET", "/readyz").await,
            (503, "text/plain".into(), "starting\n".into())
        );
        fake.ready.store(true, Ordering::Relaxed);
        assert_eq!(call(addr, "GET", "/readyz").await.0, 200);
        fake.alive.store(false, Ordering::Relaxed);
        assert_eq!(
            call(addr, "GET", "/healthz").await,
            (503, "text/plain".into(), "loop stalled\n".into())
        );
        // HEAD answers like GET, without a body.
        let (code, _, body) = call(addr, "HEAD", "/readyz").await;
        assert_eq!((code, body.as_str()), (200, ""));
        assert_eq!(call(addr, "GET", "/").await.0, 404);
        assert_eq!(call(addr, "GET", "/livez").await.0, 404);
        assert_eq!(call(addr, "GET", "/metrics/x").await.0, 404);
        assert_eq!(call(addr, "POST", "/healthz").await.0, 405);

        server.stop().await;
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "stopped: the port is closed"
        );
    }

    #[tokio::test]
    async fn all_interfaces_take_ipv4_and_a_taken_port_fails_the_start() {
        let report = Arc::new(Fake {
            alive: AtomicBool::new(true),
            ready: AtomicBool::new(true),
        });
        let server = start(&HttpEndpoint::any(0), report.clone()).await.unwrap();
        let port = server.local_addr().port();
        let v4 = SocketAddr::from(([127, 0, 0, 1], port));
        assert_eq!(call(v4, "GET", "/healthz").await.0, 200);
        if server.local_addr().is_ipv6() {
            let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
            assert_eq!(call(v6, "GET", "/readyz").await.0, 200);
        }
        let err = start(&HttpEndpoint::any(port), report).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
        server.stop().await;
    }
}
