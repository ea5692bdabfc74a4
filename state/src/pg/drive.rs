//! A PostgreSQL session whose socket is driven by the thread that waits
//! on it, as the synchronous `postgres` crate drives its own, but with no
//! runtime: a store is called from plain threads and from async tasks
//! alike (blocking them for the call, as a SQLite statement does), where
//! nesting a runtime would panic.
//!
//! The client (`tokio_postgres`) speaks the protocol; its `Connection`
//! future is polled here, beside the call, over a non-blocking socket that
//! answers "not yet" instead of waiting. When neither can go on, the
//! thread waits in `poll(2)` for the socket. A session driven by a thread
//! of its own instead paid two thread wake-ups per round trip (the
//! caller's request handed to that thread, its answer handed back), a
//! large share of a round trip on loopback.
//!
//! Connecting follows the client's own rules for the URL's hosts, ports,
//! `hostaddr`, `load_balance_hosts`, `target_session_attrs`,
//! `connect_timeout`, `tcp_user_timeout` and keepalives.
//!
//! Between calls nothing drives the session; [`Driver::poll_idle`] lets
//! it notice a server that closed it, before a transaction is begun on it.

use std::future::Future;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::{Host, LoadBalanceHosts, TargetSessionAttrs};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, SimpleQueryMessage};

use crate::sql::{Error, Result};

/// A session's socket: non-blocking, never waiting inside a read or a
/// write (the driver waits for it instead).
pub(crate) struct Socket {
    stream: Stream,
    /// A write found the socket full: the driver waits until it drains.
    wants_write: Arc<AtomicBool>,
}

enum Stream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Socket {
    fn new(stream: Stream) -> std::io::Result<Socket> {
        match &stream {
            Stream::Tcp(s) => s.set_nonblocking(true)?,
            Stream::Unix(s) => s.set_nonblocking(true)?,
        }
        Ok(Socket {
            stream,
            wants_write: Arc::new(AtomicBool::new(false)),
        })
    }

    fn fd(&self) -> RawFd {
        match &self.stream {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Runs `io` until it does not fail as interrupted; "would block" is
    /// `Pending` (the driver polls again once the socket is ready).
    fn attempt<T>(
        &mut self,
        mut io: impl FnMut(&mut Stream) -> std::io::Result<T>,
    ) -> Poll<std::io::Result<T>> {
        loop {
            match io(&mut self.stream) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Poll::Pending,
                r => return Poll::Ready(r),
            }
        }
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        // At most 16 KiB a read: the client's read buffer grows with a
        // large answer, and its free space is zeroed before each read.
        let into = buf.initialize_unfilled_to(buf.remaining().min(READ_MAX));
        let read = self.get_mut().attempt(|s| match s {
            Stream::Tcp(s) => s.read(into),
            Stream::Unix(s) => s.read(into),
        });
        read.map_ok(|n| buf.advance(n))
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let written = this.attempt(|s| match s {
            Stream::Tcp(s) => s.write(data),
            Stream::Unix(s) => s.write(data),
        });
        if written.is_pending() {
            this.wants_write.store(true, Ordering::Relaxed);
        }
        written
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // Nothing is buffered here: a write went to the kernel or waits.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let how = std::net::Shutdown::Write;
        Poll::Ready(match &self.stream {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
        })
    }
}

/// The most one read asks of the socket.
const READ_MAX: usize = 16 * 1024;

type Session = Pin<Box<dyn Future<Output = std::result::Result<(), tokio_postgres::Error>> + Send>>;

/// What drives one session: its `Connection` (until it ends) and its
/// socket's descriptor.
pub(crate) struct Driver {
    session: Option<Session>,
    /// The session ended: its socket is closed.
    ended: bool,
    fd: RawFd,
    wants_write: Arc<AtomicBool>,
    woken: Arc<Woken>,
}

/// Set by any waker the call or the session handed out: something may go
/// on without the socket.
struct Woken(AtomicBool);

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.store(true, Ordering::Release);
    }
}

impl Driver {
    /// A driver for `socket` with no session yet: it drives the session's
    /// start, then [`Driver::start`] hands it the session.
    fn for_socket(socket: &Socket) -> Driver {
        Driver {
            session: None,
            ended: false,
            fd: socket.fd(),
            wants_write: socket.wants_write.clone(),
            woken: Arc::new(Woken(AtomicBool::new(false))),
        }
    }

    fn start<T>(&mut self, connection: tokio_postgres::Connection<Socket, T>)
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        self.session = Some(Box::pin(connection));
    }

    /// Polls `f` and the session until `f` is done, waiting for the
    /// socket whenever neither can go on.
    pub(crate) fn block_on<F: Future>(&mut self, f: F) -> F::Output {
        self.block_on_until(f, None)
            .expect("no deadline: the call's own end")
    }

    /// [`Driver::block_on`], giving up (`None`) once `deadline` passed.
    fn block_on_until<F: Future>(
        &mut self,
        f: F,
        deadline: Option<std::time::Instant>,
    ) -> Option<F::Output> {
        let waker = Waker::from(self.woken.clone());
        let mut cx = Context::from_waker(&waker);
        let mut f = std::pin::pin!(f);
        loop {
            self.woken.0.store(false, Ordering::Release);
            // The call first: it queues its requests for the session.
            if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return Some(v);
            }
            if self.turn(&mut cx) || self.woken.0.load(Ordering::Acquire) {
                // The session ended (its calls now fail as closed), or a
                // waker fired: poll again before waiting.
                continue;
            }
            let left = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(std::time::Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return None,
                },
            };
            self.wait(left);
        }
    }

    /// One turn of the session, not waiting: what the server sent is read
    /// (a session it closed ends here, and its client says so).
    pub(crate) fn poll_idle(&mut self) {
        let waker = Waker::from(self.woken.clone());
        self.turn(&mut Context::from_waker(&waker));
    }

    /// Polls the session; `true` when it just ended.
    fn turn(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(session) = self.session.as_mut() else {
            return false;
        };
        match session.as_mut().poll(cx) {
            Poll::Ready(r) => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "postgresql session ended");
                }
                // Dropped: its client's calls fail as closed.
                self.session = None;
                self.ended = true;
                true
            }
            Poll::Pending => false,
        }
    }

    /// Waits until the socket can be read (or written, if a write waits),
    /// for at most `limit`.
    fn wait(&self, limit: Option<std::time::Duration>) {
        if self.ended {
            // No socket to wait for: a call on an ended session fails
            // when next polled.
            return std::thread::yield_now();
        }
        let mut events = libc::POLLIN;
        if self.wants_write.swap(false, Ordering::Relaxed) {
            events |= libc::POLLOUT;
        }
        let mut fd = libc::pollfd {
            fd: self.fd,
            events,
            revents: 0,
        };
        // SAFETY: one valid pollfd, whose descriptor is open: the session
        // (or the handshake's future, while it runs) owns its socket.
        let timeout = limit.map_or(-1, |l| {
            // Rounded up: a wait of 0 ms would spin until the deadline.
            i32::try_from(l.as_millis() + 1).unwrap_or(i32::MAX)
        });
        unsafe { libc::poll(&mut fd, 1, timeout) };
    }
}

/// Connects to the database `config` names, as the client's own `connect`
/// would: each host in turn (in random order with
/// `load_balance_hosts=random`), each of its addresses, until one takes a
/// session of the kind `target_session_attrs` asks for.
pub(crate) fn connect<T>(config: &Config, tls: T) -> Result<(Client, Driver)>
where
    T: MakeTlsConnect<Socket> + Clone,
    T::Stream: Send + 'static,
{
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    let n = hosts.len().max(addrs.len());
    if n == 0 {
        return Err(Error::Connect("the URL names no host".into()));
    }
    // (Host, `hostaddr` and port counts that do not match were refused
    // with the URL: `PgTarget::new`.)
    let ports = config.get_ports();
    let random = config.get_load_balance_hosts() == LoadBalanceHosts::Random;
    let mut order: Vec<usize> = (0..n).collect();
    if random {
        shuffle(&mut order);
    }
    let mut last = None;
    for i in order {
        let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
        let hostname = match hosts.get(i) {
            Some(Host::Tcp(h)) => Some(h.as_str()),
            _ => None,
        };
        let targets: Vec<Target> = match (addrs.get(i), hosts.get(i)) {
            (Some(ip), _) => vec![Target::Tcp(std::net::SocketAddr::new(*ip, port))],
            (None, Some(Host::Tcp(h))) => {
                match std::net::ToSocketAddrs::to_socket_addrs(&(h.as_str(), port)) {
                    Ok(a) => {
                        let mut a: Vec<Target> = a.map(Target::Tcp).collect();
                        if random {
                            shuffle(&mut a);
                        }
                        a
                    }
                    Err(e) => {
                        last = Some(Error::Connect(format!("cannot resolve `{h}`: {e}")));
                        continue;
                    }
                }
            }
            (None, Some(Host::Unix(dir))) => {
                vec![Target::Unix(dir.join(format!(".s.PGSQL.{port}")))]
            }
            (None, None) => continue,
        };
        for target in targets {
            match connect_once(config, &target, hostname, tls.clone()) {
                Ok(session) => return Ok(session),
                Err(e) => last = Some(e),
            }
        }
    }
    Err(last.unwrap_or_else(|| Error::Connect("no address to connect to".into())))
}

enum Target {
    Tcp(std::net::SocketAddr),
    Unix(std::path::PathBuf),
}

fn connect_once<T>(
    config: &Config,
    target: &Target,
    hostname: Option<&str>,
    mut tls: T,
) -> Result<(Client, Driver)>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
{
    let failed = |what: &str, e: std::io::Error| Error::Connect(format!("{what}: {e}"));
    let stream = match target {
        Target::Tcp(addr) => {
            let s = match config.get_connect_timeout() {
                Some(t) => std::net::TcpStream::connect_timeout(addr, *t),
                None => std::net::TcpStream::connect(addr),
            }
            .map_err(|e| failed(&format!("cannot connect to {addr}"), e))?;
            s.set_nodelay(true)
                .map_err(|e| failed("cannot set TCP_NODELAY", e))?;
            let sock = socket2::SockRef::from(&s);
            #[cfg(target_os = "linux")]
            if let Some(t) = config.get_tcp_user_timeout() {
                sock.set_tcp_user_timeout(Some(*t))
                    .map_err(|e| failed("cannot set TCP_USER_TIMEOUT", e))?;
            }
            if config.get_keepalives() {
                let mut keepalive =
                    socket2::TcpKeepalive::new().with_time(config.get_keepalives_idle());
                if let Some(i) = config.get_keepalives_interval() {
                    keepalive = keepalive.with_interval(i);
                }
                if let Some(r) = config.get_keepalives_retries() {
                    keepalive = keepalive.with_retries(r);
                }
                sock.set_tcp_keepalive(&keepalive)
                    .map_err(|e| failed("cannot set keepalives", e))?;
            }
            Stream::Tcp(s)
        }
        Target::Unix(path) => Stream::Unix(
            std::os::unix::net::UnixStream::connect(path)
                .map_err(|e| failed(&format!("cannot connect to {}", path.display()), e))?,
        ),
    };
    let socket = Socket::new(stream).map_err(|e| failed("cannot set up the socket", e))?;
    let tls = tls
        .make_tls_connect(hostname.unwrap_or(""))
        .map_err(|e| Error::Connect(format!("cannot set up TLS: {}", e.into())))?;
    // The handshake, driven as calls are: by this thread, waiting in
    // poll(2) between the server's answers, and for no longer than the
    // connection itself may take (a server that takes the connection and
    // never answers would otherwise hold the caller for good).
    let mut driver = Driver::for_socket(&socket);
    let deadline = config
        .get_connect_timeout()
        .map(|t| std::time::Instant::now() + *t);
    let (client, connection) = driver
        .block_on_until(config.connect_raw(socket, tls), deadline)
        .ok_or_else(|| {
            Error::Connect("the server did not finish the session's start in time".into())
        })??;
    driver.start(connection);
    let wanted = config.get_target_session_attrs();
    if wanted != TargetSessionAttrs::Any {
        let answer = driver.block_on(client.simple_query("SHOW transaction_read_only"))?;
        let read_only = answer.iter().find_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).map(|v| v == "on"),
            _ => None,
        });
        match (wanted, read_only) {
            (TargetSessionAttrs::ReadWrite, Some(true)) => {
                return Err(Error::Connect("the database does not allow writes".into()))
            }
            (TargetSessionAttrs::ReadOnly, Some(false)) => {
                return Err(Error::Connect("the database is not read-only".into()))
            }
            _ => {}
        }
    }
    Ok((client, driver))
}

/// Shuffles `v` (Fisher–Yates; random UUIDs as the random numbers).
fn shuffle<T>(v: &mut [T]) {
    for i in (1..v.len()).rev() {
        let j = (uuid::Uuid::new_v4().as_u128() % (i as u128 + 1)) as usize;
        v.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that takes the connection (the kernel completes it from
    /// the listen queue) and never answers does not hold the caller past
    /// the connect timeout.
    #[test]
    fn a_server_that_never_answers_the_start_is_given_up_on_in_time() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(port)
            .user("jujube")
            .connect_timeout(std::time::Duration::from_millis(50));
        match connect(&config, tokio_postgres::NoTls) {
            Err(Error::Connect(why)) => assert!(why.contains("in time"), "{why}"),
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("a session with a server that never answered"),
        }
        drop(listener);
    }
}
