//! `[transport]`: the selection rules, and one section per transport, each in its own file
//! (`[transport.<name>]` in `<name>.rs`: its struct, its defaults, its checks).

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::names::is_valid_name;
use crate::rule::{Locality, MemoryClass, Rule};
use crate::units::format_size;
use crate::validate::{Violation, fail, name_problem};

mod ipc;
mod shm;
mod staged;
mod tcp;
mod ucx;

pub use ipc::IpcTuning;
pub use shm::ShmTuning;
pub use staged::StagedTuning;
pub use tcp::TcpTuning;
pub use ucx::{UcxMode, UcxTuning};

/// Smallest accepted payload of a data frame (`transport.tcp.chunk_size`,
/// `transport.staged.link_chunk`).
const MIN_CHUNK: u64 = 4 << 10;

/// `[transport]`: transport tuning and selection rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransportConfig {
    /// Tuning of the TCP transport.
    pub tcp: TcpTuning,
    /// Tuning of the ipc transport.
    pub ipc: IpcTuning,
    /// Tuning of the staged transport.
    pub staged: StagedTuning,
    /// The ucx transport.
    pub ucx: UcxTuning,
    /// The shm transport.
    pub shm: ShmTuning,
    /// Selection rules, first match wins (`[[transport.rules]]`). Default: `"gpu"`, device
    /// memory to a same-host peer over ipc (pull), falling back to staged, then tcp;
    /// `"remote-gpu"`, device memory to another host over ucx, else staged, else tcp;
    /// `"remote-host"`, anything else to another host over ucx, else tcp; `"same-host-host"`,
    /// host memory to a same-host peer over shm (pull, where both turn it on), else tcp; then `"host"`,
    /// which matches everything and uses tcp, push. A file that sets rules replaces the
    /// whole list.
    pub rules: Vec<Rule>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            tcp: TcpTuning::default(),
            ipc: IpcTuning::default(),
            staged: StagedTuning::default(),
            ucx: UcxTuning::default(),
            shm: ShmTuning::default(),
            rules: vec![
                Rule::same_host_gpu(),
                Rule::remote_gpu(),
                Rule::remote_host(),
                Rule::same_host_host(),
                Rule::catch_all(),
            ],
        }
    }
}

impl TransportConfig {
    /// The first rule that matches a transfer, with its index in `rules`, or `None` if no rule
    /// does. Pure.
    pub fn first_match(
        &self,
        locality: Locality,
        src: MemoryClass,
        dst: MemoryClass,
        bytes: u64,
    ) -> Option<(usize, &Rule)> {
        self.rules
            .iter()
            .enumerate()
            .find(|(_, rule)| rule.matches(locality, src, dst, bytes))
    }
}

impl TransportConfig {
    /// Checks each transport's section, then the rules.
    pub(crate) fn check(&self) -> Result<(), Violation> {
        self.tcp.check()?;
        self.ipc.check()?;
        self.staged.check()?;
        self.ucx.check()?;
        self.shm.check()?;
        self.check_rules()
    }

    fn check_rules(&self) -> Result<(), Violation> {
        let rules = &self.rules;
        if rules.is_empty() {
            return fail(
                "transport.rules",
                "no rules: add at least one, e.g. one without conditions that names [\"tcp\"]",
            );
        }
        let mut names = HashSet::new();
        for (i, rule) in rules.iter().enumerate() {
            let key = |field: &str| format!("transport.rules[{i}].{field}");
            if !is_valid_name(&rule.name) {
                return fail(key("name"), name_problem(&rule.name));
            }
            if !names.insert(rule.name.as_str()) {
                return fail(
                    key("name"),
                    format!("rule {:?} is defined twice", rule.name),
                );
            }
            if rule.transports.is_empty() {
                return fail(
                    key("transports"),
                    format!("rule {:?} names no transport; list at least one", rule.name),
                );
            }
            let mut seen = HashSet::new();
            if let Some(dup) = rule.transports.iter().find(|t| !seen.insert(**t)) {
                return fail(
                    key("transports"),
                    format!("rule {:?} lists transport {dup} twice", rule.name),
                );
            }
            if let Some(max) = rule.max_bytes {
                if rule.min_bytes > max {
                    return Err(Violation {
                        keys: vec![key("max_bytes"), key("min_bytes")],
                        detail: format!(
                            "rule {:?}: min_bytes ({}) is larger than max_bytes ({}), so it never matches",
                            rule.name,
                            format_size(rule.min_bytes),
                            format_size(max)
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

impl crate::Config {
    /// Bytes per data frame of what streams over the control link itself (puts, and the
    /// sends of transports whose bytes travel in its frames): `transport.tcp.chunk_size`.
    pub fn link_chunk(&self) -> u64 {
        self.transport.tcp.chunk_size
    }
}
