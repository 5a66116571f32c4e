//! Sizes, durations and memory budgets as people write them: `"64 MiB"`, `"30s"`, `"80%"`.
//!
//! Values are parsed exactly (integer arithmetic, no rounding) and printed in a form that
//! parses back to the same value, so a configuration survives `ferry config show`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Units accepted after a number, lower-cased, with their size in bytes. The order is the
/// order of preference when printing (binary units first).
const UNITS: &[(&str, &str, u64)] = &[
    ("eib", "EiB", 1 << 60),
    ("pib", "PiB", 1 << 50),
    ("tib", "TiB", 1 << 40),
    ("gib", "GiB", 1 << 30),
    ("mib", "MiB", 1 << 20),
    ("kib", "KiB", 1 << 10),
    ("eb", "EB", 1_000_000_000_000_000_000),
    ("pb", "PB", 1_000_000_000_000_000),
    ("tb", "TB", 1_000_000_000_000),
    ("gb", "GB", 1_000_000_000),
    ("mb", "MB", 1_000_000),
    ("kb", "kB", 1_000),
    ("b", "B", 1),
];

/// Parses a size: a number of bytes (`"4096"`) or a number and a unit (`"64 MiB"`, `"64MiB"`,
/// `"1.5 GiB"`, `"1 GB"`). Units are case-insensitive; `KiB`, `MiB`, ... are powers of 1024
/// and `kB`, `MB`, ... powers of 1000. A bare `K`, `M` or `G` is refused as ambiguous, and so
/// is a fraction that is not a whole number of bytes.
///
/// # Errors
///
/// A message saying what is wrong with the text (it does not repeat the text).
pub fn parse_size(text: &str) -> Result<u64, crate::ParseError> {
    let text = text.trim();
    let unit_start = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = (&text[..unit_start], text[unit_start..].trim());
    let (whole, fraction) = match number.split_once('.') {
        Some((whole, fraction)) => (whole, fraction),
        None => (number, ""),
    };
    if whole.is_empty() || (number.contains('.') && fraction.is_empty()) {
        return Err("expected a number of bytes, or a number and a unit such as MiB".into());
    }
    let unit_lower = unit.to_ascii_lowercase();
    let multiplier = if unit.is_empty() {
        1
    } else if let Some(&(_, _, bytes)) = UNITS.iter().find(|(name, _, _)| *name == unit_lower) {
        bytes
    } else if matches!(unit_lower.as_str(), "k" | "m" | "g" | "t" | "p" | "e") {
        return Err(format!(
            "unit {unit:?} is ambiguous; write {}iB (powers of 1024) or {}B (powers of 1000)",
            unit.to_ascii_uppercase(),
            unit.to_ascii_uppercase()
        )
        .into());
    } else {
        return Err(
            format!("unknown unit {unit:?}; use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB").into(),
        );
    };
    let too_large = || "too large (the limit is 16 EiB)".to_string();
    // Digits only from here on, so the parses fail only on overflow.
    let whole: u128 = whole.parse().map_err(|_| too_large())?;
    let mut bytes = whole
        .checked_mul(u128::from(multiplier))
        .ok_or_else(too_large)?;
    if !fraction.is_empty() {
        if fraction.len() > 19 {
            return Err("too many digits after the decimal point".into());
        }
        let numerator: u128 = fraction.parse().map_err(|_| too_large())?;
        let denominator = 10u128.pow(fraction.len() as u32);
        let scaled = numerator * u128::from(multiplier);
        if scaled % denominator != 0 {
            return Err("is not a whole number of bytes".into());
        }
        bytes += scaled / denominator;
    }
    u64::try_from(bytes).map_err(|_| too_large().into())
}

/// Prints a size in the shortest exact form [`parse_size`] reads back: `"1 MiB"`, `"1536 KiB"`,
/// `"1 GB"`, `"1000001 B"`, `"0 B"`.
pub fn format_size(bytes: u64) -> String {
    let mut best = (bytes, "B");
    for &(_, label, unit) in UNITS {
        if bytes != 0 && bytes % unit == 0 && bytes / unit < best.0 {
            best = (bytes / unit, label);
        }
    }
    format!("{} {}", best.0, best.1)
}

/// Reads a size from a string ([`parse_size`]) or a non-negative integer (bytes).
struct SizeVisitor;

impl Visitor<'_> for SizeVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a size such as \"64 MiB\" or a number of bytes")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom(format!("invalid size {v}: must not be negative")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        parse_size(v).map_err(|msg| E::custom(format!("invalid size {v:?}: {msg}")))
    }
}

/// `#[serde(with = "size")]` for a `u64` byte count written as a size string.
pub(crate) mod size {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(bytes: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_size(*bytes))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(SizeVisitor)
    }
}

/// `#[serde(with = "size_option")]` for an optional size; `None` is left out when written.
pub(crate) mod size_option {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(bytes: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(bytes) => s.serialize_some(&format_size(*bytes)),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        struct Wrapped(u64);
        impl<'de> Deserialize<'de> for Wrapped {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any(SizeVisitor).map(Wrapped)
            }
        }
        Ok(Option::<Wrapped>::deserialize(d)?.map(|w| w.0))
    }
}

/// A size that may be left to the program to pick: `"auto"` or a size (`"4 MiB"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AutoSize {
    /// Picked at start-up (see the key that uses it).
    #[default]
    Auto,
    /// Exactly this many bytes.
    Bytes(u64),
}

impl fmt::Display for AutoSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AutoSize::Auto => f.write_str("auto"),
            AutoSize::Bytes(b) => f.write_str(&format_size(*b)),
        }
    }
}

impl Serialize for AutoSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for AutoSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct AutoVisitor;
        impl Visitor<'_> for AutoVisitor {
            type Value = AutoSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\" or a size such as \"4 MiB\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<AutoSize, E> {
                if v.trim().eq_ignore_ascii_case("auto") {
                    return Ok(AutoSize::Auto);
                }
                SizeVisitor.visit_str(v).map(AutoSize::Bytes)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<AutoSize, E> {
                Ok(AutoSize::Bytes(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<AutoSize, E> {
                SizeVisitor.visit_i64(v).map(AutoSize::Bytes)
            }
        }
        d.deserialize_any(AutoVisitor)
    }
}

/// `#[serde(with = "duration")]` for a [`Duration`] written the humantime way (`"30s"`,
/// `"1m 30s"`, `"250ms"`).
pub(crate) mod duration {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        struct DurationVisitor;
        impl Visitor<'_> for DurationVisitor {
            type Value = Duration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as \"30s\" or \"250ms\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
                humantime::parse_duration(v)
                    .map_err(|e| E::custom(format!("invalid duration {v:?}: {e}")))
            }
        }
        d.deserialize_str(DurationVisitor)
    }
}

/// `#[serde(with = "duration_option")]` for an optional duration; `None` is left out when
/// written.
pub(crate) mod duration_option {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&humantime::format_duration(*d).to_string()),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        struct Wrapped(Duration);
        impl<'de> Deserialize<'de> for Wrapped {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                super::duration::deserialize(d).map(Wrapped)
            }
        }
        Ok(Option::<Wrapped>::deserialize(d)?.map(|w| w.0))
    }
}

/// A memory budget: a fixed number of bytes, or a share of what the domain has.
///
/// Written `"64 MiB"`, `"1GiB"`, `"4096"` (bytes) or `"80%"`. A percentage must be in
/// `(0, 100]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// This many bytes.
    Bytes(u64),
    /// This percentage of the domain's total memory, in `(0, 100]`.
    Percent(f64),
}

impl Budget {
    /// The budget in bytes for a domain of `total` bytes. A percentage is rounded down; a byte
    /// count is returned as it is, even when it exceeds `total` (the allocator decides what
    /// to do with a budget larger than the memory).
    pub fn resolve(&self, total: u64) -> u64 {
        match *self {
            Budget::Bytes(bytes) => bytes,
            Budget::Percent(percent) => {
                // f64 -> u64 `as` saturates; the min guards rounding above `total`.
                ((total as f64) * (percent / 100.0))
                    .floor()
                    .min(total as f64) as u64
            }
        }
    }
}

impl FromStr for Budget {
    type Err = crate::ParseError;

    /// Parses `"80%"` or a size ([`parse_size`]).
    fn from_str(text: &str) -> Result<Self, crate::ParseError> {
        let text = text.trim();
        match text.strip_suffix('%') {
            Some(number) => {
                let percent: f64 = number
                    .trim()
                    .parse()
                    .map_err(|_| "expected a percentage such as \"80%\"".to_string())?;
                if percent.is_finite() && percent > 0.0 && percent <= 100.0 {
                    Ok(Budget::Percent(percent))
                } else {
                    Err("a percentage must be above 0 and at most 100".into())
                }
            }
            None => parse_size(text).map(Budget::Bytes),
        }
    }
}

impl fmt::Display for Budget {
    /// Prints the form [`Budget::from_str`] reads back: `"50%"`, `"64 MiB"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Budget::Bytes(bytes) => f.write_str(&format_size(*bytes)),
            Budget::Percent(percent) => write!(f, "{percent}%"),
        }
    }
}

impl Serialize for Budget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Budget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct BudgetVisitor;
        impl Visitor<'_> for BudgetVisitor {
            type Value = Budget;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a budget such as \"80%\" or \"64 GiB\"")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Budget, E> {
                Ok(Budget::Bytes(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Budget, E> {
                SizeVisitor.visit_i64(v).map(Budget::Bytes)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Budget, E> {
                v.parse()
                    .map_err(|msg| E::custom(format!("invalid budget {v:?}: {msg}")))
            }
        }
        d.deserialize_any(BudgetVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_parse() {
        for (text, bytes) in [
            ("4096", 4096),
            ("0", 0),
            ("64 MiB", 64 << 20),
            ("64MiB", 64 << 20),
            ("64mib", 64 << 20),
            ("1GiB", 1 << 30),
            ("1 GB", 1_000_000_000),
            ("1 kB", 1000),
            ("1.5 KiB", 1536),
            ("  2 B ", 2),
            ("15 EiB", 15 << 60),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
    }

    #[test]
    fn bad_sizes_say_why() {
        for (text, needle) in [
            ("12 parsecs", "unknown unit"),
            ("64M", "ambiguous"),
            ("0.1 KiB", "whole number"),
            ("MiB", "expected a number"),
            ("1. MiB", "expected a number"),
            ("-1", "expected a number"),
            ("99999999999 EiB", "too large"),
            ("16 EiB", "too large"),
        ] {
            let err = parse_size(text).expect_err(text);
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn sizes_print_exactly() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1 << 20), "1 MiB");
        assert_eq!(format_size(1536 << 10), "1536 KiB");
        assert_eq!(format_size(1_000_000_000), "1 GB");
        assert_eq!(format_size(1_000_001), "1000001 B");
        assert_eq!(format_size(4 << 20), "4 MiB");
    }

    #[test]
    fn budgets() {
        assert_eq!("80%".parse(), Ok(Budget::Percent(80.0)));
        assert_eq!("12.5 %".parse(), Ok(Budget::Percent(12.5)));
        assert_eq!("100%".parse(), Ok(Budget::Percent(100.0)));
        assert_eq!("64 MiB".parse(), Ok(Budget::Bytes(64 << 20)));
        assert_eq!("4096".parse(), Ok(Budget::Bytes(4096)));
        for bad in ["0%", "100.5%", "-3%", "NaN%", "inf%", "lots%", "%"] {
            assert!(bad.parse::<Budget>().is_err(), "{bad}");
        }
        assert_eq!(Budget::Percent(50.0).resolve(1001), 500);
        assert_eq!(Budget::Percent(100.0).resolve(u64::MAX), u64::MAX);
        assert_eq!(Budget::Bytes(7).resolve(1), 7);
        assert_eq!(Budget::Percent(50.0).to_string(), "50%");
    }

    proptest! {
        #[test]
        fn printed_sizes_parse_back(bytes in any::<u64>()) {
            prop_assert_eq!(parse_size(&format_size(bytes)), Ok(bytes));
        }

        #[test]
        fn round_multiples_parse_back(n in 0u64..1 << 20, shift in 0u32..40) {
            let bytes = n << shift;
            prop_assert_eq!(parse_size(&format_size(bytes)), Ok(bytes));
        }

        #[test]
        fn printed_percentages_parse_back(percent in 0.0001f64..=100.0) {
            let budget = Budget::Percent(percent);
            prop_assert_eq!(budget.to_string().parse::<Budget>(), Ok(budget));
        }
    }
}
