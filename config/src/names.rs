//! Names in the configuration: enums spelled as fixed strings (`"same-host"`, `"tcp"`,
//! `"json"`), and what a node, peer or rule name may be.

/// Whether `name` is a valid node, peer or rule name: non-empty, only `[A-Za-z0-9._-]`.
pub(crate) fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Gives a fieldless enum its configuration spelling: `as_str`, `Display`, `FromStr`, and
/// serde as that string. Written out rather than derived so that every source (TOML, YAML,
/// environment) reports an unknown name the same way: "unknown variant `x`, expected one of
/// ...".
macro_rules! config_names {
    ($($ty:ident { $($variant:ident => $name:literal),* $(,)? })*) => {$(
        impl $ty {
            /// Every spelling this type accepts, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($name),*];

            /// The name used for this value in configuration files.
            pub fn as_str(self) -> &'static str {
                match self { $($ty::$variant => $name),* }
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = crate::ParseError;

            /// Parses the configuration spelling (exact, case-sensitive).
            fn from_str(text: &str) -> Result<Self, crate::ParseError> {
                match text {
                    $($name => Ok($ty::$variant),)*
                    _ => Err(format!(
                        "unknown variant `{text}`, expected one of {}",
                        $ty::NAMES.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
                    ).into()),
                }
            }
        }

        impl ::serde::Serialize for $ty {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $ty {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct NameVisitor;
                impl ::serde::de::Visitor<'_> for NameVisitor {
                    type Value = $ty;

                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        write!(f, "one of {}", $ty::NAMES.join(", "))
                    }

                    fn visit_str<E: ::serde::de::Error>(self, v: &str) -> Result<$ty, E> {
                        v.parse().map_err(E::custom)
                    }
                }
                d.deserialize_str(NameVisitor)
            }
        }
    )*};
}

pub(crate) use config_names;
