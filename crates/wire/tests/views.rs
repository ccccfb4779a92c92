//! The plane view's messages (docs/replication.md#rejoining): Epoch,
//! SetView and their View reply round-trip; a view naming more units than
//! a plane may have is refused; and which requests a unit serves only on
//! a connection of its own view.

use stowage_wire::{
    decode_header, encode, BlobId, Envelope, ErrorCode, Limits, Member, PlaneView, Request,
    Response, MAX_MEMBERS, PREFIX_LEN,
};

fn view(units: usize) -> PlaneView {
    PlaneView {
        epoch: 3,
        members: (0..units)
            .map(|u| Member {
                instance: (u % 3 != 0).then_some((u as u128) << 64 | 7),
                since: (u % 2) as u64 * 3,
            })
            .collect(),
    }
}

fn round_trip<T>(msg: T)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let mut out = Vec::new();
    encode(9, &msg, 0, &mut out).unwrap();
    let back: Envelope<T> = decode_header(&out[PREFIX_LEN..]).unwrap();
    assert_eq!(back.body, msg);
}

#[test]
fn the_view_messages_round_trip() {
    round_trip(Request::Epoch {
        epoch: u64::MAX,
        digest: 7,
    });
    round_trip(Request::SetView { view: view(5) });
    round_trip(Response::View { view: view(0) });
    round_trip(Response::View { view: view(4) });
    round_trip(Response::Error {
        code: ErrorCode::Stale,
        message: "another view".into(),
    });
    let limits = Limits::default();
    Request::Epoch {
        epoch: 1,
        digest: 0,
    }
    .validate(&limits)
    .unwrap();
    Request::SetView { view: view(5) }
        .validate(&limits)
        .unwrap();
}

#[test]
fn a_view_of_more_units_than_a_plane_may_have_is_refused() {
    let limits = Limits::default();
    Request::SetView {
        view: view(MAX_MEMBERS),
    }
    .validate(&limits)
    .unwrap();
    let e = Request::SetView {
        view: view(MAX_MEMBERS + 1),
    }
    .validate(&limits)
    .unwrap_err()
    .to_string();
    assert!(e.contains(&format!("{} units", MAX_MEMBERS + 1)), "{e}");
}

#[test]
fn rows_are_served_only_in_the_units_view_and_letting_go_always() {
    let rows = [
        Request::ListPartitions,
        Request::ClearRows {
            partition: "p".into(),
            rows: vec![1],
        },
        Request::Alloc {
            blob: BlobId(1),
            nbytes: 8,
            n_entries: 1,
        },
        Request::Commit {
            blob: BlobId(1),
            partition: "p".into(),
            entries: vec![],
        },
        Request::ClaimsState,
        Request::OpenRepair { key: "k".into() },
    ];
    for r in &rows {
        assert!(r.needs_view(), "{r:?}");
    }
    let any_view = [
        Request::Stats,
        Request::Epoch {
            epoch: 2,
            digest: 0,
        },
        Request::SetView { view: view(1) },
        Request::Abort {
            blob: BlobId(1),
            in_flight: false,
        },
        Request::CloseRepair { window: 1 },
        Request::Fence { instance: 1 },
    ];
    for r in &any_view {
        assert!(!r.needs_view(), "{r:?}");
    }
}

#[test]
fn views_of_one_epoch_are_told_apart_by_their_digests() {
    assert_eq!(view(3).digest(), view(3).digest());
    assert_ne!(view(3).digest(), view(4).digest());
    let mut other = view(3);
    other.members[1].since = 9;
    assert_eq!(other.epoch, view(3).epoch);
    assert_ne!(other.digest(), view(3).digest());
    // Two views without members, of two epochs.
    assert_ne!(PlaneView::default().digest(), view(0).digest());
}
