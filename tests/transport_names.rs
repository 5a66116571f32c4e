//! The layout rule of the transport seam, checked on the sources: outside the registry and
//! the wire's name mapping, no code names a transport (`TransportName::Ipc` and the like)
//! but in that transport's own files; it reads the transport's declaration instead. Test
//! modules (`#[cfg(test)] mod ... {` to the end of a file) may name them.

use std::path::{Path, PathBuf};

use ferry::TransportName;

/// Files that name transports by design: the registry and the wire's typed names.
const ALLOWED: &[&str] = &[
    "transports/src/registry.rs",
    "transports/src/wire/message.rs",
];

/// The crates whose code must not name a transport (`config/` does: it is where rules and
/// settings name them).
const SCANNED: &[&str] = &["actors/src", "transports/src", "src"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether `relative` is one of transport `name`'s own files: a folder or file named after
/// it (`ucx/`, `ipc.rs`), or after one of its parts (`staged_ring.rs`).
fn owned_by(relative: &Path, name: &str) -> bool {
    relative.iter().any(|part| {
        let part = part.to_string_lossy();
        let stem = part.strip_suffix(".rs").unwrap_or(&part);
        stem == name || stem.starts_with(&format!("{name}_"))
    })
}

/// The code of a file before its test module, without comment lines.
fn code(text: &str) -> Vec<(usize, &str)> {
    let lines: Vec<&str> = text.lines().collect();
    let tests = lines.windows(2).position(|w| {
        w[0].trim() == "#[cfg(test)]" && {
            // A test module written inline (`mod tests {`) runs to the end of the file; an
            // out-of-line one (`mod tests;`) hides nothing here.
            let next = w[1].trim();
            (next.starts_with("mod ") || next.contains(" mod ")) && next.ends_with('{')
        }
    });
    lines[..tests.unwrap_or(lines.len())]
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.trim_start().starts_with("//"))
        .map(|(i, l)| (i + 1, *l))
        .collect()
}

#[test]
fn no_code_outside_the_registry_names_a_transport() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let names: Vec<&str> = TransportName::NAMES.to_vec();
    let variants: Vec<String> = names
        .iter()
        .map(|n| {
            let name: TransportName = n.parse().expect("a transport name");
            format!("TransportName::{name:?}")
        })
        .collect();
    let mut files = Vec::new();
    for dir in SCANNED {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(
        files.len() > 50,
        "the scan found only {} files",
        files.len()
    );
    let mut found = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(root).expect("under the root");
        let shown = relative.to_string_lossy().replace('\\', "/");
        if ALLOWED.contains(&shown.as_str()) {
            continue;
        }
        // A transport's own files may name it, and no other.
        let text = std::fs::read_to_string(file).expect("a readable source file");
        for (line, code) in code(&text) {
            for (name, v) in names.iter().zip(&variants) {
                if !owned_by(relative, name) && code.contains(v.as_str()) {
                    found.push(format!("{shown}:{line}: {v}"));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "code outside the registry decides by a transport's name (read its declaration in \
         `transports::registry`, or move the code into the transport's own files):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scan_sees_a_name_and_skips_test_modules() {
    let text = "fn a() {\n    let t = TransportName::Ipc;\n}\n#[cfg(test)]\nmod tests {\n    \
                TransportName::Tcp\n}\n";
    let code = code(text);
    assert!(
        code.iter()
            .any(|(n, l)| *n == 2 && l.contains("TransportName::Ipc"))
    );
    assert!(!code.iter().any(|(_, l)| l.contains("TransportName::Tcp")));
    assert!(owned_by(
        Path::new("actors/src/peer/staged_ring.rs"),
        "staged"
    ));
    assert!(owned_by(Path::new("transports/src/ucx/engine.rs"), "ucx"));
    assert!(!owned_by(Path::new("actors/src/coordinator.rs"), "ucx"));
}
