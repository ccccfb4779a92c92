//! Claims with copies: a unit claims only the rows of the homes it is
//! asked to (it holds copies of other units' rows too), and takes a row
//! marked consumed by another copy's claimer as consumed. Driven through
//! `UnitCore::handle` with a virtual clock, the claims state checked
//! after every input (`common::Unit`).

use stowage_core::home::{consumed_field, home_unit, Homes};
use stowage_core::op::ClearRows;
use stowage_core::{input, ClaimAnswer, Lease, LeaseId, Owner};

mod common;
use common::Unit;

const UNITS: u32 = 4;

fn homes(of: &[u32]) -> Option<Homes> {
    Some(Homes {
        units: UNITS,
        of: of.to_vec(),
    })
}

/// A unit holding rows 0..8 of "p" (field "x"; row `r`'s home is
/// `r % 4`), "p" registered for "train" and "reward", and a connection.
fn holding_copies() -> (Unit, Owner) {
    let mut u = Unit::new();
    let c = u.conn();
    u.register(c, "p", &["train", "reward"], 8, 0).unwrap();
    let rows: Vec<(u64, &str)> = (0..8).map(|r| (r, "x")).collect();
    u.put(c, "p", &rows);
    (u, c)
}

fn claim(u: &mut Unit, c: Owner, task: &str, want: u32, of: &[u32]) -> Lease {
    match u.claim_of(c, "p", task, &["x"], want, None, 0, homes(of)) {
        Ok(ClaimAnswer::Leased(l)) => l,
        other => panic!("claim answered {other:?}"),
    }
}

fn mark(u: &mut Unit, c: Owner, rows: &[u64], home: u32, task: &str) {
    let field = consumed_field(home, task);
    let keys: Vec<(u64, &str)> = rows.iter().map(|&r| (r, field.as_str())).collect();
    u.put(c, "p", &keys);
}

#[test]
fn a_claim_of_some_homes_leases_only_their_rows_and_names_each_rows_home() {
    let (mut u, c) = holding_copies();
    let l = claim(&mut u, c, "train", 8, &[1]);
    assert_eq!((l.rows, l.homes), (vec![1, 5], vec![1, 1]));
    let l = claim(&mut u, c, "train", 8, &[3, 0]);
    assert_eq!((l.rows, l.homes), (vec![0, 3, 4, 7], vec![0, 3, 0, 3]));
    // Without homes every row is claimed, and no home is named.
    let l = claim(&mut u, c, "reward", 8, &[]);
    assert!(l.rows.is_empty(), "no home asked: {:?}", l.rows);
    let l = match u.claim_op(c, "p", "reward", &["x"], 8, None, 0) {
        Ok(ClaimAnswer::Leased(l)) => l,
        other => panic!("{other:?}"),
    };
    assert_eq!((l.rows.len(), l.homes.len()), (8, 0));
}

#[test]
fn a_row_marked_consumed_is_not_claimed_and_is_counted_for_its_home() {
    let (mut u, c) = holding_copies();
    // The claimer of home 1 consumed row 1 elsewhere.
    mark(&mut u, c, &[1], 1, "train");
    let l = claim(&mut u, c, "train", 8, &[1]);
    assert_eq!(l.rows, vec![5]);
    // Another task's mark is that task's.
    let l2 = claim(&mut u, c, "reward", 8, &[1]);
    assert_eq!(l2.rows, vec![1, 5]);
    let status = |u: &mut Unit, of: &[u32]| u.status_of(c, "p", "train", homes(of)).consumed;
    assert_eq!(status(&mut u, &[1]), 1);
    assert_eq!(status(&mut u, &[0, 2, 3]), 0);
    // Settled here: counted for the row's home, and in the plain count.
    assert_eq!(u.settle(c, l.id, &[5]).unwrap(), vec![5]);
    assert_eq!(status(&mut u, &[1]), 2);
    assert_eq!(u.status(c, "p", "train").consumed, 1);
    // The mark of a row consumed already counts nothing more.
    mark(&mut u, c, &[5], 1, "train");
    assert_eq!(status(&mut u, &[1]), 2);
    // A cleared row leaves; put again, it is claimable again.
    u.request(
        c,
        ClearRows {
            partition: "p".into(),
            rows: vec![1],
        },
    )
    .unwrap();
    u.put(c, "p", &[(1, "x")]);
    assert_eq!(claim(&mut u, c, "train", 8, &[1]).rows, vec![1]);
    assert_eq!(status(&mut u, &[1]), 2);
}

#[test]
fn a_mark_of_a_row_leased_here_keeps_it_from_the_lease() {
    // The claimer died after settling the row elsewhere; this copy, its
    // claimer now, leased it before the mark came: the settle keeps it no
    // more, and the row stays consumed.
    let (mut u, c) = holding_copies();
    let l = claim(&mut u, c, "train", 8, &[2]);
    assert_eq!(l.rows, vec![2, 6]);
    mark(&mut u, c, &[2], 2, "train");
    assert_eq!(u.settle(c, l.id, &[2, 6]).unwrap(), vec![6]);
    assert!(claim(&mut u, c, "train", 8, &[2]).rows.is_empty());
    assert_eq!(u.status_of(c, "p", "train", homes(&[2])).consumed, 2);
    // Given back instead: the marked row stays consumed.
    let c2 = u.conn();
    let l = claim(&mut u, c2, "reward", 8, &[2]);
    mark(&mut u, c, &[6], 2, "reward");
    u.end(c2);
    assert_eq!(l.rows, vec![2, 6]);
    assert_eq!(claim(&mut u, c, "reward", 8, &[2]).rows, vec![2]);
}

#[test]
fn a_mark_that_comes_before_its_row_is_kept_and_the_row_arrives_consumed() {
    // A copy may get a row's mark before the row (a repair that has not
    // brought it yet, a producer's slow put): the mark is kept, and the
    // row, once it arrives, is consumed.
    let (mut u, c) = holding_copies();
    mark(&mut u, c, &[9], 1, "train");
    assert_eq!(u.status(c, "p", "train").rows, 9, "the mark alone is a row");
    assert_eq!(u.status_of(c, "p", "train", homes(&[1])).consumed, 1);
    u.put(c, "p", &[(9, "x")]);
    assert_eq!(claim(&mut u, c, "train", 8, &[1]).rows, vec![1, 5]);
    // Another task claims it as any row.
    assert_eq!(claim(&mut u, c, "reward", 8, &[1]).rows, vec![1, 5, 9]);
    // A clear takes the row, mark and all.
    u.request(
        c,
        ClearRows {
            partition: "p".into(),
            rows: vec![9],
        },
    )
    .unwrap();
    assert_eq!(u.status(c, "p", "train").rows, 8);
}

#[test]
fn a_task_registered_after_its_marks_takes_the_marked_rows_as_consumed() {
    let mut u = Unit::new();
    let c = u.conn();
    let rows: Vec<(u64, &str)> = (0..4).map(|r| (r, "x")).collect();
    u.put(c, "p", &rows);
    mark(&mut u, c, &[0, 2], 0, "train");
    u.register(c, "p", &["train"], 4, 0).unwrap();
    let l = claim(&mut u, c, "train", 8, &[0, 1, 2, 3]);
    assert_eq!(l.rows, vec![1, 3]);
    assert_eq!(
        u.status_of(c, "p", "train", homes(&[0])).consumed,
        2,
        "counted for the home the marks name"
    );
}

#[test]
fn a_group_is_claimed_by_its_groups_home() {
    let mut u = Unit::new();
    let c = u.conn();
    u.register(c, "p", &["train"], 4, 2).unwrap();
    // Two groups of two rows; each group's home is its name's unit.
    let (ga, gb) = ("\0g:alpha", "\0g:beta");
    let ha = home_unit(0, [ga], UNITS as usize) as u32;
    let hb = home_unit(0, [gb], UNITS as usize) as u32;
    assert_ne!(ha, hb, "the test needs groups of two homes");
    u.put(c, "p", &[(0, "x"), (0, ga), (1, "x"), (1, ga)]);
    u.put(c, "p", &[(2, "x"), (2, gb), (3, "x"), (3, gb)]);
    let l = claim(&mut u, c, "train", 4, &[hb]);
    assert_eq!((l.rows, l.homes), (vec![2, 3], vec![hb, hb]));
    let l = claim(&mut u, c, "train", 4, &[ha]);
    assert_eq!((l.rows, l.homes), (vec![0, 1], vec![ha, ha]));
}

#[test]
fn a_restored_claims_state_keeps_its_counts_per_home() {
    let (mut u, c) = holding_copies();
    mark(&mut u, c, &[1], 1, "train");
    let l = claim(&mut u, c, "train", 8, &[3]);
    u.settle(c, l.id, &[3]).unwrap();
    let parts = u.input(input::TakeClaims).unwrap();
    assert_eq!(parts[0].tasks[0].by_home, vec![(1, 1), (3, 1)]);
    u.input(input::RestoreClaims(parts)).unwrap();
    assert_eq!(u.status_of(c, "p", "train", homes(&[1, 3])).consumed, 2);
    let l = claim(&mut u, c, "train", 8, &[1, 3]);
    assert_eq!(l.rows, vec![5, 7]);
    assert_ne!(l.id, LeaseId(0));
}
