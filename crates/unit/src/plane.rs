//! The unit's view of the plane (docs/replication.md#rejoining): which
//! unit instances make it up, numbered by epoch. Each connection speaks
//! for one epoch (`Request::Epoch`, 0 until it says); the unit serves its
//! row requests only while that is the unit's own, so that once a rejoin
//! moved the unit to a new view, no client still placing copies the old
//! way writes or reads rows here.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use stowage_wire::PlaneView;

/// The view, and its epoch to check requests against without a lock.
pub(crate) struct Plane {
    /// This unit's instance.
    me: u128,
    epoch: AtomicU64,
    /// The view's [`PlaneView::digest`].
    digest: AtomicU64,
    view: Mutex<PlaneView>,
    /// Whether the view names this instance (a view of the start names
    /// none: every unit serves). A unit started again in a member's place
    /// and handed the plane's view before it rejoined is not one: it
    /// serves no rows until a view takes it in.
    member: AtomicBool,
}

impl Plane {
    pub(crate) fn new(me: u128) -> Self {
        Plane {
            me,
            epoch: AtomicU64::new(0),
            digest: AtomicU64::new(PlaneView::default().digest()),
            view: Mutex::new(PlaneView::default()),
            member: AtomicBool::new(true),
        }
    }

    /// Whether row requests of a connection of view `(epoch, digest)`
    /// are served.
    pub(crate) fn serves(&self, (epoch, digest): (u64, u64)) -> bool {
        // The member flag is set before the epoch moves, and read after.
        self.epoch() == epoch
            && self.digest.load(Ordering::SeqCst) == digest
            && self.member.load(Ordering::SeqCst)
    }

    /// What a connection that never said Epoch speaks for.
    pub(crate) fn first() -> (u64, u64) {
        (0, PlaneView::default().digest())
    }

    /// The epoch of the unit's view.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// The unit's view.
    pub(crate) fn view(&self) -> PlaneView {
        self.view.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Take `view` when it is newer (a higher epoch) than the unit's;
    /// the unit's view after. An offer of the same epoch with other
    /// members keeps the unit's: the one who offered it sees the
    /// difference, and offers a view that has both, of a higher epoch.
    pub(crate) fn offer(&self, view: PlaneView) -> PlaneView {
        let mut mine = self.view.lock().unwrap_or_else(|p| p.into_inner());
        if view.epoch > mine.epoch {
            tracing::warn!(
                from = mine.epoch,
                to = view.epoch,
                "the plane's view changed (a unit rejoined): row requests of connections of the old view are refused from now on"
            );
            *mine = view;
            let member = mine.members.iter().any(|m| m.instance == Some(self.me));
            // A connection checks the epoch before the rest: moved last,
            // so no connection of the old epoch is served by the new
            // digest and member flag, nor one of the new by the old.
            self.epoch.store(u64::MAX, Ordering::SeqCst);
            self.member.store(member, Ordering::SeqCst);
            self.digest.store(mine.digest(), Ordering::SeqCst);
            self.epoch.store(mine.epoch, Ordering::SeqCst);
            if !member {
                tracing::warn!(
                    "the plane's view does not name this unit's instance: it serves no rows until a rejoin takes it in"
                );
            }
        }
        mine.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_wire::Member;

    fn view(epoch: u64, instance: u128) -> PlaneView {
        PlaneView {
            epoch,
            members: vec![Member {
                instance: Some(instance),
                since: epoch,
            }],
        }
    }

    #[test]
    fn only_a_newer_view_is_taken() {
        let p = Plane::new(7);
        assert_eq!(p.epoch(), 0);
        assert_eq!(p.offer(view(2, 7)), view(2, 7));
        assert_eq!(p.epoch(), 2);
        // Older, or the same epoch with other members: the unit's stays.
        assert_eq!(p.offer(view(1, 8)), view(2, 7));
        assert_eq!(p.offer(view(2, 8)), view(2, 7));
        assert_eq!(p.epoch(), 2);
        let at = |v: &PlaneView| (v.epoch, v.digest());
        assert!(p.serves(at(&view(2, 7))));
        assert!(!p.serves(at(&view(1, 7))) && !p.serves(at(&view(3, 7))));
        // The same epoch, another view: not served.
        assert!(!p.serves(at(&view(2, 8))));
        assert_eq!(p.offer(view(3, 8)), view(3, 8));
        assert_eq!(p.view(), view(3, 8));
        // A view that names another instance in this unit's place.
        assert!(!p.serves(at(&view(3, 8))), "not a member");
        assert_eq!(p.offer(view(4, 7)), view(4, 7));
        assert!(p.serves(at(&view(4, 7))));
    }

    #[test]
    fn a_unit_serves_every_connection_of_the_start_until_a_view_comes() {
        let p = Plane::new(1);
        assert!(p.serves(Plane::first()));
        assert!(!p.serves((1, PlaneView::default().digest())));
    }
}
