//! A unit core driven as its driver would, for the claims tests: a
//! virtual clock, `poll_action` drained after every input, and the claims
//! state checked against itself after each.

#![allow(dead_code)]

use std::time::Duration;

use stowage_core::home::Homes;
use stowage_core::op::{Alloc, Claim, ClaimStatus, CommitWritten, RegisterTasks, Settle};
use stowage_core::{
    input, Action, BlobId, ClaimAnswer, ClaimReply, ClaimStatusAnswer, Committed, ConnEnd,
    CoreConfig, CoreError, EntrySpec, Input, Key, Lease, LeaseId, Owner, Request, Time, UnitCore,
};

pub const LEASE: Duration = Duration::from_secs(30);

pub struct Unit {
    pub core: UnitCore,
    pub now: Time,
    next_blob: u128,
    /// Answers of waiting claims, in the order the core gave them.
    replies: Vec<ClaimReply>,
}

impl Unit {
    pub fn new() -> Self {
        let mut cfg = CoreConfig::new(4 << 20);
        cfg.claim_lease = LEASE;
        Unit {
            core: UnitCore::new(cfg).unwrap(),
            now: Time::ZERO,
            next_blob: 1,
            replies: Vec::new(),
        }
    }

    pub fn input<I: Input>(&mut self, input: I) -> Result<I::Answer, CoreError> {
        let r = self.core.handle(self.now, input);
        while let Some(a) = self.core.poll_action() {
            if let Action::Claimed(reply) = a {
                self.replies.push(reply);
            }
        }
        if let Err(e) = self.core.check_claims() {
            panic!("claims state broken: {e}");
        }
        r
    }

    pub fn request<O: stowage_core::Op>(
        &mut self,
        owner: Owner,
        op: O,
    ) -> Result<O::Answer, CoreError> {
        self.input(Request { owner, op })
    }

    pub fn conn(&mut self) -> Owner {
        let s = self.input(input::OpenSession).unwrap();
        self.input(input::Attach {
            session: s,
            mapped: false,
        })
        .unwrap()
    }

    pub fn end(&mut self, owner: Owner) {
        self.input(input::ConnEnded {
            owner,
            end: ConnEnd::Closed,
        })
        .unwrap();
    }

    /// Store the given (row, field) values of `partition`, one blob.
    pub fn put(&mut self, who: Owner, partition: &str, keys: &[(u64, &str)]) {
        let blob = BlobId(self.next_blob);
        self.next_blob += 1;
        let entries: Vec<EntrySpec> = keys
            .iter()
            .enumerate()
            .map(|(i, (row, field))| EntrySpec {
                key: Key::new(*row, *field),
                offset: i as u64 * 8,
                len: 8,
                meta: Vec::new(),
            })
            .collect();
        self.request(
            who,
            Alloc {
                blob,
                nbytes: 8 * keys.len() as u64,
                n_entries: keys.len() as u32,
            },
        )
        .unwrap();
        let done = self
            .request(
                who,
                CommitWritten {
                    partition: partition.into(),
                    blob,
                    entries,
                },
            )
            .unwrap();
        assert_eq!(done, Committed::Done);
    }

    pub fn register(
        &mut self,
        who: Owner,
        partition: &str,
        tasks: &[&str],
        samples: u64,
        group_size: u32,
    ) -> Result<(), CoreError> {
        self.request(
            who,
            RegisterTasks {
                partition: partition.into(),
                tasks: tasks.iter().map(|t| t.to_string()).collect(),
                samples,
                group_size,
            },
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub fn claim_op(
        &mut self,
        who: Owner,
        partition: &str,
        task: &str,
        fields: &[&str],
        want: u32,
        wait_until: Option<Time>,
        tag: u64,
    ) -> Result<ClaimAnswer, CoreError> {
        self.claim_of(who, partition, task, fields, want, wait_until, tag, None)
    }

    /// [`Unit::claim_op`], of the rows of `homes` only (claims with
    /// copies).
    #[allow(clippy::too_many_arguments)]
    pub fn claim_of(
        &mut self,
        who: Owner,
        partition: &str,
        task: &str,
        fields: &[&str],
        want: u32,
        wait_until: Option<Time>,
        tag: u64,
        homes: Option<Homes>,
    ) -> Result<ClaimAnswer, CoreError> {
        self.request(
            who,
            Claim {
                partition: partition.into(),
                task: task.into(),
                fields: fields.iter().map(|f| f.to_string()).collect(),
                want,
                wait_until,
                tag,
                homes,
            },
        )
    }

    /// A claim that does not wait: its lease.
    pub fn claim(
        &mut self,
        who: Owner,
        partition: &str,
        task: &str,
        fields: &[&str],
        want: u32,
    ) -> Lease {
        match self.claim_op(who, partition, task, fields, want, None, 0) {
            Ok(ClaimAnswer::Leased(l)) => l,
            other => panic!("claim answered {other:?}"),
        }
    }

    /// A claim of partition "p" that waits until `wait_ms` from now.
    pub fn claim_waiting(
        &mut self,
        who: Owner,
        task: &str,
        fields: &[&str],
        want: u32,
        wait_ms: u64,
        tag: u64,
    ) -> ClaimAnswer {
        let until = self.now + Duration::from_millis(wait_ms);
        self.claim_op(who, "p", task, fields, want, Some(until), tag)
            .unwrap()
    }

    pub fn settle(
        &mut self,
        who: Owner,
        lease: LeaseId,
        keep: &[u64],
    ) -> Result<Vec<u64>, CoreError> {
        self.request(
            who,
            Settle {
                lease,
                keep: keep.to_vec(),
            },
        )
    }

    pub fn status(&mut self, who: Owner, partition: &str, task: &str) -> ClaimStatusAnswer {
        self.status_of(who, partition, task, None)
    }

    /// [`Unit::status`], counting the consumption of `homes` only.
    pub fn status_of(
        &mut self,
        who: Owner,
        partition: &str,
        task: &str,
        homes: Option<Homes>,
    ) -> ClaimStatusAnswer {
        self.request(
            who,
            ClaimStatus {
                partition: partition.into(),
                task: task.into(),
                homes,
            },
        )
        .unwrap()
    }

    pub fn advance(&mut self, by: Duration) {
        self.now += by;
        self.input(input::Timeout).unwrap();
    }

    pub fn take_replies(&mut self) -> Vec<ClaimReply> {
        std::mem::take(&mut self.replies)
    }
}
