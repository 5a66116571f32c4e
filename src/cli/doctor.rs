//! `ferry doctor`: checks this machine for what ferry's transports need, and says what to do
//! about each problem. The exit status is 1 when a problem blocks a transport that the
//! configuration relies on.
//!
//! Sans-IO: [`Facts::gather`] reads the machine, [`diagnose`] turns facts and a
//! configuration into findings without touching anything, so tests feed it made-up facts.

mod cuda;
mod facts;
mod host;
mod pool_test;
mod rules;

use std::path::PathBuf;
use std::process::ExitCode;

use ferry_config::{Config, TransportName};
use ferry_transports::cuda::CudaProbe;
pub use ferry_transports::transport::{Finding, Status};
use serde::Serialize;

use cuda::{block_copies_finding, cuda_findings};
use host::{memlock_finding, shm_finding};
use rules::config_findings;

pub use facts::{Facts, MEMLOCK_MIN, Memlock, SHM_MIN};
pub use pool_test::PoolTest;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print the findings as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Internal: the importing side of the pool export/import test, talking to the doctor
    /// over this Unix socket.
    #[arg(long, hide = true, value_name = "SOCKET")]
    pool_import_child: Option<PathBuf>,
}

pub fn run(file: Option<PathBuf>, overrides: &[String], args: Args) -> anyhow::Result<ExitCode> {
    if let Some(socket) = &args.pool_import_child {
        pool_test::child(socket)?;
        return Ok(ExitCode::SUCCESS);
    }
    // A configuration that only lacks a secret still says which transports it relies on:
    // check the machine for it and report the secret as a warning (`ferry config check`
    // is the place for the rest).
    let (config, config_error) = match super::load_config(file.clone(), overrides, Vec::new()) {
        Ok(config) => (config, None),
        Err(first) => {
            let insecure = vec![("security.danger_insecure".to_string(), "true".to_string())];
            match super::load_config(file, overrides, insecure) {
                Ok(config) => (config, Some(format!("{first:#}"))),
                Err(_) => return Err(first),
            }
        }
    };
    super::telemetry::init_command(&config.telemetry);
    let mut facts = Facts::gather(&config, &named_transports(&config));
    if let Ok(exe) = std::env::current_exe() {
        facts.pool_export = pool_test::run(&facts.cuda, &exe);
    }
    let mut findings = diagnose(&facts, &config);
    if let Some(error) = config_error {
        findings.push(
            Finding::new("config", Status::Warn, error)
                .remedy("a node will not start with this configuration; see `ferry config check`"),
        );
    }
    let blocked = findings.iter().any(|f| f.blocks);
    let text = if args.json {
        #[derive(Serialize)]
        struct Report<'a> {
            blocked: bool,
            findings: &'a [Finding],
        }
        let report = Report {
            blocked,
            findings: &findings,
        };
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        render(&findings)
    };
    // A closed pipe (`ferry doctor | head`) is not an error worth a panic.
    let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
    Ok(if blocked {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The human report: a summary, then one aligned line per finding, its remedy indented
/// beneath it.
pub fn render(findings: &[Finding]) -> String {
    let count = |s: Status| findings.iter().filter(|f| f.status == s).count();
    let blocking = findings.iter().filter(|f| f.blocks).count();
    let mut out = format!(
        "ferry doctor: {} checks: {} ok, {} warnings, {} problems ({} blocking), {} skipped\n\n",
        findings.len(),
        count(Status::Ok),
        count(Status::Warn),
        count(Status::Problem),
        blocking,
        count(Status::Skipped),
    );
    let width = findings.iter().map(|f| f.check.len()).max().unwrap_or(0);
    for f in findings {
        out.push_str(&format!(
            "  {:<8} {:<width$}  {}\n",
            f.status.label(),
            f.check,
            f.found
        ));
        if let Some(remedy) = &f.remedy {
            out.push_str(&format!("  {:<8} {:<width$}  -> {remedy}\n", "", ""));
        }
    }
    out
}

/// Diagnoses the machine described by `facts` for `config`. Pure.
pub fn diagnose(facts: &Facts, config: &Config) -> Vec<Finding> {
    let named = named_transports(config);
    let mut out = cuda_findings(&facts.cuda, &facts.pool_export, &named);
    if let CudaProbe::Ready(driver) = &facts.cuda
        && !driver.devices.is_empty()
    {
        out.push(block_copies_finding(
            driver,
            facts.block_copies,
            facts.gather_kernel.as_ref(),
        ));
    }
    out.push(shm_finding(&facts.shm));
    out.push(memlock_finding(&facts.memlock));
    // What each transport checks of what it is built on (a library's release, its tools).
    out.extend(facts.probes.iter().cloned());
    out.extend(config_findings(config, &facts.transports));
    out
}

/// The transports the rules name, in first-mention order.
/// The transports the configuration asks for. The built-in `"gpu"` and `"remote-gpu"`
/// rules only count when the node is told to use GPUs (`gpu.devices`): a host-only machine
/// with the default configuration is not asking for GPU transports.
fn named_transports(config: &Config) -> Vec<TransportName> {
    let uses_gpus = config.gpu.devices.as_ref().is_some_and(|d| !d.is_empty());
    let builtin = [
        ferry_config::Rule::same_host_gpu(),
        ferry_config::Rule::remote_gpu(),
    ];
    let mut named = Vec::new();
    for t in config
        .transport
        .rules
        .iter()
        .filter(|r| uses_gpus || !builtin.contains(r))
        .flat_map(|r| &r.transports)
    {
        if !named.contains(t) {
            named.push(*t);
        }
    }
    named
}

#[cfg(test)]
mod tests {
    use super::cuda::CUDA;
    use super::*;
    use ferry_transports::cuda::{BlockCopies, CudaDevice, CudaDriver};

    fn healthy() -> Facts {
        Facts {
            cuda: CudaProbe::NoDriver,
            shm: Ok(8 << 30),
            memlock: Ok(Memlock {
                soft: None,
                hard: None,
            }),
            probes: Vec::new(),
            // No CUDA driver, as the facts say, whatever this machine has.
            transports: crate::cli::explain::tests::host_only_catalog(),
            pool_export: Vec::new(),
            block_copies: None,
            gather_kernel: None,
        }
    }

    fn config(rules: &str) -> Config {
        Config::from_toml_str(&format!(
            "[node]\nname = \"a\"\n[security]\ndanger_insecure = true\n{rules}"
        ))
        .expect("test config")
    }

    fn find<'a>(findings: &'a [Finding], check: &str) -> &'a Finding {
        findings
            .iter()
            .find(|f| f.check == check)
            .unwrap_or_else(|| panic!("no {check} finding in {findings:#?}"))
    }

    fn gpu(ordinal: i32) -> CudaDevice {
        CudaDevice {
            ordinal,
            name: "NVIDIA H200".into(),
            uuid: format!("GPU-0000000{ordinal}-0000-0000-0000-000000000000"),
            pci_bus_id: format!("0000:1{ordinal}:00.0"),
            total_memory: 141 << 30,
            vmm: true,
            posix_fd_handles: true,
            memory_pools: true,
            pool_posix_fd: true,
            gpudirect_rdma: true,
            gpudirect_rdma_with_vmm: true,
            rdma_flush_writes_options: 1,
        }
    }

    #[test]
    fn healthy_machine_default_config_blocks_nothing() {
        let findings = diagnose(&healthy(), &config(""));
        assert!(findings.iter().all(|f| !f.blocks), "{findings:#?}");
        assert_eq!(find(&findings, "rule #4 host").status, Status::Ok);
        assert_eq!(find(&findings, "/dev/shm").status, Status::Ok);
        assert_eq!(find(&findings, "memlock").status, Status::Ok);
    }

    #[test]
    fn cuda_absent_is_one_clear_line() {
        let findings = diagnose(&healthy(), &config(""));
        let cuda: Vec<_> = findings.iter().filter(|f| f.check == CUDA).collect();
        assert_eq!(cuda.len(), 1);
        assert_eq!(cuda[0].found, "no CUDA driver: GPU transports disabled");
        assert_eq!(cuda[0].status, Status::Skipped);
        assert!(!findings.iter().any(|f| f.check.starts_with("gpu")));
    }

    #[test]
    fn small_shm_warns_with_the_container_remedy() {
        let facts = Facts {
            shm: Ok(64 << 20),
            ..healthy()
        };
        let f = diagnose(&facts, &config(""));
        let shm = find(&f, "/dev/shm");
        assert_eq!(shm.status, Status::Warn);
        assert!(shm.found.contains("64 MiB"), "{}", shm.found);
        assert!(
            shm.remedy
                .as_deref()
                .is_some_and(|r| r.contains("--shm-size"))
        );
        assert!(!shm.blocks);
    }

    #[test]
    fn low_memlock_warns() {
        let facts = Facts {
            memlock: Ok(Memlock {
                soft: Some(8 << 20),
                hard: Some(8 << 20),
            }),
            ..healthy()
        };
        let f = diagnose(&facts, &config(""));
        let m = find(&f, "memlock");
        assert_eq!(m.status, Status::Warn);
        assert!(m.found.contains("8 MiB"), "{}", m.found);
        assert!(
            m.remedy
                .as_deref()
                .is_some_and(|r| r.contains("ulimit -l unlimited"))
        );
        let ok = Facts {
            memlock: Ok(Memlock {
                soft: Some(1 << 30),
                hard: None,
            }),
            ..healthy()
        };
        assert_eq!(
            find(&diagnose(&ok, &config("")), "memlock").status,
            Status::Ok
        );
    }

    #[test]
    fn each_transport_says_what_it_found_of_what_it_is_built_on() {
        let probed = Finding::new("lib", Status::Warn, "release 1.0 is too old").remedy("update");
        let facts = Facts {
            probes: vec![probed.clone()],
            ..healthy()
        };
        let f = diagnose(&facts, &config(""));
        assert_eq!(find(&f, "lib"), &probed);
        assert!(!f.iter().any(|f| f.blocks), "{f:#?}");
    }

    #[test]
    fn the_transports_wanted_are_those_the_rules_name() {
        let named = config(
            "[[transport.rules]]\nname = \"net\"\ntransports = [\"ucx\", \"tcp\"]\n\
             [[transport.rules]]\nname = \"rest\"\ntransports = [\"tcp\"]\n",
        );
        assert_eq!(
            named_transports(&named),
            [TransportName::Ucx, TransportName::Tcp]
        );
        // The built-in GPU rules count only on a node told to use GPUs.
        let default = named_transports(&config(""));
        assert!(!default.contains(&TransportName::Ipc), "{default:?}");
        let gpus = named_transports(&config("[gpu]\ndevices = [0]\n"));
        assert!(gpus.contains(&TransportName::Ipc), "{gpus:?}");
    }

    #[test]
    fn a_rule_that_excludes_everything_blocks() {
        let only_ipc = config("[[transport.rules]]\nname = \"gpu\"\ntransports = [\"ipc\"]\n");
        let f = diagnose(&healthy(), &only_ipc);
        let r = find(&f, "rule #0 gpu");
        assert_eq!(r.status, Status::Problem);
        assert!(r.blocks);
        // Not viable without a driver; on a GPU machine it cannot move host memory.
        assert!(r.found.contains("ipc ("), "{}", r.found);

        // tcp only pushes: a pull rule still uses it.
        let pull = config(
            "[[transport.rules]]\nname = \"pull\"\ntransports = [\"tcp\"]\ndirection = \"pull\"\n",
        );
        let r = diagnose(&healthy(), &pull);
        assert!(!find(&r, "rule #0 pull").blocks);

        let device = config(
            "[[transport.rules]]\nname = \"dev\"\ndst = [\"device\"]\ntransports = [\"tcp\"]\n",
        );
        let r = diagnose(&healthy(), &device);
        assert!(
            find(&r, "rule #0 dev")
                .found
                .contains("cannot move device destination memory")
        );
    }

    #[test]
    fn fallback_warns_without_blocking() {
        let c = config("[[transport.rules]]\nname = \"x\"\ntransports = [\"ipc\", \"tcp\"]\n");
        let f = diagnose(&healthy(), &c);
        let r = find(&f, "rule #0 x");
        assert_eq!(r.status, Status::Warn);
        assert!(r.found.starts_with("falls back to tcp"), "{}", r.found);
        assert!(!r.blocks);
        // ipc named but no driver: the cuda line warns instead of being skipped.
        assert_eq!(find(&f, CUDA).status, Status::Warn);
    }

    #[test]
    fn two_gpus_without_peer_access_warn() {
        let facts = Facts {
            cuda: CudaProbe::Ready(CudaDriver {
                cuda_version: 13000,
                kernel_module: Some("580.65.06".into()),
                devices: vec![gpu(0), gpu(1)],
                peer_access: vec![vec![false, false], vec![false, false]],
            }),
            ..healthy()
        };
        let f = diagnose(&facts, &config(""));
        let cuda = find(&f, CUDA);
        assert_eq!(cuda.status, Status::Ok);
        assert!(cuda.found.contains("CUDA 13.0") && cuda.found.contains("2 devices"));
        assert!(find(&f, "gpu 1").found.contains("0000:11:00.0"));
        let p = find(&f, "peer access");
        assert_eq!(p.status, Status::Warn);
        assert!(p.found.contains("GPU0->GPU1") && p.found.contains("GPU1->GPU0"));
        assert!(!p.blocks);
        assert_eq!(find(&f, "pool export").status, Status::Skipped);
        assert_eq!(find(&f, "gpudirect rdma").status, Status::Ok);
    }

    #[test]
    fn one_gpu_skips_peer_access_and_broken_driver_is_a_problem() {
        let one = Facts {
            cuda: CudaProbe::Ready(CudaDriver {
                cuda_version: 12080,
                kernel_module: None,
                devices: vec![CudaDevice {
                    gpudirect_rdma: false,
                    pool_posix_fd: false,
                    ..gpu(0)
                }],
                peer_access: vec![vec![false]],
            }),
            ..healthy()
        };
        let f = diagnose(&one, &config(""));
        assert_eq!(find(&f, "peer access").found, "needs 2 GPUs");
        assert_eq!(find(&f, "pool export").status, Status::Warn);
        assert_eq!(find(&f, "gpudirect rdma").status, Status::Warn);
        let broken = Facts {
            cuda: CudaProbe::Failed {
                cuda_version: Some(13000),
                error: "cuInit failed: CUDA_ERROR_NOT_INITIALIZED".into(),
            },
            ..healthy()
        };
        let f = diagnose(&broken, &config(""));
        assert_eq!(find(&f, CUDA).status, Status::Problem);
    }

    #[test]
    fn block_copies_say_whether_the_driver_batches() {
        let with = |cuda_version, copies| Facts {
            cuda: CudaProbe::Ready(CudaDriver {
                cuda_version,
                kernel_module: None,
                devices: vec![gpu(0)],
                peer_access: vec![vec![false]],
            }),
            block_copies: Some(copies),
            ..healthy()
        };
        let f = diagnose(&with(12080, BlockCopies::Batched), &config(""));
        let b = find(&f, "block copies");
        assert_eq!(b.status, Status::Ok);
        assert!(b.found.contains("cuMemcpyBatchAsync"), "{}", b.found);
        let f = diagnose(&with(12040, BlockCopies::PerRun), &config(""));
        let b = find(&f, "block copies");
        assert_eq!(b.status, Status::Warn);
        assert!(
            b.found.contains("one cuMemcpyAsync per block"),
            "{}",
            b.found
        );
        assert!(b.found.contains("CUDA 12.4"), "{}", b.found);
        assert!(!b.blocks);
        // A kernel that does not load is said, with the driver's words.
        let f = diagnose(
            &Facts {
                gather_kernel: Some(Err("CUDA_ERROR_INVALID_PTX".into())),
                ..with(13000, BlockCopies::Batched)
            },
            &config(""),
        );
        let b = find(&f, "block copies");
        assert_eq!(b.status, Status::Warn);
        assert!(b.found.contains("CUDA_ERROR_INVALID_PTX"), "{}", b.found);
        // Without a driver, nothing to say.
        let f = diagnose(&healthy(), &config(""));
        assert!(!f.iter().any(|f| f.check == "block copies"));
    }

    #[test]
    fn pool_export_reports_the_two_process_test() {
        let driver = CudaDriver {
            cuda_version: 13000,
            kernel_module: None,
            devices: vec![gpu(0), gpu(1)],
            peer_access: vec![vec![true, true], vec![true, true]],
        };
        let with = |pool_export: Vec<PoolTest>| Facts {
            cuda: CudaProbe::Ready(driver.clone()),
            pool_export,
            ..healthy()
        };
        let passed = |ordinal| PoolTest {
            ordinal,
            outcome: Ok(()),
        };

        let f = diagnose(&with(vec![passed(0), passed(1)]), &config(""));
        let p = find(&f, "pool export");
        assert_eq!(p.status, Status::Ok);
        assert!(p.found.contains("GPU0, GPU1"), "{}", p.found);
        assert!(!p.found.contains("arrives"), "{}", p.found);

        let failed = PoolTest {
            ordinal: 1,
            outcome: Err(
                "importing the pool: cuMemPoolImportFromShareableHandle failed: \
                          CUDA_ERROR_NOT_PERMITTED"
                    .into(),
            ),
        };
        let f = diagnose(&with(vec![passed(0), failed]), &config(""));
        let p = find(&f, "pool export");
        assert_eq!(p.status, Status::Warn);
        assert!(
            p.found.contains("GPU1: importing the pool") && !p.found.contains("GPU0"),
            "{}",
            p.found
        );
        assert!(p.remedy.is_some());
        assert!(!p.blocks);

        // Not run (made-up facts, or no way to start the importer): said as such.
        let f = diagnose(&with(Vec::new()), &config(""));
        let p = find(&f, "pool export");
        assert_eq!(p.status, Status::Skipped);
        assert!(p.found.contains("did not run"), "{}", p.found);
    }

    #[test]
    fn render_aligns_one_finding_per_line() {
        let text = render(&diagnose(&healthy(), &config("")));
        assert!(text.contains("  skipped  cuda "), "{text}");
        assert!(
            text.lines().any(|l| l.starts_with("  ok       /dev/shm")),
            "{text}"
        );
    }
}
