//! Loading UCX: the version report, and the typed errors for a wrong library.

mod common;

use std::path::Path;
use std::process::Command;

use ucx_sys::sys::{LIBRARY_ENV, MIN_VERSION};
use ucx_sys::testing::ucx_test;
use ucx_sys::{LibraryLocation, LibrarySource, LoadError, Ucx};

#[test]
fn loads_the_library_and_reports_its_version() {
    let Some(ucx) = ucx_test("loads_the_library_and_reports_its_version") else {
        return;
    };
    println!(
        "UCX {} ({}) from {} = {}",
        ucx.version(),
        ucx.version_string().unwrap_or("no version string"),
        ucx.location(),
        ucx.file().map_or("?".into(), |p| p.display().to_string())
    );
    assert!(ucx.version() >= MIN_VERSION);
    // The library's two reports of its release agree, and asking again gives the same.
    assert_eq!(ucx_sys::result::get_version(ucx.library()), ucx.version());
    if let Some(text) = ucx.version_string() {
        assert!(
            text.starts_with(&ucx.version().to_string()),
            "ucp_get_version_string {text:?} is not release {}",
            ucx.version()
        );
    }
    let file = ucx
        .file()
        .expect("the mapped file is found in /proc/self/maps");
    assert!(
        file.is_absolute() && file.to_string_lossy().contains("libucp"),
        "{file:?}"
    );

    let context = common::loopback_context(&ucx, None);
    let info = context.info().expect("ucp_context_query");
    println!(
        "memory types: {:?}, request size {}",
        info.memory_types, info.request_size
    );
    assert!(info.memory_types.contains(&ucx_sys::MemoryType::Host));
}

#[test]
fn a_wrong_path_is_a_typed_error_naming_it() {
    let wrong = Path::new("/nonexistent/ferry/libucp.so");
    let e = Ucx::load(Some(wrong)).expect_err("no library there");
    match &e {
        LoadError::Open { location, reason } => {
            assert_eq!(location.source, LibrarySource::Configured);
            assert_eq!(location.path, wrong);
            assert!(reason.contains("nonexistent"), "{reason}");
        }
        other => panic!("expected LoadError::Open, got {other:?}"),
    }
    let text = e.to_string();
    assert!(text.contains("/nonexistent/ferry/libucp.so"), "{text}");
    assert!(text.contains("transport.ucx.library"), "{text}");
}

#[test]
fn a_library_that_is_not_ucx_is_a_typed_error_naming_the_symbol() {
    // libc is on every Linux machine and is no UCX.
    let location = LibraryLocation {
        source: LibrarySource::Configured,
        path: "libc.so.6".into(),
    };
    match Ucx::load_from(location.clone()) {
        Err(LoadError::MissingSymbol {
            location: l,
            symbol,
            ..
        }) => {
            assert_eq!(l, location);
            assert_eq!(symbol, "ucp_get_version");
        }
        other => panic!("expected LoadError::MissingSymbol, got {other:?}"),
    }
}

/// The environment variable is the second source: run this test binary again with it set
/// to a wrong path and check what the child saw.
#[test]
fn the_environment_variable_is_used_and_named_when_wrong() {
    if std::env::var_os("FERRY_UCX_LOAD_CHILD").is_some() {
        let e = Ucx::load(None).expect_err("the env var points nowhere");
        assert_eq!(e.location().source, LibrarySource::Environment);
        assert_eq!(e.location().path, Path::new("/nonexistent/env/libucp.so"));
        assert!(e.to_string().contains("FERRY_UCX_LIBRARY"), "{e}");
        return;
    }
    let out = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "--exact",
            "the_environment_variable_is_used_and_named_when_wrong",
            "--test-threads=1",
        ])
        .env("FERRY_UCX_LOAD_CHILD", "1")
        .env(LIBRARY_ENV, "/nonexistent/env/libucp.so")
        .output()
        .expect("the child runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 passed"), "{stdout}");
}

/// Builds a stand-in `libucp` exporting only `ucp_get_version`, reporting `version`, with
/// the C compiler cargo links with (`cc`), in cargo's scratch directory for tests.
fn fake_ucp(name: &str, version: (u32, u32, u32)) -> std::path::PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ucx-sys-fake");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let source = dir.join(format!("{name}.c"));
    let library = dir.join(format!("lib{name}.so"));
    std::fs::write(
        &source,
        format!(
            "void ucp_get_version(unsigned *a, unsigned *b, unsigned *c) \
             {{ *a = {}; *b = {}; *c = {}; }}\n",
            version.0, version.1, version.2
        ),
    )
    .expect("write the C file");
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .status()
        .expect("cc runs (cargo links test binaries with it)");
    assert!(status.success(), "cc failed");
    library
}

#[test]
fn a_ucx_older_than_1_13_is_refused_naming_version_and_file() {
    let path = fake_ucp("ucp_1_12", (1, 12, 1));
    let e = Ucx::load(Some(&path)).expect_err("1.12 is too old");
    match &e {
        LoadError::TooOld {
            location,
            found,
            required,
        } => {
            assert_eq!(location.path, path);
            assert_eq!(found.to_string(), "1.12.1");
            assert_eq!(*required, MIN_VERSION);
        }
        other => panic!("expected LoadError::TooOld, got {other:?}"),
    }
    assert_eq!(
        e.release().map(|r| r.to_string()).as_deref(),
        Some("1.12.1")
    );
    let text = e.to_string();
    assert!(
        text.contains("UCX 1.12.1") && text.contains("1.13.0"),
        "{text}"
    );
    assert!(text.contains(&path.display().to_string()), "{text}");
}

#[test]
fn a_new_enough_library_without_the_entry_points_names_the_first_missing() {
    let path = fake_ucp("ucp_1_13_hollow", (1, 13, 0));
    match Ucx::load(Some(&path)) {
        Err(LoadError::MissingSymbol { symbol, .. }) => assert_eq!(symbol, "ucp_config_read"),
        other => panic!("expected LoadError::MissingSymbol, got {other:?}"),
    }
}
