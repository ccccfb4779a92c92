//! The forwarded put's messages: a borrowed ForwardPut is the owned one's
//! bytes, both round-trip with their reply, and validation refuses a
//! forward to no copy, too many (counting the hops before it down its
//! chain), a unit named twice or an address that is not `ip:port`.

use stowage_wire::{
    decode_header, encode, BlobId, EntrySpec, Envelope, ErrorCode, FailedCopy, Hop, Key, Limits,
    Request, RequestRef, Response, MAX_HOPS, PREFIX_LEN,
};

fn hop(unit: u32) -> Hop {
    Hop {
        unit,
        addr: format!("10.0.0.{unit}:4000"),
        instance: unit.is_multiple_of(2).then_some(u128::from(unit) << 64),
    }
}

fn forward(to: Vec<Hop>) -> Request {
    Request::ForwardPut {
        blob: BlobId(42),
        partition: "step-3".into(),
        entries: vec![EntrySpec {
            key: Key {
                row: 7,
                field: "tokens".into(),
            },
            offset: 0,
            len: 4096,
            meta: vec![1, 2, 3],
        }],
        timeout_ms: 9_000,
        to,
        hop: 0,
    }
}

#[test]
fn a_borrowed_forward_put_is_the_owned_ones_bytes_and_round_trips() {
    let r = forward(vec![hop(1), hop(3)]);
    let Request::ForwardPut {
        blob,
        partition,
        entries,
        timeout_ms,
        to,
        hop,
    } = &r
    else {
        unreachable!()
    };
    let borrowed = RequestRef::ForwardPut {
        blob: *blob,
        partition,
        entries,
        timeout_ms: *timeout_ms,
        to,
        hop: *hop,
    };
    let (mut owned, mut by_ref) = (Vec::new(), Vec::new());
    encode(5, &r, 4096, &mut owned).unwrap();
    encode(5, &borrowed, 4096, &mut by_ref).unwrap();
    assert_eq!(by_ref, owned);
    let back: Envelope<Request> = decode_header(&by_ref[PREFIX_LEN..]).unwrap();
    assert_eq!(back.body, r);
    assert!(r.carries_payload());
    r.validate(&Limits::default()).unwrap();

    let reply = Response::Forwarded {
        pending: true,
        failed: vec![FailedCopy {
            unit: 3,
            code: ErrorCode::Full,
            message: "no room".into(),
        }],
    };
    let mut out = Vec::new();
    encode(5, &reply, 0, &mut out).unwrap();
    let back: Envelope<Response> = decode_header(&out[PREFIX_LEN..]).unwrap();
    assert_eq!(back.body, reply);
}

#[test]
fn a_forward_to_no_copy_too_many_a_unit_twice_or_a_bad_address_is_refused() {
    let limits = Limits::default();
    let refused = |r: Request, says: &str| {
        let e = r.validate(&limits).unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
    };
    refused(forward(vec![]), "0 copies");
    refused(
        forward((0..=MAX_HOPS as u32).map(hop).collect()),
        &format!("{} copies", MAX_HOPS + 1),
    );
    // Down a chain: the hops before count.
    let mut late = forward(vec![hop(1), hop(2)]);
    if let Request::ForwardPut { hop, .. } = &mut late {
        *hop = (MAX_HOPS - 1) as u8;
    }
    refused(late, "2 copies at hop 6");
    refused(forward(vec![hop(2), hop(2)]), "unit 2 named twice");
    let mut named = hop(4);
    named.addr = "unit-4.example:4000".into();
    refused(forward(vec![named]), "copy 4");
    let mut unix = hop(5);
    unix.addr = "/tmp/unit.sock".into();
    refused(forward(vec![unix]), "copy 5");
    forward((1..=MAX_HOPS as u32).map(hop).collect())
        .validate(&limits)
        .unwrap();
}

fn copy_reserved(to: Vec<Hop>) -> Request {
    let Request::ForwardPut {
        blob,
        partition,
        entries,
        timeout_ms,
        ..
    } = forward(vec![hop(1)])
    else {
        unreachable!()
    };
    Request::CopyReserved {
        blob,
        partition,
        entries,
        timeout_ms,
        to,
    }
}

fn unix_hop(unit: u32) -> Hop {
    Hop {
        unit,
        addr: format!("/run/stowage/unit-{unit}.sock"),
        instance: Some(u128::from(unit)),
    }
}

/// The copy of a reserved blob to the units of one host: a borrowed
/// CopyReserved is the owned one's bytes; its copies are at absolute
/// Unix socket paths (not tcp addresses, relative paths or paths too long
/// for a socket), each unit named once.
#[test]
fn a_copy_of_a_reserved_blob_names_unix_sockets_and_encodes_as_borrowed() {
    let r = copy_reserved(vec![unix_hop(1), unix_hop(2)]);
    let Request::CopyReserved {
        blob,
        partition,
        entries,
        timeout_ms,
        to,
    } = &r
    else {
        unreachable!()
    };
    let borrowed = RequestRef::CopyReserved {
        blob: *blob,
        partition,
        entries,
        timeout_ms: *timeout_ms,
        to,
    };
    let (mut owned, mut by_ref) = (Vec::new(), Vec::new());
    encode(6, &r, 0, &mut owned).unwrap();
    encode(6, &borrowed, 0, &mut by_ref).unwrap();
    assert_eq!(by_ref, owned);
    let back: Envelope<Request> = decode_header(&by_ref[PREFIX_LEN..]).unwrap();
    assert_eq!(back.body, r);
    assert!(!r.carries_payload());
    let limits = Limits::default();
    r.validate(&limits).unwrap();
    let refused = |r: Request, says: &str| {
        let e = r.validate(&limits).unwrap_err().to_string();
        assert!(e.contains(says), "{e}");
    };
    refused(copy_reserved(vec![hop(3)]), "copy 3");
    let mut relative = unix_hop(4);
    relative.addr = "unit-4.sock".into();
    refused(copy_reserved(vec![relative]), "copy 4");
    let mut long = unix_hop(5);
    long.addr = format!("/{}", "x".repeat(107));
    refused(copy_reserved(vec![long]), "copy 5");
    refused(
        copy_reserved(vec![unix_hop(6), unix_hop(6)]),
        "unit 6 named twice",
    );
    refused(copy_reserved(vec![]), "0 copies");
}
