use super::*;
use std::os::unix::net::UnixStream;

/// Whether this process has a page-table entry for each 4 KiB page of
/// `[addr, addr + len)` (/proc/self/pagemap, bit 63: present).
fn present(addr: usize, len: usize) -> Vec<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open("/proc/self/pagemap").unwrap();
    f.seek(SeekFrom::Start((addr / 4096 * 8) as u64)).unwrap();
    let mut raw = vec![0u8; len / 4096 * 8];
    f.read_exact(&mut raw).unwrap();
    raw.chunks(8)
        .map(|e| u64::from_le_bytes(e.try_into().unwrap()) >> 63 == 1)
        .collect()
}

#[test]
fn prepare_fills_a_small_range_once_per_chunk() {
    let len: u64 = 8 << 20;
    let s = Slab::create("prep", len).unwrap();
    s.fault_in(0, len, false).unwrap();
    let lazy = Slab::open(s.fd().try_clone_to_owned().unwrap(), len).unwrap();
    if lazy.page_mode() != PageMode::Small {
        return; // huge pages map 2 MiB at a time: no 4 KiB pages to see
    }
    let base = lazy.addr();
    let all = |from: usize, to: usize, want: bool| {
        present(base + from, to - from).iter().all(|&p| p == want)
    };
    // Drop this mapping's page tables (the memory stays in the memfd).
    let drop_tables = || {
        // SAFETY: a shared mapping of a memfd: MADV_DONTNEED drops this
        // process's page-table entries only; the contents stay in the
        // file and later touches fault them back in.
        unsafe {
            lazy.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, 0, len as usize)
                .unwrap()
        }
    };
    let c = CHUNK;
    assert!(all(0, 1 << 20, false), "mapped lazily");
    // A few pages in a chunk nothing filled: exactly those pages.
    lazy.prepare(c as u64 + 1000, 5000);
    assert!(all(c, c + 2 * 4096, true));
    assert!(all(c + 2 * 4096, 2 * c, false));
    // 32 KiB or more: the whole chunk, and it is marked filled.
    lazy.prepare(c as u64 + 1000, 40_000);
    assert!(all(c, 2 * c, true));
    assert!(all(0, c, false) && all(2 * c, 4 * c, false));
    // A filled chunk is not filled again, by a large range or a small
    // one; a large range reaching into chunk 2 fills chunk 2 only.
    drop_tables();
    assert!(all(c, 2 * c, false));
    lazy.prepare(c as u64 + 1000, 40_000);
    lazy.prepare(c as u64 + 1000, 5000);
    assert!(all(c, 2 * c, false), "filled twice");
    lazy.prepare(2 * c as u64 - 8192, 40_000);
    assert!(all(c, 2 * c, false));
    assert!(all(2 * c, 3 * c, true));
    // A small range in a chunk not filled: its pages, once each (the
    // tables dropped since, filled again by the copy's faults); a
    // range reaching a page not filled yet fills its pages.
    drop_tables();
    lazy.prepare(3 * c as u64, 4096);
    assert!(all(3 * c, 3 * c + 4096, true));
    assert!(all(3 * c + 4096, 4 * c, false));
    drop_tables();
    lazy.prepare(3 * c as u64, 4096);
    lazy.prepare(3 * c as u64 + 100, 3000);
    assert!(all(3 * c, 4 * c, false), "a page filled twice");
    lazy.prepare(3 * c as u64 + 4000, 5000);
    assert!(all(3 * c, 3 * c + 3 * 4096, true));
    assert!(all(3 * c + 3 * 4096, 4 * c, false));
    // A large copy fills the chunks it reaches, and only those (a reader
    // of every other value does not fill the values between): they
    // count as filled.
    let mut big = vec![0u8; FILL_MIN];
    let at = 4 << 20;
    lazy.read(at as u64, &mut big).unwrap();
    assert!(all(at, at + FILL_MIN, true));
    assert!(all(at + FILL_MIN, 6 << 20, false), "the rest of the region");
    drop_tables();
    lazy.prepare(at as u64 + c as u64, 100);
    lazy.prepare(at as u64 + 2 * c as u64, 40_000);
    assert!(all(at, at + FILL_MIN, false), "filled twice");
    lazy.prepare(at as u64 + 5 * c as u64, 40_000);
    assert!(all(at + 5 * c, at + 6 * c, true));
    assert!(all(at + FILL_MIN, at + 5 * c, false));
}

#[test]
fn faulting_in_keeps_contents_and_clamps_to_the_slab() {
    let len = 8 << 20;
    let s = Slab::create("fault", len).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    s.write(0, &data[..(len / 2) as usize]).unwrap();
    // Faulting in written and unwritten pages, with and without mlock
    // (which may be refused without CAP_IPC_LOCK), past the end too.
    s.fault_in(0, len / 4, false).unwrap();
    let _ = s.fault_in(len / 4, len, true);
    s.fault_in(len - 4096, 1 << 30, false).unwrap();
    s.fault_in(len + 4096, 4096, false).unwrap();
    let mut out = vec![0u8; len as usize];
    s.read(0, &mut out).unwrap();
    assert!(out[..(len / 2) as usize] == data[..(len / 2) as usize]);
    assert!(out[(len / 2) as usize..].iter().all(|&b| b == 0));
    // A client's mapping of the same memory fills its page tables as
    // copies reach each region: the same bytes, both ways.
    let lazy = Slab::open(s.fd().try_clone_to_owned().unwrap(), s.len()).unwrap();
    let mut back = vec![0u8; 3 << 20];
    lazy.read(1 << 20, &mut back).unwrap();
    assert!(back == out[1 << 20..4 << 20]);
    lazy.write(len - 10, b"0123456789").unwrap();
    s.read(len - 10, &mut back[..10]).unwrap();
    assert_eq!(&back[..10], b"0123456789");
    assert!(lazy.range_ptr(len - 1, 1).is_ok());
}

#[test]
fn page_modes_parse_and_auto_never_fails() {
    for (s, m) in [
        ("auto", HugePages::Auto),
        ("hugetlb", HugePages::Hugetlb),
        ("thp", HugePages::Thp),
        ("4k", HugePages::Off),
    ] {
        assert_eq!(s.parse::<HugePages>().unwrap(), m);
        assert_eq!(m.to_string(), s);
    }
    assert!("huge"
        .parse::<HugePages>()
        .unwrap_err()
        .contains("auto, hugetlb, thp or 4k"));
    // Whatever the host offers, auto starts, says why, and a client's
    // mapping of its fd sees the same bytes.
    let (s, why) = Slab::create_paged("auto", 3 << 20, HugePages::Auto).unwrap();
    assert!(s.len() >= 3 << 20, "{why}");
    assert!(
        why.starts_with(match s.page_mode() {
            PageMode::Small => "4 KiB pages",
            PageMode::Thp => "transparent huge pages",
            PageMode::Hugetlb => "hugetlb pages",
        }),
        "{why}"
    );
    s.write(12345, b"paged").unwrap();
    let c = Slab::open(s.fd().try_clone_to_owned().unwrap(), s.len()).unwrap();
    let mut out = [0u8; 5];
    c.read(12345, &mut out).unwrap();
    assert_eq!(&out, b"paged");
    assert_eq!(
        c.page_mode() == PageMode::Hugetlb,
        s.page_mode() == PageMode::Hugetlb
    );
    let (s, _) = Slab::create_paged("4k", 4096, HugePages::Off).unwrap();
    assert_eq!((s.page_mode(), s.len()), (PageMode::Small, 4096));
    // An explicit mode the host lacks names the setting to change.
    let host = HostPages::read();
    if host.hugetlb_fits(1 << 40).is_err() {
        let e = Slab::create_paged("big", 1 << 40, HugePages::Hugetlb)
            .err()
            .unwrap();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
        assert!(e.to_string().contains("nr_hugepages"), "{e}");
    }
}

#[test]
fn write_read_and_bounds() {
    let s = Slab::create("test", 1 << 16).unwrap();
    s.write(100, b"hello").unwrap();
    let mut out = [0u8; 5];
    s.read(100, &mut out).unwrap();
    assert_eq!(&out, b"hello");
    assert!(s.write((1 << 16) - 2, b"abc").is_err());
    assert!(s.read(u64::MAX, &mut out).is_err());
    // Chunked copies through the heap.
    let src: Vec<u8> = (0..1000).map(|i| i as u8).collect();
    s.copy_in_chunked(10, 1000, 64, |at, buf| {
        buf.copy_from_slice(&src[at as usize..at as usize + buf.len()]);
        Ok::<(), ()>(())
    })
    .unwrap()
    .unwrap();
    let mut back = Vec::new();
    s.copy_out_chunked(10, 1000, &mut [0u8; 96], |c| {
        back.extend_from_slice(c);
        Ok::<(), ()>(())
    })
    .unwrap()
    .unwrap();
    assert_eq!(back, src);
    assert!(s
        .copy_out_chunked(1 << 16, 1, &mut [0u8; 8], |_| Ok::<(), ()>(()))
        .is_err());
    assert!(s.range_ptr(u64::MAX, 1).is_err());
}

#[test]
fn sockets_move_bytes_straight_to_and_from_the_slab() {
    let s = Slab::create("test", 1 << 20).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    let src: Vec<u8> = (0..300_000).map(|i| (i % 253) as u8).collect();
    s.write(4096, &src).unwrap();
    let head = b"head".to_vec();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let reader = std::thread::spawn(move || {
        let mut got = vec![0u8; 4 + 300_000];
        std::io::Read::read_exact(&mut &b, &mut got).unwrap();
        // And back into the slab, at another offset.
        (got, b)
    });
    s.send_pieces(
        a.as_fd(),
        &[
            Piece::Heap(&head),
            Piece::Slab {
                offset: 4096,
                len: 300_000,
            },
        ],
        deadline,
    )
    .unwrap();
    let (got, b) = reader.join().unwrap();
    assert_eq!(&got[..4], b"head");
    assert!(got[4..] == src[..]);
    let writer = std::thread::spawn(move || {
        std::io::Write::write_all(&mut &a, &src).unwrap();
        (a, src)
    });
    s.recv_into(
        b.as_fd(),
        500_000,
        300_000,
        std::time::Duration::from_micros(50),
        Some(deadline),
    )
    .unwrap();
    let (a, src) = writer.join().unwrap();
    let mut back = vec![0u8; 300_000];
    s.read(500_000, &mut back).unwrap();
    assert!(back == src);
    // A peer that closes early: UnexpectedEof.
    std::io::Write::write_all(&mut &a, b"abc").unwrap();
    drop(a);
    let e = s
        .recv_into(b.as_fd(), 0, 10, std::time::Duration::ZERO, None)
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    // Out of bounds: refused before any system call.
    assert!(s
        .recv_into(b.as_fd(), 1 << 20, 1, std::time::Duration::ZERO, None)
        .is_err());
    // A peer that trickles: cut off at the deadline as a whole.
    let (c, d) = UnixStream::pair().unwrap();
    let trickle = std::thread::spawn(move || {
        for _ in 0..20 {
            if std::io::Write::write_all(&mut &c, b"x").is_err() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    });
    let t = std::time::Instant::now();
    let e = s
        .recv_into(
            d.as_fd(),
            0,
            100,
            std::time::Duration::ZERO,
            Some(t + std::time::Duration::from_millis(300)),
        )
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    assert!(t.elapsed() < std::time::Duration::from_millis(700));
    drop(d);
    trickle.join().unwrap();
}

#[test]
fn gathered_writes_land_back_to_back_split_or_not() {
    let slab = Slab::create("gather", 64 << 20).unwrap();
    // Many odd-sized sources, large enough in all to be split over
    // threads, and a few small ones that are not.
    let srcs: Vec<Vec<u8>> = (0..700u32)
        .map(|i| {
            (0..(i as usize * 37) % 40_000 + 1)
                .map(|j| (i as usize * 7 + j) as u8)
                .collect()
        })
        .collect();
    let refs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
    let total: usize = refs.iter().map(|s| s.len()).sum();
    assert!(total >= PARALLEL_COPY_MIN);
    for (offset, n) in [(4096u64, refs.len()), (1u64 << 25, 3)] {
        slab.write_gather(offset, &refs[..n]).unwrap();
        let want: Vec<u8> = refs[..n].concat();
        let mut got = vec![0u8; want.len()];
        slab.read(offset, &mut got).unwrap();
        assert!(got == want, "{n} sources at {offset}");
    }
    assert!(slab.write_gather(64 << 20, &refs[..1]).is_err());
}

#[test]
fn scattered_reads_fill_every_buffer_split_or_not() {
    let slab = Slab::create("scatter", 64 << 20).unwrap();
    let bytes: Vec<u8> = (0..(24usize << 20)).map(|i| (i * 31 % 251) as u8).collect();
    slab.write(0, &bytes).unwrap();
    for count in [2usize, 5, 700] {
        let lens: Vec<usize> = (0..count)
            .map(|i| (i * 7919) % 30_000 + 1 + (16 << 20) / count)
            .collect();
        let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
        let offs: Vec<u64> = (0..count).map(|i| (i as u64 * 4099) % (4 << 20)).collect();
        let reads = offs
            .iter()
            .copied()
            .zip(bufs.iter_mut().map(Vec::as_mut_slice))
            .collect();
        slab.read_scatter(reads).unwrap();
        for ((o, b), n) in offs.iter().zip(&bufs).zip(&lens) {
            assert!(
                b[..] == bytes[*o as usize..*o as usize + n],
                "{count} reads"
            );
        }
    }
    let mut tail = vec![0u8; 2];
    assert!(slab
        .read_scatter(vec![
            (0, vec![0u8; 1].as_mut_slice()),
            ((64 << 20) - 1, tail.as_mut_slice())
        ])
        .is_err());
}

#[test]
fn large_copies_split_over_threads_round_trip() {
    let n = PARALLEL_COPY_MIN * 2 + 12345;
    let s = Slab::create("test", n as u64 + 64).unwrap();
    let src: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    s.write(64, &src).unwrap();
    let mut dst = vec![0u8; n];
    s.read(64, &mut dst).unwrap();
    assert!(src == dst);
}

#[test]
fn fd_passing_shares_the_slab() {
    let s = Slab::create("test", 4096).unwrap();
    let (a, b) = UnixStream::pair().unwrap();
    assert_eq!(send_with_fd(&a, b"hi", s.fd()).unwrap(), 2);
    let mut buf = [0u8; 16];
    let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"hi");
    let other = Slab::open(fd.expect("fd attached"), s.len()).unwrap();
    assert_eq!(other.len(), 4096);
    s.write(10, b"shared").unwrap();
    let mut out = [0u8; 6];
    other.read(10, &mut out).unwrap();
    assert_eq!(&out, b"shared");
}

#[test]
fn open_refuses_fds_that_are_not_a_sealed_slab_of_the_announced_size() {
    let msg = |r: io::Result<Slab>| match r {
        Ok(_) => panic!("an unfit fd was mapped"),
        Err(e) => {
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            e.to_string()
        }
    };
    // A regular file.
    let f = std::fs::File::open("/proc/self/exe").unwrap();
    let n = f.metadata().unwrap().len();
    let e = msg(Slab::open(f.into(), n));
    assert!(e.contains("not a sealed memfd"), "{e}");
    // A memfd nobody sealed: it could shrink under the mapping.
    let m = rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .unwrap();
    rustix::fs::ftruncate(&m, 4096).unwrap();
    let e = msg(Slab::open(m, 4096));
    assert!(e.contains("SHRINK | GROW | SEAL"), "{e}");
    // A real slab of another size than announced.
    let s = Slab::create("sized", 8192).unwrap();
    let e = msg(Slab::open(s.fd().try_clone_to_owned().unwrap(), 4096));
    assert!(e.contains("8192") && e.contains("4096"), "{e}");
    assert!(Slab::open(s.fd().try_clone_to_owned().unwrap(), 8192).is_ok());
}
