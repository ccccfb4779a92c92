//! The disk tier's tests.

use super::*;
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rustix::fs::{FileType, FlockOperation, Mode, OFlags};

use super::format::*;
use super::root::*;
use std::sync::Mutex;

fn dirfd(p: &Path) -> Arc<OwnedFd> {
    Arc::new(rustix::fs::open(p, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap())
}

fn engine(p: &Path) -> FileEngine {
    FileEngine::new(dirfd(p), p.to_owned(), 1)
}

/// An engine over `p` whose files have chunks of `chunk` bytes.
fn chunked(p: &Path, chunk: u32) -> FileEngine {
    FileEngine::with_chunk(dirfd(p), p.to_owned(), chunk)
}

/// `blob`, read whole, is `bytes`.
fn assert_reads_whole(e: &FileEngine, blob: BlobId, bytes: &[u8]) {
    let mut whole = vec![0u8; bytes.len()];
    e.read(blob, &mut whole).unwrap();
    assert!(whole == bytes, "{blob:?} read whole");
}

#[test]
fn blob_files_round_trip_and_detect_damage() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(dir.path());
    let mut w = e.create(BlobId(7), 10).unwrap();
    w.write(b"hello").unwrap();
    w.write(b"world").unwrap();
    let file_sum = w.finish().unwrap();
    assert_eq!(
        file_sum,
        xxhash_rust::xxh3::xxh3_64(&fs::read(e.path(BlobId(7))).unwrap())
    );
    let mut out = [0u8; 10];
    e.read(BlobId(7), &mut out).unwrap();
    assert_eq!(&out, b"helloworld");
    let mut part = [0u8; 4];
    e.read_at(BlobId(7), 3, &mut part).unwrap();
    assert_eq!(&part, b"lowo");
    assert_eq!(e.blob_size(BlobId(7)).unwrap(), 10);
    // Flip a byte of the data.
    let p = e.path(BlobId(7));
    let mut bytes = fs::read(&p).unwrap();
    bytes[HEADER as usize + 3] ^= 1;
    fs::write(&p, &bytes).unwrap();
    assert!(corrupt(&e, BlobId(7), &mut out));
    assert!(corrupt_at(&e, BlobId(7), 3, 1));
    // Truncate it, within the header and after it.
    for keep in [12, bytes.len() - 1] {
        fs::write(&p, &bytes[..keep]).unwrap();
        assert!(corrupt(&e, BlobId(7), &mut out));
        assert!(corrupt_at(&e, BlobId(7), 0, 1));
    }
    e.delete(BlobId(7)).unwrap();
    e.delete(BlobId(7)).unwrap();
    assert!(corrupt(&e, BlobId(7), &mut out));
    assert!(corrupt_at(&e, BlobId(7), 0, 0));
    // Short and long writes and the failpoint leave no file.
    let mut w = e.create(BlobId(8), 10).unwrap();
    w.write(b"short").unwrap();
    assert!(w.finish().is_err());
    let mut w = e.create(BlobId(8), 10).unwrap();
    w.write(b"eight by").unwrap();
    assert!(w.write(b"tes").is_err());
    assert!(w.write(b"te").is_err(), "a refused write poisons the file");
    assert!(w.finish().is_err());
    e.failpoints.enable("disk-write").unwrap();
    let mut w = e.create(BlobId(9), 1).unwrap();
    assert!(w.write(b"x").is_err());
    assert!(w.finish().is_err());
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Bytes that differ from chunk to chunk (so reading the wrong chunk
/// cannot pass).
fn data(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Write `bytes` as `blob`, in pieces of the sizes in `pieces` (in
/// turn); returns what `finish` does.
fn put(e: &FileEngine, blob: BlobId, bytes: &[u8], pieces: &[usize]) -> u64 {
    let mut w = e.create(blob, bytes.len() as u64).unwrap();
    let mut rest = bytes;
    for &n in pieces.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at(n.min(rest.len()));
        w.write(now).unwrap();
        rest = later;
    }
    w.finish().unwrap()
}

/// A whole read of `blob` into `out` finds it corrupt.
fn corrupt(e: &FileEngine, blob: BlobId, out: &mut [u8]) -> bool {
    matches!(e.read(blob, out), Err(DiskError::Corrupt { .. }))
}

fn corrupt_at(e: &FileEngine, blob: BlobId, offset: u64, len: usize) -> bool {
    matches!(
        e.read_at(blob, offset, &mut vec![0u8; len]),
        Err(DiskError::Corrupt { .. })
    )
}

fn flip(path: &Path, at: usize) {
    let mut bytes = fs::read(path).unwrap();
    bytes[at] ^= 0x10;
    fs::write(path, &bytes).unwrap();
}

/// Every range of small blobs, with chunks smaller than, equal to and
/// larger than the blob, written in uneven pieces: exactly the range.
#[test]
fn read_at_returns_exactly_every_range() {
    let dir = tempfile::tempdir().unwrap();
    for chunk in [1u32, 7, 16, 50, 64] {
        let e = chunked(dir.path(), chunk);
        for n in [0usize, 1, 15, 16, 17, 50] {
            let blob = BlobId(u128::from(chunk) << 32 | n as u128);
            let bytes = data(n, blob.0 as u64);
            let file_sum = put(&e, blob, &bytes, &[1, 2, 5, 3, 16]);
            let file = fs::read(e.path(blob)).unwrap();
            assert_eq!(file_sum, xxh3_64(&file));
            let chunks = (n as u64).div_ceil(u64::from(chunk));
            assert_eq!(file.len() as u64, HEADER + n as u64 + chunks * SUM);
            assert_eq!(e.blob_size(blob).unwrap(), n as u64);
            assert_reads_whole(&e, blob, &bytes);
            for offset in 0..=n {
                for len in 0..=n - offset {
                    let mut got = vec![0xAAu8; len];
                    e.read_at(blob, offset as u64, &mut got).unwrap();
                    assert_eq!(
                        got,
                        &bytes[offset..offset + len],
                        "chunk {chunk}, blob of {n}, {len} bytes at {offset}"
                    );
                }
            }
        }
    }
}

/// The real chunk size: ranges at and around chunk boundaries, within
/// a chunk, across several (more than one read's worth), to the end.
#[test]
fn read_at_chunk_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(dir.path());
    let c = CHUNK as usize;
    let n = 10 * c + 123;
    let bytes = data(n, 42);
    put(&e, BlobId(1), &bytes, &[1, c - 1, c + 5, 100_000, 3 * c]);
    let points = [
        0,
        1,
        c - 1,
        c,
        c + 1,
        2 * c,
        4 * c - 1,
        4 * c,
        5 * c + 7,
        10 * c,
        n - 1,
        n,
    ];
    for (i, &a) in points.iter().enumerate() {
        for &b in &points[i..] {
            let mut got = vec![0u8; b - a];
            e.read_at(BlobId(1), a as u64, &mut got).unwrap();
            assert!(got == bytes[a..b], "{} bytes at {a}", b - a);
        }
    }
    assert_reads_whole(&e, BlobId(1), &bytes);
}

/// Reads of part of a chunk go through one buffer per thread, made at
/// the first and reused by every later one (the soak's units read a
/// partial chunk for nearly every value, 1,600 a second; a 64 KiB
/// allocation each kept the allocator's freed pages resident). A file of
/// larger chunks is read through a buffer of its own, and leaves the
/// thread's as it was.
#[test]
fn reads_of_part_of_a_chunk_reuse_the_threads_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(dir.path());
    let c = CHUNK as usize;
    let n = 3 * c + 77;
    let bytes = data(n, 7);
    put(&e, BlobId(1), &bytes, &[n]);
    // This test's thread has read nothing yet.
    assert_eq!(partial_buffer().1, 0);
    let mut first = None;
    for (a, b) in [
        (1, 2),
        (c - 10, c + 10),
        (5, 2 * c + 3),
        (3 * c + 1, n),
        (c + 1, c + 100),
    ] {
        let mut got = vec![0u8; b - a];
        e.read_at(BlobId(1), a as u64, &mut got).unwrap();
        assert!(got == bytes[a..b], "{} bytes at {a}", b - a);
        let now = partial_buffer();
        assert!(now.1 >= c, "a chunk's room: {now:?}");
        assert_eq!(*first.get_or_insert(now), now, "{} bytes at {a}", b - a);
    }
    let big = chunked(dir.path(), 4 * CHUNK);
    put(&big, BlobId(2), &bytes, &[n]);
    let mut got = vec![0u8; 100];
    big.read_at(BlobId(2), 3, &mut got).unwrap();
    assert!(got == bytes[3..103]);
    assert_eq!(Some(partial_buffer()), first);
}

/// More chunks than one read of the sum table holds: the sums are
/// read window by window, each chunk checked against its own.
#[test]
fn many_chunks_are_checked_against_their_own_sums() {
    let dir = tempfile::tempdir().unwrap();
    let e = chunked(dir.path(), 2);
    let n = 4 * SUMS_AT_ONCE + 3;
    let bytes = data(n, 5);
    put(&e, BlobId(1), &bytes, &[333]);
    assert_reads_whole(&e, BlobId(1), &bytes);
    for (a, b) in [(1, n - 1), (2 * SUMS_AT_ONCE - 1, n), (1500, 1501)] {
        let mut got = vec![0u8; b - a];
        e.read_at(BlobId(1), a as u64, &mut got).unwrap();
        assert!(got == bytes[a..b], "{} bytes at {a}", b - a);
    }
    // Damage to a chunk far into the table is found by reads that
    // start far before it.
    flip(&e.path(BlobId(1)), HEADER as usize + n - 2);
    assert!(corrupt_at(&e, BlobId(1), 0, n));
    assert!(corrupt_at(&e, BlobId(1), 1, n - 2));
    let mut got = vec![0u8; n - 3];
    e.read_at(BlobId(1), 0, &mut got).unwrap();
}

/// read_at checks the chunks it reads (and may miss damage in others,
/// which read finds); damage to a chunk's sum, to the header or to
/// the length is caught too.
#[test]
fn read_at_is_checked_where_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(dir.path());
    let c = u64::from(CHUNK);
    let n = 10 * c + 123;
    let bytes = data(n as usize, 7);
    put(&e, BlobId(1), &bytes, &[65_536]);
    let p = e.path(BlobId(1));
    let clean = fs::read(&p).unwrap();
    let mut whole = vec![0u8; n as usize];

    // A flipped byte in chunk 3.
    flip(&p, (HEADER + 3 * c + 10) as usize);
    assert!(corrupt_at(&e, BlobId(1), 3 * c + 10, 1));
    assert!(corrupt_at(&e, BlobId(1), 3 * c + 11, 5), "same chunk");
    assert!(corrupt_at(&e, BlobId(1), 2 * c, c as usize + 1));
    assert!(corrupt_at(&e, BlobId(1), 0, n as usize));
    let mut got = vec![0u8; 3 * c as usize];
    e.read_at(BlobId(1), 0, &mut got).unwrap();
    assert!(got == bytes[..3 * c as usize], "chunks 0-2 are intact");
    e.read_at(BlobId(1), 4 * c, &mut got[..10]).unwrap();
    assert!(got[..10] == bytes[4 * c as usize..][..10]);
    assert!(corrupt(&e, BlobId(1), &mut whole));

    // A flipped byte in the last (short) chunk.
    fs::write(&p, &clean).unwrap();
    flip(&p, (HEADER + n - 1) as usize);
    assert!(corrupt_at(&e, BlobId(1), n - 1, 1));
    e.read_at(BlobId(1), 0, &mut got).unwrap();

    // A flipped byte in chunk 5's sum.
    fs::write(&p, &clean).unwrap();
    flip(&p, (HEADER + n + 5 * SUM + 2) as usize);
    assert!(corrupt_at(&e, BlobId(1), 5 * c + 1, 1));
    e.read_at(BlobId(1), 4 * c, &mut got[..c as usize]).unwrap();
    assert!(corrupt(&e, BlobId(1), &mut whole));

    // Any flipped header byte (magic, version, size, chunk size,
    // padding, the header's own sum) fails every read.
    for at in 0..HEADER as usize {
        fs::write(&p, &clean).unwrap();
        flip(&p, at);
        assert!(corrupt_at(&e, BlobId(1), 0, 0), "header byte {at}");
        assert!(corrupt_at(&e, BlobId(1), c, 1), "header byte {at}");
        assert!(e.blob_size(BlobId(1)).is_err(), "header byte {at}");
    }

    // One byte short, one byte long.
    fs::write(&p, &clean[..clean.len() - 1]).unwrap();
    assert!(corrupt_at(&e, BlobId(1), 0, 1));
    let mut long = clean.clone();
    long.push(0);
    fs::write(&p, &long).unwrap();
    assert!(corrupt_at(&e, BlobId(1), 0, 1));

    fs::write(&p, &clean).unwrap();
    assert_reads_whole(&e, BlobId(1), &bytes);
}

/// Ranges not inside the blob are errors, never panics; empty ranges
/// inside it are fine; a blob of no bytes works.
#[test]
fn read_at_out_of_range_empty_and_empty_blobs() {
    let dir = tempfile::tempdir().unwrap();
    let e = chunked(dir.path(), 16);
    put(&e, BlobId(1), &data(40, 1), &[40]);
    let out_of_range = |offset: u64, len: usize| {
        matches!(
            e.read_at(BlobId(1), offset, &mut vec![0u8; len]),
            Err(DiskError::OutOfRange { size: 40, .. })
        )
    };
    assert!(out_of_range(41, 0));
    assert!(out_of_range(39, 2));
    assert!(out_of_range(0, 41));
    assert!(out_of_range(40, 1));
    assert!(out_of_range(u64::MAX, 1), "offset + len overflows");
    assert!(out_of_range(u64::MAX, 0));
    for offset in [0, 15, 16, 40] {
        e.read_at(BlobId(1), offset, &mut []).unwrap();
    }
    // The whole-blob read wants exactly the blob's size.
    assert!(corrupt(&e, BlobId(1), &mut [0u8; 39]));

    put(&e, BlobId(2), &[], &[1]);
    assert_eq!(fs::metadata(e.path(BlobId(2))).unwrap().len(), HEADER);
    assert_eq!(e.blob_size(BlobId(2)).unwrap(), 0);
    e.read(BlobId(2), &mut []).unwrap();
    e.read_at(BlobId(2), 0, &mut []).unwrap();
    assert!(matches!(
        e.read_at(BlobId(2), 0, &mut [0u8; 1]),
        Err(DiskError::OutOfRange { size: 0, .. })
    ));
    assert!(matches!(
        e.read_at(BlobId(2), 1, &mut []),
        Err(DiskError::OutOfRange { .. })
    ));
    // A missing blob.
    assert!(corrupt_at(&e, BlobId(3), 0, 0));
}

/// A checkpoint engine over `dir` holding blob 1 as a file of format
/// version 1 (one sum after all the bytes): the engine, the blob's `n`
/// bytes (`data(n, seed)`), the file's path and its contents.
fn version_1_file(
    dir: &Path,
    n: usize,
    seed: u64,
) -> (FileEngine, Vec<u8>, std::path::PathBuf, Vec<u8>) {
    let e = FileEngine::checkpoint(dirfd(dir), dir.to_owned(), 1);
    let bytes = data(n, seed);
    let mut file = Vec::new();
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&1u32.to_le_bytes());
    file.extend_from_slice(&(n as u64).to_le_bytes());
    file.extend_from_slice(&bytes);
    file.extend_from_slice(&xxh3_64(&bytes).to_le_bytes());
    let p = e.path(BlobId(1));
    fs::write(&p, &file).unwrap();
    (e, bytes, p, file)
}

/// Files of format version 1 (in checkpoints written before chunk
/// sums) still read, whole or in part, and are still checked.
#[test]
fn version_1_files_still_read() {
    let dir = tempfile::tempdir().unwrap();
    let n = 3 * READ_RUN as usize + 5;
    let (e, bytes, p, file) = version_1_file(dir.path(), n, 3);
    assert_eq!(e.blob_size(BlobId(1)).unwrap(), n as u64);
    let mut whole = vec![0u8; n];
    e.read(BlobId(1), &mut whole).unwrap();
    assert!(whole == bytes);
    for (a, b) in [
        (0, 0),
        (0, 1),
        (READ_RUN as usize - 1, READ_RUN as usize + 1),
        (n - 5, n),
    ] {
        let mut got = vec![0u8; b - a];
        e.read_at(BlobId(1), a as u64, &mut got).unwrap();
        assert!(got == bytes[a..b], "{} bytes at {a}", b - a);
    }
    flip(&p, V1_HEADER as usize + n - 1);
    assert!(corrupt_at(&e, BlobId(1), 0, 1), "one sum covers all");
    assert!(corrupt(&e, BlobId(1), &mut whole));
    fs::write(&p, &file[..file.len() - 1]).unwrap();
    assert!(corrupt_at(&e, BlobId(1), 0, 1));
}

/// `copy_all` reads a version 1 file once, whole, however small the
/// pieces it hands on; and reports a damaged one after its last piece.
#[test]
fn version_1_files_are_copied_in_one_pass() {
    let dir = tempfile::tempdir().unwrap();
    let n = (8 << 20) + 5;
    let (e, bytes, p, file) = version_1_file(dir.path(), n, 4);
    let copy = |buf: &mut [u8]| {
        let before = BYTES_READ.with(|b| b.get());
        let mut got = Vec::new();
        let mut most = 0;
        let r = e.reader(BlobId(1)).and_then(|r| {
            r.copy_all(buf, |piece| {
                most = most.max(piece.len());
                got.extend_from_slice(piece);
                Ok(())
            })
        });
        (r, got, most, BYTES_READ.with(|b| b.get()) - before)
    };
    let mut buf = vec![0u8; 1 << 20];
    let (r, got, most, read) = copy(&mut buf);
    r.unwrap().unwrap();
    assert!(got == bytes);
    assert_eq!(most, 1 << 20, "pieces of the buffer's size");
    assert!(
        read <= 2 * file.len() as u64,
        "read {read} bytes to copy a file of {}",
        file.len()
    );
    flip(&p, V1_HEADER as usize + n / 2);
    let (r, got, _, _) = copy(&mut buf);
    assert!(matches!(r, Err(DiskError::Corrupt { .. })), "{:?}", r.err());
    assert_eq!(got.len(), n, "pieces reach the sink before the check");
}

#[test]
fn dead_units_directories_are_removed_live_ones_kept() {
    let root = tempfile::tempdir().unwrap();
    let (live, _) = OwnedDir::create(root.path(), "a", 1).unwrap();
    let (dead, _) = OwnedDir::create(root.path(), "b", 2).unwrap();
    let dead_path = dead.path.clone();
    drop(dead); // releases the lock, as a killed process would
    let (fresh, removed) = OwnedDir::create(root.path(), "c", 3).unwrap();
    assert_eq!(removed, vec![dead_path.clone()]);
    assert!(!dead_path.exists());
    assert!(live.path.exists());
    use std::os::unix::fs::PermissionsExt;
    let mode = fs::metadata(&fresh.path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    fresh.remove().unwrap();
    assert!(!fresh.path.exists());
}

#[test]
fn leftovers_of_dead_starts_are_removed_a_live_start_is_kept() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let mk = |name: &str| {
        let d = r.join(name);
        fs::create_dir(&d).unwrap();
        d
    };
    // A start that died before creating its lock file.
    let empty = mk("stowage-new-x-1-00000001-0");
    // One that died after creating it.
    let unlocked = mk("stowage-new-x-1-00000002-1");
    fs::write(unlocked.join(LOCK), b"").unwrap();
    // One in progress: its lock is held.
    let starting = mk("stowage-new-x-1-00000003-2");
    let held = File::create(starting.join(LOCK)).unwrap();
    assert!(try_lock(&held).unwrap());
    // A unit directory whose removal was cut short after its lock file.
    let half_removed = mk("stowage-unit-x-1-00000004");
    fs::write(half_removed.join("0.blob"), b"x").unwrap();
    // Not ours.
    let other = mk("something-else");
    let mut removed = remove_dead_dirs(dirfd(r).as_fd(), r).unwrap();
    removed.sort();
    let mut expect = vec![empty, unlocked, half_removed];
    expect.sort();
    assert_eq!(removed, expect);
    assert!(expect.iter().all(|d| !d.exists()));
    assert!(starting.join(LOCK).exists() && other.exists());
    // A temporary directory that is not empty but has no lock file is
    // left alone: its maker may be about to create the lock file.
    let odd = mk("stowage-new-x-1-00000005-3");
    fs::write(odd.join("x"), b"").unwrap();
    assert!(remove_dead_dirs(dirfd(r).as_fd(), r).unwrap().is_empty());
    assert!(odd.exists());
}

/// The lock file at `dir/lock` is the one held by a live owner: a
/// fresh open of it cannot take the lock.
fn held(dir: &Path) -> bool {
    match File::open(dir.join("lock")) {
        Ok(f) => rustix::fs::flock(&f, FlockOperation::NonBlockingLockExclusive).is_err(),
        Err(_) => false,
    }
}

/// Units starting at once on one root, each cleaning up after dead
/// ones, while others clean up too: every start succeeds and every
/// live directory keeps its locked lock file. (With the directory
/// made under its final name and locked afterwards, a cleanup saw it
/// without a lock file, or with a free one, and removed it: this test
/// failed hundreds of times per run.)
#[test]
fn concurrent_starts_and_cleanups_never_remove_a_live_directory() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let next = AtomicU64::new(1);
    let stop = AtomicBool::new(false);
    let failures = Mutex::new(Vec::<String>::new());
    let fail = |what: String| failures.lock().unwrap().push(what);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    if let Err(e) = remove_dead_dirs(dirfd(root).as_fd(), root) {
                        fail(format!("cleanup failed: {e}"));
                    }
                }
            });
        }
        let creators: Vec<_> = (0..3)
            .map(|t| {
                let (next, fail) = (&next, &fail);
                s.spawn(move || {
                    // A few live directories at a time; older ones are
                    // dropped (their owner "dies"), giving the cleaners
                    // dead directories to remove meanwhile.
                    let mut live = std::collections::VecDeque::new();
                    for _ in 0..300 {
                        let id = next.fetch_add(1, Ordering::SeqCst);
                        match OwnedDir::create(root, &format!("t{t}"), id.into()) {
                            Ok((d, _)) => live.push_back(d),
                            Err(e) => fail(format!("create failed: {e}")),
                        }
                        if live.len() > 3 {
                            live.pop_front();
                        }
                        for d in &live {
                            if !held(&d.path) {
                                fail(format!(
                                    "live {} lost its locked lock file",
                                    d.path.display()
                                ));
                            }
                        }
                    }
                    live
                })
            })
            .collect();
        let joined: Vec<_> = creators.into_iter().map(|h| h.join()).collect();
        // Stop the cleaners before anything can panic, or the scope
        // would wait for them forever.
        stop.store(true, Ordering::SeqCst);
        let live: Vec<_> = joined.into_iter().flat_map(|r| r.unwrap()).collect();
        for d in &live {
            if !held(&d.path) {
                fail(format!(
                    "live {} lost its locked lock file",
                    d.path.display()
                ));
            }
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} failures, first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
}

/// Two files of equal size swapped (or one copied over another, or
/// one written by another unit instance): every read of either is
/// Corrupt, never the other blob's bytes.
#[test]
fn a_file_under_another_blobs_name_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(dir.path());
    put(&e, BlobId(1), &data(1000, 1), &[1000]);
    put(&e, BlobId(2), &data(1000, 2), &[1000]);
    let (a, b) = (e.path(BlobId(1)), e.path(BlobId(2)));
    let tmp = dir.path().join("t");
    fs::rename(&a, &tmp).unwrap();
    fs::rename(&b, &a).unwrap();
    fs::rename(&tmp, &b).unwrap();
    for blob in [BlobId(1), BlobId(2)] {
        assert!(corrupt_at(&e, blob, 0, 10));
        assert!(e.blob_size(blob).is_err());
        let err = e.read(blob, &mut vec![0u8; 1000]).unwrap_err().to_string();
        assert!(err.contains("another blob's name"), "{err}");
    }
    // Another instance's file under the right name.
    let other = FileEngine::new(dirfd(dir.path()), dir.path().to_owned(), 2);
    put(&other, BlobId(3), &data(10, 3), &[10]);
    let err = e.read(BlobId(3), &mut [0u8; 10]).unwrap_err().to_string();
    assert!(err.contains("instance"), "{err}");
    // A checkpoint reads any instance's files, still by blob id.
    let ck = FileEngine::checkpoint(dirfd(dir.path()), dir.path().to_owned(), 9);
    let mut got = [0u8; 10];
    ck.read(BlobId(3), &mut got).unwrap();
    assert!(got[..] == data(10, 3)[..]);
    assert!(ck.read(BlobId(1), &mut vec![0u8; 1000]).is_err());
}

/// A version 2 file (no blob id) is read from checkpoints only.
#[test]
fn version_2_files_are_read_from_checkpoints_only() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = data(100, 4);
    let mut h = [0u8; V2_HEADER as usize];
    h[..4].copy_from_slice(MAGIC);
    h[4..8].copy_from_slice(&2u32.to_le_bytes());
    h[8..16].copy_from_slice(&100u64.to_le_bytes());
    h[16..20].copy_from_slice(&64u32.to_le_bytes());
    let sum = xxh3_64(&h[..24]);
    h[24..32].copy_from_slice(&sum.to_le_bytes());
    let mut file = h.to_vec();
    file.extend_from_slice(&bytes);
    file.extend_from_slice(&xxh3_64(&bytes[..64]).to_le_bytes());
    file.extend_from_slice(&xxh3_64(&bytes[64..]).to_le_bytes());
    let live = engine(dir.path());
    fs::write(live.path(BlobId(5)), &file).unwrap();
    let mut got = vec![0u8; 100];
    let err = live.read(BlobId(5), &mut got).unwrap_err().to_string();
    assert!(err.contains("format version 2"), "{err}");
    let ck = FileEngine::checkpoint(dirfd(dir.path()), dir.path().to_owned(), 1);
    ck.read(BlobId(5), &mut got).unwrap();
    assert!(got == bytes);
}

/// Names are single components; a link in the directory is never
/// followed by a read, a write or a delete.
#[test]
fn links_in_the_directory_are_never_followed() {
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let e = engine(dir.path());
    put(
        &elsewhere_engine(elsewhere.path()),
        BlobId(1),
        b"theirs",
        &[6],
    );
    std::os::unix::fs::symlink(
        elsewhere.path().join(FileEngine::name(BlobId(1))),
        e.path(BlobId(1)),
    )
    .unwrap();
    assert!(corrupt_at(&e, BlobId(1), 0, 1));
    // A tmp name linked elsewhere: the write fails rather than follow.
    let target = elsewhere.path().join("victim");
    fs::write(&target, b"keep").unwrap();
    std::os::unix::fs::symlink(&target, dir.path().join(FileEngine::tmp_name(BlobId(2)))).unwrap();
    assert!(e.create(BlobId(2), 1).is_err());
    e.delete(BlobId(2)).unwrap();
    e.delete(BlobId(1)).unwrap();
    assert_eq!(fs::read(&target).unwrap(), b"keep");
    assert!(elsewhere.path().join(FileEngine::name(BlobId(1))).exists());
    assert!(open_in(
        dirfd(dir.path()).as_fd(),
        "../x",
        OFlags::RDONLY,
        Mode::empty()
    )
    .is_err());
}

fn elsewhere_engine(p: &Path) -> FileEngine {
    FileEngine::new(dirfd(p), p.to_owned(), 1)
}

/// Removing a unit's directory empties it through its descriptor: a
/// link in it (to a directory, or the directory itself swapped for a
/// link) is removed or left, never followed.
#[test]
fn removal_follows_no_link() {
    let root = tempfile::tempdir().unwrap();
    let victim = tempfile::tempdir().unwrap();
    fs::write(victim.path().join("keep"), b"x").unwrap();
    fs::create_dir(victim.path().join("sub")).unwrap();
    fs::write(victim.path().join("sub/keep"), b"y").unwrap();
    let (d, _) = OwnedDir::create(root.path(), "a", 1).unwrap();
    std::os::unix::fs::symlink(victim.path(), d.path.join("link")).unwrap();
    fs::create_dir(d.path.join("nested")).unwrap();
    std::os::unix::fs::symlink(victim.path(), d.path.join("nested/link")).unwrap();
    fs::write(d.path.join("nested/file"), b"z").unwrap();
    d.remove().unwrap();
    assert!(!d.path.exists());
    // The directory swapped for a link before removal.
    let (d, _) = OwnedDir::create(root.path(), "b", 2).unwrap();
    fs::write(d.path.join("0.blob"), b"z").unwrap();
    let moved = root.path().join("moved");
    fs::rename(&d.path, &moved).unwrap();
    std::os::unix::fs::symlink(victim.path(), &d.path).unwrap();
    d.remove().unwrap();
    assert_eq!(
        fs::read_dir(&moved).unwrap().count(),
        0,
        "its own files went"
    );
    assert!(fs::symlink_metadata(&d.path)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(fs::read(victim.path().join("keep")).unwrap(), b"x");
    assert_eq!(fs::read(victim.path().join("sub/keep")).unwrap(), b"y");
    // A dead unit's directory that is a link, or holds one: the
    // cleanup removes the links and its own files only.
    fs::remove_file(&d.path).unwrap();
    let dead = root.path().join("stowage-unit-dead-1-00000001");
    fs::create_dir(&dead).unwrap();
    fs::write(dead.join(LOCK), b"").unwrap();
    std::os::unix::fs::symlink(victim.path(), dead.join("link")).unwrap();
    std::os::unix::fs::symlink(victim.path(), root.path().join("stowage-unit-l-1-00000002"))
        .unwrap();
    let r = root.path();
    remove_dead_dirs(dirfd(r).as_fd(), r).unwrap();
    assert!(!dead.exists());
    assert_eq!(fs::read(victim.path().join("keep")).unwrap(), b"x");
    assert_eq!(fs::read(victim.path().join("sub/keep")).unwrap(), b"y");
}

/// A FIFO (or any non-regular file) as a lock file is opened without
/// blocking and its directory left alone.
#[test]
fn a_fifo_lock_file_is_skipped_without_blocking() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let dead = r.join("stowage-unit-x-1-00000001");
    fs::create_dir(&dead).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        dead.join(LOCK),
        FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    assert!(remove_dead_dirs(dirfd(r).as_fd(), r).unwrap().is_empty());
    assert!(dead.exists());
    let (d, _) = OwnedDir::create(r, "y", 2).unwrap();
    d.remove().unwrap();
}

/// A root that is a link, or writable by group or others, is refused
/// with the fix; a missing one is made 0700.
#[test]
fn only_a_private_root_is_taken() {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::tempdir().unwrap();
    let fresh = base.path().join("a/b");
    open_private_root(&fresh, "disk root").unwrap();
    let mode = fs::metadata(&fresh).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    for m in [0o777, 0o770, 0o702, 0o1777] {
        fs::set_permissions(&fresh, fs::Permissions::from_mode(m)).unwrap();
        let err = open_private_root(&fresh, "disk root")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("writable by") && err.contains("chmod 700"),
            "{m:o}: {err}"
        );
    }
    fs::set_permissions(&fresh, fs::Permissions::from_mode(0o755)).unwrap();
    open_private_root(&fresh, "disk root").unwrap();
    let link = base.path().join("link");
    std::os::unix::fs::symlink(&fresh, &link).unwrap();
    let err = open_private_root(&link, "disk root")
        .unwrap_err()
        .to_string();
    assert!(err.contains("symbolic link"), "{err}");
}
