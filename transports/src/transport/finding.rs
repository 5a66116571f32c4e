//! What `ferry doctor` reports: one [`Finding`] per check, from the node's own checks and
//! from each transport's [`probe`](super::TransportKind::probe) of what it is built on.

use serde::Serialize;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Nothing to do.
    Ok,
    /// Works, but slower or narrower than it could; the remedy says how to do better.
    Warn,
    /// Does not work; the remedy says how to fix it.
    Problem,
    /// Not checked (nothing to check, or the check is not built yet); the text says which.
    Skipped,
}

impl Status {
    /// The status as the doctor's table prints it (`ok`, `warn`, `problem`, `skipped`).
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Problem => "problem",
            Self::Skipped => "skipped",
        }
    }
}

/// One line of the doctor's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// What was checked ("cuda", "/dev/shm", "rule #0 host", ...).
    pub check: String,
    /// How it came out.
    pub status: Status,
    /// What was found.
    pub found: String,
    /// What to do about it, when anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remedy: Option<String>,
    /// True when this blocks a transport the configuration relies on (exit status 1).
    pub blocks: bool,
}

impl Finding {
    /// A finding of `check` that came out `status`, with what was `found`; no remedy, and
    /// it blocks nothing.
    pub fn new(check: impl Into<String>, status: Status, found: impl Into<String>) -> Self {
        Self {
            check: check.into(),
            status,
            found: found.into(),
            remedy: None,
            blocks: false,
        }
    }

    /// The same finding, saying what to do about it.
    pub fn remedy(mut self, remedy: impl Into<String>) -> Self {
        self.remedy = Some(remedy.into());
        self
    }
}
