//! What `ferry doctor` checks of UCX, the ucx transport's library: the release a node loads
//! and from which file, whether it moves device memory, and which of its own transports
//! `ucx_info -d` lists (RDMA ones, or only tcp and shared memory). [`ProbedUcx::gather`]
//! reads the machine; [`finding`] words it without touching anything, so tests feed it
//! made-up facts.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_config::{Config, UcxMode};

use super::{LoadError, LoadedUcx, Version};
use crate::transport::{Finding, Status};

/// What was found of UCX.
#[derive(Debug, Clone)]
pub struct ProbedUcx {
    /// The UCX a node loads (`transport.ucx.library`, else `FERRY_UCX_LIBRARY`, else the
    /// system's `libucp.so.0`), as the library reports itself, or why it did not load.
    pub library: Result<LoadedUcx, LoadError>,
    /// Transports `ucx_info -d` lists, or why they are unknown (no `ucx_info` on `PATH`,
    /// or one of another UCX release).
    pub transports: Result<Vec<String>, String>,
}

impl ProbedUcx {
    /// Loads UCX as a node with `transport.ucx.library = configured` would, and asks the
    /// `ucx_info` on `PATH` for its transports when it is of the same release. Blocks while
    /// it loads and while `ucx_info` runs (killed after 10 s); does not fail: what cannot be
    /// read is recorded.
    pub fn gather(configured: Option<&Path>) -> Self {
        let library = super::loaded(configured);
        let transports = match &library {
            Ok(loaded) => ucx_transports(loaded.release),
            Err(_) => Err("UCX does not load".into()),
        };
        ProbedUcx {
            library,
            transports,
        }
    }
}

/// `ferry doctor`'s findings of UCX for a node with `config`: one, `ucx`. It counts
/// (a warning where UCX does not load, not a skip) where a rule the node uses names ucx
/// (`wanted`) and the node would serve it: `transport.ucx.enabled` "on", or "auto" (which
/// serves it on RDMA machines).
pub fn probe(config: &Config, wanted: bool) -> Vec<Finding> {
    let probed = ProbedUcx::gather(config.transport.ucx.library.as_deref());
    vec![finding(&probed, counts(config, wanted))]
}

/// Whether a problem with UCX matters to a node with `config` whose rules name ucx when
/// `wanted`.
fn counts(config: &Config, wanted: bool) -> bool {
    wanted && config.transport.ucx.enabled != UcxMode::Off
}

/// The `ucx` finding of what was `probed`; `ucx_named`: UCX matters to the node. Pure.
pub fn finding(probed: &ProbedUcx, ucx_named: bool) -> Finding {
    const CHECK: &str = "ucx";
    let library = match &probed.library {
        Ok(library) => library,
        Err(why) => {
            let status = if ucx_named {
                Status::Warn
            } else {
                Status::Skipped
            };
            return Finding::new(
                CHECK,
                status,
                format!("UCX does not load: the ucx transport cannot run here: {why}"),
            )
            .remedy(
                "install UCX (apt install libucx0, or HPC-X / MLNX_OFED) and make libucp.so.0 \
                 findable through ldconfig or LD_LIBRARY_PATH, or name its libucp.so in \
                 transport.ucx.library",
            );
        }
    };
    // What the loaded UCX says of itself (the file a node loads: transport.ucx.library,
    // FERRY_UCX_LIBRARY, else the system's).
    let device = if library.moves_cuda {
        "moves device memory (ucx carries GPU buffers)"
    } else {
        "moves host memory only (built without CUDA, or no driver): ucx carries no GPU buffer"
    };
    let (transports, remedy) = match &probed.transports {
        Err(why) => (
            format!(
                "transports unknown ({why}): whether it has an RDMA transport here (rc, dc, \
                 ud) or only tcp and shared memory, and CUDA transports (cuda_copy, \
                 cuda_ipc), is not checked"
            ),
            Some(format!(
                "to check them, put the ucx_info of UCX {} on PATH (Debian/Ubuntu: \
                 ucx-utils, for the system's UCX)",
                library.release
            )),
        ),
        Ok(list) if list.is_empty() => ("ucx_info -d lists no transports".to_string(), None),
        Ok(list) => {
            let cuda = list
                .iter()
                .any(|t| t.starts_with("cuda") || t == "gdr_copy");
            let text = format!(
                "transports: {}{}",
                list.join(", "),
                if cuda { "" } else { " (no CUDA transports)" }
            );
            (text, None)
        }
    };
    let finding = Finding::new(
        CHECK,
        Status::Ok,
        format!("{library}; {transports}; {device}"),
    );
    match remedy {
        Some(remedy) => finding.remedy(remedy),
        None => finding,
    }
}

/// The transports of the loaded UCX `release`, from the `ucx_info` on `PATH` when it is of
/// that release, else why they are unknown.
fn ucx_transports(release: Version) -> Result<Vec<String>, String> {
    let Some(program) = on_path("ucx_info") else {
        return Err("ucx_info is not on PATH".into());
    };
    let version = run_for(&program.to_string_lossy(), &["-v"], Duration::from_secs(10))
        .ok_or_else(|| format!("{} -v failed", program.display()))?;
    match parse_ucx_info_release(&version) {
        Some(theirs) if theirs != release.to_string() => {
            return Err(format!(
                "{} is UCX {theirs}'s, not the loaded {release}'s",
                program.display()
            ));
        }
        _ => {}
    }
    let out = run_for(&program.to_string_lossy(), &["-d"], Duration::from_secs(10))
        .ok_or_else(|| format!("{} -d failed", program.display()))?;
    Ok(parse_ucx_transports(&out))
}

/// The first executable file `name` in a directory of `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|file| {
            std::fs::metadata(file)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The release `ucx_info -v` names: `# Version 1.13.1` (UCX 1.13) or `# Library version:
/// 1.16.0` (later releases).
fn parse_ucx_info_release(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.trim_start_matches(['#', ' ', '\t']);
        let rest = line
            .strip_prefix("Version ")
            .or_else(|| line.strip_prefix("Library version:"))?;
        rest.split_whitespace().next().map(str::to_string)
    })
}

/// The transport names `ucx_info -d` reports (`# Transport: rc_mlx5`), deduplicated.
fn parse_ucx_transports(text: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for line in text.lines() {
        let line = line.trim_start_matches(['#', ' ', '\t']);
        if let Some(name) = line.strip_prefix("Transport:") {
            let name = name.trim().to_string();
            if !name.is_empty() && !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

/// Runs a program and returns its stdout, or `None` if it is missing, fails or outlives
/// `limit` (then it is killed).
fn run_for(program: &str, args: &[&str], limit: Duration) -> Option<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdout = child.stdout.take()?;
    // Read on a thread so a chatty program cannot block on a full pipe while we wait.
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let text = reader.join().ok()?;
    status.filter(|s| s.success()).map(|_| text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ucx::{LibraryLocation, LibrarySource};

    #[test]
    fn ucx_info_transports_are_read_once_each() {
        let text = "#\n# Memory domain: self\n#      Transport: self\n#   Device: memory\n\
                    #      Transport: tcp\n#      Transport: tcp\n#      Transport: cuda_copy\n";
        assert_eq!(parse_ucx_transports(text), ["self", "tcp", "cuda_copy"]);
    }

    #[test]
    fn ucx_info_names_its_release_either_way() {
        let old = "# Version 1.13.1\n# Git branch '<unknown>', revision 0000000\n";
        assert_eq!(parse_ucx_info_release(old).as_deref(), Some("1.13.1"));
        let new = "# Library version: 1.16.0\n# Library path: /usr/lib/libucs.so.0\n\
                   # API headers version: 1.16.0\n";
        assert_eq!(parse_ucx_info_release(new).as_deref(), Some("1.16.0"));
        assert_eq!(parse_ucx_info_release("nothing here\n"), None);
    }

    #[test]
    fn gathering_never_panics() {
        let probed = ProbedUcx::gather(None);
        assert!(probed.library.is_ok() || probed.transports.is_err());
    }

    fn system_ucx() -> LibraryLocation {
        LibraryLocation {
            source: LibrarySource::System,
            path: "libucp.so.0".into(),
        }
    }

    fn absent() -> ProbedUcx {
        ProbedUcx {
            library: Err(LoadError::Open {
                location: system_ucx(),
                reason: "libucp.so.0: cannot open shared object file".into(),
            }),
            transports: Err("UCX does not load".into()),
        }
    }

    /// UCX 1.13.1, loaded by the system's search, with `transports` from ucx_info.
    fn ucx_1_13(transports: Result<Vec<String>, String>) -> ProbedUcx {
        ProbedUcx {
            library: Ok(LoadedUcx {
                release: Version {
                    major: 1,
                    minor: 13,
                    release: 1,
                },
                version_string: Some("1.13.1".into()),
                location: system_ucx(),
                file: Some("/usr/lib/x86_64-linux-gnu/libucp.so.0.0.0".into()),
                moves_cuda: false,
            }),
            transports,
        }
    }

    fn config(text: &str) -> Config {
        Config::from_toml_str(&format!(
            "[node]\nname = \"a\"\n[security]\ndanger_insecure = true\n{text}"
        ))
        .expect("test config")
    }

    #[test]
    fn ucx_absent_is_skipped_unless_a_rule_names_it() {
        let u = finding(&absent(), false);
        assert_eq!(u.status, Status::Skipped);
        assert!(u.found.contains("UCX does not load"), "{}", u.found);
        assert!(u.found.contains("libucp.so.0"), "{}", u.found);
        assert_eq!(finding(&absent(), true).status, Status::Warn);
        assert!(
            !finding(&absent(), true).blocks,
            "another transport may carry it"
        );
        // Named by a rule but turned off: it does not count.
        let off = config("[transport.ucx]\nenabled = \"off\"\n");
        assert!(!counts(&off, true));
        assert!(counts(&config(""), true));
        assert!(!counts(&config(""), false));
        let u = finding(&ucx_1_13(Ok(vec!["self".into(), "tcp".into()])), false);
        assert_eq!(u.status, Status::Ok);
        assert!(u.found.contains("no CUDA transports"), "{}", u.found);
        assert!(
            u.found.starts_with(
                "UCX 1.13.1 from /usr/lib/x86_64-linux-gnu/libucp.so.0.0.0 (the system's \
                 libucp.so.0); transports: self, tcp"
            ),
            "{}",
            u.found
        );
        assert_eq!(u.remedy, None);
    }

    #[test]
    fn ucx_without_its_ucx_info_is_named_and_says_what_is_unknown() {
        for why in [
            "ucx_info is not on PATH",
            "/usr/bin/ucx_info is UCX 1.16.0's, not the loaded 1.13.1's",
        ] {
            let u = finding(&ucx_1_13(Err(why.into())), false);
            assert_eq!(u.status, Status::Ok);
            assert!(
                u.found.starts_with(&format!(
                    "UCX 1.13.1 from /usr/lib/x86_64-linux-gnu/libucp.so.0.0.0 (the system's \
                     libucp.so.0); transports unknown ({why}): whether it has an RDMA transport"
                )),
                "{}",
                u.found
            );
            assert!(u.found.contains("moves host memory only"), "{}", u.found);
            let remedy = u.remedy.as_deref().unwrap_or_default();
            assert!(remedy.contains("ucx_info of UCX 1.13.1"), "{remedy}");
        }
    }
}
