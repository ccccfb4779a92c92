//! Claims, as the handler plans them: each request goes to the core's
//! op of the same name; a claim with nothing ready waits in the core
//! (`Plan::Wait`), answered later through `Action::Claimed`.

use std::time::Duration;

use stowage_core::{op, ClaimAnswer, CoreError, Lease, LeaseId, Owner, Time, UnitCore};
use stowage_wire::{ClaimProgress, Request, Response};

use super::{error_response, request, scope, Plan};

/// The plan for a claims request (`req` is one of them).
pub(super) fn plan(
    core: &mut UnitCore,
    owner: Owner,
    namespace: &str,
    req: Request,
    now: Time,
) -> Plan {
    // The core names partitions scoped by the namespace; the client
    // knows them without it.
    let scoped = format!("{:?}", scope(namespace, ""));
    let scoped = scoped.trim_matches('"');
    let error = |e: CoreError| {
        let mut r = error_response(&e);
        if let Response::Error { message, .. } = &mut r {
            *message = message.replace(scoped, "");
        }
        Plan::Reply(r)
    };
    let answer = |r: Result<Response, CoreError>| match r {
        Ok(r) => Plan::Reply(r),
        Err(e) => error(e),
    };
    match req {
        Request::RegisterTasks {
            partition,
            tasks,
            samples,
            group_size,
        } => answer(
            request(
                core,
                now,
                owner,
                op::RegisterTasks {
                    partition: scope(namespace, &partition),
                    tasks,
                    samples,
                    group_size,
                },
            )
            .map(|()| Response::Done),
        ),
        Request::Claim {
            partition,
            task,
            fields,
            want,
            wait_ms,
            homes,
        } => {
            let wait_until = (wait_ms > 0).then(|| now + Duration::from_millis(wait_ms.into()));
            let op = op::Claim {
                partition: scope(namespace, &partition),
                task,
                fields,
                want,
                wait_until,
                tag: 0,
                homes,
            };
            match request(core, now, owner, op) {
                Ok(ClaimAnswer::Leased(lease)) => Plan::Reply(claimed(lease)),
                Ok(ClaimAnswer::Waiting) => Plan::Wait,
                Err(e) => error(e),
            }
        }
        Request::Settle { lease, keep } => answer(
            request(
                core,
                now,
                owner,
                op::Settle {
                    lease: LeaseId(lease),
                    keep,
                },
            )
            .map(|rows| Response::Settled { rows }),
        ),
        Request::ClaimStatus {
            partition,
            task,
            homes,
        } => answer(
            request(
                core,
                now,
                owner,
                op::ClaimStatus {
                    partition: scope(namespace, &partition),
                    task,
                    homes,
                },
            )
            .map(|s| {
                Response::ClaimStatus(ClaimProgress {
                    registered: s.registered,
                    samples: s.samples,
                    group_size: s.group_size,
                    consumed: s.consumed,
                    leased: s.leased,
                })
            }),
        ),
        Request::ClaimsState => {
            let prefix = scope(namespace, "");
            let mut parts = match core.handle(now, stowage_core::input::TakeClaims) {
                Ok(p) => p,
                Err(e) => return error(e),
            };
            parts.retain_mut(|p| match p.partition.strip_prefix(&prefix) {
                Some(name) => {
                    p.partition = name.to_owned();
                    true
                }
                None => false,
            });
            match crate::checkpoint::claims::encode(&parts) {
                Ok(state) => Plan::Reply(Response::ClaimsState { state }),
                Err(e) => error(CoreError::Invalid(format!("the claims state: {e}"))),
            }
        }
        Request::LoadClaims { state } => {
            let mut parts = match crate::checkpoint::claims::decode(&state) {
                Ok(p) => p,
                Err(e) => return error(CoreError::Invalid(e)),
            };
            for p in &mut parts {
                p.partition = scope(namespace, &p.partition);
            }
            answer(
                core.handle(now, stowage_core::input::RestoreClaims(parts))
                    .map(|()| Response::Done),
            )
        }
        other => Plan::Refuse(format!("not a claims request: {other:?}")),
    }
}

/// The wire's answer to a claim: its lease.
pub fn claimed(lease: Lease) -> Response {
    Response::Claimed {
        lease: lease.id.0,
        rows: lease.rows,
        homes: lease.homes,
    }
}
