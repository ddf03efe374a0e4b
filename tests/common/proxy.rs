//! A loopback TCP proxy for network faults between a client and a server (RELIABILITY.md §6.1).
//!
//! Modes, switchable at run time with [`Proxy::set_mode`]:
//! * `Pass` — bytes flow both ways.
//! * `Delay(d)` — replies (server → client) are delivered `d` after the proxy read them; requests
//!   pass at once. Order is kept.
//! * `Blackhole` — bytes in both directions are dropped; sockets stay open. A connection that
//!   dropped bytes is closed when the mode leaves `Blackhole` (its stream has a hole, as a TCP
//!   session that outlived its retransmission timeout would be dead).
//! * `Reset` — every open connection is closed and new ones are accepted and closed at once.
//! * `Hold` — bytes in both directions are held, not dropped: sockets stay open and every byte
//!   read is kept, in order, for later delivery (what TCP retransmission does during a
//!   partition). [`Proxy::heal_delivering_held_after`] ends it: new bytes pass at once on new
//!   connections, and the held bytes are delivered `d` later, each connection's later bytes
//!   behind them; `set_mode` away from `Hold` delivers them at once. New connections are
//!   closed at once during a `Hold` (none can be set up across a partition).
//!
//! [`Proxy::heal_leaving_dead`] leaves `Blackhole` without closing the connections that dropped
//! bytes: they stay open and keep dropping everything (a TCP session that died silently: NAT
//! state lost, a peer gone without a reset), while new connections pass.
//!
//! The proxy runs on its own thread and runtime, so that it outlives `#[tokio::test]` runtimes
//! and a busy test runtime does not slow it. Dropping the `Proxy` stops it.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio::time::Instant;

/// What the proxy does with the bytes it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    Delay(Duration),
    Blackhole,
    Reset,
    /// Requests pass, replies are dropped (a reply lost after the server acted). Leaving this
    /// mode closes the connections that dropped bytes, as leaving `Blackhole` does.
    DropReplies,
    /// Bytes in both directions are kept and delivered when the hold ends (see the header).
    Hold,
}

struct Conn {
    tasks: Vec<AbortHandle>,
    dropped: Arc<AtomicBool>,
    /// Drops every byte, whatever the mode (see `Proxy::heal_leaving_dead`).
    dead: Arc<AtomicBool>,
}

struct State {
    mode: Mutex<Mode>,
    conns: Mutex<Vec<Conn>>,
    /// Bumped when a `Hold` starts; held bytes carry the number of their hold.
    hold: std::sync::atomic::AtomicU64,
    /// The last hold that ended, and when its bytes are delivered.
    flushed: tokio::sync::watch::Sender<(u64, Instant)>,
}

impl State {
    fn mode(&self) -> Mode {
        *self.mode.lock().unwrap()
    }
}

/// A running proxy from `127.0.0.1:<port>` to `upstream`.
pub struct Proxy {
    port: u16,
    state: Arc<State>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("port", &self.port)
            .field("mode", &self.state.mode())
            .finish()
    }
}

impl Proxy {
    /// Starts a proxy in `Pass` mode to `127.0.0.1:upstream_port`.
    pub fn start(upstream_port: u16) -> Proxy {
        let upstream: SocketAddr = ([127, 0, 0, 1], upstream_port).into();
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy port");
        std_listener.set_nonblocking(true).unwrap();
        let port = std_listener.local_addr().unwrap().port();
        let state = Arc::new(State {
            mode: Mutex::new(Mode::Pass),
            conns: Mutex::new(Vec::new()),
            hold: std::sync::atomic::AtomicU64::new(0),
            flushed: tokio::sync::watch::Sender::new((0, Instant::now())),
        });
        let (stop_tx, stop_rx) = oneshot::channel();
        let st = state.clone();
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{port}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                rt.block_on(async move {
                    let listener = TcpListener::from_std(std_listener).unwrap();
                    tokio::select! {
                        _ = stop_rx => {}
                        _ = accept_loop(listener, upstream, st.clone()) => {}
                    }
                    for c in st.conns.lock().unwrap().drain(..) {
                        c.tasks.iter().for_each(AbortHandle::abort);
                    }
                });
            })
            .expect("proxy thread");
        Proxy {
            port,
            state,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<proxy port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn mode(&self) -> Mode {
        self.state.mode()
    }

    /// Switches the mode; takes effect for the next bytes read. `Reset` closes every connection;
    /// leaving `Blackhole` closes the connections that dropped bytes.
    pub fn set_mode(&self, mode: Mode) {
        if mode == Mode::Hold {
            // Numbered before the mode changes: every byte held carries this hold's number.
            self.state.hold.fetch_add(1, Ordering::SeqCst);
        }
        let old = std::mem::replace(&mut *self.state.mode.lock().unwrap(), mode);
        if old == Mode::Hold && mode != Mode::Hold {
            self.flush_held_at(Instant::now());
        }
        let mut conns = self.state.conns.lock().unwrap();
        if mode == Mode::Reset {
            for c in conns.drain(..) {
                c.tasks.iter().for_each(AbortHandle::abort);
            }
        } else if matches!(old, Mode::Blackhole | Mode::DropReplies) && mode != old {
            conns.retain(|c| {
                if c.dropped.load(Ordering::SeqCst) {
                    c.tasks.iter().for_each(AbortHandle::abort);
                    false
                } else {
                    true
                }
            });
        }
        conns.retain(|c| c.tasks.iter().any(|t| !t.is_finished()));
    }

    /// Ends a `Hold`: switches to `Pass` at once (new connections work now), and delivers the
    /// bytes held during the hold `d` from now, each connection's later bytes queued behind
    /// them: a request sent during a partition reaches the server late, after the heal, as TCP
    /// retransmission delivers it.
    pub fn heal_delivering_held_after(&self, d: Duration) {
        let old = std::mem::replace(&mut *self.state.mode.lock().unwrap(), Mode::Pass);
        assert_eq!(old, Mode::Hold, "heal_delivering_held_after outside a Hold");
        self.flush_held_at(Instant::now() + d);
    }

    fn flush_held_at(&self, at: Instant) {
        let hold = self.state.hold.load(Ordering::SeqCst);
        self.state.flushed.send_replace((hold, at));
    }

    /// Switches to `Pass`, but the connections that dropped bytes during a `Blackhole` stay
    /// open and dead (every byte dropped, no close): only new connections work.
    pub fn heal_leaving_dead(&self) {
        let conns = self.state.conns.lock().unwrap();
        for c in conns.iter() {
            if c.dropped.load(Ordering::SeqCst) {
                c.dead.store(true, Ordering::SeqCst);
            }
        }
        *self.state.mode.lock().unwrap() = Mode::Pass;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, state: Arc<State>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        if matches!(state.mode(), Mode::Reset | Mode::Hold) {
            // During a `Hold` (a partition), a new connection cannot be set up either.
            drop(client);
            continue;
        }
        let Ok(server) = TcpStream::connect(upstream).await else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        let dropped = Arc::new(AtomicBool::new(false));
        let dead = Arc::new(AtomicBool::new(false));
        let up = pump(cr, sw, state.clone(), dropped.clone(), dead.clone(), false);
        let down = pump(sr, cw, state.clone(), dropped.clone(), dead.clone(), true);
        state.conns.lock().unwrap().push(Conn {
            tasks: vec![up, down],
            dropped,
            dead,
        });
    }
}

/// Copies `from` to `to` under the current mode. The reader stamps each chunk with its delivery
/// time; a writer task sleeps until then, so a delay does not accumulate over chunks.
fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<State>,
    dropped: Arc<AtomicBool>,
    dead: Arc<AtomicBool>,
    is_reply: bool,
) -> AbortHandle {
    let handle = tokio::spawn(async move {
        // A chunk held during hold number `h` carries `Some(h)` and waits for that hold's end.
        let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Option<u64>, Vec<u8>)>();
        let mut flushed = state.flushed.subscribe();
        let writer = async move {
            while let Some((at, held, bytes)) = rx.recv().await {
                if let Some(h) = held {
                    let end = match flushed.wait_for(|(f, _)| *f >= h).await {
                        Ok(v) => v.1,
                        Err(_) => break,
                    };
                    tokio::time::sleep_until(end).await;
                }
                tokio::time::sleep_until(at).await;
                if to.write_all(&bytes).await.is_err() {
                    break;
                }
            }
        };
        let reader = async move {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = match from.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if dead.load(Ordering::SeqCst) {
                    continue;
                }
                let mut held = None;
                let at = match state.mode() {
                    Mode::Hold => {
                        held = Some(state.hold.load(Ordering::SeqCst));
                        Instant::now()
                    }
                    Mode::Pass => Instant::now(),
                    Mode::Delay(d) if is_reply => Instant::now() + d,
                    Mode::Delay(_) => Instant::now(),
                    Mode::DropReplies if !is_reply => Instant::now(),
                    Mode::Blackhole | Mode::Reset | Mode::DropReplies => {
                        dropped.store(true, Ordering::SeqCst);
                        continue;
                    }
                };
                if tx.send((at, held, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        };
        // Either side ending ends the connection half; dropping the write half closes it.
        tokio::pin!(writer);
        tokio::select! {
            _ = &mut writer => {}
            _ = reader => writer.await,
        }
    });
    handle.abort_handle()
}
