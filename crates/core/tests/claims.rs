//! Claims: consumer tasks lease ready rows, each row at most once per
//! task, settle or give them back; waiting claims are answered through
//! `Action::Claimed`. Every test drives the core only through
//! `UnitCore::handle` with a virtual clock, and drains `poll_action` after
//! every input as the unit's driver does.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use stowage_core::home::consumed_field;
use stowage_core::op::{ClearPartition, ClearRows};
use stowage_core::{input, ClaimAnswer, ClaimStatusAnswer, CoreError, Lease, LeaseId, Owner, Time};

mod common;
use common::{Unit, LEASE};

fn invalid<T: std::fmt::Debug>(r: Result<T, CoreError>) -> String {
    match r {
        Err(CoreError::Invalid(m)) => m,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

/// A unit with partition "p" registered for "train" and "reward", and a
/// connection.
fn registered() -> (Unit, Owner) {
    let mut u = Unit::new();
    let c = u.conn();
    u.register(c, "p", &["train", "reward"], 100, 0).unwrap();
    (u, c)
}

#[test]
fn registration_is_idempotent_adds_tasks_and_refuses_what_contradicts_it() {
    let mut u = Unit::new();
    let c = u.conn();
    u.register(c, "p", &["train"], 10, 4).unwrap();
    u.register(c, "p", &["train"], 10, 4).unwrap();
    u.register(c, "p", &["reward"], 0, 0).unwrap();
    for task in ["train", "reward"] {
        let s = u.status(c, "p", task);
        assert!(s.registered, "{task}");
        assert_eq!((s.samples, s.group_size), (10, 4));
    }
    assert!(!u.status(c, "p", "other").registered);
    assert!(!u.status(c, "q", "train").registered);
    let m = invalid(u.register(c, "p", &["train"], 10, 2));
    assert!(m.contains("groups"), "{m}");
    invalid(u.register(c, "p", &[""], 0, 0));
    let many: Vec<String> = (0..63).map(|i| format!("t{i}")).collect();
    let many: Vec<&str> = many.iter().map(|s| s.as_str()).collect();
    // 2 + 63 > 64: refused whole.
    invalid(u.register(c, "p", &many, 0, 0));
    assert!(!u.status(c, "p", "t0").registered);
    u.register(c, "p", &many[..62], 0, 0).unwrap();
    assert!(u.status(c, "p", "t61").registered);
    invalid(u.register(c, "p", &["one-more"], 0, 0));
    // Registering the same tasks again adds none.
    u.register(c, "p", &many[..62], 0, 0).unwrap();
}

#[test]
fn a_claim_of_an_unregistered_task_or_asking_nothing_is_refused() {
    let (mut u, c) = registered();
    u.put(c, "p", &[(0, "a")]);
    let m = invalid(u.claim_op(c, "p", "eval", &["a"], 1, None, 0));
    assert!(m.contains("not registered"), "{m}");
    invalid(u.claim_op(c, "q", "train", &["a"], 1, None, 0));
    invalid(u.claim_op(c, "p", "train", &["a"], 0, None, 0));
    invalid(u.claim_op(c, "p", "train", &[], 1, None, 0));
    // Nothing was taken by the refused claims.
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, vec![0]);
}

#[test]
fn a_row_is_ready_only_with_every_field_asked() {
    let (mut u, c) = registered();
    u.put(c, "p", &[(0, "prompt"), (1, "prompt"), (1, "response")]);
    u.put(c, "p", &[(2, "response")]);
    let l = u.claim(c, "p", "train", &["prompt", "response"], 8);
    assert_eq!(l.rows, vec![1]);
    assert_eq!(
        u.claim(c, "p", "train", &["prompt", "response"], 8).rows,
        Vec::<u64>::new()
    );
    u.put(c, "p", &[(0, "response")]);
    assert_eq!(
        u.claim(c, "p", "train", &["prompt", "response"], 8).rows,
        vec![0]
    );
    // Asking one field only, row 2 (which has just it) is ready too.
    assert_eq!(
        u.claim(c, "p", "reward", &["response"], 8).rows,
        vec![0, 1, 2]
    );
}

#[test]
fn rows_come_oldest_first_by_their_first_entry() {
    let (mut u, c) = registered();
    u.put(c, "p", &[(5, "a")]);
    u.put(c, "p", &[(2, "a")]);
    u.put(c, "p", &[(9, "a"), (3, "a")]);
    // A later entry of an old row does not make it younger.
    u.put(c, "p", &[(5, "b")]);
    assert_eq!(u.claim(c, "p", "train", &["a"], 2).rows, vec![5, 2]);
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, vec![9, 3]);
    // Rows stored before the partition is registered arrive at
    // registration, ascending.
    u.put(c, "q", &[(7, "a"), (4, "a")]);
    u.register(c, "q", &["train"], 0, 0).unwrap();
    u.put(c, "q", &[(1, "a")]);
    assert_eq!(u.claim(c, "q", "train", &["a"], 8).rows, vec![4, 7, 1]);
}

#[test]
fn a_row_is_claimed_once_per_task_and_again_by_another_task() {
    let (mut u, c) = registered();
    u.put(c, "p", &[(0, "a"), (1, "a"), (2, "a")]);
    let l = u.claim(c, "p", "train", &["a"], 2);
    assert_eq!(l.rows, vec![0, 1]);
    // Leased: not claimable for train; claimable for reward.
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, vec![2]);
    assert_eq!(u.claim(c, "p", "reward", &["a"], 8).rows, vec![0, 1, 2]);
    assert_eq!(u.settle(c, l.id, &[0, 1]).unwrap(), vec![0, 1]);
    // Consumed: never again for train.
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, Vec::<u64>::new());
    let s = u.status(c, "p", "train");
    assert_eq!((s.consumed, s.leased, s.rows), (2, 1, 3));
}

#[test]
fn two_connections_never_get_the_same_row() {
    let (mut u, c) = registered();
    let d = u.conn();
    u.put(c, "p", &[(0, "a"), (1, "a"), (2, "a"), (3, "a")]);
    let x = u.claim(c, "p", "train", &["a"], 3);
    let y = u.claim(d, "p", "train", &["a"], 3);
    assert_eq!(x.rows, vec![0, 1, 2]);
    assert_eq!(y.rows, vec![3]);
    assert_ne!(x.id, y.id);
    // Another connection may not settle a lease: it stays whole.
    assert!(matches!(
        u.settle(d, x.id, &[0]),
        Err(CoreError::NotOwner(_))
    ));
    assert_eq!(u.claim(d, "p", "train", &["a"], 3).rows, Vec::<u64>::new());
    assert_eq!(u.settle(c, x.id, &[0]).unwrap(), vec![0]);
}

#[test]
fn settle_keeps_exactly_what_is_kept_and_gives_back_the_rest() {
    let (mut u, c) = registered();
    u.put(c, "p", &[(0, "a"), (1, "a"), (2, "a"), (3, "a")]);
    let l = u.claim(c, "p", "train", &["a"], 4);
    // Rows not in the lease, and a row named twice, are not kept twice.
    assert_eq!(u.settle(c, l.id, &[2, 7, 0, 2]).unwrap(), vec![2, 0]);
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, vec![1, 3]);
    // A settled lease is gone; an unknown lease answers nothing.
    assert_eq!(u.settle(c, l.id, &[1]).unwrap(), Vec::<u64>::new());
    assert_eq!(u.settle(c, LeaseId(987), &[1]).unwrap(), Vec::<u64>::new());
    let s = u.status(c, "p", "train");
    assert_eq!((s.consumed, s.leased), (2, 2));
}

#[test]
fn an_ended_connections_lease_gives_its_rows_back() {
    let (mut u, c) = registered();
    let d = u.conn();
    u.put(c, "p", &[(0, "a"), (1, "a")]);
    let l = u.claim(d, "p", "train", &["a"], 1);
    assert_eq!(l.rows, vec![0]);
    u.end(d);
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, vec![0, 1]);
}

#[test]
fn an_expired_lease_gives_its_rows_back() {
    let (mut u, c) = registered();
    u.put(c, "p", &[(0, "a"), (1, "a")]);
    let l = u.claim(c, "p", "train", &["a"], 2);
    assert_eq!(u.core.poll_timeout(), Some(u.now + LEASE));
    u.advance(LEASE - Duration::from_millis(1));
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, Vec::<u64>::new());
    u.advance(Duration::from_millis(1));
    assert_eq!(u.core.stats().leases_expired, 1);
    assert_eq!(u.core.poll_timeout(), None);
    assert_eq!(u.settle(c, l.id, &[0, 1]).unwrap(), Vec::<u64>::new());
    let again = u.claim(c, "p", "train", &["a"], 8);
    assert_eq!(again.rows, vec![0, 1]);
    // Past its time but before the Timeout: a settle finds it expired.
    u.now += LEASE;
    assert_eq!(u.settle(c, again.id, &[0]).unwrap(), Vec::<u64>::new());
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, vec![0, 1]);
    assert_eq!(u.core.stats().leases_expired, 2);
    assert_eq!(u.status(c, "p", "train").consumed, 0);
}

#[test]
fn a_waiting_claim_is_answered_by_the_commit_that_makes_a_row_ready() {
    let (mut u, c) = registered();
    let d = u.conn();
    u.put(c, "p", &[(0, "a")]);
    assert_eq!(
        u.claim_waiting(d, "train", &["a", "b"], 4, 5000, 11),
        ClaimAnswer::Waiting
    );
    assert_eq!(
        u.claim_waiting(c, "train", &["a", "b"], 4, 5000, 12),
        ClaimAnswer::Waiting
    );
    assert_eq!(u.core.stats().claim_waits, 2);
    assert_eq!(
        u.core.poll_timeout(),
        Some(u.now + Duration::from_millis(5000))
    );
    u.put(c, "p", &[(1, "a")]);
    assert!(u.take_replies().is_empty(), "row 1 is not ready");
    u.put(c, "p", &[(0, "b")]);
    // The oldest waiting claim gets the row, through the action queue.
    let r = u.take_replies();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].owner, r[0].tag, r[0].lease.rows.clone()),
        (d, 11, vec![0])
    );
    assert_ne!(r[0].lease.id, LeaseId(0));
    u.put(c, "p", &[(1, "b")]);
    let r = u.take_replies();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].owner, r[0].tag, r[0].lease.rows.clone()),
        (c, 12, vec![1])
    );
    // Its lease is a lease like any other.
    assert_eq!(u.settle(c, r[0].lease.id, &[1]).unwrap(), vec![1]);
    assert_eq!(u.core.stats().claims, 2);
}

#[test]
fn rows_given_back_answer_a_waiting_claim() {
    let (mut u, c) = registered();
    let d = u.conn();
    u.put(c, "p", &[(0, "a"), (1, "a")]);
    let l = u.claim(c, "p", "train", &["a"], 2);
    assert_eq!(
        u.claim_waiting(d, "train", &["a"], 4, 60_000, 3),
        ClaimAnswer::Waiting
    );
    u.settle(c, l.id, &[0]).unwrap();
    let r = u.take_replies();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].owner, r[0].tag, r[0].lease.rows.clone()),
        (d, 3, vec![1])
    );
    // Its lease expires; the rows answer the next waiting claim.
    assert_eq!(
        u.claim_waiting(c, "train", &["a"], 4, 60_000, 4),
        ClaimAnswer::Waiting
    );
    u.advance(LEASE);
    let r = u.take_replies();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].owner, r[0].tag, r[0].lease.rows.clone()),
        (c, 4, vec![1])
    );
    // A connection's end gives its rows back to a waiting claim too.
    assert_eq!(
        u.claim_waiting(d, "train", &["a"], 4, 60_000, 5),
        ClaimAnswer::Waiting
    );
    u.end(c);
    let r = u.take_replies();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].owner, r[0].tag, r[0].lease.rows.clone()),
        (d, 5, vec![1])
    );
}

#[test]
fn a_waiting_claim_is_answered_empty_at_its_deadline() {
    let (mut u, c) = registered();
    assert_eq!(
        u.claim_waiting(c, "train", &["a"], 1, 1000, 9),
        ClaimAnswer::Waiting
    );
    // A deadline that is not ahead does not wait.
    assert_eq!(
        u.claim_op(c, "p", "train", &["a"], 1, Some(u.now), 10)
            .unwrap(),
        ClaimAnswer::Leased(Lease {
            id: LeaseId(0),
            rows: vec![],
            homes: vec![]
        })
    );
    let deadline = u.now + Duration::from_millis(1000);
    assert_eq!(u.core.poll_timeout(), Some(deadline));
    u.advance(Duration::from_millis(999));
    assert!(u.take_replies().is_empty());
    u.advance(Duration::from_millis(1));
    let r = u.take_replies();
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].owner, r[0].tag), (c, 9));
    assert_eq!(
        r[0].lease,
        Lease {
            id: LeaseId(0),
            rows: vec![],
            homes: vec![]
        }
    );
    assert_eq!(u.core.poll_timeout(), None);
    // Answered once: a row arriving now answers nothing.
    u.put(c, "p", &[(0, "a")]);
    assert!(u.take_replies().is_empty());
}

#[test]
fn a_waiting_claim_is_dropped_when_its_connection_ends() {
    let (mut u, c) = registered();
    let d = u.conn();
    assert_eq!(
        u.claim_waiting(d, "train", &["a"], 1, 1000, 1),
        ClaimAnswer::Waiting
    );
    u.end(d);
    assert_eq!(u.core.poll_timeout(), None);
    u.put(c, "p", &[(0, "a")]);
    u.advance(Duration::from_millis(2000));
    assert!(u.take_replies().is_empty());
    // The row went to nobody.
    assert_eq!(u.claim(c, "p", "train", &["a"], 1).rows, vec![0]);
}

#[test]
fn groups_are_never_split() {
    let mut u = Unit::new();
    let c = u.conn();
    u.register(c, "p", &["train"], 0, 2).unwrap();
    let g = |id: &str| format!("\0g:{id}");
    let (gx, gy, gz) = (g("x"), g("y"), g("z"));
    u.put(c, "p", &[(0, "a"), (0, &gx), (1, "a"), (1, &gx)]);
    u.put(c, "p", &[(2, "a"), (2, &gy)]);
    u.put(c, "p", &[(3, "a")]); // no group: a group of its own, never whole
    invalid(u.claim_op(c, "p", "train", &["a"], 1, None, 0));
    // Group y has one row of two: not claimable.
    assert_eq!(u.claim(c, "p", "train", &["a"], 3).rows, vec![0, 1]);
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, Vec::<u64>::new());
    u.put(c, "p", &[(4, &gy)]);
    // Row 4 lacks "a": the group is not ready.
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, Vec::<u64>::new());
    u.put(c, "p", &[(4, "a")]);
    u.put(c, "p", &[(5, "a"), (5, &gz), (6, "a"), (6, &gz)]);
    // Whole groups only, as many as fit: 3 rows fit one group.
    assert_eq!(u.claim(c, "p", "train", &["a"], 3).rows, vec![2, 4]);
    let l = u.claim(c, "p", "train", &["a"], 8);
    assert_eq!(l.rows, vec![5, 6]);
    // A group partly kept is never whole again.
    assert_eq!(u.settle(c, l.id, &[5]).unwrap(), vec![5]);
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, Vec::<u64>::new());
}

#[test]
fn clearing_rows_drops_them_from_consumed_and_leased_and_consumed_stays_counted() {
    let (mut u, c) = registered();
    u.put(c, "p", &[(0, "a"), (1, "a"), (2, "a")]);
    let l = u.claim(c, "p", "train", &["a"], 1);
    assert_eq!(u.settle(c, l.id, &[0]).unwrap(), vec![0]);
    let l = u.claim(c, "p", "train", &["a"], 2);
    assert_eq!(l.rows, vec![1, 2]);
    u.request(
        c,
        ClearRows {
            partition: "p".into(),
            rows: vec![0, 1],
        },
    )
    .unwrap();
    // A settle of a cleared row does not return it.
    assert_eq!(u.settle(c, l.id, &[1, 2]).unwrap(), vec![2]);
    let s = u.status(c, "p", "train");
    assert_eq!((s.consumed, s.leased, s.rows), (2, 0, 1));
    // Rows put again are new rows: claimable again, the newest last.
    u.put(c, "p", &[(1, "a"), (0, "a")]);
    assert_eq!(u.claim(c, "p", "train", &["a"], 8).rows, vec![1, 0]);
    // Clearing a consumed row does not lower the count.
    u.request(
        c,
        ClearRows {
            partition: "p".into(),
            rows: vec![2],
        },
    )
    .unwrap();
    assert_eq!(u.status(c, "p", "train").consumed, 2);
}

#[test]
fn clearing_a_partition_drops_its_claims_state() {
    let (mut u, c) = registered();
    let d = u.conn();
    u.put(c, "p", &[(0, "a"), (1, "a")]);
    let l = u.claim(c, "p", "train", &["a"], 2);
    u.settle(c, l.id, &[0]).unwrap();
    let l = u.claim(c, "p", "train", &["a"], 2);
    assert_eq!(l.rows, vec![1]);
    assert_eq!(
        u.claim_waiting(d, "reward", &["b"], 1, 5000, 7),
        ClaimAnswer::Waiting
    );
    u.request(
        c,
        ClearPartition {
            partition: "p".into(),
        },
    )
    .unwrap();
    // The waiting claim is answered, empty.
    let r = u.take_replies();
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].owner, r[0].tag), (d, 7));
    assert!(r[0].lease.rows.is_empty());
    // The registration, the lease and the timers are gone.
    assert_eq!(u.core.poll_timeout(), None);
    assert_eq!(u.status(c, "p", "train"), ClaimStatusAnswer::default());
    assert_eq!(u.settle(c, l.id, &[1]).unwrap(), Vec::<u64>::new());
    invalid(u.claim_op(c, "p", "train", &["a"], 1, None, 0));
    // Registered afresh, the rows put again are claimable again.
    u.register(c, "p", &["train"], 0, 0).unwrap();
    u.put(c, "p", &[(0, "a")]);
    assert_eq!(u.claim(c, "p", "train", &["a"], 2).rows, vec![0]);
}

#[test]
fn a_detached_connection_may_not_claim() {
    let (mut u, _) = registered();
    let d = u.conn();
    u.end(d);
    assert!(matches!(
        u.claim_op(d, "p", "train", &["a"], 1, Some(u.now + LEASE), 0),
        Err(CoreError::NotOwner(_))
    ));
    assert_eq!(u.core.poll_timeout(), None);
}

// ---------------------------------------------------------------------------
// Random interleavings against a model.

const TASKS: [&str; 2] = ["train", "reward"];
const FIELDS: [&str; 2] = ["a", "b"];
/// Units of the model's plane (claims with homes): row `r`'s home is
/// `r % HOME_UNITS`.
const HOME_UNITS: u32 = 4;

#[derive(Clone, Debug)]
enum Step {
    /// Put fields (bit 0: "a", bit 1: "b") of rows.
    Put {
        rows: Vec<u64>,
        fields: u8,
    },
    Claim {
        conn: usize,
        task: usize,
        both: bool,
        want: u32,
        wait_ms: Option<u64>,
        /// With copies: the homes claimed (bit `h`: home `h`).
        homes: Option<u8>,
    },
    /// Another copy's claimer consumed `rows` for `task`: their
    /// consumption marks arrive.
    Mark {
        rows: Vec<u64>,
        task: usize,
    },
    /// Settle the `pick`-th live lease of `conn` (any connection's, if it has
    /// none), keeping rows whose bit in `keep` is set.
    Settle {
        conn: usize,
        pick: usize,
        keep: u64,
        other: bool,
    },
    End {
        conn: usize,
    },
    ClearRows {
        rows: Vec<u64>,
    },
    ClearPartition,
    Advance {
        ms: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let row = 0u64..10;
    prop_oneof![
        4 => (prop::collection::vec(row.clone(), 1..4), 1u8..4)
            .prop_map(|(rows, fields)| Step::Put { rows, fields }),
        4 => (0usize..3, 0usize..2, any::<bool>(), 1u32..5, prop::option::of(1u64..40_000),
              prop::option::weighted(0.5, 0u8..16))
            .prop_map(|(conn, task, both, want, wait_ms, homes)| Step::Claim { conn, task, both, want, wait_ms, homes }),
        1 => (prop::collection::vec(row.clone(), 1..3), 0usize..2)
            .prop_map(|(rows, task)| Step::Mark { rows, task }),
        3 => (0usize..3, 0usize..4, any::<u64>(), prop::bool::weighted(0.1))
            .prop_map(|(conn, pick, keep, other)| Step::Settle { conn, pick, keep, other }),
        1 => (0usize..3).prop_map(|conn| Step::End { conn }),
        1 => prop::collection::vec(row, 1..3).prop_map(|rows| Step::ClearRows { rows }),
        1 => Just(Step::ClearPartition),
        2 => (0u64..45_000).prop_map(|ms| Step::Advance { ms }),
    ]
}

struct ModelLease {
    conn: usize,
    task: usize,
    rows: BTreeSet<u64>,
    expires: Time,
    /// Leased by a claim of homes: its rows count for their homes.
    homes: bool,
}

struct ModelWait {
    conn: usize,
    task: usize,
    fields: Vec<&'static str>,
    want: u32,
    until: Time,
    homes: Option<u8>,
}

/// The homes a claim names (bit `h`: home `h`).
fn homes_of(bits: Option<u8>) -> Option<stowage_core::home::Homes> {
    bits.map(|b| stowage_core::home::Homes {
        units: HOME_UNITS,
        of: (0..HOME_UNITS).filter(|h| b & (1 << h) != 0).collect(),
    })
}

fn in_homes(bits: Option<u8>, row: u64) -> bool {
    bits.is_none_or(|b| b & (1 << (row % HOME_UNITS as u64)) != 0)
}

#[derive(Default)]
struct Model {
    /// Fields stored per row.
    rows: BTreeMap<u64, BTreeSet<&'static str>>,
    registered: bool,
    consumed: [BTreeSet<u64>; 2],
    /// Per task, rows consumed per home (settled under a claim of homes,
    /// or marked), never lowered but by a partition's clear.
    by_home: [BTreeMap<u32, u64>; 2],
    leases: BTreeMap<LeaseId, ModelLease>,
    waits: BTreeMap<u64, ModelWait>,
}

impl Model {
    fn ready(&self, row: u64, fields: &[&str]) -> bool {
        self.rows
            .get(&row)
            .is_some_and(|f| fields.iter().all(|n| f.contains(n)))
    }

    fn leased(&self, task: usize, row: u64) -> bool {
        self.leases
            .values()
            .any(|l| l.task == task && l.rows.contains(&row))
    }

    /// Rows a claim of `task` for `fields` (of `homes`) could take now.
    fn claimable(&self, task: usize, fields: &[&str], homes: Option<u8>) -> BTreeSet<u64> {
        self.rows
            .keys()
            .copied()
            .filter(|r| {
                self.ready(*r, fields)
                    && in_homes(homes, *r)
                    && !self.consumed[task].contains(r)
                    && !self.leased(task, *r)
            })
            .collect()
    }

    /// `row` became consumed by `task`: counted for its home.
    fn count(&mut self, task: usize, row: u64) {
        *self.by_home[task]
            .entry((row % HOME_UNITS as u64) as u32)
            .or_default() += 1;
    }

    /// A lease the core gave: check it and record it.
    #[allow(clippy::too_many_arguments)]
    fn leased_now(
        &mut self,
        conn: usize,
        task: usize,
        fields: &[&str],
        want: u32,
        homes: Option<u8>,
        l: &Lease,
        now: Time,
    ) -> Result<(), TestCaseError> {
        prop_assert!(!l.rows.is_empty());
        prop_assert!(l.rows.len() <= want as usize);
        match homes {
            None => prop_assert!(l.homes.is_empty()),
            Some(_) => {
                let want: Vec<u32> = l
                    .rows
                    .iter()
                    .map(|r| (r % HOME_UNITS as u64) as u32)
                    .collect();
                prop_assert_eq!(&l.homes, &want, "each row's home");
            }
        }
        let can = self.claimable(task, fields, homes);
        let rows: BTreeSet<u64> = l.rows.iter().copied().collect();
        prop_assert_eq!(rows.len(), l.rows.len(), "a row twice in one lease");
        prop_assert!(
            rows.is_subset(&can),
            "leased {:?}, claimable {:?}",
            rows,
            can
        );
        prop_assert!(!self.leases.contains_key(&l.id));
        self.leases.insert(
            l.id,
            ModelLease {
                conn,
                task,
                rows,
                expires: now + LEASE,
                homes: homes.is_some(),
            },
        );
        Ok(())
    }
}

struct Run {
    u: Unit,
    conns: [Owner; 3],
    m: Model,
    next_tag: u64,
}

impl Run {
    /// Check the answers of waiting claims the last input gave.
    fn replies(&mut self) -> Result<(), TestCaseError> {
        for r in self.u.take_replies() {
            let w = self.m.waits.remove(&r.tag);
            prop_assert!(w.is_some(), "an answer to no waiting claim: {:?}", r);
            let w = w.unwrap();
            prop_assert_eq!(r.owner, self.conns[w.conn]);
            if r.lease.rows.is_empty() {
                prop_assert!(
                    w.until <= self.u.now || !self.m.registered,
                    "answered empty before its time"
                );
            } else {
                prop_assert!(w.until > self.u.now);
                let fields = w.fields.clone();
                self.m.leased_now(
                    w.conn, w.task, &fields, w.want, w.homes, &r.lease, self.u.now,
                )?;
            }
        }
        // No waiting claim could take a row now.
        for (tag, w) in &self.m.waits {
            if w.until > self.u.now {
                let can = self.m.claimable(w.task, &w.fields, w.homes);
                prop_assert!(
                    can.is_empty(),
                    "claim {} waits while {:?} are claimable",
                    tag,
                    can
                );
            }
        }
        Ok(())
    }

    fn apply(&mut self, s: &Step) -> Result<(), TestCaseError> {
        let now = self.u.now;
        match s {
            Step::Put { rows, fields } => {
                let mut keys = Vec::new();
                for r in rows {
                    for (i, f) in FIELDS.iter().enumerate() {
                        if fields & (1 << i) != 0 && !keys.contains(&(*r, *f)) {
                            keys.push((*r, *f));
                            self.m.rows.entry(*r).or_default().insert(*f);
                        }
                    }
                }
                self.u.put(self.conns[0], "p", &keys);
            }
            Step::Claim {
                conn,
                task,
                both,
                want,
                wait_ms,
                homes,
            } => {
                let fields: Vec<&'static str> = if *both { FIELDS.to_vec() } else { vec!["a"] };
                let tag = self.next_tag;
                self.next_tag += 1;
                let until = wait_ms.map(|ms| now + Duration::from_millis(ms));
                let a = self.u.claim_of(
                    self.conns[*conn],
                    "p",
                    TASKS[*task],
                    &fields,
                    *want,
                    until,
                    tag,
                    homes_of(*homes),
                );
                if !self.m.registered {
                    prop_assert!(matches!(a, Err(CoreError::Invalid(_))), "{:?}", a);
                    return Ok(());
                }
                let can = self.m.claimable(*task, &fields, *homes);
                match a {
                    Ok(ClaimAnswer::Leased(l)) if l.rows.is_empty() => {
                        prop_assert!(can.is_empty(), "nothing leased of {:?}", can);
                        prop_assert!(until.is_none_or(|t| t <= now));
                        prop_assert_eq!(l.id, LeaseId(0));
                    }
                    Ok(ClaimAnswer::Leased(l)) => {
                        prop_assert_eq!(l.rows.len(), can.len().min(*want as usize));
                        self.m
                            .leased_now(*conn, *task, &fields, *want, *homes, &l, now)?;
                    }
                    Ok(ClaimAnswer::Waiting) => {
                        prop_assert!(can.is_empty());
                        self.m.waits.insert(
                            tag,
                            ModelWait {
                                conn: *conn,
                                task: *task,
                                fields,
                                want: *want,
                                until: until.unwrap(),
                                homes: *homes,
                            },
                        );
                    }
                    Err(e) => prop_assert!(false, "claim refused: {:?}", e),
                }
            }
            Step::Settle {
                conn,
                pick,
                keep,
                other,
            } => {
                let mine: Vec<LeaseId> = self
                    .m
                    .leases
                    .iter()
                    .filter(|(_, l)| l.conn == *conn)
                    .map(|(id, _)| *id)
                    .collect();
                let all: Vec<LeaseId> = self.m.leases.keys().copied().collect();
                let pool = if mine.is_empty() || *other {
                    &all
                } else {
                    &mine
                };
                let id = if pool.is_empty() {
                    LeaseId(1_000_000)
                } else {
                    pool[pick % pool.len()]
                };
                let keep_rows: Vec<u64> = (0..10).filter(|r| keep & (1 << r) != 0).collect();
                let owner_conn = self.m.leases.get(&id).map(|l| l.conn);
                let got = self.u.settle(self.conns[*conn], id, &keep_rows);
                match owner_conn {
                    Some(c) if c != *conn => {
                        prop_assert!(matches!(got, Err(CoreError::NotOwner(_))), "{:?}", got);
                    }
                    Some(_) => {
                        let l = self.m.leases.remove(&id).unwrap();
                        let want: Vec<u64> = if l.expires <= now {
                            vec![]
                        } else {
                            keep_rows
                                .iter()
                                .copied()
                                .filter(|r| l.rows.contains(r))
                                .collect()
                        };
                        prop_assert_eq!(got.clone().unwrap(), want.clone());
                        for r in want {
                            prop_assert!(
                                self.m.consumed[l.task].insert(r),
                                "row {} consumed twice",
                                r
                            );
                            if l.homes {
                                self.m.count(l.task, r);
                            }
                        }
                    }
                    None => prop_assert_eq!(got.unwrap(), Vec::<u64>::new()),
                }
            }
            Step::Mark { rows, task } => {
                let names: Vec<String> = rows
                    .iter()
                    .map(|r| consumed_field((r % HOME_UNITS as u64) as u32, TASKS[*task]))
                    .collect();
                let keys: Vec<(u64, &str)> = rows
                    .iter()
                    .zip(&names)
                    .map(|(r, n)| (*r, n.as_str()))
                    .collect();
                self.u.put(self.conns[0], "p", &keys);
                for &r in rows {
                    // A mark makes its row (of no field the claims ask
                    // for) when it comes first.
                    self.m.rows.entry(r).or_default();
                    if self.m.consumed[*task].insert(r) {
                        self.m.count(*task, r);
                    }
                    // A lease of it keeps it no more.
                    for l in self.m.leases.values_mut() {
                        if l.task == *task {
                            l.rows.remove(&r);
                        }
                    }
                }
            }
            Step::End { conn } => {
                let old = self.conns[*conn];
                self.u.end(old);
                self.m.leases.retain(|_, l| l.conn != *conn);
                self.m.waits.retain(|_, w| w.conn != *conn);
                self.conns[*conn] = self.u.conn();
            }
            Step::ClearRows { rows } => {
                self.u
                    .request(
                        self.conns[0],
                        ClearRows {
                            partition: "p".into(),
                            rows: rows.clone(),
                        },
                    )
                    .unwrap();
                for r in rows {
                    self.m.rows.remove(r);
                    for c in &mut self.m.consumed {
                        c.remove(r);
                    }
                    for l in self.m.leases.values_mut() {
                        l.rows.remove(r);
                    }
                }
            }
            Step::ClearPartition => {
                self.u
                    .request(
                        self.conns[0],
                        ClearPartition {
                            partition: "p".into(),
                        },
                    )
                    .unwrap();
                self.m.rows.clear();
                self.m.consumed = Default::default();
                self.m.by_home = Default::default();
                self.m.leases.clear();
                self.m.registered = false;
                // Its waiting claims are answered empty (checked in `replies`);
                // register again so the run goes on.
                self.replies()?;
                prop_assert!(self.m.waits.is_empty());
                self.u.register(self.conns[0], "p", &TASKS, 0, 0).unwrap();
                self.m.registered = true;
            }
            Step::Advance { ms } => {
                self.u.advance(Duration::from_millis(*ms));
                let now = self.u.now;
                self.m.leases.retain(|_, l| l.expires > now);
            }
        }
        self.replies()?;
        // The counts per home, one home at a time.
        for (t, name) in TASKS.iter().enumerate() {
            for h in 0..HOME_UNITS {
                let got = self
                    .u
                    .status_of(self.conns[0], "p", name, homes_of(Some(1 << h)))
                    .consumed;
                let want = self.m.by_home[t].get(&h).copied().unwrap_or(0);
                prop_assert_eq!(got, want, "task {} home {}", name, h);
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn claims_match_a_model(steps in prop::collection::vec(step(), 1..60)) {
        let mut u = Unit::new();
        let conns = [u.conn(), u.conn(), u.conn()];
        u.register(conns[0], "p", &TASKS, 0, 0).unwrap();
        let mut run = Run { u, conns, m: Model { registered: true, ..Model::default() }, next_tag: 1 };
        for s in &steps {
            run.apply(s)?;
        }
        // Every lease ends, every waiting claim is answered: then a final
        // claim of each task takes exactly the ready rows not consumed.
        for c in 0..3 {
            run.apply(&Step::End { conn: c })?;
        }
        run.apply(&Step::Advance { ms: 100_000 })?;
        prop_assert!(run.m.waits.is_empty());
        prop_assert!(run.m.leases.is_empty());
        for (task, name) in TASKS.iter().enumerate() {
            for fields in [&["a"][..], &FIELDS[..]] {
                let want: BTreeSet<u64> = run.m.rows.keys().copied()
                    .filter(|r| run.m.ready(*r, fields) && !run.m.consumed[task].contains(r))
                    .collect();
                let l = run.u.claim(run.conns[0], "p", name, fields, 1000);
                let got: BTreeSet<u64> = l.rows.iter().copied().collect();
                prop_assert_eq!(got, want);
                if !l.rows.is_empty() {
                    prop_assert!(run.u.settle(run.conns[0], l.id, &[]).unwrap().is_empty());
                }
            }
        }
    }
}

/// Store in `u` every entry of `snap` again (one blob per partition, rows
/// ascending: not the order they first arrived in), then its claims state.
fn restore_into(u: &mut Unit, who: Owner, snap: &stowage_core::Snapshot) {
    let mut by_part: BTreeMap<&str, Vec<(u64, &str)>> = BTreeMap::new();
    for e in &snap.entries {
        by_part
            .entry(e.partition.as_str())
            .or_default()
            .push((e.key.row, e.key.field.as_str()));
    }
    for (p, mut keys) in by_part {
        keys.sort_unstable();
        u.put(who, p, &keys);
    }
    u.input(input::RestoreClaims(snap.claims.clone())).unwrap();
}

/// A snapshot keeps each partition's registration, rows' order and every
/// task's consumption; restored into a fresh core, a claim takes exactly
/// the rows not consumed before the snapshot, in their first order, and a
/// lease unsettled at the snapshot is claimable again.
#[test]
fn claims_survive_a_snapshot_and_restore() {
    let mut u = Unit::new();
    let c = u.conn();
    u.register(c, "p", &["train", "reward"], 100, 0).unwrap();
    u.register(c, "g", &["train"], 8, 2).unwrap();
    for row in [5, 3, 9, 1, 7] {
        u.put(c, "p", &[(row, "a")]);
    }
    let gr = |id: &str| format!("\0g:{id}");
    let (gx, gy) = (gr("x"), gr("y"));
    u.put(c, "g", &[(4, "a"), (4, &gy), (6, "a"), (6, &gy)]);
    u.put(c, "g", &[(0, "a"), (0, &gx), (2, "a"), (2, &gx)]);
    // train: 5 consumed, 3 leased when the snapshot is taken.
    let l = u.claim(c, "p", "train", &["a"], 2);
    assert_eq!(l.rows, vec![5, 3]);
    assert_eq!(u.settle(c, l.id, &[5]).unwrap(), vec![5]);
    let unsettled = u.claim(c, "p", "train", &["a"], 1);
    assert_eq!(unsettled.rows, vec![3]);
    // reward: 5 and 3 consumed.
    let l = u.claim(c, "p", "reward", &["a"], 2);
    assert_eq!(u.settle(c, l.id, &l.rows).unwrap(), vec![5, 3]);
    // g: group y consumed.
    let l = u.claim(c, "g", "train", &["a"], 2);
    assert_eq!(l.rows, vec![4, 6]);
    assert_eq!(u.settle(c, l.id, &[4, 6]).unwrap(), vec![4, 6]);
    // A waiting claim is not part of the snapshot.
    assert_eq!(
        u.claim_op(c, "g", "train", &["b"], 2, Some(u.now + LEASE), 9)
            .unwrap(),
        ClaimAnswer::Waiting
    );

    let snap = u.input(input::TakeSnapshot).unwrap();
    let names: Vec<&str> = snap.claims.iter().map(|p| p.partition.as_str()).collect();
    assert_eq!(names, ["g", "p"]);
    let p = &snap.claims[1];
    assert_eq!((p.samples, p.group_size), (100, 0));
    assert_eq!(p.order, vec![5, 3, 9, 1, 7]);
    let tasks: Vec<(&str, &[u64], u64)> = p
        .tasks
        .iter()
        .map(|t| (t.name.as_str(), &t.consumed[..], t.consumed_total))
        .collect();
    assert_eq!(
        tasks,
        [("train", &[5u64][..], 1), ("reward", &[3u64, 5][..], 2)],
        "the lease of row 3 is not consumed"
    );

    let mut v = Unit::new();
    let d = v.conn();
    restore_into(&mut v, d, &snap);
    let again = v.input(input::TakeSnapshot).unwrap();
    assert_eq!(again.claims, snap.claims, "the round trip is exact");
    let st = v.status(d, "p", "train");
    assert!(st.registered);
    assert_eq!((st.samples, st.consumed, st.leased), (100, 1, 0));
    assert_eq!(v.status(d, "p", "reward").consumed, 2);
    assert_eq!(v.status(d, "g", "train").group_size, 2);
    // Never a row consumed before; the unsettled lease's row first, in
    // the first order (not the order the restore stored them in).
    assert_eq!(v.claim(d, "p", "train", &["a"], 10).rows, vec![3, 9, 1, 7]);
    assert_eq!(v.claim(d, "p", "reward", &["a"], 10).rows, vec![9, 1, 7]);
    assert_eq!(v.claim(d, "g", "train", &["a"], 10).rows, vec![0, 2]);
    assert!(v.take_replies().is_empty(), "no waiting claim came back");

    // A bad state is refused whole.
    let mut bad = snap.claims.clone();
    let twice = bad[0].tasks[0].clone();
    bad[0].tasks.push(twice);
    let mut w = Unit::new();
    let e = w.conn();
    w.put(e, "p", &[(1, "a")]);
    invalid(w.input(input::RestoreClaims(bad)));
    assert!(!w.status(e, "p", "train").registered);
}
