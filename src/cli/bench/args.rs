//! `ferry bench`'s command line: its flags, and the sizes they name.

use std::path::PathBuf;

use ferry_config::TransportName;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Smallest size (suffixes K, M, G are powers of 1024).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_bytes)]
    pub(super) min: u64,
    /// Largest size.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = parse_bytes)]
    pub(super) max: u64,
    /// Multiply the size by this between steps.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..))]
    pub(super) factor: u64,
    /// Timed transfers per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) iters: u64,
    /// Untimed transfers per size, before the timed ones; at least one per buffer in
    /// flight, so the timed transfers find every buffer already mapped by the peer (the
    /// first transfer of a buffer pays for its mapping; `RUST_LOG=ferry_actors=debug` on the
    /// peer shows those).
    #[arg(short = 'w', long = "warmup", default_value_t = 5)]
    pub(super) warmup: u64,
    /// Transfers in flight at once (fewer for large sizes, to bound memory).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(super) window: u64,
    /// Transport to measure (default: the one whose bytes travel on the control link).
    #[arg(long, default_value_t = ferry_transports::registry::LINK, value_parser = transport_name())]
    pub(super) transport: TransportName,
    /// Who moves the bytes: push (the sender writes into memory the receiver lends) or
    /// pull (the receiver reads the sender's memory). Unset: the transport's own (tcp
    /// pushes, ipc pulls). A local bench only: both of its nodes get a rule saying so.
    #[arg(long, value_parser = ["push", "pull"])]
    pub(super) direction: Option<String>,
    /// Memory at both ends: host or device.
    #[arg(long, default_value = "host")]
    pub(super) memory: String,
    /// Buffer layout: `contiguous`, or `strided:ROW:PITCH` (each transfer sends its size in
    /// rows of ROW bytes, PITCH apart in a larger buffer: the rows arrive packed). With a
    /// GPU baseline, a raw 2D copy of the same rows is the baseline, and one copy per row is
    /// timed too. One direction only, with --no-check. Or `blocks:SIZE:COUNT`: COUNT blocks
    /// of SIZE bytes at random places of a pool 4 times their bytes, sent as one block list,
    /// next to the same bytes contiguous and to one transfer per block (one size: -b and -e
    /// are not used; one direction only).
    #[arg(long, default_value = "contiguous")]
    pub(super) layout: String,
    /// What is timed: sends (`send`, the default), or one-sided operations between
    /// registered regions, this node's and the peer's: `read` (the peer's region into
    /// ours) or `write` (ours into the peer's); contiguous (one row a size) or `--layout
    /// blocks:SIZE:COUNT` (scattered at both ends, next to the same bytes contiguous).
    #[arg(long, value_enum, default_value_t = super::onesided::Op::Send)]
    pub(super) op: super::onesided::Op,
    /// Single flight: for each size the peer publishes buffers of it (in --memory), and N
    /// fetches of one key run at once, each round one flight (the bytes cross once), next to
    /// N fetches of N keys (N flights, the baseline; skipped with --no-baseline) and one
    /// fetch alone; the single-flight gain is the baseline's time per round over the one
    /// flight's. N from 1 to 4096 and at most limits.peer_queue; contiguous, one direction
    /// (--window is not used).
    #[arg(long, value_name = "N")]
    pub(super) fetchers: Option<u64>,
    /// With --fetchers: fetches that join a flight take the one read-only handle on the
    /// landed buffer instead of a copy each.
    #[arg(long, requires = "fetchers")]
    pub(super) shared: bool,
    /// Both directions at once.
    #[arg(long)]
    pub(super) bidir: bool,
    /// Latency: each transfer is sent back by the peer as soon as it arrives, and the next
    /// one leaves when it is back; the latency columns are half of each round trip (the
    /// one-way time from `send` called to the peer's `recv` returning).
    #[arg(long, conflicts_with = "bidir")]
    pub(super) pingpong: bool,
    /// `all`: also print a matrix of every ordered pair at the largest size.
    #[arg(long)]
    pub(super) pairs: Option<String>,
    /// Skip verifying every transfer (on by default).
    #[arg(long)]
    pub(super) no_check: bool,
    /// Skip the baseline.
    #[arg(long)]
    pub(super) no_baseline: bool,
    /// The control link to the local peer.
    #[arg(long, value_enum, default_value_t)]
    pub(super) link: ControlLink,
    /// Join these running bench peers (started with `ferry bench --serve-peer CONFIG`)
    /// instead of starting one; the first is measured.
    #[arg(long, value_delimiter = ',')]
    pub(super) peers: Vec<String>,
    /// Write one JSON document: the header and every row, in any mode (sweep, block list,
    /// fetchers), one schema (docs/PERFORMANCE.md).
    #[arg(long, value_name = "FILE")]
    pub(super) json: Option<PathBuf>,
    /// Write one CSV line per row, in any mode, with the JSON rows' columns.
    #[arg(long, value_name = "FILE")]
    pub(super) csv: Option<PathBuf>,
    /// Plot bandwidth against size, ferry and baseline (.svg or .png; a size sweep only).
    #[arg(long, value_name = "FILE")]
    pub(super) plot: Option<PathBuf>,
    /// Measure nothing: read a document written by --json and write --plot/--csv from it.
    #[arg(long, value_name = "FILE")]
    pub(super) from_json: Option<PathBuf>,
    /// Run as the far end of a bench, with this node configuration.
    #[arg(long, value_name = "CONFIG", hide = true)]
    pub(super) serve_peer: Option<PathBuf>,
}

/// The control link between the bench and its local peer: the socket, not a transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ControlLink {
    /// TCP over loopback.
    #[default]
    Tcp,
    /// A Unix socket.
    Unix,
}

impl ControlLink {
    /// How the header names it.
    pub fn name(self) -> &'static str {
        match self {
            ControlLink::Tcp => "tcp",
            ControlLink::Unix => "unix",
        }
    }
}

/// `--transport`: one of the transports this build declares (an unknown name is refused
/// with the list).
fn transport_name() -> impl clap::builder::TypedValueParser<Value = TransportName> {
    use clap::builder::TypedValueParser;
    let names: Vec<&'static str> = ferry_transports::registry::declarations()
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    clap::builder::PossibleValuesParser::new(names).try_map(|name| name.parse::<TransportName>())
}

/// Parses 8, 64K, 1M, 1G (powers of 1024), or anything `ferry_config::parse_size` reads.
pub(super) fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => t.split_at(i),
        None => (t, ""),
    };
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" => Some(0),
        "K" => Some(10),
        "M" => Some(20),
        "G" => Some(30),
        _ => None,
    };
    match (digits.parse::<u64>(), shift) {
        (Ok(n), Some(shift)) => n
            .checked_shl(shift)
            .filter(|v| v >> shift == n)
            .ok_or_else(|| format!("{s}: too large")),
        _ => ferry_config::parse_size(t).map_err(|e| e.to_string()),
    }
}

/// The sizes of the sweep: min, min·f, min·f², … up to max.
pub(super) fn sizes(min: u64, max: u64, factor: u64) -> Vec<u64> {
    let mut out = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        out.push(s);
        match s.checked_mul(factor) {
            Some(next) => s = next,
            None => break,
        }
    }
    out
}
