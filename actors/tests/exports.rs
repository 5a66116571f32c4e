//! A peer that dies while holding exported memory: the real allocator actor keeps that
//! memory out of use until the peer's lease times out, and never frees it while the peer
//! could still be copying.

use std::time::{Duration, Instant};

use actix::prelude::*;
use ferry_actors::allocator::{
    Allocator, Export, ExportReleased, Fill, PeerGone, Stats, reserve_in_tiers,
    reserve_now_in_tiers,
};
use ferry_actors::core::exports::ExportId;
use ferry_transports::memory::MemoryKind;

const MIB: u64 = 1 << 20;

#[test]
fn dead_peers_exports_stay_quarantined_for_the_lease() {
    System::new().block_on(async {
        let lease = Duration::from_millis(300);
        let handle = Allocator::new(MemoryKind::PinnedHost, 8 * MIB, 16, lease).launch(16);
        let (domain, tier) = (handle.actor.clone(), handle.tier());
        let deadline = || Instant::now() + Duration::from_secs(5);
        let stats = async || domain.send(Stats).await.expect("stats");

        // Two buffers exported to two peers; their owners drop them at once.
        let mut bufs =
            reserve_in_tiers(std::slice::from_ref(&tier), &[4 * MIB, 2 * MIB], deadline())
                .await
                .expect("reserve");
        let b = bufs.pop().expect("two");
        let a = bufs.pop().expect("two");
        domain
            .send(Export {
                id: ExportId(1),
                peer: "dies".into(),
                view: a.share(),
            })
            .await
            .expect("export");
        domain
            .send(Export {
                id: ExportId(2),
                peer: "lives".into(),
                view: b.share(),
            })
            .await
            .expect("export");
        drop((a, b));
        let s = stats().await;
        assert_eq!(s.exports.exported, 6 * MIB);
        assert_eq!(s.budget.granted, 6 * MIB, "exported memory is not free");

        // One peer releases: its memory is free. The other dies: quarantined.
        domain
            .send(ExportReleased(ExportId(2)))
            .await
            .expect("release");
        let died = Instant::now();
        domain.send(PeerGone("dies".into())).await.expect("gone");
        let s = stats().await;
        assert_eq!(s.exports.quarantined, 4 * MIB);
        assert_eq!(s.budget.granted, 4 * MIB);
        // A late release from the dead peer does not shorten the quarantine.
        domain
            .send(ExportReleased(ExportId(1)))
            .await
            .expect("late release");

        // A reservation that needs the quarantined memory waits until the lease is out.
        let got = reserve_in_tiers(&[tier], &[8 * MIB], deadline())
            .await
            .expect("after the lease");
        let waited = died.elapsed();
        assert!(
            waited >= lease,
            "memory reused after {waited:?}, before the {lease:?} lease"
        );
        assert!(
            waited < lease + Duration::from_secs(1),
            "freed late: {waited:?}"
        );
        assert_eq!(got.len(), 1);
        let s = stats().await;
        assert_eq!(s.exports.quarantined, 0);
        assert_eq!(s.budget.granted, 8 * MIB);
    });
}

/// A reservation that fits is made on the caller's thread with no message; one that must
/// wait goes through the actor's queue, and nothing made at once jumps that queue.
#[test]
fn reservations_that_fit_are_made_at_once_and_never_jump_the_queue() {
    System::new().block_on(async {
        let handle =
            Allocator::new(MemoryKind::Host, 8 * MIB, 16, Duration::from_secs(1)).launch(16);
        let tier = handle.tier();
        let tiers = std::slice::from_ref(&tier);
        let now = |parts: &[u64]| reserve_now_in_tiers(tiers, parts, None, Fill::Zeroed);

        let first = now(&[6 * MIB]).expect("fits: made at once");
        assert_eq!(first.len(), 1);
        assert!(
            now(&[4 * MIB]).is_none(),
            "6 + 4 MiB do not fit an 8 MiB budget"
        );
        assert!(
            now(&[16 * MIB]).is_none(),
            "larger than the budget: not now"
        );

        // A waiting reservation (through the actor) for 4 MiB...
        let waiting = tokio::task::spawn_local({
            let tier = tier.clone();
            async move {
                reserve_in_tiers(&[tier], &[4 * MIB], Instant::now() + Duration::from_secs(5)).await
            }
        });
        while handle
            .actor
            .send(Stats)
            .await
            .expect("stats")
            .budget
            .waiting
            == 0
        {
            tokio::task::yield_now().await;
        }
        // ...keeps a later small one from being made at once, though it would fit.
        assert!(now(&[MIB]).is_none(), "a waiter is ahead of it");
        drop(first);
        let got = waiting
            .await
            .expect("joined")
            .expect("granted once 6 MiB came back");
        assert_eq!(got[0].len(), 4 * MIB as usize);
        // Bytes given back are seen by the next reservation made at once.
        drop(got);
        let again = now(&[8 * MIB]).expect("the whole budget is free again");
        assert_eq!(
            handle
                .actor
                .send(Stats)
                .await
                .expect("stats")
                .budget
                .granted,
            8 * MIB
        );
        drop(again);
    });
}
