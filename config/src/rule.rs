//! Transport selection rules: which transports to try for a transfer, and in which direction.
//!
//! Rules are pure data; [`Rule::matches`] and
//! [`TransportConfig::first_match`](crate::TransportConfig::first_match) do no I/O.

use serde::{Deserialize, Serialize};

use crate::names::config_names;
use crate::units::{size, size_option};

/// Where the two ends of a transfer are, relative to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Locality {
    /// Both ends in one process (`"same-process"`).
    SameProcess,
    /// Two processes on one host (`"same-host"`).
    SameHost,
    /// Two hosts (`"remote"`).
    Remote,
}

/// The kind of memory at one end of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryClass {
    /// Pageable host memory (`"host"`).
    Host,
    /// Page-locked host memory (`"pinned"`).
    Pinned,
    /// GPU memory (`"device"`).
    Device,
}

/// A transport, by the name the configuration uses for it.
///
/// All four names are accepted in a configuration whether or not this build or this machine
/// can run the transport; a rule simply falls through to its next transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportName {
    /// Host memory over TCP (`"tcp"`).
    Tcp,
    /// CUDA IPC between processes of one host (`"ipc"`).
    Ipc,
    /// Device → pinned host → link → pinned host → device, pipelined (`"staged"`).
    Staged,
    /// UCX: GPUDirect RDMA or host memory across hosts (`"ucx"`).
    Ucx,
    /// Host memory between processes of one host, read in place from a shared-memory pool
    /// (`"shm"`).
    Shm,
}

/// Which side moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The receiver grants a region and the sender writes into it (`"push"`).
    Push,
    /// The sender offers a buffer and the receiver copies from it (`"pull"`).
    Pull,
}

config_names! {
    Locality { SameProcess => "same-process", SameHost => "same-host", Remote => "remote" }
    MemoryClass { Host => "host", Pinned => "pinned", Device => "device" }
    TransportName { Tcp => "tcp", Ipc => "ipc", Staged => "staged", Ucx => "ucx", Shm => "shm" }
    Direction { Push => "push", Pull => "pull" }
}

/// One transport selection rule. The first rule that matches a transfer picks its transports
/// (tried in order) and its direction.
///
/// `name` and `transports` are required; every other field defaults to "any".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Name shown by `ferry explain` and in logs; `[A-Za-z0-9._-]`, unique among rules.
    pub name: String,
    /// Localities this rule applies to; empty means any.
    #[serde(default)]
    pub locality: Vec<Locality>,
    /// Memory classes of the source buffer; empty means any.
    #[serde(default)]
    pub src: Vec<MemoryClass>,
    /// Memory classes of the destination buffer; empty means any.
    #[serde(default)]
    pub dst: Vec<MemoryClass>,
    /// Smallest transfer (inclusive) this rule applies to, in bytes. Default 0.
    #[serde(default, with = "size")]
    pub min_bytes: u64,
    /// Largest transfer (inclusive) this rule applies to, in bytes; `None` is unbounded.
    #[serde(default, with = "size_option", skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// Transports to try, in order; non-empty, no repeats.
    pub transports: Vec<TransportName>,
    /// Who moves the bytes; `None` (the default): each transport's own preferred direction
    /// (tcp and staged push, ipc pulls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction: Option<Direction>,
}

impl Rule {
    /// The default's first rule, `"gpu"`: device memory to a same-host peer, over ipc
    /// (pulled by the receiver), else staged (through shared pinned memory), else tcp.
    pub fn same_host_gpu() -> Rule {
        Rule {
            name: "gpu".into(),
            locality: vec![Locality::SameHost],
            src: vec![MemoryClass::Device],
            dst: Vec::new(),
            min_bytes: 0,
            max_bytes: None,
            transports: vec![
                TransportName::Ipc,
                TransportName::Staged,
                TransportName::Tcp,
            ],
            direction: Some(Direction::Pull),
        }
    }

    /// The default's second rule, `"remote-gpu"`: device memory to another host over ucx
    /// (GPUDirect RDMA where the machine has it), else staged through pinned host memory
    /// over the link, else tcp.
    pub fn remote_gpu() -> Rule {
        Rule {
            name: "remote-gpu".into(),
            locality: vec![Locality::Remote],
            src: vec![MemoryClass::Device],
            dst: Vec::new(),
            min_bytes: 0,
            max_bytes: None,
            transports: vec![
                TransportName::Ucx,
                TransportName::Staged,
                TransportName::Tcp,
            ],
            direction: None,
        }
    }

    /// The default's third rule, `"remote-host"`: host memory to another host over ucx
    /// (pulled, RDMA where the machine has it), else tcp.
    pub fn remote_host() -> Rule {
        Rule {
            name: "remote-host".into(),
            locality: vec![Locality::Remote],
            src: Vec::new(),
            dst: Vec::new(),
            min_bytes: 0,
            max_bytes: None,
            transports: vec![TransportName::Ucx, TransportName::Tcp],
            direction: None,
        }
    }

    /// The default's fourth rule, `"same-host-host"`: host memory to a same-host peer over
    /// shm (the receiver copies once from the sender's pool), else tcp.
    pub fn same_host_host() -> Rule {
        Rule {
            name: "same-host-host".into(),
            locality: vec![Locality::SameHost],
            src: vec![MemoryClass::Host],
            dst: Vec::new(),
            min_bytes: 0,
            max_bytes: None,
            transports: vec![TransportName::Shm, TransportName::Tcp],
            direction: Some(Direction::Pull),
        }
    }

    /// The default's last rule, `"host"`: anything, over tcp, push.
    pub fn catch_all() -> Rule {
        Rule {
            name: "host".into(),
            locality: Vec::new(),
            src: Vec::new(),
            dst: Vec::new(),
            min_bytes: 0,
            max_bytes: None,
            transports: vec![TransportName::Tcp],
            direction: Some(Direction::Push),
        }
    }

    /// Whether this rule applies to a transfer of `bytes` bytes from `src` memory to `dst`
    /// memory at `locality`. An empty list matches anything; the size range is inclusive at
    /// both ends. Pure: no I/O, no allocation.
    pub fn matches(
        &self,
        locality: Locality,
        src: MemoryClass,
        dst: MemoryClass,
        bytes: u64,
    ) -> bool {
        fn any_or<T: PartialEq>(list: &[T], value: &T) -> bool {
            list.is_empty() || list.contains(value)
        }
        any_or(&self.locality, &locality)
            && any_or(&self.src, &src)
            && any_or(&self.dst, &dst)
            && bytes >= self.min_bytes
            && self.max_bytes.is_none_or(|max| bytes <= max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Locality::*;
    use MemoryClass::*;

    #[test]
    fn empty_lists_match_anything() {
        let rule = Rule::catch_all();
        for locality in [SameProcess, SameHost, Remote] {
            for src in [Host, Pinned, Device] {
                assert!(rule.matches(locality, src, Device, 0));
                assert!(rule.matches(locality, src, Host, u64::MAX));
            }
        }
    }

    #[test]
    fn every_condition_must_hold() {
        let rule = Rule {
            name: "gpu".into(),
            locality: vec![SameHost],
            src: vec![Device],
            dst: vec![Device, Pinned],
            min_bytes: 10,
            max_bytes: Some(20),
            transports: vec![TransportName::Ipc],
            direction: Some(Direction::Pull),
        };
        assert!(rule.matches(SameHost, Device, Pinned, 10));
        assert!(rule.matches(SameHost, Device, Device, 20));
        assert!(!rule.matches(Remote, Device, Device, 15));
        assert!(!rule.matches(SameHost, Host, Device, 15));
        assert!(!rule.matches(SameHost, Device, Host, 15));
        assert!(!rule.matches(SameHost, Device, Device, 9));
        assert!(!rule.matches(SameHost, Device, Device, 21));
    }

    proptest::proptest! {
        /// Sizes written by the serializer (`ferry config show`) read back to the same value.
        #[test]
        fn rule_sizes_survive_toml(min in proptest::prelude::any::<u64>(), max in proptest::option::of(proptest::prelude::any::<u64>())) {
            let rule = Rule { min_bytes: min, max_bytes: max, ..Rule::catch_all() };
            let text = toml::to_string(&rule).map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
            let back: Rule = toml::from_str(&text).map_err(|e| proptest::test_runner::TestCaseError::fail(e.to_string()))?;
            proptest::prop_assert_eq!(back, rule);
        }
    }

    #[test]
    fn names_match_serde() {
        assert_eq!(Locality::SameHost.to_string(), "same-host");
        assert_eq!(TransportName::Staged.as_str(), "staged");
        assert_eq!("pull".parse(), Ok(Direction::Pull));
        let err = "carrier-pigeon"
            .parse::<TransportName>()
            .expect_err("unknown");
        assert!(
            err.contains("expected one of `tcp`, `ipc`, `staged`, `ucx`"),
            "{err}"
        );
    }
}
