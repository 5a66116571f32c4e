//! What `ferry doctor` says of the configuration's rules: one finding per rule, whether a
//! transport it lists can carry something here, and why the others cannot.

use ferry_config::{Config, Locality, MemoryClass, Rule, TransportName};
use ferry_transports::transport::{Capabilities, DevicePath, Finding, Status, Viability};

/// One finding per rule: which of its transports can carry something here, and why the
/// others cannot.
pub(super) fn config_findings(
    config: &Config,
    catalog: &[(Capabilities, Viability)],
) -> Vec<Finding> {
    config
        .transport
        .rules
        .iter()
        .enumerate()
        .map(|(i, rule)| {
            let copy_engine = catalog
                .iter()
                .any(|(c, v)| c.device_path == DevicePath::CopyEngine && *v == Viability::Viable);
            if *rule == ferry_config::Rule::same_host_gpu() && !copy_engine {
                // The built-in GPU rule on a machine without GPU transports: device memory
                // cannot exist here, so nothing is lost.
                return Finding::new(
                    format!("rule #{i} {}", rule.name),
                    Status::Skipped,
                    "device memory only; no GPU transport here",
                );
            }
            rule_finding(i, rule, catalog)
        })
        .collect()
}

fn rule_finding(index: usize, rule: &Rule, catalog: &[(Capabilities, Viability)]) -> Finding {
    let check = format!("rule #{index} {}", rule.name);
    let verdicts: Vec<(TransportName, Result<(), String>)> = rule
        .transports
        .iter()
        .map(|&t| (t, transport_fits_rule(t, rule, catalog)))
        .collect();
    let reasons = |list: &[(TransportName, Result<(), String>)]| {
        list.iter()
            .filter_map(|(t, v)| v.as_ref().err().map(|why| format!("{t} ({why})")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    match verdicts.iter().position(|(_, v)| v.is_ok()) {
        None => Finding {
            check,
            status: Status::Problem,
            found: format!(
                "no transport of this rule can run here: {}",
                reasons(&verdicts)
            ),
            remedy: Some(format!(
                "add a transport viable here to the rule's list ({} carries host memory \
                 between processes and hosts), or fix what keeps the listed ones from running",
                ferry_transports::registry::LINK
            )),
            blocks: true,
        },
        Some(0) => Finding::new(check, Status::Ok, format!("uses {}", verdicts[0].0)),
        Some(k) => Finding::new(
            check,
            Status::Warn,
            format!(
                "falls back to {}: {}",
                verdicts[k].0,
                reasons(&verdicts[..k])
            ),
        )
        .remedy(
            "expected while those transports are not built; otherwise fix what the reasons name",
        ),
    }
}

/// Whether transport `t` is viable here and its declaration can carry at least part of
/// what `rule` matches, in the rule's direction.
fn transport_fits_rule(
    t: TransportName,
    rule: &Rule,
    catalog: &[(Capabilities, Viability)],
) -> Result<(), String> {
    let (caps, viability) = catalog
        .iter()
        .find(|(c, _)| c.name == t)
        .ok_or_else(|| "unknown to this build".to_string())?;
    if let Viability::NotViable(why) = viability {
        return Err(why.clone());
    }
    if caps.direction_for(rule.direction).is_none() {
        return Err(ferry_transports::transport::Unsuitable::Direction(rule.direction).to_string());
    }
    let localities: &[Locality] = if rule.locality.is_empty() {
        &[Locality::SameProcess, Locality::SameHost, Locality::Remote]
    } else {
        &rule.locality
    };
    if let Some(l) = localities.iter().find(|l| !caps.localities.contains(l))
        && !localities.iter().any(|l| caps.localities.contains(l))
    {
        return Err(format!("cannot reach a {l} peer"));
    }
    for (end, list) in [("source", &rule.src), ("destination", &rule.dst)] {
        let kinds: &[MemoryClass] = if list.is_empty() {
            &[MemoryClass::Host, MemoryClass::Pinned, MemoryClass::Device]
        } else {
            list
        };
        let declared = if end == "source" {
            caps.sources
        } else {
            caps.memory
        };
        if !kinds.iter().any(|k| declared.contains(k)) {
            let names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
            return Err(format!("cannot move {} {end} memory", names.join("/")));
        }
    }
    Ok(())
}
