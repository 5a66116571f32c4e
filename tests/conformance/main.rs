//! One conformance suite for every transport: the same checks run against every viable
//! transport of the catalog × every (source memory, destination memory, locality, direction)
//! it declares (`combos.rs`). A transport added to the registry
//! (`ferry_transports::registry::catalog`) runs them by being there.
//!
//! The checks (`checks/`): byte-exact sizes from 0 B to 64 MiB (64 MiB once per transport);
//! every layout, packed and received into a layout, refusals before anything moves; block
//! lists (scattered pages of a pool, received into places of the receiver's own, hostile
//! lists refused, and a proptest of lists: counts, sizes, orders); order
//! per peer under mixed sizes and backpressure; cancellation as the API defines it (a
//! dropped send still runs to its end, a dropped receive loses nothing); a deadline that
//! passes while the peer has no memory; a peer killed with transfers in flight (they end
//! within 2 s as `PeerLost`, memory comes back); spill to the next tier when the landing
//! tier is full, and promotion back; a corrupt frame from an authenticated peer (ends that
//! link and fails its transfer at once). Each check ends with this node's memory back
//! where it started.
//!
//! How a combination is made (`pair.rs`): both nodes route every transfer over the
//! transport and direction by one `[[transport.rules]]` rule (the far node falls back to
//! tcp for an echo the transport cannot read) and land received buffers in the destination
//! memory. Same-process: two nodes of this process; same-host: a `ferry serve` child over
//! Unix sockets; remote: a child over TCP configured as to another host (staged sends over
//! the link). Host-memory combinations run everywhere; those with GPU memory at either end
//! (both nodes on GPU 0) run under the GPU gate: skipped, saying so, without
//! `FERRY_GPU_TESTS=1`, failed when it is set and no GPU works. `FERRY_CONFORMANCE_ONLY=ucx`
//! (a comma-separated list) narrows every check to those transports.
//!
//! Every combination of a check runs even when one fails; the test then lists each failure.
//! A check that the library fails today is `#[ignore]`d with the reason (run them with
//! `--ignored`); removing the attribute is the test of the fix.

#[path = "../common/mod.rs"]
mod common;

mod checks;
mod combos;
mod pair;

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use combos::{Combo, Group, of_group};
use futures::FutureExt;

/// How long one combination of one check may take.
const CASE_LIMIT: Duration = Duration::from_secs(120);

/// Which combinations of a group a check takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every one.
    All,
    /// The first of each (transport, direction).
    PerTransportAndDirection,
}

/// Runs `body` against every combination of `group` in `scope`, each to its end, and fails
/// naming every combination that failed. `body` gets the combination and whether it is the
/// first of its transport in the group (the one that carries the large cases).
async fn run<F, Fut>(check: &str, group: Group, scope: Scope, body: F)
where
    F: Fn(Combo, bool) -> Fut,
    Fut: Future<Output = ()>,
{
    if group == Group::Device
        && ferry::testing::gpu_test(&format!("conformance::device::{check}")).is_none()
    {
        return;
    }
    let (_, passed_over) = combos::enumerate();
    for line in &passed_over {
        println!("{check}: transport {line}");
    }
    let mut cases = of_group(group);
    if scope == Scope::PerTransportAndDirection {
        let mut seen = Vec::new();
        cases.retain(|(c, _)| {
            let key = (c.transport(), c.direction);
            let first = !seen.contains(&key);
            seen.push(key);
            first
        });
    }
    assert!(
        !cases.is_empty(),
        "{check}: no viable transport declares a {group:?} combination here ({passed_over:?})"
    );
    let mut failures = Vec::new();
    let count = cases.len();
    for (combo, first) in cases {
        let started = Instant::now();
        let label = combo.to_string();
        let outcome = AssertUnwindSafe(tokio::time::timeout(CASE_LIMIT, body(combo, first)))
            .catch_unwind()
            .await;
        let took = started.elapsed();
        match outcome {
            Ok(Ok(())) => println!("{check}: ok   {label} ({took:.2?})"),
            Ok(Err(_)) => failures.push(format!("{label}: did not end within {CASE_LIMIT:?}")),
            Err(panic) => failures.push(format!("{label}: {}", panic_text(&panic))),
        }
    }
    assert!(
        failures.is_empty(),
        "{check}: {} of {count} combinations failed:\n  {}",
        failures.len(),
        failures.join("\n  ")
    );
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Declares each check as two tests: `host::NAME` (host-memory combinations) and
/// `device::NAME` (combinations with GPU memory, under the GPU gate).
macro_rules! conformance {
    ($($(#[$meta:meta])* $check:ident: $scope:expr;)*) => {
        mod host {
            use super::*;
            $(
                $(#[$meta])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    run(stringify!($check), Group::Host, $scope, checks::$check).await;
                }
            )*
        }
        mod device {
            use super::*;
            $(
                $(#[$meta])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    run(stringify!($check), Group::Device, $scope, checks::$check).await;
                }
            )*
        }
    };
}

conformance! {
    sizes_arrive_byte_exact: Scope::All;
    every_layout_arrives_packed: Scope::All;
    block_lists_arrive_packed: Scope::All;
    fetches_cross_once: Scope::All;
    regions_read_and_write_block_lists: Scope::All;
    one_sided_deadline_then_killed_peer: Scope::All;
    writes_add_up_past_the_inbound_share: Scope::PerTransportAndDirection;
    order_per_peer_holds_under_mixed_sizes: Scope::All;
    order_holds_under_backpressure: Scope::All;
    dropped_sends_still_arrive: Scope::All;
    dropped_receives_lose_nothing: Scope::All;
    deadline_then_killed_peer: Scope::All;
    full_tier_spills_and_promotes_back: Scope::All;
    corrupt_frame_ends_the_link_and_its_transfer: Scope::PerTransportAndDirection;
}
