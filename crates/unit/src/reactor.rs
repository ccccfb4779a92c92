//! The threads that serve a unit's connections: a fixed set of workers
//! (`--threads`, default one per core), each waiting on readiness events
//! (mio: epoll) for its share of the connections, and a bounded pool
//! (`--io-threads`) for the steps that block (a tcp put's or get's bytes,
//! spilled values, checkpoints, nixl setup, a Hello that hands over the
//! slab's memfd).
//!
//! A connection is a state ([`Conn`]), not a thread: an idle one costs its
//! socket and a few hundred bytes. A worker reads what a readable
//! connection has without blocking, serves each whole frame in its buffer
//! (the handler plans it under the core's lock), writes the reply without
//! blocking, and keeps what the peer did not take yet; it serves at most
//! [`QUANTUM`] frames of one connection before it turns to the next ready
//! one, so no session starves the others. A step that would block moves
//! the connection to the pool, which carries it out with the blocking
//! code (bounded by the request's deadline, as before) and hands the
//! connection back to its worker. Timers: a handshake that is not done by
//! its deadline, a frame begun and not finished within the frame timeout,
//! and a reply not taken within it end the connection as cut, exactly as
//! the socket timeouts of the thread-per-connection unit did.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Registry, Token, Waker};

use crate::budget;
use crate::conn::{Conn, EndReason, Ended, RingStep, Step};
use crate::shared::Shared;
use stowage_wire::Response;

/// Frames of one connection a worker serves before it turns to the next
/// ready connection.
pub(crate) const QUANTUM: usize = 32;

const WAKER: Token = Token(usize::MAX);
/// An idle blocking-pool thread exits after this.
const POOL_IDLE: Duration = Duration::from_secs(5);

enum Msg {
    New(Box<Conn>),
    /// A connection back from the pool: its slot, the slot's generation,
    /// and how its blocking step ended.
    Back(usize, u64, Box<Conn>, Ended),
    /// The answer to the waiting claim of the connection in a slot (and
    /// the slot's generation).
    Deliver(usize, u64, Response),
    /// The budget for memory outside the slab chose to cut the
    /// connection in a slot (of this generation).
    Cut(usize, u64),
}

struct Handle {
    tx: Mutex<Sender<Msg>>,
    waker: Waker,
    /// Connections it serves (to pick the least loaded).
    conns: AtomicUsize,
}

impl Handle {
    fn send(&self, m: Msg) {
        let sent = self
            .tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(m)
            .is_ok();
        if sent {
            let _ = self.waker.wake();
        }
    }
}

/// The serving threads of a unit.
pub(crate) struct Reactor {
    workers: Vec<Arc<Handle>>,
}

impl Reactor {
    /// Start `threads` workers (0: one per core) and a pool of at most
    /// `io_threads`.
    pub(crate) fn start(
        shared: &Arc<Shared>,
        threads: usize,
        io_threads: usize,
    ) -> std::io::Result<Reactor> {
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let pool = Arc::new(Pool::new("io", io_threads.max(1)));
        // Puts forwarded to other units wait on those units' pools: a
        // pool of their own per place in a chain (threads start only when
        // a step needs one), so that a step waits only on pools further
        // down its chain, and the pool serving plain puts on none.
        let forward_pools: Arc<[Arc<Pool>]> = (0..stowage_wire::MAX_HOPS)
            .map(|_| Arc::new(Pool::new("fwd", io_threads.max(1))))
            .collect();
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads {
            let poll = Poll::new()?;
            let waker = Waker::new(poll.registry(), WAKER)?;
            let (tx, rx) = mpsc::channel();
            let handle = Arc::new(Handle {
                tx: Mutex::new(tx),
                waker,
                conns: AtomicUsize::new(0),
            });
            let w = Worker {
                shared: shared.clone(),
                poll,
                rx,
                me: handle.clone(),
                pool: pool.clone(),
                forward_pools: forward_pools.clone(),
                slots: Vec::new(),
                free: Vec::new(),
                timers: BinaryHeap::new(),
                ready: VecDeque::new(),
                rings: Vec::new(),
                starved: Vec::new(),
                retry_at: Instant::now(),
                next_gen: 0,
            };
            std::thread::Builder::new()
                .name(format!("serve-{i}"))
                .spawn(move || w.run())?;
            workers.push(handle);
        }
        Ok(Reactor { workers })
    }

    /// Serve `conn` on the worker with the fewest connections.
    pub(crate) fn admit(&self, conn: Box<Conn>) {
        let Some(w) = self
            .workers
            .iter()
            .min_by_key(|w| w.conns.load(Ordering::Relaxed))
        else {
            return;
        };
        w.conns.fetch_add(1, Ordering::Relaxed);
        w.send(Msg::New(conn));
    }
}

struct Slot {
    gen: u64,
    conn: Option<Box<Conn>>,
    fd: RawFd,
    /// The connection is on the pool.
    away: bool,
    /// In the ready queue.
    queued: bool,
    /// The earliest timer set for it and not yet fired.
    armed: Option<Instant>,
    /// Its request ring is polled (in `rings`).
    polled: bool,
    /// Since when its polled ring had no request.
    ring_idle: Option<Instant>,
    /// When its ring last had requests, and the recent gap between
    /// requests (a moving average of gaps shorter than
    /// [`RING_LINGER_MAX`]).
    ring_last: Option<Instant>,
    ring_gap: Duration,
    /// The answer to its waiting claim, come while it was on the pool.
    delivery: Option<Response>,
}

struct Worker {
    shared: Arc<Shared>,
    poll: Poll,
    rx: Receiver<Msg>,
    me: Arc<Handle>,
    pool: Arc<Pool>,
    /// The pools of steps that forward puts, one per place in a chain
    /// (`Conn::parked_forwards`).
    forward_pools: Arc<[Arc<Pool>]>,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    timers: BinaryHeap<Reverse<(Instant, usize, u64)>>,
    ready: VecDeque<usize>,
    /// Connections whose request rings are polled: each turn while any
    /// is, until it has been idle for its linger ([`ring_linger`]), then it is parked and the
    /// client kicks it on its socket.
    rings: Vec<usize>,
    /// Connections whose next read waits for the budget (slot and
    /// generation), tried again every [`budget::RETRY`].
    starved: Vec<(usize, u64)>,
    retry_at: Instant,
    next_gen: u64,
}

fn register(registry: &Registry, fd: RawFd, idx: usize) -> std::io::Result<()> {
    registry.register(
        &mut SourceFd(&fd),
        Token(idx),
        Interest::READABLE | Interest::WRITABLE,
    )
}

impl Worker {
    fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        let spin = self.shared.settings.spin;
        let mut busy_until = Instant::now();
        loop {
            let now = Instant::now();
            let stopping = self.shared.life.stop.load(Ordering::SeqCst);
            if stopping && self.me.conns.load(Ordering::Relaxed) == 0 {
                return;
            }
            let timeout = if !self.ready.is_empty() || !self.rings.is_empty() || now < busy_until {
                Some(Duration::ZERO)
            } else {
                let mut next = self
                    .timers
                    .peek()
                    .map(|Reverse((t, _, _))| t.saturating_duration_since(now));
                if !self.starved.is_empty() {
                    let retry = self.retry_at.saturating_duration_since(now);
                    next = Some(next.map_or(retry, |t| t.min(retry)));
                }
                match (next, stopping) {
                    (Some(t), true) => Some(t.min(Duration::from_millis(100))),
                    (None, true) => Some(Duration::from_millis(100)),
                    (t, false) => t,
                }
            };
            if let Err(e) = self.poll.poll(&mut events, timeout) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "a serving thread's readiness wait failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            let mut worked = false;
            for ev in events.iter() {
                if ev.token() == WAKER {
                    continue;
                }
                worked = true;
                self.enqueue(ev.token().0);
            }
            while let Ok(m) = self.rx.try_recv() {
                worked = true;
                self.take(m);
            }
            self.fire_timers();
            self.retry_starved();
            // Serve each connection ready now once (a quantum each); those
            // that have more go to the back.
            for _ in 0..self.ready.len() {
                let Some(idx) = self.ready.pop_front() else {
                    break;
                };
                worked = true;
                self.step(idx);
            }
            worked |= self.poll_rings(spin);
            if worked {
                busy_until = Instant::now() + spin;
            } else if self.ready.is_empty() {
                // Polling while nothing came: let the clients (on the same
                // cores, often) run first.
                std::thread::yield_now();
            }
        }
    }

    fn enqueue(&mut self, idx: usize) {
        if let Some(Some(s)) = self.slots.get_mut(idx) {
            if !s.queued && !s.away {
                s.queued = true;
                self.ready.push_back(idx);
            }
        }
    }

    fn take(&mut self, m: Msg) {
        match m {
            Msg::New(conn) => {
                let fd = conn.fd();
                let idx = self.free.pop().unwrap_or_else(|| {
                    self.slots.push(None);
                    self.slots.len() - 1
                });
                if let Err(e) = register(self.poll.registry(), fd, idx) {
                    tracing::warn!(error = %e, "cannot watch a connection; it is closed");
                    self.free.push(idx);
                    self.me.conns.fetch_sub(1, Ordering::Relaxed);
                    crate::conn::finish(conn, Ended::Ran(Err(e.into())));
                    return;
                }
                self.next_gen += 1;
                self.slots[idx] = Some(Slot {
                    gen: self.next_gen,
                    conn: Some(conn),
                    fd,
                    away: false,
                    queued: false,
                    armed: None,
                    polled: false,
                    ring_idle: None,
                    ring_last: None,
                    ring_gap: Duration::ZERO,
                    delivery: None,
                });
                let me = self.me.clone();
                let gen = self.next_gen;
                if let Some(Some(s)) = self.slots.get(idx) {
                    if let Some(c) = &s.conn {
                        c.register_charge(Box::new(move || me.send(Msg::Cut(idx, gen))));
                    }
                }
                // Its first bytes may be there already (no edge will say so).
                self.enqueue(idx);
            }
            Msg::Back(idx, gen, conn, ended) => {
                let Some(Some(s)) = self.slots.get_mut(idx) else {
                    return;
                };
                if s.gen != gen {
                    return;
                }
                if conn.budget_cut() {
                    // Chosen while it made progress on the pool.
                    conn.spare_cut();
                }
                match ended {
                    Ended::Ran(Ok(())) => {
                        // A ring made, or served, on the pool: poll it
                        // (parked rings cost one look).
                        let ring = conn.has_ring();
                        s.conn = Some(conn);
                        s.away = false;
                        if let Some(r) = s.delivery.take() {
                            self.deliver(idx, gen, r);
                        }
                        if ring {
                            self.poll_ring(idx);
                        }
                        // Readiness that came meanwhile was not served.
                        self.enqueue(idx);
                    }
                    ended => self.end(idx, conn, ended),
                }
            }
            Msg::Deliver(idx, gen, r) => self.deliver(idx, gen, r),
            Msg::Cut(idx, gen) => {
                let Some(Some(s)) = self.slots.get_mut(idx) else {
                    return;
                };
                if s.gen != gen {
                    return;
                }
                // (On the pool, it is spared when it comes back.)
                if let Some(conn) = s.conn.take_if(|c| c.budget_cut()) {
                    let why = "cut: the unit's budget for memory outside its slab \
                               (--outside-slab-budget) was spent and this connection held \
                               the most stalled bytes";
                    self.end(idx, conn, Ended::Ran(Err(EndReason::Busy(why.into()))));
                }
            }
        }
    }

    /// Try again the connections that wait for the budget, every
    /// [`budget::RETRY`].
    fn retry_starved(&mut self) {
        if self.starved.is_empty() {
            return;
        }
        let now = Instant::now();
        if now < self.retry_at {
            return;
        }
        self.retry_at = now + budget::RETRY;
        for (idx, gen) in std::mem::take(&mut self.starved) {
            if self
                .slots
                .get(idx)
                .and_then(Option::as_ref)
                .is_some_and(|s| s.gen == gen)
            {
                self.enqueue(idx);
            }
        }
    }

    /// Send the connection in slot `idx` the answer to its waiting claim
    /// (kept until it is back, when the pool has it).
    fn deliver(&mut self, idx: usize, gen: u64, r: Response) {
        let Some(Some(s)) = self.slots.get_mut(idx) else {
            return;
        };
        if s.gen != gen {
            return;
        }
        let Some(conn) = s.conn.as_mut() else {
            s.delivery = Some(r);
            return;
        };
        match conn.deliver(r) {
            // The rest of the answer, if the socket took only part, goes
            // with the connection's next turn.
            Ok(()) => self.enqueue(idx),
            Err(e) => {
                if let Some(conn) = self.slots[idx].as_mut().and_then(|s| s.conn.take()) {
                    self.end(idx, conn, Ended::Ran(Err(e.into())));
                }
            }
        }
    }

    /// A claim of the connection in slot `idx` began to wait: leave a
    /// mailbox for its answer, which comes back to this worker.
    fn mailbox(&mut self, idx: usize, conn: &mut Conn) {
        let Some(id) = conn.take_wait_started() else {
            return;
        };
        let Some(Some(s)) = self.slots.get(idx) else {
            return;
        };
        let (gen, me) = (s.gen, self.me.clone());
        self.shared
            .conns
            .answers
            .wait(id, Box::new(move |r| me.send(Msg::Deliver(idx, gen, r))));
    }

    fn fire_timers(&mut self) {
        let now = Instant::now();
        while let Some(&Reverse((t, idx, gen))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            let Some(Some(s)) = self.slots.get_mut(idx) else {
                continue;
            };
            if s.gen != gen || s.armed != Some(t) {
                continue;
            }
            s.armed = None;
            if s.away {
                continue;
            }
            let Some(conn) = s.conn.as_ref() else {
                continue;
            };
            match conn.deadline() {
                Some(d) if d <= now => {
                    // A last read: the bytes may have come just now.
                    self.enqueue(idx);
                }
                Some(d) => self.arm(idx, d),
                None => {}
            }
        }
    }

    fn arm(&mut self, idx: usize, at: Instant) {
        let Some(Some(s)) = self.slots.get_mut(idx) else {
            return;
        };
        if s.armed.is_some_and(|a| a <= at) {
            return;
        }
        s.armed = Some(at);
        self.timers.push(Reverse((at, idx, s.gen)));
    }

    fn step(&mut self, idx: usize) {
        let Some(Some(s)) = self.slots.get_mut(idx) else {
            return;
        };
        s.queued = false;
        let Some(mut conn) = s.conn.take() else {
            return;
        };
        let gen = s.gen;
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.pump(QUANTUM)));
        let step = match ran {
            Ok(step) => step,
            Err(panic) => {
                self.end(idx, conn, Ended::panicked(panic));
                return;
            }
        };
        if conn.take_kick() && conn.has_ring() {
            self.poll_ring(idx);
        }
        self.mailbox(idx, &mut conn);
        if let Step::Starved(_) = step {
            if self.starved.is_empty() {
                self.retry_at = Instant::now() + budget::RETRY;
            }
            self.starved.push((idx, gen));
        }
        match step {
            Step::Wait(deadline) | Step::Starved(deadline) => {
                if let Some(Some(s)) = self.slots.get_mut(idx) {
                    s.conn = Some(conn);
                }
                if let Some(d) = deadline {
                    if d <= Instant::now() {
                        let conn = self.slots[idx].as_mut().and_then(|s| s.conn.take());
                        if let Some(conn) = conn {
                            let end = Ended::Ran(Err(std::io::Error::from(
                                std::io::ErrorKind::TimedOut,
                            )
                            .into()));
                            self.end(idx, conn, end);
                        }
                        return;
                    }
                    self.arm(idx, d);
                }
            }
            Step::Again => {
                if let Some(Some(s)) = self.slots.get_mut(idx) {
                    s.conn = Some(conn);
                }
                self.enqueue(idx);
            }
            Step::Pool => self.send_to_pool(idx, gen, conn),
            Step::End(r) => self.end(idx, conn, Ended::Ran(r)),
        }
    }

    /// Carry the connection's parked step out on the pool; it comes back
    /// to this worker.
    fn send_to_pool(&mut self, idx: usize, gen: u64, conn: Box<Conn>) {
        if let Some(Some(s)) = self.slots.get_mut(idx) {
            s.away = true;
        }
        let me = self.me.clone();
        let pool = match conn.parked_forwards() {
            Some(hop) => {
                let last = self.forward_pools.len() - 1;
                &self.forward_pools[usize::from(hop).min(last)]
            }
            None => &self.pool,
        };
        pool.submit(Box::new(move || {
            let mut conn = conn;
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.run_parked()));
            let ended = match ran {
                Ok(r) => Ended::Ran(r),
                Err(panic) => Ended::panicked(panic),
            };
            me.send(Msg::Back(idx, gen, conn, ended));
        }));
    }

    /// The connection in slot `idx` ended: stop watching it, free the
    /// slot, and release what it holds by the rules for how it ended.
    fn end(&mut self, idx: usize, conn: Box<Conn>, ended: Ended) {
        if let Some(s) = self.slots.get_mut(idx).and_then(Option::take) {
            let _ = self.poll.registry().deregister(&mut SourceFd(&s.fd));
            if s.polled {
                self.rings.retain(|&r| r != idx);
            }
            self.free.push(idx);
            self.me.conns.fetch_sub(1, Ordering::Relaxed);
        }
        crate::conn::finish(conn, ended);
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Threads for blocking steps: started when a job finds none idle (at
/// most `max`), gone after [`POOL_IDLE`] without work.
pub(crate) struct Pool {
    state: Mutex<PoolState>,
    cv: Condvar,
    max: usize,
    /// Its threads' names' prefix.
    name: &'static str,
}

struct PoolState {
    queue: VecDeque<Job>,
    threads: usize,
    idle: usize,
}

impl Pool {
    fn new(name: &'static str, max: usize) -> Self {
        Self {
            name,
            state: Mutex::new(PoolState {
                queue: VecDeque::new(),
                threads: 0,
                idle: 0,
            }),
            cv: Condvar::new(),
            max,
        }
    }

    fn submit(self: &Arc<Self>, job: Job) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.queue.push_back(job);
        if st.idle >= st.queue.len() || st.threads >= self.max {
            self.cv.notify_one();
            return;
        }
        st.threads += 1;
        let n = st.threads;
        drop(st);
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{}-{n}", self.name))
            .spawn(move || me.work());
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a blocking-pool thread");
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.threads -= 1;
            let stranded = st.threads == 0;
            drop(st);
            if stranded {
                // Nobody would ever run it: run what waits here.
                while let Some(job) = self.pop() {
                    job();
                }
            }
        }
    }

    fn pop(&self) -> Option<Job> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .queue
            .pop_front()
    }

    fn work(self: Arc<Self>) {
        loop {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let job = loop {
                if let Some(j) = st.queue.pop_front() {
                    break j;
                }
                st.idle += 1;
                let (s, waited) = self
                    .cv
                    .wait_timeout(st, POOL_IDLE)
                    .unwrap_or_else(|p| p.into_inner());
                st = s;
                st.idle -= 1;
                if waited.timed_out() && st.queue.is_empty() {
                    st.threads -= 1;
                    return;
                }
            };
            drop(st);
            job();
        }
    }
}

// A worker's request rings: each polled ring is served a quantum per
// turn while its client is busy, and parked (the client then kicks it)
// once idle for its linger.

/// The longest a polled request ring stays polled with no request before
/// it is parked: a ring lingers for `--spin`, or for four of its client's
/// recent gaps between requests when that is longer (a client that
/// alternates between units comes back to each after the others' round
/// trips, and a parked ring costs it a kick and a wake-up), never longer
/// than this.
const RING_LINGER_MAX: Duration = Duration::from_micros(500);

/// How long an idle polled ring of `slot` is still polled: `spin`, or
/// four of its recent gaps between requests when that is longer, at most
/// [`RING_LINGER_MAX`]; zero when `spin` is zero (adaptive polling off).
fn ring_linger(spin: Duration, gap: Duration) -> Duration {
    if spin.is_zero() {
        return Duration::ZERO;
    }
    spin.max(gap.saturating_mul(4))
        .min(RING_LINGER_MAX.max(spin))
}

impl Worker {
    /// Serve every polled ring a quantum; park those idle for their
    /// linger ([`ring_linger`] of `idle`, the `--spin`).
    /// Whether any request was served.
    fn poll_rings(&mut self, idle: Duration) -> bool {
        let mut worked = false;
        let mut i = 0;
        while i < self.rings.len() {
            let idx = self.rings[i];
            let Some(Some(s)) = self.slots.get_mut(idx) else {
                self.rings.swap_remove(i);
                continue;
            };
            if s.away {
                i += 1;
                continue;
            }
            let Some(mut conn) = s.conn.take() else {
                i += 1;
                continue;
            };
            let gen = s.gen;
            let ran =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.pump_ring(QUANTUM)));
            let step = match ran {
                Ok(step) => step,
                Err(panic) => {
                    self.end(idx, conn, Ended::panicked(panic));
                    continue;
                }
            };
            match step {
                RingStep::Served(n) => {
                    let now = Instant::now();
                    let mut parked = false;
                    if n > 0 {
                        worked = true;
                        s.ring_idle = None;
                        if let Some(last) = s.ring_last {
                            let gap = now.duration_since(last);
                            if gap < RING_LINGER_MAX {
                                s.ring_gap = (s.ring_gap * 3 + gap) / 4;
                            }
                        }
                        s.ring_last = Some(now);
                    } else {
                        let since = *s.ring_idle.get_or_insert(now);
                        if now.duration_since(since) >= ring_linger(idle, s.ring_gap)
                            && conn.park_ring()
                        {
                            parked = true;
                        }
                    }
                    s.conn = Some(conn);
                    if parked {
                        s.polled = false;
                        s.ring_idle = None;
                        self.rings.swap_remove(i);
                        continue;
                    }
                    i += 1;
                }
                RingStep::Pool => {
                    worked = true;
                    s.ring_idle = None;
                    self.send_to_pool(idx, gen, conn);
                    i += 1;
                }
                RingStep::End(e) => {
                    tracing::warn!(error = %e, "a request ring broke the protocol; its connection is cut");
                    self.end(idx, conn, Ended::Ran(Err(e)));
                }
            }
        }
        worked
    }

    /// Poll the ring of `idx` (its client kicked it, or it was just made).
    fn poll_ring(&mut self, idx: usize) {
        if let Some(Some(s)) = self.slots.get_mut(idx) {
            if !s.polled {
                s.polled = true;
                s.ring_idle = None;
                self.rings.push(idx);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_lingers_for_its_clients_gap_within_bounds() {
        let us = Duration::from_micros;
        // No gap seen yet: --spin.
        assert_eq!(ring_linger(us(50), Duration::ZERO), us(50));
        // A client that comes back every 40 us keeps its ring for 160 us.
        assert_eq!(ring_linger(us(50), us(40)), us(160));
        // Never past the bound, never under --spin.
        assert_eq!(ring_linger(us(50), us(400)), RING_LINGER_MAX);
        assert_eq!(ring_linger(us(800), us(400)), us(800));
        // --spin 0 turns adaptive polling off: rings park at once.
        assert_eq!(ring_linger(Duration::ZERO, us(40)), Duration::ZERO);
    }
}
