//! What `ferry doctor` checks of the host: the size of `/dev/shm` and the memory lock
//! limit, which pinned staging and RDMA registration run into.

use ferry_transports::transport::{Finding, Status};

use super::{MEMLOCK_MIN, Memlock, SHM_MIN};

/// A size rounded for reading: `24.0 GiB`, `8 MiB`.
pub(super) fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

pub(super) fn shm_finding(shm: &Result<u64, String>) -> Finding {
    const CHECK: &str = "/dev/shm";
    match shm {
        Err(e) => Finding::new(CHECK, Status::Warn, format!("cannot read its size: {e}"))
            .remedy("mount a tmpfs at /dev/shm: NCCL-style tools need it (ferry's staging rings are memfds, counted against the process's memory instead)"),
        Ok(size) if *size < SHM_MIN => Finding::new(
            CHECK,
            Status::Warn,
            format!(
                "{} (below {}): NCCL-style tools run out of shared memory",
                human_size(*size),
                human_size(SHM_MIN)
            ),
        )
        .remedy(
            "containers default to 64 MiB: pass --shm-size=8g to docker, or mount an \
             emptyDir with medium: Memory at /dev/shm in Kubernetes",
        ),
        Ok(size) => Finding::new(CHECK, Status::Ok, human_size(*size)),
    }
}

pub(super) fn memlock_finding(memlock: &Result<Memlock, String>) -> Finding {
    const CHECK: &str = "memlock";
    let limit = |v: Option<u64>| v.map_or_else(|| "unlimited".to_string(), human_size);
    match memlock {
        Err(e) => Finding::new(
            CHECK,
            Status::Warn,
            format!("cannot read RLIMIT_MEMLOCK: {e}"),
        ),
        Ok(Memlock { soft: None, .. }) => {
            Finding::new(CHECK, Status::Ok, "RLIMIT_MEMLOCK unlimited")
        }
        Ok(Memlock {
            soft: Some(soft),
            hard,
        }) if *soft < MEMLOCK_MIN => Finding::new(
            CHECK,
            Status::Warn,
            format!(
                "RLIMIT_MEMLOCK is {} (hard limit {}): pinning host memory for staging and \
                 RDMA registration fails beyond it",
                human_size(*soft),
                limit(*hard)
            ),
        )
        .remedy(
            "run `ulimit -l unlimited` before ferry (raise the hard limit in \
             /etc/security/limits.conf or with LimitMEMLOCK=infinity for systemd); in docker \
             pass --ulimit memlock=-1:-1",
        ),
        Ok(Memlock { soft, .. }) => Finding::new(
            CHECK,
            Status::Ok,
            format!("RLIMIT_MEMLOCK {}", limit(*soft)),
        ),
    }
}
