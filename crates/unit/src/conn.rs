//! One client connection: read a frame, act on the core and the slab,
//! reply; repeat until the client leaves or misbehaves.

use std::collections::HashSet;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::sync::Arc;

use stowage_core::{Allocated, BlobId, Committed, CoreError, PinId};
use stowage_wire::io::{
    drain, read_header, read_prefix, write_all_vectored, ReadError, Socket, SpinReader,
};
use stowage_wire::{
    encode, ErrorCode, Found, Item, Request, Response, PARTITION_SEPARATOR, PROTOCOL_VERSION,
};

use crate::disk::DiskEngine;
use crate::{Served, Shared};

/// What a connection holds on the unit, given back when it ends.
#[derive(Default)]
struct Holdings {
    pins: HashSet<PinId>,
    reservations: HashSet<BlobId>,
}

struct Conn {
    shared: Arc<Shared>,
    reader: BufReader<SpinReader>,
    writer: Socket,
    namespace: Option<String>,
    holdings: Holdings,
    out: Vec<u8>,
    scratch: Vec<u8>,
}

/// Serve one connection until it ends.
pub(crate) fn serve(shared: Arc<Shared>, stream: Socket) {
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot clone a connection's socket");
            return;
        }
    };
    let mut c = Conn {
        shared: shared.clone(),
        reader: BufReader::with_capacity(
            64 << 10,
            SpinReader {
                socket: stream,
                spin: shared.spin,
            },
        ),
        writer,
        namespace: None,
        holdings: Holdings::default(),
        out: Vec::with_capacity(4096),
        scratch: Vec::new(),
    };
    if let Err(e) = c.run() {
        tracing::debug!(error = %e, "connection ended");
    }
    c.release_holdings();
}

#[derive(Debug, thiserror::Error)]
enum ConnEnd {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("closed after an invalid request: {0}")]
    Invalid(String),
}

impl Conn {
    fn run(&mut self) -> Result<(), ConnEnd> {
        let limits = self.shared.limits;
        loop {
            let prefix = match read_prefix(&mut self.reader, &limits) {
                Ok(Some(p)) => p,
                Ok(None) => return Ok(()),
                Err(ReadError::Io(e)) => return Err(e.into()),
                Err(ReadError::Wire(e)) => return self.refuse(0, e.to_string()),
            };
            let env = match read_header::<_, Request>(&mut self.reader, &prefix, &mut self.scratch)
            {
                Ok(env) => env,
                Err(ReadError::Io(e)) => return Err(e.into()),
                Err(ReadError::Wire(e)) => return self.refuse(0, e.to_string()),
            };
            if let Err(e) = env.body.validate(&limits) {
                return self.refuse(env.id, e.to_string());
            }
            let carries_payload = matches!(env.body, Request::Put { .. });
            if prefix.payload_len > 0 && !carries_payload {
                return self.refuse(env.id, "this request carries no payload".into());
            }
            self.handle(env.id, env.body, prefix.payload_len)?;
        }
    }

    /// Answer InvalidRequest and end the connection.
    fn refuse(&mut self, id: u64, message: String) -> Result<(), ConnEnd> {
        tracing::warn!(%message, "invalid request; closing the connection");
        let _ = self.reply(
            id,
            &Response::Error {
                code: ErrorCode::InvalidRequest,
                message: message.clone(),
            },
        );
        Err(ConnEnd::Invalid(message))
    }

    fn reply(&mut self, id: u64, r: &Response) -> io::Result<()> {
        self.out.clear();
        encode(id, r, 0, &mut self.out).map_err(io::Error::other)?;
        self.writer.write_all(&self.out)
    }

    fn handle(&mut self, id: u64, req: Request, payload_len: u64) -> Result<(), ConnEnd> {
        let ns = match (&self.namespace, &req) {
            (None, Request::Hello { .. }) => String::new(),
            (None, _) => {
                self.reply(
                    id,
                    &Response::Error {
                        code: ErrorCode::Unauthorized,
                        message: "the first request must be Hello".into(),
                    },
                )?;
                return Err(ConnEnd::Invalid("no Hello".into()));
            }
            (Some(_), Request::Hello { .. }) => {
                return self.refuse(id, "Hello was already said on this connection".into())
            }
            (Some(ns), _) => ns.clone(),
        };
        let now = self.shared.now();
        let writes = matches!(
            req,
            Request::Alloc { .. } | Request::Put { .. } | Request::Checkpoint { .. }
        );
        if writes && self.shared.stop.load(std::sync::atomic::Ordering::SeqCst) {
            if payload_len > 0 {
                drain(&mut self.reader, payload_len)?;
            }
            return self.reply_internal(id, "the unit is shutting down");
        }
        let resp = match req {
            Request::Hello {
                version,
                namespace,
                want_fd,
            } => return self.hello(id, version, namespace, want_fd),
            Request::Alloc {
                blob,
                nbytes,
                n_entries,
            } => {
                let r = self.shared.core().alloc(blob, nbytes, n_entries, now);
                match r {
                    Ok(Allocated::Reserved { offset }) => {
                        self.holdings.reservations.insert(blob);
                        Response::Allocated { offset }
                    }
                    Ok(Allocated::ToDisk) => {
                        self.holdings.reservations.insert(blob);
                        Response::ToDisk
                    }
                    Ok(Allocated::AlreadyCommitted) => Response::AlreadyCommitted,
                    Err(e) => error_response(&e),
                }
            }
            Request::Commit {
                blob,
                partition,
                entries,
            } => {
                let r = self
                    .shared
                    .core()
                    .commit(&scope(&ns, &partition), blob, &entries);
                match r {
                    Ok(Committed::Done) => {
                        self.holdings.reservations.remove(&blob);
                        Response::Done
                    }
                    Ok(Committed::Pending) => {
                        self.holdings.reservations.remove(&blob);
                        Response::Pending
                    }
                    Err(e) => error_response(&e),
                }
            }
            Request::Abort { blob, in_flight } => {
                self.shared.core().abort(blob, in_flight, now);
                self.holdings.reservations.remove(&blob);
                Response::Done
            }
            Request::Resolve {
                partition,
                keys,
                hold,
            } => {
                let (pin, found) =
                    self.shared
                        .core()
                        .resolve_with_meta(&scope(&ns, &partition), &keys, now, hold);
                if let Some(p) = pin {
                    self.holdings.pins.insert(p);
                }
                let (found, _) = self.shared.bring_back(found, false);
                let mut bad = Vec::new();
                let found = found
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| match f? {
                        Served::Memory(l, meta) => Some(Found {
                            offset: l.offset,
                            len: l.len,
                            meta,
                            on_disk: false,
                        }),
                        Served::Disk { len, meta, .. } => Some(Found {
                            offset: 0,
                            len,
                            meta,
                            on_disk: true,
                        }),
                        Served::Corrupt => {
                            bad.push(i as u32);
                            None
                        }
                    })
                    .collect();
                Response::Resolved {
                    pin,
                    found,
                    corrupt: bad,
                }
            }
            Request::Unpin { pin, reply } => {
                self.shared.core().unpin(pin);
                self.holdings.pins.remove(&pin);
                if !reply {
                    return Ok(());
                }
                Response::Done
            }
            Request::ReleaseRows { partition, rows } => {
                let entries = self
                    .shared
                    .core()
                    .release_rows(&scope(&ns, &partition), &rows);
                Response::Released { entries }
            }
            Request::Stats => Response::Stats(self.shared.stats()),
            Request::Put {
                blob,
                partition,
                entries,
            } => return self.put(id, &scope(&ns, &partition), blob, entries, payload_len),
            Request::Read { partition, keys } => {
                return self.read(id, &scope(&ns, &partition), keys)
            }
            Request::List { partition } => Response::Listed {
                rows: self.shared.core().list(&scope(&ns, &partition)),
            },
            Request::DropPartition { partition } => Response::Released {
                entries: self.shared.core().drop_namespace(&scope(&ns, &partition)),
            },
            Request::Checkpoint { dir } => {
                if self.shared.stop.load(std::sync::atomic::Ordering::SeqCst) {
                    Response::Error {
                        code: ErrorCode::Internal,
                        message: "the unit is shutting down".into(),
                    }
                } else {
                    self.shared
                        .checkpoints
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let r = crate::checkpoint::write(&self.shared, std::path::Path::new(&dir));
                    self.shared
                        .checkpoints
                        .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    match r {
                        Ok(info) => Response::Checkpointed(info),
                        Err(e) => Response::Error {
                            code: ErrorCode::Internal,
                            message: e.to_string(),
                        },
                    }
                }
            }
            Request::Shutdown { timeout_ms } => {
                let problems = self
                    .shared
                    .shut_down(std::time::Duration::from_millis(timeout_ms));
                self.reply(id, &Response::ShutDown { problems })?;
                self.shared.request_exit();
                return Ok(());
            }
            Request::ListPartitions => {
                let prefix = scope(&ns, "");
                let names = self
                    .shared
                    .core()
                    .namespaces(&prefix)
                    .into_iter()
                    .map(|n| n[prefix.len()..].to_owned())
                    .collect();
                Response::Partitions { names }
            }
        };
        self.reply(id, &resp)?;
        Ok(())
    }

    fn hello(
        &mut self,
        id: u64,
        version: u16,
        namespace: String,
        want_fd: bool,
    ) -> Result<(), ConnEnd> {
        if version != PROTOCOL_VERSION {
            self.reply(
                id,
                &Response::Error {
                    code: ErrorCode::VersionMismatch,
                    message: format!("unit speaks protocol {PROTOCOL_VERSION}, client {version}"),
                },
            )?;
            return Err(ConnEnd::Invalid("protocol version mismatch".into()));
        }
        self.namespace = Some(namespace);
        let attach = want_fd && matches!(self.writer, Socket::Unix(_));
        let r = Response::Hello {
            version: PROTOCOL_VERSION,
            instance_id: self.shared.instance_id,
            slab_bytes: self.shared.slab.len(),
            fd_attached: attach,
        };
        self.out.clear();
        encode(id, &r, 0, &mut self.out).map_err(io::Error::other)?;
        match &self.writer {
            Socket::Unix(s) if attach => {
                let sent = stowage_shm::send_with_fd(s, &self.out, self.shared.slab.fd())?;
                let rest = self.out[sent..].to_vec();
                self.writer.write_all(&rest)?;
            }
            _ => {
                let out = std::mem::take(&mut self.out);
                self.writer.write_all(&out)?;
                self.out = out;
            }
        }
        Ok(())
    }

    /// Fused alloc + bytes + commit: the payload goes straight from the
    /// socket into the slab — or, when the slab is full and the disk tier
    /// has room, into the blob's file, answered Pending until it is synced.
    fn put(
        &mut self,
        id: u64,
        ns: &str,
        blob: BlobId,
        entries: Vec<stowage_core::EntrySpec>,
        nbytes: u64,
    ) -> Result<(), ConnEnd> {
        let now = self.shared.now();
        let n_entries = u32::try_from(entries.len()).unwrap_or(u32::MAX);
        let alloc = self.shared.core().alloc(blob, nbytes, n_entries, now);
        let offset = match alloc {
            Ok(Allocated::Reserved { offset }) => offset,
            Ok(Allocated::ToDisk) => return self.put_to_disk(id, ns, blob, entries, nbytes),
            Ok(Allocated::AlreadyCommitted) => {
                drain(&mut self.reader, nbytes)?;
                // Still being made durable, or done.
                let r = self.shared.core().commit(ns, blob, &entries);
                let resp = match r {
                    Ok(Committed::Pending) => Response::Pending,
                    _ => Response::Done,
                };
                self.reply(id, &resp)?;
                return Ok(());
            }
            Err(e) => {
                drain(&mut self.reader, nbytes)?;
                self.reply(id, &error_response(&e))?;
                return Ok(());
            }
        };
        self.holdings.reservations.insert(blob);
        let len = usize::try_from(nbytes).map_err(|_| io::Error::other("payload too large"))?;
        let reader = &mut self.reader;
        let filled = self
            .shared
            .slab
            .with_mut(offset, len, |dst| reader.read_exact(dst))
            .map_err(io::Error::other)?;
        if let Err(e) = filled {
            // Only this thread writes the range, and it has stopped: no
            // quarantine needed.
            self.shared.core().abort(blob, false, now);
            self.holdings.reservations.remove(&blob);
            return Err(e.into());
        }
        let r = self.shared.core().commit(ns, blob, &entries);
        self.holdings.reservations.remove(&blob);
        let resp = match r {
            Ok(Committed::Done) => Response::Done,
            Ok(Committed::Pending) => Response::Pending,
            Err(e) => {
                self.shared.core().abort(blob, false, now);
                error_response(&e)
            }
        };
        self.reply(id, &resp)?;
        Ok(())
    }

    /// The payload of a put that went to the disk tier: streamed into the
    /// blob's file; the flusher syncs it and publishes the entries.
    fn put_to_disk(
        &mut self,
        id: u64,
        ns: &str,
        blob: BlobId,
        entries: Vec<stowage_core::EntrySpec>,
        nbytes: u64,
    ) -> Result<(), ConnEnd> {
        let now = self.shared.now();
        let Some(d) = &self.shared.disk else {
            drain(&mut self.reader, nbytes)?;
            self.shared.core().abort(blob, false, now);
            return self.reply_internal(id, "disk tier missing");
        };
        let mut writer = match d.engine.create(blob, nbytes) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot create a blob file");
                None
            }
        };
        let mut failure = writer
            .is_none()
            .then(|| "cannot create the blob file".to_string());
        let mut left = nbytes;
        let mut buf = vec![0u8; (64 << 10).min(nbytes as usize).max(1)];
        while left > 0 {
            let n = (left as usize).min(buf.len());
            if let Err(e) = self.reader.read_exact(&mut buf[..n]) {
                self.shared.core().abort(blob, false, now);
                return Err(e.into());
            }
            left -= n as u64;
            if let (Some(w), None) = (writer.as_mut(), &failure) {
                if let Err(e) = w.write(&buf[..n]) {
                    failure = Some(format!("writing the blob file: {e}"));
                }
            }
        }
        if let Some(why) = failure {
            // Nothing of this put is kept; the client may retry.
            self.shared.core().abort(blob, false, now);
            if let Some(w) = writer {
                let _ = w.finish();
            }
            let _ = d.engine.delete(blob);
            return self.reply_internal(id, &why);
        }
        let r = self.shared.core().commit(ns, blob, &entries);
        let resp = match r {
            Ok(Committed::Pending) => {
                if let Some(w) = writer {
                    let sent = d
                        .flush
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .send((blob, w));
                    if sent.is_err() {
                        self.shared.core().disk_written(blob, false);
                    }
                }
                Response::Pending
            }
            Ok(Committed::Done) => Response::Done,
            Err(e) => {
                self.shared.core().abort(blob, false, now);
                error_response(&e)
            }
        };
        self.reply(id, &resp)?;
        Ok(())
    }

    fn reply_internal(&mut self, id: u64, why: &str) -> Result<(), ConnEnd> {
        self.reply(
            id,
            &Response::Error {
                code: ErrorCode::Internal,
                message: why.to_owned(),
            },
        )?;
        Ok(())
    }

    /// Fused resolve + bytes + unpin: the values go straight from the slab
    /// (or a spilled blob's checked file) to the socket.
    fn read(&mut self, id: u64, ns: &str, keys: Vec<stowage_core::Key>) -> Result<(), ConnEnd> {
        let now = self.shared.now();
        let (pin, found) = self.shared.core().resolve_with_meta(ns, &keys, now, false);
        let (served, buffers) = self.shared.bring_back(found, true);
        let mut corrupt = Vec::new();
        let mut ranges = Vec::new();
        let items: Vec<Option<Item>> = served
            .iter()
            .enumerate()
            .map(|(i, s)| match s.as_ref()? {
                Served::Memory(l, meta) => {
                    ranges.push((l.offset, l.len as usize));
                    Some(Item {
                        len: l.len,
                        meta: meta.clone(),
                    })
                }
                Served::Disk { len, meta, .. } => Some(Item {
                    len: *len,
                    meta: meta.clone(),
                }),
                Served::Corrupt => {
                    corrupt.push(i as u32);
                    None
                }
            })
            .collect();
        let total: u64 = items.iter().flatten().map(|it| it.len).sum();
        self.out.clear();
        encode(id, &Response::Data { items, corrupt }, total, &mut self.out)
            .map_err(io::Error::other)?;
        let header = std::mem::take(&mut self.out);
        let writer = &mut self.writer;
        let sent = self.shared.slab.with_io_slices(&ranges, |slab_slices| {
            let mut all = Vec::with_capacity(served.len() + 1);
            all.push(IoSlice::new(&header));
            let mut next_slab = slab_slices.iter();
            for s in served.iter().flatten() {
                match s {
                    Served::Memory(..) => {
                        if let Some(sl) = next_slab.next() {
                            all.push(IoSlice::new(sl));
                        }
                    }
                    Served::Disk {
                        blob, offset, len, ..
                    } => {
                        let (o, n) = (*offset as usize, *len as usize);
                        if let Some(b) = buffers.get(blob).and_then(|b| b.get(o..o + n)) {
                            all.push(IoSlice::new(b));
                        }
                    }
                    Served::Corrupt => {}
                }
            }
            write_all_vectored(writer, &mut all)
        });
        self.out = header;
        if let Some(p) = pin {
            self.shared.core().unpin(p);
        }
        sent.map_err(io::Error::other)??;
        Ok(())
    }

    fn release_holdings(&mut self) {
        let now = self.shared.now();
        let mut core = self.shared.core();
        for pin in self.holdings.pins.drain() {
            core.unpin(pin);
        }
        for blob in self.holdings.reservations.drain() {
            // The client may still be copying into it (shm): quarantine.
            core.abort(blob, true, now);
        }
    }
}

fn error_response(e: &CoreError) -> Response {
    let code = match e {
        CoreError::Full { .. } => ErrorCode::Full,
        CoreError::Busy { .. } => ErrorCode::Busy,
        CoreError::UnknownBlob(_) => ErrorCode::UnknownBlob,
        CoreError::Invalid(_) => ErrorCode::InvalidRequest,
    };
    Response::Error {
        code,
        message: e.to_string(),
    }
}

/// The core namespace of a partition of a connection's namespace.
fn scope(ns: &str, partition: &str) -> String {
    let mut s = String::with_capacity(ns.len() + 1 + partition.len());
    s.push_str(ns);
    s.push(PARTITION_SEPARATOR);
    s.push_str(partition);
    s
}
