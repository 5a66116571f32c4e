//! What `ferry bench` prints and writes: a table, JSON, CSV and a plot.

use std::io::IsTerminal;
use std::path::Path;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

/// What was measured, and how.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct Header {
    /// The bench's mode: `sweep` (one row a size), `blocks` (`--layout blocks:...`, three
    /// rows of one size) or `fetchers` (`--fetchers N`, three rows a size); documents
    /// written before it existed held sweeps.
    #[serde(default = "default_mode")]
    pub mode: String,
    /// `--layout` as given.
    #[serde(default = "default_layout")]
    pub layout: String,
    /// `--pingpong`: the latency columns are one-way times, one transfer at a time.
    #[serde(default)]
    pub pingpong: bool,
    pub transport: String,
    pub memory: String,
    pub link: String,
    pub bidir: bool,
    pub iters: u64,
    pub warmup: u64,
    pub route: String,
    pub baseline: String,
    /// What the latency columns measure (documents written before it existed: the old
    /// wording, send() to completion).
    #[serde(default = "default_latency")]
    pub latency: String,
}

fn default_latency() -> String {
    "send() to completion".into()
}

fn default_mode() -> String {
    "sweep".into()
}

fn default_layout() -> String {
    "contiguous".into()
}

fn default_series() -> String {
    default_layout()
}

/// One row, in every mode (docs/PERFORMANCE.md says what each column holds in each).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Record {
    /// The series the row belongs to: a sweep's layout (`contiguous`, `strided:ROW:PITCH`);
    /// `blocks`, `contiguous` or `per-block` for a block list; `one-flight`, `flights` or
    /// `single` for fetchers (documents written before it existed: `contiguous`).
    #[serde(default = "default_series")]
    pub series: String,
    /// Bytes per transfer (per fetched buffer).
    pub bytes: u64,
    /// Timed transfers.
    pub iterations: u64,
    /// Transfers in flight at once.
    pub window: u64,
    /// ferry's bandwidth, GB/s (10^9 B/s).
    pub ferry_gbps: f64,
    /// The baseline's, GB/s.
    pub baseline_gbps: Option<f64>,
    /// ferry / baseline.
    pub ratio: Option<f64>,
    /// Time from send to completion, microseconds.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Transfers that arrived wrong or not at all.
    pub wrong: u64,
    /// Whether transfers were verified.
    pub checked: bool,
}

/// The header's lines and the sweep table's column names.
pub fn print_header(h: &Header) {
    print_preamble(h);
    println!(
        "{:>12} {:>7} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10} {:>7}",
        "bytes",
        "window",
        "ferry GB/s",
        "base GB/s",
        "ratio",
        "p50 us",
        "p99 us",
        "p999 us",
        "#wrong"
    );
}

/// The header's lines: what is measured, the route, the baseline, the latency.
pub fn print_preamble(h: &Header) {
    println!(
        "# ferry bench: transport {}, {} memory, link over {}{}",
        h.transport,
        h.memory,
        h.link,
        if h.bidir {
            ", both directions at once"
        } else {
            ""
        }
    );
    println!("# route: {}", h.route);
    println!("# baseline: {}", h.baseline);
    println!(
        "# {} timed transfers per size after {} warm-up (at least the row's window); GB/s = 10^9 bytes/s",
        h.iters, h.warmup
    );
    println!("# latency (p50/p99/p999 us): {}", h.latency);
}

pub fn print_row(r: &Record) {
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    println!(
        "{:>12} {:>7} {:>10.3} {:>10} {:>7} {:>10.1} {:>10.1} {:>10.1} {:>7}",
        r.bytes,
        r.window,
        r.ferry_gbps,
        opt(r.baseline_gbps, 3),
        opt(r.ratio, 2),
        r.p50_us,
        r.p99_us,
        r.p999_us,
        if r.checked {
            r.wrong.to_string()
        } else {
            "-".into()
        },
    );
}

/// Every record of a document, as a table: the sweep's (one row a size) for a sweep, with
/// the series in front for the other modes.
pub fn print_records(header: &Header, records: &[Record]) {
    if header.mode == "sweep" {
        print_header(header);
        records.iter().for_each(print_row);
        return;
    }
    print_preamble(header);
    println!(
        "{:>12} {:>12} {:>7} {:>10} {:>10} {:>7} {:>10} {:>10} {:>10} {:>7}",
        "series",
        "bytes",
        "window",
        "ferry GB/s",
        "base GB/s",
        "ratio",
        "p50 us",
        "p99 us",
        "p999 us",
        "#wrong"
    );
    for r in records {
        print!("{:>12} ", r.series);
        print_row(r);
    }
}

/// A progress bar on stderr when stdout is a terminal; hidden otherwise.
pub fn progress(len: u64) -> ProgressBar {
    if !std::io::stdout().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} sizes, now {msg}") {
        bar.set_style(style);
    }
    bar
}

/// An nvbandwidth-style matrix: GB/s from each row's node to each column's.
pub fn print_matrix(names: &[String], cells: &[Vec<Option<f64>>], size: u64) {
    println!("\n# GB/s from row to column at {} bytes", size);
    print!("{:>14}", "");
    for n in names {
        print!(" {n:>14}");
    }
    println!();
    for (n, row) in names.iter().zip(cells) {
        print!("{n:>14}");
        for c in row {
            match c {
                Some(v) => print!(" {v:>14.3}"),
                None => print!(" {:>14}", "-"),
            }
        }
        println!();
    }
}

#[derive(Serialize)]
struct Document<'a> {
    tool: &'static str,
    version: &'static str,
    date: String,
    host: String,
    header: &'a Header,
    records: &'a [Record],
}

pub fn write_json(path: &Path, header: &Header, records: &[Record]) -> anyhow::Result<()> {
    let doc = Document {
        tool: "ferry bench",
        version: env!("CARGO_PKG_VERSION"),
        date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        host: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        header,
        records,
    };
    let text = serde_json::to_string_pretty(&doc)?;
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// The CSV's columns, in order: [`Record`]'s fields.
pub const CSV_COLUMNS: &str = "series,bytes,iterations,window,ferry_gbps,baseline_gbps,ratio,\
                               p50_us,p99_us,p999_us,wrong,checked";

pub fn write_csv(path: &Path, records: &[Record]) -> anyhow::Result<()> {
    let mut out = format!("{CSV_COLUMNS}\n");
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.6}"));
    for r in records {
        // Series names are the bench's own (no comma, no quote): nothing to escape.
        out.push_str(&format!(
            "{},{},{},{},{:.6},{},{},{},{},{},{},{}\n",
            r.series,
            r.bytes,
            r.iterations,
            r.window,
            r.ferry_gbps,
            opt(r.baseline_gbps),
            opt(r.ratio),
            r.p50_us,
            r.p99_us,
            r.p999_us,
            r.wrong,
            r.checked
        ));
    }
    std::fs::write(path, out).with_context(|| format!("cannot write {}", path.display()))
}

/// Fonts tried first for the plot's text (plotters lays text out with it); after them, any
/// TrueType font under the usual font directories.
const FONTS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];
const FONT_DIRS: [&str; 2] = ["/usr/share/fonts", "/usr/local/share/fonts"];

fn find_font() -> Option<Vec<u8>> {
    if let Some(font) = FONTS.iter().find_map(|f| std::fs::read(f).ok()) {
        return Some(font);
    }
    let mut dirs: Vec<std::path::PathBuf> = FONT_DIRS.iter().map(Into::into).collect();
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("ttf"))
            {
                if let Ok(font) = std::fs::read(&path) {
                    return Some(font);
                }
            }
        }
    }
    None
}

/// Reads a document written by `--json`, to plot it again elsewhere.
pub fn read_json(path: &Path) -> anyhow::Result<(Header, Vec<Record>)> {
    #[derive(serde::Deserialize)]
    struct Doc {
        header: Header,
        records: Vec<Record>,
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let doc: Doc = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a ferry bench document", path.display()))?;
    Ok((doc.header, doc.records))
}

/// Bandwidth against size, ferry and the baseline on one chart, as SVG or PNG (by the
/// file's extension).
pub fn plot(path: &Path, header: &Header, records: &[Record]) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let svg = match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => true,
        Some("png") => false,
        _ => bail!(
            "--plot {}: the file must end in .svg or .png",
            path.display()
        ),
    };
    if header.mode != "sweep" {
        bail!(
            "--plot draws a size sweep, one row a size; this document holds {} rows: write \
             --json or --csv",
            header.mode
        );
    }
    let font = find_font().with_context(|| {
        "a plot needs a TrueType font for its text and none is installed (looked under \
         /usr/share/fonts); install fonts-dejavu-core, or write --json here and plot it \
         elsewhere with `ferry bench --from-json FILE --plot PLOT`"
            .to_string()
    })?;
    // plotters keeps a reference to the font for the rest of the process.
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::anyhow!("the font is not a usable TrueType font"))?;
    if svg {
        draw(
            SVGBackend::new(path, (900, 540)).into_drawing_area(),
            header,
            records,
        )
    } else {
        draw(
            BitMapBackend::new(path, (900, 540)).into_drawing_area(),
            header,
            records,
        )
    }
}

fn draw<B: plotters::prelude::DrawingBackend>(
    root: plotters::prelude::DrawingArea<B, plotters::coord::Shift>,
    header: &Header,
    records: &[Record],
) -> anyhow::Result<()>
where
    B::ErrorType: 'static,
{
    use plotters::prelude::*;
    if records.is_empty() {
        bail!("nothing to plot");
    }
    let lo = records.iter().map(|r| r.bytes).min().unwrap_or(1).max(1) as f64;
    let hi = records.iter().map(|r| r.bytes).max().unwrap_or(1).max(2) as f64;
    let top = records
        .iter()
        .flat_map(|r| [Some(r.ferry_gbps), r.baseline_gbps])
        .flatten()
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    root.fill(&WHITE)?;
    let title = format!(
        "ferry bench: {} transport, {} memory",
        header.transport, header.memory
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("bytes per transfer")
        .y_desc("GB/s (10^9 B/s)")
        .x_label_formatter(&|v| ferry_config::format_size(*v as u64))
        .draw()?;
    let ferry: Vec<(f64, f64)> = records
        .iter()
        .map(|r| (r.bytes as f64, r.ferry_gbps))
        .collect();
    chart
        .draw_series(LineSeries::new(ferry.clone(), BLUE.stroke_width(2)))?
        .label("ferry")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    chart.draw_series(ferry.iter().map(|p| Circle::new(*p, 3, BLUE.filled())))?;
    let base: Vec<(f64, f64)> = records
        .iter()
        .filter_map(|r| r.baseline_gbps.map(|b| (r.bytes as f64, b)))
        .collect();
    if !base.is_empty() {
        chart
            .draw_series(LineSeries::new(base, RED.stroke_width(2)))?
            .label(header.baseline.as_str())
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    Ok(())
}
