//! The modes of `ferry bench`, one arm each: what one transfer moves at most, the header's
//! baseline and latency, and the rows measured. Every mode measures [`Record`]s, so
//! `--json` and `--csv` write one schema whatever the mode.

use ferry::Node;

use super::args::sizes;
use super::report::{self, Header, Record};
use super::{Args, Target, blocks, fetch, onesided, sweep};

/// What a bench measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One row a size of `-b`..`-e`, contiguous or `--layout strided:...`; one way,
    /// `--bidir` or `--pingpong`.
    Sweep,
    /// `--layout blocks:SIZE:COUNT`: three rows of one size.
    Blocks(blocks::Spec),
    /// `--fetchers N`: three rows a size.
    Fetchers(u64),
    /// `--op read|write`: one row a size, or two of a block list.
    OneSided(Option<blocks::Spec>),
}

impl Mode {
    /// The mode `args` ask for. Fails on a `--layout blocks:...` that does not read.
    pub fn of(args: &Args) -> anyhow::Result<Self> {
        if args.op != onesided::Op::Send {
            return Ok(Mode::OneSided(blocks::parse(&args.layout)?));
        }
        Ok(match (args.fetchers, blocks::parse(&args.layout)?) {
            (Some(n), _) => Mode::Fetchers(n),
            (None, Some(spec)) => Mode::Blocks(spec),
            (None, None) => Mode::Sweep,
        })
    }

    /// Its name in the header (`mode`).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Sweep => "sweep",
            Mode::Blocks(_) => "blocks",
            Mode::Fetchers(_) => "fetchers",
            Mode::OneSided(_) => "one-sided",
        }
    }

    /// The most one transfer moves: the largest size, or a block list's bytes.
    pub fn largest(self, args: &Args) -> u64 {
        match self {
            Mode::Blocks(spec) | Mode::OneSided(Some(spec)) => spec.packed(),
            Mode::Sweep | Mode::Fetchers(_) | Mode::OneSided(None) => args.max,
        }
    }

    /// The header's baseline.
    pub fn baseline_label(self, args: &Args, target: &Target) -> String {
        match self {
            Mode::Sweep => sweep::baseline_label(args, target),
            Mode::Blocks(_) => blocks::baseline_label(),
            Mode::Fetchers(_) => fetch::baseline_label(args),
            Mode::OneSided(spec) => onesided::baseline_label(args, target, spec),
        }
    }

    /// The header's latency.
    pub fn latency_label(self, args: &Args) -> String {
        match self {
            Mode::Sweep | Mode::Blocks(_) => {
                sweep::latency_label(args.transport, args.direction.as_deref(), args.pingpong)
            }
            Mode::Fetchers(n) => fetch::latency_label(n),
            Mode::OneSided(_) => format!(
                "time from the {} call to its end (the bytes in place at its destination)",
                args.op.name()
            ),
        }
    }

    /// Prints the header: with the sweep's column names, or without for a mode that prints
    /// a table of its own.
    pub fn print_header(self, header: &Header) {
        match self {
            Mode::Sweep => report::print_header(header),
            Mode::Blocks(_) | Mode::Fetchers(_) | Mode::OneSided(_) => {
                report::print_preamble(header)
            }
        }
    }

    /// Measures the mode's rows, printing them as they come.
    pub async fn run(
        self,
        node: &Node,
        target: &Target,
        args: &Args,
    ) -> anyhow::Result<Vec<Record>> {
        let list = sizes(args.min, args.max, args.factor);
        match self {
            Mode::Sweep => sweep::run(node, target, args, &list).await,
            Mode::Blocks(spec) => blocks::run(node, target, args, spec).await,
            Mode::Fetchers(n) => fetch::run(node, target, args, n, &list).await,
            Mode::OneSided(spec) => onesided::run(node, target, args, spec, &list).await,
        }
    }
}
