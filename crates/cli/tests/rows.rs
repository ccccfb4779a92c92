//! The rows × fields API against real units, over both transports.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{client, data_bytes, pattern, plane, Kind, Raw};
use stowage_client::rows::KEY_FIELD;
use stowage_client::{
    new_blob_id, BlobPut, Client, Column, DType, EntrySpec, Error, Key, RowKey, Sink, Tensor,
    TensorAsk, UnitAddr,
};
use stowage_local::LocalPlane;
use stowage_wire::{Request, Response};

const MIB: u64 = 1 << 20;

common::both_transports!(
    every_dtype_round_trips_jagged_and_dense,
    rows_grow_fields_and_clear_by_partition,
    not_found_names_exactly_the_missing_pairs,
    concurrent_replacements_are_never_torn,
    colliding_names_never_read_as_each_other,
    long_colliding_names_are_told_apart_by_digest,
    values_without_an_owner_are_checked_against_the_row_name,
);

fn keys_mixed(n: u64) -> Vec<RowKey> {
    (0..n)
        .map(|i| {
            if i % 3 == 0 {
                RowKey::Name(format!("uid_g{i}"))
            } else {
                RowKey::Index(i)
            }
        })
        .collect()
}

fn every_dtype_round_trips_jagged_and_dense(kind: Kind) {
    let (p, _) = plane(2, 64 * MIB, &[]);
    let c = client(&p, kind, Duration::from_secs(30));
    let keys = keys_mixed(7);
    for dtype in DType::ALL {
        let field = format!("f_{}", dtype.name());
        // Jagged: row i has i*3 elements (row 0 is empty), 1-D; row 5 is 2-D.
        let bufs: Vec<Vec<u8>> = (0..keys.len())
            .map(|i| pattern(i as u64, dtype.itemsize() as u64, i * 3 * dtype.itemsize()))
            .collect();
        let shapes: Vec<Vec<u64>> = (0..keys.len())
            .map(|i| {
                if i == 5 {
                    vec![3, 5]
                } else {
                    vec![i as u64 * 3]
                }
            })
            .collect();
        let col = Column::Jagged(
            bufs.iter()
                .zip(&shapes)
                .map(|(b, s)| Tensor::new(dtype, s.clone(), b).unwrap())
                .collect(),
        );
        c.put("p", &keys, &[(field.as_str(), col)], None, c.deadline())
            .unwrap();
        let got = c
            .get_tensors("p", &keys, &[field.as_str()], None, c.deadline())
            .unwrap();
        for (i, t) in got[0].iter().enumerate() {
            assert_eq!(t.dtype, dtype);
            assert_eq!(t.shape, shapes[i], "{dtype:?} row {i}");
            assert!(t.data == bufs[i], "{dtype:?} row {i} bytes");
        }
        // Dense: one [rows, 4] array split along its first axis.
        let dense = pattern(
            99,
            dtype.itemsize() as u64,
            keys.len() * 4 * dtype.itemsize(),
        );
        let dfield = format!("d_{}", dtype.name());
        let t = Tensor::new(dtype, vec![keys.len() as u64, 4], &dense).unwrap();
        c.put(
            "p",
            &keys,
            &[(dfield.as_str(), Column::Dense(t))],
            None,
            c.deadline(),
        )
        .unwrap();
        let got = c
            .get_tensors("p", &keys, &[dfield.as_str()], None, c.deadline())
            .unwrap();
        let row = 4 * dtype.itemsize();
        for (i, t) in got[0].iter().enumerate() {
            assert_eq!(t.shape, vec![4]);
            assert!(t.data[..] == dense[i * row..(i + 1) * row]);
        }
    }
    // Every value is listed under its row key.
    let listed = c.list("p", c.deadline()).unwrap();
    assert_eq!(listed.len(), keys.len());
    for (k, fields) in &listed {
        assert!(keys.contains(k), "{k:?} listed but never put");
        assert_eq!(fields.len(), 2 * DType::ALL.len());
    }
    assert!(listed
        .iter()
        .any(|(k, _)| *k == RowKey::Name("uid_g3".into())));
}

fn rows_grow_fields_and_clear_by_partition(kind: Kind) {
    let (p, _) = plane(3, 16 * MIB, &[]);
    let c = client(&p, kind, Duration::from_secs(30));
    let keys = keys_mixed(10);
    let ids: Vec<Vec<u8>> = (0..10)
        .map(|i| pattern(i, 1, 64 + i as usize * 8))
        .collect();
    let ids_col = Column::Jagged(
        ids.iter()
            .map(|b| Tensor::new(DType::I64, vec![b.len() as u64 / 8], b).unwrap())
            .collect(),
    );
    c.put(
        "step-1",
        &keys,
        &[("input_ids", ids_col.clone())],
        None,
        c.deadline(),
    )
    .unwrap();
    // The same keys in another partition are other rows.
    c.put(
        "step-2",
        &keys[..2],
        &[(
            "input_ids",
            Column::Jagged(vec![
                Tensor::new(DType::I64, vec![1], &[7; 8]).unwrap(),
                Tensor::new(DType::I64, vec![1], &[8; 8]).unwrap(),
            ]),
        )],
        None,
        c.deadline(),
    )
    .unwrap();
    // A later stage adds a column to the same rows.
    let lp: Vec<u8> = pattern(5, 5, 10 * 2 * 16);
    let lp_t = Tensor::new(DType::BF16, vec![10, 16], &lp).unwrap();
    c.put(
        "step-1",
        &keys,
        &[("reference_logprobs", Column::Dense(lp_t))],
        None,
        c.deadline(),
    )
    .unwrap();
    let got = c
        .get_tensors(
            "step-1",
            &keys,
            &["input_ids", "reference_logprobs"],
            None,
            c.deadline(),
        )
        .unwrap();
    for i in 0..10 {
        assert!(got[0][i].data == ids[i]);
        assert!(got[1][i].data[..] == lp[i * 32..(i + 1) * 32]);
    }
    assert_eq!(
        c.get_tensors("step-2", &keys[..1], &["input_ids"], None, c.deadline())
            .unwrap()[0][0]
            .data,
        vec![7; 8]
    );
    let mut parts = c.partitions(c.deadline()).unwrap();
    parts.sort();
    assert_eq!(parts, vec!["step-1".to_string(), "step-2".to_string()]);
    // Clearing rows is row-wide and partition-local.
    let removed = c.clear("step-1", &keys[..4], None, c.deadline()).unwrap();
    // 4 rows x 2 fields (the string rows' hidden name entries go too, uncounted).
    assert_eq!(removed, 4 * 2);
    assert_eq!(c.list("step-1", c.deadline()).unwrap().len(), 6);
    assert_eq!(c.list("step-2", c.deadline()).unwrap().len(), 2);
    // A whole partition goes at once.
    let gone = c.clear_partition("step-1", c.deadline()).unwrap();
    assert_eq!(gone, 6 * 2, "6 rows x 2 fields (names are not counted)");
    assert!(c.list("step-1", c.deadline()).unwrap().is_empty());
    assert_eq!(c.clear_partition("step-2", c.deadline()).unwrap(), 2);
    assert!(c
        .stats(c.deadline())
        .into_iter()
        .all(|s| data_bytes(&s.unwrap()) == 0));
    // Named placement: the caller's unit, read back from it.
    let one = [RowKey::Index(1)];
    let t = Tensor::new(DType::U8, vec![3], &[1, 2, 3]).unwrap();
    c.put(
        "pinned",
        &one,
        &[("x", Column::Jagged(vec![t]))],
        Some(2),
        c.deadline(),
    )
    .unwrap();
    assert_eq!(
        c.get_tensors("pinned", &one, &["x"], Some(2), c.deadline())
            .unwrap()[0][0]
            .data,
        vec![1, 2, 3]
    );
    assert!(matches!(
        c.get_tensors("pinned", &one, &["x"], None, c.deadline()),
        Err(Error::NotFound { .. })
    ));
}

fn not_found_names_exactly_the_missing_pairs(kind: Kind) {
    let (p, _) = plane(2, 16 * MIB, &[]);
    let c = client(&p, kind, Duration::from_secs(30));
    let keys = vec![RowKey::Name("a".into()), RowKey::Index(4), RowKey::Index(5)];
    let v = Tensor::new(DType::I32, vec![2], &[0; 8]).unwrap();
    c.put(
        "p",
        &keys[..2],
        &[("x", Column::Jagged(vec![v.clone(), v.clone()]))],
        None,
        c.deadline(),
    )
    .unwrap();
    c.put(
        "p",
        &keys[1..2],
        &[("y", Column::Jagged(vec![v]))],
        None,
        c.deadline(),
    )
    .unwrap();
    match c.get_tensors("p", &keys, &["x", "y"], None, c.deadline()) {
        Err(Error::NotFound {
            mut named,
            keys: wire,
        }) => {
            named.sort();
            assert_eq!(named, vec!["5@x", "5@y", "a@y"]);
            assert_eq!(wire.len(), 3);
        }
        other => panic!("expected NotFound, got {:?}", other.map(|_| ())),
    }
    // A partition that does not exist: every pair is missing.
    match c.get_tensors("nope", &keys[..1], &["x"], None, c.deadline()) {
        Err(Error::NotFound { named, .. }) => assert_eq!(named, vec!["a@x"]),
        other => panic!("expected NotFound, got {:?}", other.map(|_| ())),
    }
    // Bad input is refused before anything is sent.
    assert!(matches!(
        c.put(
            "p",
            &keys,
            &[("x", Column::Jagged(vec![]))],
            None,
            c.deadline()
        ),
        Err(Error::InvalidRequest(_))
    ));
    assert!(matches!(
        c.put("p", &[RowKey::Index(u64::MAX)], &[], None, c.deadline()),
        Err(Error::InvalidRequest(_))
    ));
    assert!(Tensor::new(DType::F32, vec![3], &[0; 11]).is_err());
    // What was stored is intact.
    assert_eq!(
        c.get_tensors("p", &keys[..2], &["x"], None, c.deadline())
            .unwrap()[0]
            .len(),
        2
    );
}

/// Writers replace one (key, field) with values whose every byte is the
/// writer's sequence number and whose length depends on it; readers check
/// that each value they see is one whole write.
fn concurrent_replacements_are_never_torn(kind: Kind) {
    let (p, _) = plane(2, 64 * MIB, &[]);
    let c = Arc::new(client(&p, kind, Duration::from_secs(30)));
    let keys = vec![RowKey::Name("hot".into()), RowKey::Index(1)];
    let stop = AtomicBool::new(false);
    let reads = std::sync::atomic::AtomicU64::new(0);
    let end = Instant::now() + Duration::from_millis(1500);
    std::thread::scope(|s| {
        for w in 0..2u8 {
            let c = c.clone();
            let (keys, stop) = (&keys, &stop);
            s.spawn(move || {
                let mut seq = w;
                while !stop.load(Ordering::Relaxed) {
                    let len = 4096 + usize::from(seq) * 64;
                    let buf = vec![seq; len];
                    let t = Tensor::new(DType::U8, vec![len as u64], &buf).unwrap();
                    let col = Column::Jagged(vec![t.clone(), t]);
                    c.put("p", keys, &[("v", col)], None, c.deadline()).unwrap();
                    seq = seq.wrapping_add(2);
                }
            });
        }
        for _ in 0..2 {
            let c = c.clone();
            let (keys, stop, reads) = (&keys, &stop, &reads);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match c.get_tensors("p", keys, &["v"], None, c.deadline()) {
                        Ok(got) => {
                            for t in &got[0] {
                                let seq = t.data[0];
                                assert_eq!(
                                    t.data.len(),
                                    4096 + usize::from(seq) * 64,
                                    "length of another write"
                                );
                                assert!(t.data.iter().all(|&b| b == seq), "torn value");
                            }
                            reads.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(Error::NotFound { .. }) => {} // before the first put
                        Err(e) => panic!("{e}"),
                    }
                }
            });
        }
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(reads.load(Ordering::Relaxed) > 10, "readers barely ran");
    // Only the last value of each key is left: old blobs were freed.
    let stats: Vec<_> = c
        .stats(c.deadline())
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(stats.iter().map(|s| s.entries).sum::<u64>(), 3, "{stats:?}");
    // Readers unpin without awaiting a reply: the last unpins land shortly.
    assert!(common::eventually(Duration::from_secs(5), || {
        c.stats(c.deadline())
            .into_iter()
            .all(|s| s.unwrap().pins == 0)
    }));
}

#[test]
fn a_packed_view_points_at_each_units_values_of_a_field_or_copies_them() {
    let (p, _) = plane(2, 16 * MIB, &[]);
    let c = Arc::new(client(&p, Kind::Shm, Duration::from_secs(30)));
    let keys: Vec<RowKey> = (0..6).map(RowKey::Index).collect();
    // Row r: r + 1 elements of 3 int16s; the second field a byte per row.
    let data: Vec<Vec<u8>> = (0..6)
        .map(|r| pattern(r, 5, (r as usize + 1) * 6))
        .collect();
    let ids = Column::Jagged(
        data.iter()
            .map(|b| Tensor::new(DType::I16, vec![b.len() as u64 / 6, 3], b).unwrap())
            .collect(),
    );
    let bytes: Vec<[u8; 1]> = (0..6).map(|r| [r as u8]).collect();
    let one = Column::Jagged(
        bytes
            .iter()
            .map(|b| Tensor::new(DType::U8, vec![], b).unwrap())
            .collect(),
    );
    c.put(
        "p",
        &keys,
        &[("ids", ids), ("one", one)],
        None,
        c.deadline(),
    )
    .unwrap();
    let packed_bytes =
        |view: &stowage_client::View, chunk: &stowage_client::PackedChunk, f: usize| {
            let p = &chunk.fields[f];
            let mut copy = vec![0u8; p.len];
            view.read_packed_into(chunk, f, &mut copy).unwrap();
            if let Some((ptr, len)) = view.packed_ptr(chunk, p) {
                // SAFETY: the view pins the values it points at until dropped.
                assert_eq!(unsafe { std::slice::from_raw_parts(ptr, len) }, copy);
            }
            copy
        };
    // Rows r live on unit r % 2: a chunk each, the put's order, in place.
    let (view, chunks) = c
        .packed_view("p", &keys, &["ids", "one"], None, c.deadline())
        .unwrap();
    assert_eq!(chunks.len(), 2);
    for (u, chunk) in chunks.iter().enumerate() {
        assert_eq!(chunk.unit, u);
        assert_eq!(chunk.rows, (u..6).step_by(2).collect::<Vec<_>>());
        let ids = &chunk.fields[0];
        assert!(ids.in_place() && chunk.fields[1].in_place());
        assert_eq!((ids.dtype, &ids.inner[..]), (DType::I16, &[3][..]));
        let mut at = vec![0];
        at.extend(chunk.rows.iter().scan(0, |n, &r| {
            *n += r as u64 + 1;
            Some(*n)
        }));
        assert_eq!(ids.offsets, at);
        assert_eq!(&ids.shape()[..], &[*at.last().unwrap(), 3]);
        let want: Vec<u8> = chunk.rows.iter().flat_map(|&r| data[r].clone()).collect();
        assert_eq!(packed_bytes(&view, chunk, 0), want);
        let one = &chunk.fields[1];
        assert_eq!(
            one.offsets,
            (0..=3).collect::<Vec<u64>>(),
            "a 0-d value is one element"
        );
        let want: Vec<u8> = chunk.rows.iter().map(|&r| r as u8).collect();
        assert_eq!(packed_bytes(&view, chunk, 1), want);
    }
    // Out of the put's order: copied, the rows in the order asked for.
    let back: Vec<RowKey> = keys.iter().rev().cloned().collect();
    let (view, chunks) = c
        .packed_view("p", &back, &["ids"], None, c.deadline())
        .unwrap();
    for chunk in &chunks {
        assert!(!chunk.fields[0].in_place());
        assert!(view.packed_ptr(chunk, &chunk.fields[0]).is_none());
        let want: Vec<u8> = chunk
            .rows
            .iter()
            .flat_map(|&i| data[5 - i].clone())
            .collect();
        assert_eq!(packed_bytes(&view, chunk, 0), want);
    }
    // In the put's order for two values, then not: unit 0's rows 2, 4
    // and 0 are copied (the first two as one range), unit 1's in place.
    let order: Vec<RowKey> = [2, 4, 0, 1, 3, 5]
        .iter()
        .map(|&i| keys[i].clone())
        .collect();
    let (view, chunks) = c
        .packed_view("p", &order, &["ids"], None, c.deadline())
        .unwrap();
    assert_eq!(chunks[0].rows, [0, 1, 2]);
    assert!(!chunks[0].fields[0].in_place() && chunks[1].fields[0].in_place());
    for chunk in &chunks {
        let want: Vec<u8> = chunk
            .rows
            .iter()
            .flat_map(|&i| data[[2, 4, 0, 1, 3, 5][i]].clone())
            .collect();
        assert_eq!(packed_bytes(&view, chunk, 0), want);
    }
    // Values that cannot be packed: refused, naming the field.
    let t = Tensor::new(DType::I16, vec![3], &data[0][..6]).unwrap();
    c.put(
        "p",
        &keys[..1],
        &[("ids", Column::Jagged(vec![t]))],
        None,
        c.deadline(),
    )
    .unwrap();
    match c.packed_view("p", &keys, &["ids"], None, c.deadline()) {
        Err(Error::InvalidRequest(m)) => assert!(m.contains("\"ids\" cannot be packed"), "{m}"),
        other => panic!("expected InvalidRequest, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn views_see_values_in_place_and_keep_them_pinned() {
    let (p, _) = plane(2, 16 * MIB, &[]);
    let c = Arc::new(client(&p, Kind::Shm, Duration::from_secs(30)));
    let keys = keys_mixed(4);
    let data: Vec<Vec<u8>> = (0..4)
        .map(|i| pattern(i, 3, 800 + i as usize * 8))
        .collect();
    let col = Column::Jagged(
        data.iter()
            .map(|b| Tensor::new(DType::F64, vec![b.len() as u64 / 8], b).unwrap())
            .collect(),
    );
    c.put("p", &keys, &[("lp", col)], None, c.deadline())
        .unwrap();
    let view = c.view("p", &keys, &["lp"], None, c.deadline()).unwrap();
    let pins: u64 = c
        .stats(c.deadline())
        .into_iter()
        .map(|s| s.unwrap().pins)
        .sum();
    assert_eq!(pins, 2, "one held pin per unit");
    // Clearing and replacing the rows does not touch what the view sees.
    c.clear("p", &keys, None, c.deadline()).unwrap();
    let other = vec![0xEEu8; 816];
    let t = Tensor::new(DType::U8, vec![816], &other).unwrap();
    c.put(
        "p",
        &keys[..1],
        &[("lp", Column::Jagged(vec![t]))],
        None,
        c.deadline(),
    )
    .unwrap();
    // A put lays each unit's values of a field back to back in the order
    // of the call (what a packed view views in place), the first on a
    // 64-byte boundary, each aligned for its dtype.
    let mut next: std::collections::HashMap<usize, usize> = Default::default();
    for (i, t) in view.field(0).iter().enumerate() {
        assert_eq!(t.dtype, DType::F64);
        let bytes = view.to_vec(t);
        assert!(bytes == data[i], "row {i} changed under a view");
        let (ptr, len) = view.as_ptr(t).unwrap();
        let at = ptr as usize;
        assert_eq!(at % 8, 0, "row {i}: values are aligned for their dtype");
        match next.insert(t.unit(), at + len) {
            None => assert_eq!(
                at % 64,
                0,
                "row {i}: a unit's first value is 64-byte aligned"
            ),
            Some(end) => assert_eq!(at, end, "row {i} follows its unit's row before it"),
        }
    }
    assert_eq!(next.len(), 2, "the rows are on both units");
    drop(view);
    assert!(common::eventually(Duration::from_secs(5), || {
        c.stats(c.deadline())
            .into_iter()
            .all(|s| s.unwrap().pins == 0)
    }));
    c.clear("p", &keys, None, c.deadline()).unwrap();
    assert!(c
        .stats(c.deadline())
        .into_iter()
        .all(|s| data_bytes(&s.unwrap()) == 0));
    // Views need the shm transport.
    let tcp = Arc::new(client(&p, Kind::Tcp, Duration::from_secs(5)));
    assert!(matches!(
        tcp.view("p", &keys, &["lp"], None, tcp.deadline()),
        Err(Error::InvalidRequest(_))
    ));
}

/// The one unit's socket of a one-unit plane.
fn socket(p: &LocalPlane) -> std::path::PathBuf {
    match &p.uds_addrs()[0] {
        UnitAddr::Unix(path) => path.clone(),
        other => panic!("not a socket: {other:?}"),
    }
}

fn row(k: &RowKey) -> u64 {
    k.row_id().unwrap()
}

/// Copy `fields` of row `from` as stored (bytes and metadata) into row
/// `to` of a one-unit plane, and with `name` that row's hidden name: what
/// a put under `from`'s name leaves when its hash equals `to`'s row id.
/// (Real xxh3 collisions cannot be found, so they are made this way.)
fn transplant(
    p: &LocalPlane,
    c: &Client,
    partition: &str,
    from: u64,
    to: u64,
    fields: &[&str],
    name: Option<&str>,
) {
    let keys: Vec<Key> = fields.iter().map(|f| Key::new(from, *f)).collect();
    let mut metas = match Raw::hello(&socket(p), "test").call(&Request::Read {
        partition: partition.into(),
        keys: keys.clone(),
        timeout_ms: 10_000,
    }) {
        Response::Data { items, .. } => items
            .into_iter()
            .map(|i| i.expect("transplanted value exists").meta.to_vec())
            .collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    let placed: Vec<(usize, Key)> = keys.into_iter().map(|k| (0, k)).collect();
    let mut values = c.get(partition, &placed, c.deadline()).unwrap();
    let mut fields: Vec<&str> = fields.to_vec();
    if let Some(n) = name {
        values.push(n.as_bytes().to_vec());
        metas.push(Vec::new());
        fields.push(KEY_FIELD);
    }
    let pad = [0u8; 64];
    let (mut segments, mut entries, mut size): (Vec<&[u8]>, Vec<EntrySpec>, u64) =
        (Vec::new(), Vec::new(), 0);
    for ((v, meta), f) in values.iter().zip(metas).zip(fields) {
        let gap = size.next_multiple_of(64) - size;
        segments.push(&pad[..gap as usize]);
        size += gap;
        entries.push(EntrySpec {
            key: Key::new(to, f),
            offset: size,
            len: v.len() as u64,
            meta,
        });
        segments.push(v);
        size += v.len() as u64;
    }
    c.put_many(
        &[BlobPut {
            unit: 0,
            partition,
            blob: new_blob_id(),
            segments,
            entries,
        }],
        c.deadline(),
    )
    .unwrap();
}

fn put_u8(c: &Client, key: &RowKey, field: &str, data: &[u8]) {
    let t = Tensor::new(DType::U8, vec![data.len() as u64], data).unwrap();
    c.put(
        "p",
        std::slice::from_ref(key),
        &[(field, Column::Jagged(vec![t]))],
        None,
        c.deadline(),
    )
    .unwrap();
}

fn get_u8(c: &Client, key: &RowKey, fields: &[&str]) -> Result<Vec<Vec<u8>>, Error> {
    c.get_tensors("p", std::slice::from_ref(key), fields, None, c.deadline())
        .map(|got| got.into_iter().map(|mut f| f.remove(0).data).collect())
}

fn assert_collision(r: Result<Vec<Vec<u8>>, Error>, requested: &str, stored: Option<&str>) {
    match r {
        Err(Error::KeyCollision {
            partition,
            requested: req,
            stored: st,
        }) => {
            assert_eq!(partition, "p");
            assert_eq!(req, requested);
            assert_eq!(st.as_deref(), stored);
        }
        other => panic!("expected KeyCollision, got {other:?}"),
    }
}

/// Records which values a get handed to the caller.
#[derive(Default)]
struct Handed(Vec<(usize, usize)>, Vec<u8>);

impl Sink<TensorAsk<'_>> for Handed {
    fn slot(&mut self, ask: TensorAsk<'_>) -> Result<&mut [u8], String> {
        self.0.push((ask.field, ask.row));
        self.1 = vec![0; ask.dtype.nbytes(ask.shape).unwrap() as usize];
        Ok(&mut self.1)
    }
}

fn colliding_names_never_read_as_each_other(kind: Kind) {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let c = Arc::new(client(&p, kind, Duration::from_secs(30)));
    let (a, b) = (RowKey::Name("uid_a".into()), RowKey::Name("uid_b".into()));
    put_u8(&c, &a, "x", &[1; 8]);
    put_u8(&c, &a, "y", &[2; 8]);
    put_u8(&c, &b, "x", &[9; 16]);

    // b's put of x lands in a's row: b's x replaces a's, and the row's
    // hidden name becomes b's.
    transplant(&p, &c, "p", row(&b), row(&a), &["x"], Some("uid_b"));
    // a's own value is still a's.
    assert_eq!(get_u8(&c, &a, &["y"]).unwrap(), vec![vec![2; 8]]);
    // b's value is not read back as a's, alone or beside a's own.
    assert_collision(get_u8(&c, &a, &["x"]), "uid_a", Some("uid_b"));
    assert_collision(get_u8(&c, &a, &["y", "x"]), "uid_a", Some("uid_b"));
    let both = c.get_tensors("p", &[b.clone(), a.clone()], &["x"], None, c.deadline());
    assert!(matches!(both, Err(Error::KeyCollision { .. })), "{both:?}");
    // None of b's bytes reach the caller's buffers.
    let mut handed = Handed::default();
    let r = c.get_tensors_into(
        "p",
        std::slice::from_ref(&a),
        &["y", "x"],
        None,
        &mut handed,
        c.deadline(),
    );
    assert!(matches!(r, Err(Error::KeyCollision { .. })), "{r:?}");
    assert!(
        !handed.0.contains(&(1, 0)),
        "b's value was handed out as a's"
    );
    if kind == Kind::Shm {
        let v = c.view("p", std::slice::from_ref(&a), &["y"], None, c.deadline());
        assert_eq!(v.map(|v| v.to_vec(&v.field(0)[0])).unwrap(), [2; 8]);
        match c.view("p", std::slice::from_ref(&a), &["x"], None, c.deadline()) {
            Err(Error::KeyCollision { stored, .. }) => assert_eq!(stored.unwrap(), "uid_b"),
            other => panic!("expected KeyCollision, got {:?}", other.map(|_| ())),
        }
        // The refused view unpinned what it had pinned.
        assert!(common::eventually(Duration::from_secs(5), || {
            c.stats(c.deadline())
                .into_iter()
                .all(|s| s.unwrap().pins == 0)
        }));
    }

    // a's earlier put landed in b's row, then b put there: the hidden name
    // says b, yet a's value of y must not read back as b's.
    transplant(&p, &c, "p", row(&a), row(&b), &["y"], Some("uid_a"));
    put_u8(&c, &b, "x", &[8; 24]);
    assert_eq!(get_u8(&c, &b, &["x"]).unwrap(), vec![vec![8; 24]]);
    assert_collision(get_u8(&c, &b, &["y"]), "uid_b", Some("uid_a"));
    assert_collision(get_u8(&c, &b, &["x", "y"]), "uid_b", Some("uid_a"));
    // The error is final, not a transient failure.
    assert!(!get_u8(&c, &b, &["y"]).unwrap_err().is_retryable());
}

fn long_colliding_names_are_told_apart_by_digest(kind: Kind) {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let c = Arc::new(client(&p, kind, Duration::from_secs(30)));
    // Longer than a value's metadata may be: stored beside values as a
    // digest, and round-trips.
    let long = |tail: &str| RowKey::Name(format!("{}{tail}", "n".repeat(4000)));
    let (a, b) = (long("a"), long("b"));
    put_u8(&c, &a, "x", &[1; 8]);
    put_u8(&c, &b, "x", &[2; 8]);
    assert_eq!(get_u8(&c, &a, &["x"]).unwrap(), vec![vec![1; 8]]);
    assert!(c
        .list("p", c.deadline())
        .unwrap()
        .iter()
        .any(|(k, _)| *k == a));
    transplant(&p, &c, "p", row(&b), row(&a), &["x"], None);
    assert_collision(get_u8(&c, &a, &["x"]), &a.to_string(), None);
    // A short name in a long name's row, and the other way round.
    let s = RowKey::Name("short".into());
    put_u8(&c, &s, "x", &[3; 8]);
    transplant(&p, &c, "p", row(&b), row(&s), &["x"], None);
    assert_collision(get_u8(&c, &s, &["x"]), "short", None);
    put_u8(&c, &s, "y", &[3; 8]);
    transplant(&p, &c, "p", row(&s), row(&b), &["y"], None);
    assert_collision(get_u8(&c, &b, &["y"]), &b.to_string(), Some("short"));
    assert_eq!(get_u8(&c, &b, &["x"]).unwrap(), vec![vec![2; 8]]);
}

/// Values put before owners were recorded: an index row's metadata is in
/// that old form, so copying one into a string row makes such a value.
fn values_without_an_owner_are_checked_against_the_row_name(kind: Kind) {
    let (p, _) = plane(1, 16 * MIB, &[]);
    let c = Arc::new(client(&p, kind, Duration::from_secs(30)));
    let old = RowKey::Index(7);
    put_u8(&c, &old, "x", &[7; 8]);
    let (a, b) = (RowKey::Name("uid_a".into()), RowKey::Name("uid_b".into()));
    // Its row's name is the one asked for: the value is given.
    transplant(&p, &c, "p", row(&old), row(&a), &["x"], Some("uid_a"));
    assert_eq!(get_u8(&c, &a, &["x"]).unwrap(), vec![vec![7; 8]]);
    // Another name: refused.
    transplant(&p, &c, "p", row(&old), row(&b), &["x"], Some("uid_c"));
    assert_collision(get_u8(&c, &b, &["x"]), "uid_b", Some("uid_c"));
    if kind == Kind::Shm {
        let v = c.view("p", std::slice::from_ref(&a), &["x"], None, c.deadline());
        assert_eq!(v.map(|v| v.to_vec(&v.field(0)[0])).unwrap(), [7; 8]);
        match c.view("p", std::slice::from_ref(&b), &["x"], None, c.deadline()) {
            Err(Error::KeyCollision { stored, .. }) => assert_eq!(stored.unwrap(), "uid_c"),
            other => panic!("expected KeyCollision, got {:?}", other.map(|_| ())),
        }
    }
}
