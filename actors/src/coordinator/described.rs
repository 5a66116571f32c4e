//! The metrics a node records: their kinds, units and help texts, and the counters
//! registered at 0 so that dashboards see a series from the start.

#[derive(Clone, Copy)]
enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric ferry records: kind, name, unit and help text.
const METRICS: &[(MetricKind, &str, Option<metrics::Unit>, &str)] = &[
    (
        MetricKind::Counter,
        "ferry_transfer_bytes_total",
        Some(metrics::Unit::Bytes),
        "Bytes of completed outbound transfers and puts, by transport, direction (push, pull, put) and peer_class (same_host, remote)",
    ),
    (
        MetricKind::Counter,
        "ferry_transfers_total",
        None,
        "Outbound transfers and puts that ended, by status (completed, failed, cancelled)",
    ),
    (
        MetricKind::Histogram,
        "ferry_transfer_duration_seconds",
        Some(metrics::Unit::Seconds),
        "Time from submission to completion of completed outbound transfers and puts",
    ),
    (
        MetricKind::Counter,
        "ferry_failover_total",
        None,
        "Transfers routed past a transport whose connection setup failed, onto the next one, by transport (from, to)",
    ),
    (
        MetricKind::Counter,
        "ferry_pull_failures_total",
        None,
        "Pulls that failed after memory was reserved (an import, a copy or a read refused)",
    ),
    (
        MetricKind::Counter,
        "ferry_push_failures_total",
        None,
        "Pushes whose write into the peer's lent buffer failed (an import, a copy or a put refused)",
    ),
    (
        MetricKind::Counter,
        "ferry_device_alloc_failures_total",
        None,
        "Device allocations the budget allowed but the GPU refused (another process filled it)",
    ),
    (
        MetricKind::Counter,
        "ferry_spill_bytes_total",
        Some(metrics::Unit::Bytes),
        "Bytes received into a lower memory tier because the wanted domain was full",
    ),
    (
        MetricKind::Counter,
        "ferry_frames_rejected_total",
        None,
        "Frames refused from peers, by reason (crc, too_long, bad_magic, protocol, ...)",
    ),
    (
        MetricKind::Counter,
        "ferry_auth_failures_total",
        None,
        "Connections refused at the handshake (wrong secret, bad preamble, version, timeout)",
    ),
    (
        MetricKind::Gauge,
        "ferry_peers_connected",
        None,
        "Peers with a live link",
    ),
    (
        MetricKind::Counter,
        "ferry_dial_failures_total",
        None,
        "Dials of a peer that failed (nothing answered, the handshake failed, or another node answered)",
    ),
    (
        MetricKind::Counter,
        "ferry_links_refused_total",
        None,
        "Links this node accepted and refused: reason wrong_node, a dial meant for another node",
    ),
    (
        MetricKind::Gauge,
        "ferry_discovery_addresses",
        None,
        "Addresses the names of discovery.dns resolve to now (after discovery.max_peers)",
    ),
    (
        MetricKind::Counter,
        "ferry_discovery_lookups_total",
        None,
        "DNS lookups of discovery.dns names, by outcome (ok, failed)",
    ),
    (
        MetricKind::Gauge,
        "ferry_memory_budget_bytes",
        Some(metrics::Unit::Bytes),
        "Budget of a memory domain",
    ),
    (
        MetricKind::Gauge,
        "ferry_memory_granted_bytes",
        Some(metrics::Unit::Bytes),
        "Bytes of a memory domain granted to buffers now",
    ),
    (
        MetricKind::Gauge,
        "ferry_memory_free_bytes",
        Some(metrics::Unit::Bytes),
        "Bytes of a memory domain's budget not granted now",
    ),
    (
        MetricKind::Gauge,
        "ferry_reservations_waiting",
        None,
        "Reservations waiting for a memory domain's budget",
    ),
    (
        MetricKind::Gauge,
        "ferry_memory_exported_bytes",
        Some(metrics::Unit::Bytes),
        "Bytes of a memory domain held by live peers",
    ),
    (
        MetricKind::Gauge,
        "ferry_memory_quarantined_bytes",
        Some(metrics::Unit::Bytes),
        "Bytes of a memory domain held by dead peers until their lease times out",
    ),
    (
        MetricKind::Gauge,
        "ferry_memory_kept_bytes",
        Some(metrics::Unit::Bytes),
        "Bytes of dropped buffers a memory domain keeps for later grants (memory.keep_idle, keep_max)",
    ),
    (
        MetricKind::Counter,
        "ferry_promoted_bytes_total",
        Some(metrics::Unit::Bytes),
        "Bytes moved back to a faster memory tier",
    ),
    (
        MetricKind::Counter,
        "ferry_fetches_total",
        None,
        "Fetches by key asked for by this node's callers",
    ),
    (
        MetricKind::Counter,
        "ferry_fetches_joined_total",
        None,
        "Fetches that joined one already on its way (single flight: no second transfer)",
    ),
    (
        MetricKind::Counter,
        "ferry_fetch_bytes_saved_total",
        Some(metrics::Unit::Bytes),
        "Bytes joined fetches got without crossing the link again",
    ),
    (
        MetricKind::Counter,
        "ferry_fetches_served_total",
        None,
        "Peers' fetches of this node's published buffers answered with the bytes",
    ),
    (
        MetricKind::Counter,
        "ferry_fetch_refusals_total",
        None,
        "Peers' fetches refused, by reason (unknown_key, not_allowed, layout, busy, failed)",
    ),
    (
        MetricKind::Gauge,
        "ferry_published_bytes",
        Some(metrics::Unit::Bytes),
        "Bytes this node publishes for its peers to fetch",
    ),
];

/// Gives every metric ferry records its help text and unit, and registers at 0 the
/// counters that may not move for a long time (or at all yet), so dashboards and alerts see
/// a series from the start. A binary that installs a metrics exporter calls it once, after
/// installing it; without an exporter it does nothing.
///
/// Labels never name a transfer or an address, so the number of series stays small.
pub fn describe_metrics() {
    for &(kind, name, unit, help) in METRICS {
        match (kind, unit) {
            (MetricKind::Counter, Some(u)) => metrics::describe_counter!(name, u, help),
            (MetricKind::Counter, None) => metrics::describe_counter!(name, help),
            (MetricKind::Gauge, Some(u)) => metrics::describe_gauge!(name, u, help),
            (MetricKind::Gauge, None) => metrics::describe_gauge!(name, help),
            (MetricKind::Histogram, Some(u)) => metrics::describe_histogram!(name, u, help),
            (MetricKind::Histogram, None) => metrics::describe_histogram!(name, help),
        }
    }
    for status in ["completed", "failed", "cancelled"] {
        metrics::counter!("ferry_transfers_total", "status" => status).absolute(0);
    }
    metrics::counter!("ferry_pull_failures_total").absolute(0);
    metrics::counter!("ferry_push_failures_total").absolute(0);
    metrics::counter!("ferry_device_alloc_failures_total").absolute(0);
    metrics::counter!("ferry_spill_bytes_total").absolute(0);
    metrics::counter!("ferry_promoted_bytes_total").absolute(0);
    for kind in ferry_transports::registry::kinds() {
        kind.describe_metrics();
    }
    // The failovers the built-in rules can make: past a transport with a setup of its own,
    // to the one after it.
    for rule in ferry_config::TransportConfig::default().rules {
        for pair in rule.transports.windows(2) {
            if ferry_transports::registry::declared(pair[0]).per_peer_setup {
                let (from, to) = (pair[0].as_str(), pair[1].as_str());
                metrics::counter!("ferry_failover_total", "from" => from, "to" => to).absolute(0);
            }
        }
    }
    for name in [
        "ferry_fetches_total",
        "ferry_fetches_joined_total",
        "ferry_fetch_bytes_saved_total",
        "ferry_fetches_served_total",
    ] {
        metrics::counter!(name).absolute(0);
    }
    metrics::gauge!("ferry_published_bytes").set(0.0);
    metrics::counter!("ferry_auth_failures_total").absolute(0);
    metrics::counter!("ferry_dial_failures_total").absolute(0);
    metrics::counter!("ferry_links_refused_total", "reason" => "wrong_node").absolute(0);
    metrics::gauge!("ferry_peers_connected").set(0.0);
    let reasons = ferry_transports::wire::FrameError::REASONS;
    for reason in reasons.into_iter().chain(["protocol"]) {
        metrics::counter!("ferry_frames_rejected_total", "reason" => reason).absolute(0);
    }
}
