//! Memory of dropped buffers a domain keeps (the shelf) is a cache with a clock: the real
//! allocator actor gives it back once unused for `keep_idle`, and a steady load keeps
//! reusing it however long it runs.

use std::time::{Duration, Instant};

use actix::prelude::*;
use ferry_actors::allocator::{Allocator, Fill, Keeping, Stats, reserve_now_in_tiers};
use ferry_transports::memory::MemoryKind;

const MIB: u64 = 1 << 20;

/// Polls `check` every 10 ms until it holds, for `limit` at most.
async fn eventually(limit: Duration, mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    check().await
}

#[test]
fn kept_memory_goes_back_after_the_idle_time_and_a_steady_load_reuses_it() {
    System::new().block_on(async {
        let idle = Duration::from_millis(200);
        let handle = Allocator::new(MemoryKind::Host, 64 * MIB, 16, Duration::from_secs(1))
            .keeping(Keeping {
                idle,
                max: 512 * MIB,
            })
            .launch(16);
        let tier = handle.tier();
        let grant = |len: u64| {
            reserve_now_in_tiers(std::slice::from_ref(&tier), &[len], None, Fill::Overwritten)
                .expect("fits now")
        };
        let stats = async || handle.actor.send(Stats).await.expect("stats");

        // Three buffers dropped: kept, then given back once unused for the idle time.
        let dropped = Instant::now();
        drop((grant(2 * MIB), grant(2 * MIB), grant(2 * MIB)));
        let kept = stats().await.kept.bytes;
        let early = dropped.elapsed() < idle;
        assert_eq!(kept, 6 * MIB, "kept at first");
        assert!(early, "the check came too late to mean anything");
        assert!(
            eventually(Duration::from_secs(5), async || stats().await.kept.bytes
                == 0)
            .await,
            "kept memory never went back: {:?}",
            stats().await
        );
        assert!(dropped.elapsed() >= idle, "given back before the idle time");

        // A steady load for five idle times: each grant takes the memory the one before
        // it left (a grant every 20 ms, never 200 ms apart).
        let before = stats().await.kept.reused;
        let started = Instant::now();
        let mut grants = 0;
        while started.elapsed() < 5 * idle {
            drop(grant(MIB));
            grants += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let s = stats().await;
        assert!(grants >= 10, "{grants} grants");
        assert_eq!(
            s.kept.reused - before,
            grants - 1,
            "every grant after the first reused kept memory: {s:?}"
        );
        assert_eq!(s.kept.bytes, MIB);
        assert!(
            eventually(Duration::from_secs(5), async || stats().await.kept.bytes
                == 0)
            .await,
            "kept memory never went back after the load"
        );
    });
}
