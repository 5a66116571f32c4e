//! Addresses: where a node listens and how it reaches a peer.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How to reach a peer's control link.
///
/// Written as a string: `"unix:/run/ferry/b.sock"` is a Unix socket; `"tcp://host:port"` or
/// plain `"host:port"` is TCP (`host` may be a name, an IPv4 address or a bracketed IPv6
/// address such as `[::1]:7070`). It is written back as `"unix:PATH"` or `"host:port"`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PeerAddress {
    /// TCP, as `"host:port"` (without the `tcp://` prefix).
    Tcp(String),
    /// A Unix socket at this path.
    Unix(PathBuf),
}

impl FromStr for PeerAddress {
    type Err = crate::ParseError;

    fn from_str(text: &str) -> Result<Self, crate::ParseError> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("a unix address needs a path, as in \"unix:/run/ferry/b.sock\"".into());
            }
            return Ok(PeerAddress::Unix(PathBuf::from(path)));
        }
        let host_port = text.strip_prefix("tcp://").unwrap_or(text);
        if host_port.contains("://") {
            return Err(
                "unknown scheme; use \"unix:/path\", \"tcp://host:port\" or \"host:port\"".into(),
            );
        }
        check_peer_host_port(host_port)?;
        Ok(PeerAddress::Tcp(host_port.to_string()))
    }
}

impl fmt::Display for PeerAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddress::Tcp(host_port) => f.write_str(host_port),
            PeerAddress::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

impl Serialize for PeerAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            PeerAddress::Tcp(host_port) => s.serialize_str(host_port),
            PeerAddress::Unix(path) => match path.to_str() {
                Some(path) => s.serialize_str(&format!("unix:{path}")),
                None => Err(serde::ser::Error::custom(format!(
                    "unix socket path {} is not UTF-8",
                    path.display()
                ))),
            },
        }
    }
}

impl<'de> Deserialize<'de> for PeerAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct AddressVisitor;
        impl Visitor<'_> for AddressVisitor {
            type Value = PeerAddress;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an address such as \"host:port\" or \"unix:/path/x.sock\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<PeerAddress, E> {
                v.parse()
                    .map_err(|msg| E::custom(format!("invalid peer address {v:?}: {msg}")))
            }
        }
        d.deserialize_str(AddressVisitor)
    }
}

/// Splits `"host:port"` or `"[v6]:port"` into the host (brackets removed) and the port.
fn split_host_port(text: &str) -> Result<(&str, u16), crate::ParseError> {
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (host, port) = rest.split_once("]:").ok_or("expected \"[IPv6]:port\"")?;
        host.parse::<std::net::Ipv6Addr>()
            .map_err(|_| format!("{host:?} is not an IPv6 address"))?;
        (host, port)
    } else {
        let (host, port) = text.rsplit_once(':').ok_or("expected \"host:port\"")?;
        if host.contains(':') {
            return Err("put an IPv6 address in brackets, as in \"[::1]:7070\"".into());
        }
        (host, port)
    };
    if host.is_empty() {
        return Err("the host is missing".into());
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("port {port:?} is not a number from 0 to 65535"))?;
    Ok((host, port))
}

/// Checks a peer's `"host:port"`: a host name or IP address and a port other than 0.
pub(crate) fn check_peer_host_port(text: &str) -> Result<(), crate::ParseError> {
    let (host, port) = split_host_port(text)?;
    let name_like = host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-');
    if !name_like && host.parse::<IpAddr>().is_err() {
        return Err(format!("{host:?} is neither a host name nor an IP address").into());
    }
    if port == 0 {
        return Err("port 0 cannot be dialed".into());
    }
    Ok(())
}

/// A listening address, as accepted in `node.listen` and `telemetry.metrics_listen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ListenAddress {
    /// An IP literal and port.
    Ip(SocketAddr),
    /// `localhost:port`.
    Localhost(u16),
}

/// Parses `"IP:port"`, `"[IPv6]:port"` or `"localhost:port"`. Port 0 asks for an ephemeral
/// port. Host names other than `localhost` are refused: a listener binds to what the file
/// says, not to whatever a name resolves to today.
pub(crate) fn parse_listen(text: &str) -> Result<ListenAddress, crate::ParseError> {
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(ListenAddress::Ip(addr));
    }
    match split_host_port(text) {
        Ok((host, port)) if host.eq_ignore_ascii_case("localhost") => {
            Ok(ListenAddress::Localhost(port))
        }
        Ok(_) => Err(
            "expected an IP address and port, or \"localhost:port\"; host names are not resolved"
                .into(),
        ),
        Err(msg) => Err(msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_addresses() {
        assert_eq!(
            "unix:/run/x.sock".parse(),
            Ok(PeerAddress::Unix("/run/x.sock".into()))
        );
        assert_eq!("tcp://h:1".parse(), Ok(PeerAddress::Tcp("h:1".into())));
        assert_eq!(
            "10.0.0.2:7070".parse(),
            Ok(PeerAddress::Tcp("10.0.0.2:7070".into()))
        );
        assert_eq!(
            "[::1]:7070".parse(),
            Ok(PeerAddress::Tcp("[::1]:7070".into()))
        );
        for bad in [
            "unix:",
            "h",
            "h:0",
            ":7070",
            "::1:7070",
            "h:port",
            "http://h:1",
            "a b:1",
            "[zz]:1",
        ] {
            assert!(bad.parse::<PeerAddress>().is_err(), "{bad}");
        }
        let unix = PeerAddress::Unix("/run/x.sock".into());
        assert_eq!(unix.to_string().parse(), Ok(unix));
    }

    #[test]
    fn listen_addresses() {
        assert!(matches!(
            parse_listen("127.0.0.1:0"),
            Ok(ListenAddress::Ip(_))
        ));
        assert!(matches!(
            parse_listen("[::1]:7070"),
            Ok(ListenAddress::Ip(_))
        ));
        assert_eq!(
            parse_listen("localhost:7070"),
            Ok(ListenAddress::Localhost(7070))
        );
        for bad in ["example.com:7070", "127.0.0.1", "127.0.0.1:99999", ""] {
            assert!(parse_listen(bad).is_err(), "{bad}");
        }
    }
}
