//! The layout rule of the transport seam, checked on the sources: no code names a transport
//! but that transport's own files, the registry and the name enums. Everything else reads
//! the transport's declaration (`transports::registry`) or asks it through its
//! `TransportKind`.
//!
//! **What names a transport.** Its name, case-insensitively, as a whole part of an
//! identifier (`ucx_lanes`, `UcxReport`, `StagedState`, `ipc`, `TransportName::Tcp`) or as a
//! word of a string literal (`"tcp"`, `"transport.ucx.enabled"`, `"cuda_ipc"`). Identifiers
//! split at `_` and at case changes; strings at anything not a letter or digit. Comments
//! (doc comments included) do not count, nor a test module written inline (from
//! `#[cfg(test)]` and `mod ... {` to the end of its file) or in a file of its own
//! (`tests.rs`, beside the file it tests).
//!
//! **Where a name may be:**
//! - a transport's own files: a path component or a file stem named after it, or after one
//!   of its parts (`transports/src/ucx/`, `config/src/transport/ucx.rs`,
//!   `src/cli/bench/ucx_raw.rs`);
//! - the lists of transports ([`LISTS`]): the registry, the name enums (`TransportName` in
//!   `config/src/rule.rs`, which also holds the built-in rules, and `WireTransport` in the
//!   wire's messages), the configuration's list of transport sections;
//! - the plumbing that reaches a transport's own file: `mod ucx;` declaring it, and a path
//!   through a part of a transport that sits beside the file (`ucx_raw::Reader` in
//!   `bench/mod.rs`, beside `bench/ucx_raw.rs`);
//! - where the word means something else ([`FOREIGN`], [`FOREIGN_IDENTS`]): TCP the socket
//!   protocol of the control link and of addresses, CUDA's IPC, UCX's own transports. The
//!   typed names (`TransportName::Tcp`, `WireTransport::Tcp`) are the transport's even
//!   there.
//!
//! What is still to move is listed in [`PENDING`], each with why; an entry that finds
//! nothing any more fails the test, so the list only shrinks. `actors/src`, which the
//! seam's restructuring is moving, is reported by its own ignored test
//! (`cargo test --test transport_names -- --ignored` counts it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferry::TransportName;

/// A place where transports may be named, and why.
struct Place {
    /// A file, or a directory (ending in `/`), relative to the workspace root.
    path: &'static str,
    /// Only within the top-level items (their whole span) whose first line contains this,
    /// when set; else the whole file.
    item: Option<&'static str>,
    /// The transport names it covers; empty: every one.
    names: &'static [&'static str],
    /// Why.
    why: &'static str,
}

impl Place {
    fn covers(&self, file: &str, name: &str) -> bool {
        let here = match self.path.strip_suffix('/') {
            Some(dir) => file.starts_with(dir) && file[dir.len()..].starts_with('/'),
            None => file == self.path,
        };
        here && (self.names.is_empty() || self.names.contains(&name))
    }
}

/// The lists of transports: each new transport adds its line to them.
const LISTS: &[Place] = &[
    Place {
        path: "transports/src/registry.rs",
        item: None,
        names: &[],
        why: "the registry: one line per transport",
    },
    Place {
        path: "config/src/rule.rs",
        item: None,
        names: &[],
        why: "the name enum `TransportName` and the built-in rules",
    },
    Place {
        path: "config/src/transport/mod.rs",
        item: None,
        names: &[],
        why: "the configuration's transport sections, one field per transport",
    },
    Place {
        path: "transports/src/wire/message.rs",
        item: Some("WireTransport"),
        names: &[],
        why: "the wire's name enum and its mapping from and to `TransportName`",
    },
    Place {
        path: "transports/src/transport/mod.rs",
        item: Some("enum Library"),
        names: &[],
        why: "the run-time libraries transports are built on",
    },
];

/// Where a transport's name means something else.
const FOREIGN: &[Place] = &[
    Place {
        path: "transports/src/link/",
        item: None,
        names: &["tcp"],
        why: "the control link runs over a TCP or a Unix socket",
    },
    Place {
        path: "config/src/address.rs",
        item: None,
        names: &["tcp"],
        why: "a peer's address is a TCP or a Unix socket",
    },
    Place {
        path: "transports/src/cuda/",
        item: None,
        names: &["ipc"],
        why: "CUDA's IPC (cuIpc*, the legacy IPC handles)",
    },
    Place {
        path: "transports/src/ucx/",
        item: None,
        names: &["tcp", "ipc"],
        why: "UCX's own transports (its tcp, cuda_ipc)",
    },
    Place {
        path: "config/src/transport/ucx.rs",
        item: None,
        names: &["tcp"],
        why: "UCX's own transports, which transport.ucx.tls lists",
    },
    Place {
        path: "src/cli/serve.rs",
        item: Some("fn listeners"),
        names: &["tcp"],
        why: "the ready line names the node's TCP and Unix listeners",
    },
    Place {
        path: "src/cli/bench/args.rs",
        item: Some("ControlLink"),
        names: &["tcp"],
        why: "the bench's control link is a TCP or a Unix socket",
    },
    Place {
        path: "src/cli/bench/mod.rs",
        item: Some("impl Baseline"),
        names: &["tcp"],
        why: "the socket baseline is a plain TCP socket between the two processes",
    },
    Place {
        path: "src/cli/doctor.rs",
        item: None,
        names: &["shm"],
        why: "/dev/shm, the POSIX shared-memory tmpfs doctor checks (shm's segments are \
              memfds, not files there)",
    },
    Place {
        path: "src/cli/doctor/facts.rs",
        item: None,
        names: &["shm"],
        why: "the size of /dev/shm, the POSIX shared-memory tmpfs",
    },
    Place {
        path: "src/cli/doctor/host.rs",
        item: None,
        names: &["shm"],
        why: "doctor's finding on /dev/shm, the POSIX shared-memory tmpfs",
    },
    Place {
        path: "src/cli/bench/peer.rs",
        item: Some("LISTEN_FIELD"),
        names: &["tcp"],
        why: "the bench peer's ready line names its TCP listeners",
    },
];

/// Identifiers that name TCP the socket protocol, wherever they are.
const FOREIGN_IDENTS: &[&str] = &[
    "TcpListener",
    "TcpStream",
    "TcpSocket",
    "tcp_addrs",
    "bind_tcp",
];

/// Address types whose `Tcp` variant is a TCP socket address (`Endpoint::Tcp`,
/// `PeerAddress::Tcp`), wherever they are used.
const SOCKET_ADDRESSES: &[&str] = &["Endpoint", "PeerAddress"];

/// What still names a transport outside its files, while the seam's move is under way.
const PENDING: &[Place] = &[
    Place {
        path: "config/src/renamed.rs",
        item: None,
        names: &["ipc"],
        why: "transport.ipc.recv_spin, node.recv_spin's old name, is read for one release",
    },
    Place {
        path: "config/src/validate.rs",
        item: None,
        names: &[],
        why: "the frame-size checks of sections' chunk sizes against limits.max_frame, which \
              could move to each section's check with the limit passed in",
    },
    Place {
        path: "config/src/lib.rs",
        item: None,
        names: &[],
        why: "it re-exports each section's types (TcpTuning, UcxMode, ...)",
    },
];

/// The crates held to the rule (the actors' shell, core and node the strictest: no
/// transport's name at all).
const SCANNED: &[&str] = &["src", "transports/src", "config/src"];

/// The actors: the shell, the sans-IO core and the node, which name no transport at all.
const ACTORS: &[&str] = &["actors/src"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.file_name().is_some_and(|f| f != "tests.rs")
        {
            out.push(path);
        }
    }
}

/// Whether `relative` is one of transport `name`'s own files: a folder or file named after
/// it (`ucx/`, `ipc.rs`), or after one of its parts (`staged_ring.rs`).
fn owned_by(relative: &str, name: &str) -> bool {
    relative.split('/').any(|part| {
        let stem = part.strip_suffix(".rs").unwrap_or(part);
        is_part_of(stem, name)
    })
}

/// Whether a module or file stem is `name` or one of its parts (`ucx`, `ucx_raw`).
fn is_part_of(stem: &str, name: &str) -> bool {
    stem == name || stem.starts_with(&format!("{name}_"))
}

/// The text of a file before its inline test module.
fn before_tests(text: &str) -> &str {
    let mut at = 0;
    let mut lines = text.split_inclusive('\n').peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]"
            && lines.peek().is_some_and(|next| {
                // A test module written inline (`mod tests {`) runs to the end of the file;
                // an out-of-line one (`mod tests;`) hides nothing here.
                let next = next.trim();
                (next.starts_with("mod ") || next.contains(" mod ")) && next.ends_with('{')
            })
        {
            return &text[..at];
        }
        at += line.len();
    }
    text
}

/// A token of Rust source, on its 1-based line.
#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// An identifier (or keyword).
    Ident(String, usize),
    /// A run of letters and digits in a string literal.
    Word(String, usize),
    /// `{`, `}` or `;`.
    Punct(char, usize),
}

/// The identifiers, string words and braces of `text`, without its comments. Knows enough
/// of Rust's lexical grammar for these sources: nested block comments, escapes, raw and
/// byte strings, char literals beside lifetimes.
fn tokens(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let word_char = |c: char| c.is_alphanumeric() || c == '_';
    // The words of string contents chars[from..to], which start on line `line`.
    let words = |out: &mut Vec<Token>, from: usize, to: usize, mut line: usize| {
        let mut word = String::new();
        for &c in &chars[from..to] {
            if c.is_ascii_alphanumeric() {
                word.push(c);
                continue;
            }
            if !word.is_empty() {
                out.push(Token::Word(std::mem::take(&mut word), line));
            }
            if c == '\n' {
                line += 1;
            }
        }
        if !word.is_empty() {
            out.push(Token::Word(word, line));
        }
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let after_word = i > 0 && word_char(chars[i - 1]);
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(chars[i] == '\n');
                    i += 1;
                }
            }
        } else if !after_word && raw_string_at(&chars, i).is_some() {
            let (start, hashes) = raw_string_at(&chars, i).expect("checked");
            let mut end = start;
            while end < chars.len()
                && !(chars[end] == '"' && (1..=hashes).all(|k| chars.get(end + k) == Some(&'#')))
            {
                end += 1;
            }
            words(&mut out, start, end, line);
            line += chars[start..end].iter().filter(|&&c| c == '\n').count();
            i = end + 1 + hashes;
        } else if c == '"' || (!after_word && matches!(c, 'b' | 'c') && next == Some('"')) {
            let start = if c == '"' { i + 1 } else { i + 2 };
            let mut end = start;
            while end < chars.len() && chars[end] != '"' {
                end += if chars[end] == '\\' { 2 } else { 1 };
            }
            let end = end.min(chars.len());
            words(&mut out, start, end, line);
            line += chars[start..end].iter().filter(|&&c| c == '\n').count();
            i = end + 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{1F600}'), else a lifetime's quote.
            if next == Some('\\') {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if chars.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && word_char(chars[i]) {
                i += 1;
            }
            out.push(Token::Ident(chars[start..i].iter().collect(), line));
        } else if c.is_ascii_digit() {
            // A number and its suffix (`0u8`, `1_000`, `0x1f`).
            while i < chars.len()
                && (word_char(chars[i])
                    || (chars[i] == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)))
            {
                i += 1;
            }
        } else {
            if matches!(c, '{' | '}' | ';') {
                out.push(Token::Punct(c, line));
            }
            i += 1;
        }
    }
    out
}

/// Where the contents of a raw string starting at `chars[i]` (`r"`, `r#"`, `br##"`) begin,
/// and its `#`s.
fn raw_string_at(chars: &[char], i: usize) -> Option<(usize, usize)> {
    let mut at = i;
    if matches!(chars.get(at), Some('b' | 'c')) {
        at += 1;
    }
    if chars.get(at) != Some(&'r') {
        return None;
    }
    at += 1;
    let hashes = chars[at..].iter().take_while(|&&c| c == '#').count();
    (chars.get(at + hashes) == Some(&'"')).then_some((at + hashes + 1, hashes))
}

/// The parts of an identifier or a string word: split at `_` and at case changes
/// (`GpuIpcBesideTcp` → Gpu, Ipc, Beside, Tcp; `UCX_TCP` → UCX, TCP; `HTTPServer` → HTTP,
/// Server).
fn parts(token: &str) -> Vec<String> {
    let mut out = Vec::new();
    for piece in token.split(|c: char| !c.is_alphanumeric()) {
        let chars: Vec<char> = piece.chars().collect();
        let mut start = 0;
        for k in 1..chars.len() {
            let (a, b) = (chars[k - 1], chars[k]);
            let next_lower = chars.get(k + 1).is_some_and(|c| c.is_lowercase());
            let boundary = (a.is_lowercase() && b.is_uppercase())
                || (a.is_uppercase() && b.is_uppercase() && next_lower)
                || (a.is_alphabetic() != b.is_alphabetic());
            if boundary {
                out.push(chars[start..k].iter().collect());
                start = k;
            }
        }
        if start < chars.len() {
            out.push(chars[start..].iter().collect());
        }
    }
    out
}

/// The lines (1-based, inclusive) of the top-level items of `text` whose first line
/// contains `header`: from that line to the `}` that closes the item's first `{`, or to
/// its `;` when that comes first.
fn item_lines(text: &str, tokens: &[Token], header: &str) -> Vec<(usize, usize)> {
    const STARTS: &[&str] = &[
        "pub", "enum", "struct", "impl", "fn", "const", "static", "type", "trait", "mod",
    ];
    let mut out = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let first = index + 1;
        let top_level = STARTS.iter().any(|s| line.starts_with(s));
        if !top_level || !line.contains(header) {
            continue;
        }
        let mut depth = 0usize;
        let mut last = first;
        for token in tokens {
            let Token::Punct(c, at) = token else { continue };
            if *at < first {
                continue;
            }
            last = *at;
            match c {
                ';' if depth == 0 => break,
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((first, last));
    }
    out
}

/// One place in the code that names a transport.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Hit {
    file: String,
    line: usize,
    name: &'static str,
    token: String,
}

impl std::fmt::Display for Hit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}: `{}` names {}",
            self.file, self.line, self.token, self.name
        )
    }
}

/// What the scan of some directories found, outside the places that may name transports.
#[derive(Default)]
struct Scan {
    /// Files read.
    files: usize,
    /// Code that names a transport and may not.
    hits: Vec<Hit>,
    /// Code that names a transport in a [`PENDING`] place, by the place's path.
    pending: BTreeMap<&'static str, Vec<Hit>>,
}

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn names() -> Vec<&'static str> {
    TransportName::NAMES.to_vec()
}

/// Scans the Rust files under `dirs` (relative to the workspace root).
fn scan(dirs: &[&str]) -> Scan {
    let root = workspace();
    let mut files = Vec::new();
    for dir in dirs {
        rust_files(&root.join(dir), &mut files);
    }
    files.sort();
    let mut out = Scan {
        files: files.len(),
        ..Scan::default()
    };
    for file in &files {
        let relative = file
            .strip_prefix(root)
            .expect("under the root")
            .to_string_lossy()
            .replace('\\', "/");
        let text = std::fs::read_to_string(file).expect("a readable source file");
        for hit in hits_in(&relative, before_tests(&text)) {
            match PENDING.iter().find(|p| covers(p, &hit, &text)) {
                Some(p) => out.pending.entry(p.path).or_default().push(hit),
                None => out.hits.push(hit),
            }
        }
    }
    out
}

/// Whether `place` covers `hit` (in its file, its names and, for an item, within it).
fn covers(place: &Place, hit: &Hit, text: &str) -> bool {
    if !place.covers(&hit.file, hit.name) {
        return false;
    }
    match place.item {
        None => true,
        Some(header) => {
            let code = before_tests(text);
            item_lines(code, &tokens(code), header)
                .iter()
                .any(|&(from, to)| (from..=to).contains(&hit.line))
        }
    }
}

/// Where `code`, the code of the file `relative`, names a transport and may not (the
/// [`PENDING`] places not excused).
fn hits_in(relative: &str, code: &str) -> Vec<Hit> {
    let tokens = tokens(code);
    let lines: Vec<&str> = code.lines().collect();
    let dir = Path::new(relative).parent().unwrap_or(Path::new(""));
    // The item spans of the lists and foreign places of this file, by place.
    let spans = |place: &Place| match place.item {
        None => vec![(1, usize::MAX)],
        Some(header) => item_lines(code, &tokens, header),
    };
    let excused = |places: &[Place], name: &str, line: usize| {
        places.iter().any(|p| {
            p.covers(relative, name)
                && spans(p)
                    .iter()
                    .any(|&(from, to)| (from..=to).contains(&line))
        })
    };
    let mut out = Vec::new();
    for (k, token) in tokens.iter().enumerate() {
        let (text, line, ident) = match token {
            Token::Ident(t, l) => (t, *l, true),
            Token::Word(t, l) => (t, *l, false),
            Token::Punct(..) => continue,
        };
        let parts = parts(text);
        for name in names() {
            if !parts.iter().any(|p| p.eq_ignore_ascii_case(name)) || owned_by(relative, name) {
                continue;
            }
            let source = lines.get(line - 1).copied().unwrap_or_default();
            // `TransportName::Tcp`: the path's type is the token before (`::` is not one).
            let typed = k > 0
                && matches!(&tokens[k - 1], Token::Ident(t, _)
                    if t == "TransportName" || t == "WireTransport");
            let declared = ident && is_part_of(text, name) && is_mod_declaration(source, text);
            let beside = ident
                && text != name
                && is_part_of(text, name)
                && workspace().join(dir).join(format!("{text}.rs")).is_file();
            // `Endpoint::Tcp`: a socket address's variant, the type the token before.
            let address = k > 0
                && matches!(&tokens[k - 1], Token::Ident(t, _)
                    if SOCKET_ADDRESSES.contains(&t.as_str()));
            let foreign = !typed
                && (FOREIGN_IDENTS.contains(&text.as_str())
                    || address
                    || excused(FOREIGN, name, line));
            if declared || beside || foreign || excused(LISTS, name, line) {
                continue;
            }
            out.push(Hit {
                file: relative.to_string(),
                line,
                name,
                token: text.clone(),
            });
        }
    }
    out.dedup();
    out
}

/// Whether `line` declares module `module` (`mod ucx;`, `pub mod ucx;`, `pub(crate) mod
/// ucx;`).
fn is_mod_declaration(line: &str, module: &str) -> bool {
    let line = line.trim();
    let rest = line
        .strip_prefix("pub ")
        .or_else(|| {
            line.strip_prefix("pub(")
                .and_then(|r| r.split_once(") ").map(|(_, rest)| rest))
        })
        .unwrap_or(line);
    rest == format!("mod {module};")
}

/// The hits as lines, with a count per file.
fn listing(hits: &[Hit]) -> String {
    let mut per_file: BTreeMap<&str, usize> = BTreeMap::new();
    for h in hits {
        *per_file.entry(&h.file).or_default() += 1;
    }
    let lines: std::collections::BTreeSet<(&str, usize)> =
        hits.iter().map(|h| (h.file.as_str(), h.line)).collect();
    let mut out = format!(
        "{} names on {} lines in {} files:\n",
        hits.len(),
        lines.len(),
        per_file.len()
    );
    for (file, n) in &per_file {
        out.push_str(&format!("  {n:4} {file}\n"));
    }
    for h in hits {
        out.push_str(&format!("{h}\n"));
    }
    out
}

#[test]
fn no_code_outside_a_transports_own_files_names_it() {
    let scan = scan(SCANNED);
    assert!(scan.files > 80, "the scan found only {} files", scan.files);
    assert!(
        scan.hits.is_empty(),
        "code names a transport outside its own files (read its declaration in \
         `transports::registry`, ask its `TransportKind`, or move the code into the \
         transport's own files):\n{}",
        listing(&scan.hits)
    );
    // The pending list only shrinks: a place that names nothing any more leaves it.
    let stale: Vec<&str> = PENDING
        .iter()
        .filter(|p| SCANNED.iter().any(|d| p.path.starts_with(&format!("{d}/"))))
        .filter(|p| !scan.pending.contains_key(p.path))
        .map(|p| p.path)
        .collect();
    assert!(
        stale.is_empty(),
        "these PENDING places name no transport any more: remove them from the list: \
         {stale:?}"
    );
    for place in PENDING {
        if let Some(hits) = scan.pending.get(place.path) {
            let mut lines: Vec<usize> = hits.iter().map(|h| h.line).collect();
            lines.dedup();
            eprintln!(
                "pending {}: {} names on {} lines ({})",
                place.path,
                hits.len(),
                lines.len(),
                place.why
            );
        }
    }
}

#[test]
fn no_code_in_the_actors_names_a_transport() {
    let scan = scan(ACTORS);
    assert!(scan.files > 30, "the scan found only {} files", scan.files);
    let mut hits = scan.hits;
    hits.extend(scan.pending.into_values().flatten());
    assert!(
        hits.is_empty(),
        "the actors name transports (the shell and the core may not: read the declaration, \
         or move the code into the transport's directory):\n{}",
        listing(&hits)
    );
}

#[test]
fn the_scan_sees_names_in_identifiers_and_strings_and_skips_comments_and_tests() {
    let code = "// ucx in a comment\n/* staged /* nested */ ipc */\nfn a() {\n    \
                let lanes = node.ucx_lanes(peer);\n    let r = UcxReport::new();\n    \
                let t = TransportName::Ipc;\n    let s = \"transport.staged.slots\";\n    \
                let raw = r#\"over \"tcp\"\"#;\n    let c = 'x'; let l: &'static str = \"\";\n}\n\
                #[cfg(test)]\nmod tests {\n    const T: &str = \"tcp\";\n}\n";
    let hits = hits_in("src/cli/example.rs", before_tests(code));
    let found: Vec<(usize, &str, &str)> = hits
        .iter()
        .map(|h| (h.line, h.name, h.token.as_str()))
        .collect();
    assert_eq!(
        found,
        [
            (4, "ucx", "ucx_lanes"),
            (5, "ucx", "UcxReport"),
            (6, "ipc", "Ipc"),
            (7, "staged", "staged"),
            (8, "tcp", "tcp"),
        ]
    );
    // Words are whole parts: a name inside another word is not it.
    assert!(hits_in("src/a.rs", "fn tcpdump() { let ipcs = \"staging\"; }\n").is_empty());
    assert_eq!(
        parts("GpuIpcBesideTcp"),
        ["Gpu", "Ipc", "Beside", "Tcp"].map(String::from)
    );
    assert_eq!(
        parts("UCX_TCP_GBPS"),
        ["UCX", "TCP", "GBPS"].map(String::from)
    );
}

#[test]
fn own_files_lists_plumbing_and_foreign_meanings_are_excused() {
    assert!(owned_by("actors/src/peer/staged_ring.rs", "staged"));
    assert!(owned_by("transports/src/ucx/engine.rs", "ucx"));
    assert!(owned_by("config/src/transport/ucx.rs", "ucx"));
    assert!(!owned_by("actors/src/coordinator.rs", "ucx"));
    // The crate root declares a transport's directory.
    assert!(hits_in("transports/src/lib.rs", "pub mod ucx;\npub mod ipc;\n").is_empty());
    assert!(is_mod_declaration("pub(crate) mod ucx_raw;", "ucx_raw"));
    // A part of a transport beside the file is reached by its module name; one that is not
    // there is not.
    let beside = "fn f() { ucx_raw::serve(); }\n";
    assert!(hits_in("src/cli/bench/mod.rs", beside).is_empty());
    assert_eq!(hits_in("src/cli/doctor.rs", beside).len(), 1);
    // The socket protocol, where the link names it; the typed name is the transport's even
    // there.
    let link = "fn f() {\n    let s = TcpStream::connect(a);\n    let e = Endpoint::Tcp(a);\n    \
                let t = TransportName::Tcp;\n}\n";
    let hits = hits_in("transports/src/link/mod.rs", link);
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!(hits[0].token, "Tcp");
    // A socket address's `Tcp` variant is the socket anywhere; the typed name is not.
    let elsewhere = hits_in("transports/src/region.rs", link);
    assert_eq!(elsewhere.len(), 1, "{elsewhere:?}");
    assert_eq!(elsewhere[0].line, 4);
    // Only the named items of a file are lists.
    let message = "pub enum WireTransport {\n    Tcp,\n    Ucx,\n}\n\npub struct Hello {\n    \
                   ucx_address: Vec<u8>,\n}\n";
    let hits = hits_in("transports/src/wire/message.rs", message);
    assert_eq!(
        hits.iter().map(|h| h.line).collect::<Vec<_>>(),
        [7],
        "{hits:?}"
    );
}
