//! Addresses in a manifest: IP literals, or host names left for the launcher to resolve.
//!
//! A hand-written manifest usually names IPs; one derived from a Slurm allocation or a
//! Kubernetes headless Service names hosts (`node01`, `job-0.svc`), which only the
//! cluster's resolver knows. Resolving here would make parsing depend on the network and
//! differ between machines, so names are checked for syntax only and kept as written;
//! the launcher resolves them when it connects.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A node's address: an IP literal or a host name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Host {
    /// An IPv4 or IPv6 literal.
    Ip(IpAddr),
    /// A DNS host name (RFC 1123 syntax), resolved by the launcher.
    Name(String),
}

impl Host {
    /// Parses an IP literal or a syntactically valid host name.
    ///
    /// # Errors
    /// The rule the text breaks, in words.
    pub fn parse(text: &str) -> Result<Host, String> {
        if let Ok(ip) = text.parse::<IpAddr>() {
            return Ok(Host::Ip(ip));
        }
        check_host_name(text).map(|()| Host::Name(text.to_ascii_lowercase()))
    }

    /// The wildcard address of this host's family, to listen on every interface.
    pub fn unspecified(&self) -> IpAddr {
        match self {
            Host::Ip(IpAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        }
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Ip(ip) => write!(f, "{ip}"),
            Host::Name(n) => f.write_str(n),
        }
    }
}

/// A host and a port, such as the rendezvous point.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// The host.
    pub host: Host,
    /// The port, never 0.
    pub port: u16,
}

impl Endpoint {
    /// Parses `ADDRESS:PORT`, `[IPV6]:PORT` or `NAME:PORT`.
    ///
    /// # Errors
    /// The rule the text breaks, in words.
    pub fn parse(text: &str) -> Result<Endpoint, String> {
        let expected = || format!("must be ADDRESS:PORT (like 10.0.0.1:29400), got `{text}`");
        if let Ok(sa) = text.parse::<SocketAddr>() {
            return Ok(Endpoint {
                host: Host::Ip(sa.ip()),
                port: check_port(i64::from(sa.port()))?,
            });
        }
        let (host, port) = text.rsplit_once(':').ok_or_else(expected)?;
        if host.contains(':') {
            return Err(format!(
                "an IPv6 address needs brackets, as `[{host}]:{port}`; got `{text}`"
            ));
        }
        let port: i64 = port.parse().map_err(|_| expected())?;
        Ok(Endpoint {
            host: Host::parse(host)?,
            port: check_port(port)?,
        })
    }

    /// The socket address, when the host is an IP literal.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        match self.host {
            Host::Ip(ip) => Some(SocketAddr::new(ip, self.port)),
            Host::Name(_) => None,
        }
    }
}

impl fmt::Display for Endpoint {
    /// `host:port`, with brackets around an IPv6 address: what `TcpStream::connect` takes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host {
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            _ => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

/// A port peers can be told: 1-65535 (0 would let the system pick one nobody knows).
pub(crate) fn check_port(port: i64) -> Result<u16, String> {
    match u16::try_from(port) {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!("must be a port number from 1 to 65535, got {port}")),
    }
}

/// RFC 1123 host name syntax: dot-separated labels of letters, digits and inner hyphens,
/// at most 63 characters each and 253 in all, and not all digits at the end (so a
/// mistyped IP such as `10.0.0.256` is not taken for a name).
fn check_host_name(text: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "`{text}` is neither an IP address nor a host name: {why}"
        ))
    };
    if text.is_empty() {
        return bad("it is empty");
    }
    if text.len() > 253 {
        return bad("longer than 253 characters");
    }
    for label in text.split('.') {
        if label.is_empty() || label.len() > 63 {
            return bad("each dot-separated part has 1 to 63 characters");
        }
        if !label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return bad("a host name has only letters, digits, `-` and `.`");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return bad("a part may not start or end with `-`");
        }
    }
    if text
        .rsplit('.')
        .next()
        .is_some_and(|l| l.chars().all(|c| c.is_ascii_digit()))
    {
        return bad("it looks like an IP address but is not a valid one");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_follow_rfc_1123_and_mistyped_ips_are_not_names() {
        for ok in [
            "n01",
            "node-01.cluster.example",
            "A1",
            "x.y1",
            "1node",
            &"a".repeat(63),
        ] {
            assert!(check_host_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "a..b",
            "a_b",
            "a b",
            "10.0.0.256",
            "1.2.3",
            "a.1",
            &"a".repeat(64),
        ] {
            assert!(check_host_name(bad).is_err(), "{bad}");
        }
        assert!(
            check_host_name(&vec!["a".repeat(63); 4].join(".")).is_err(),
            "255 characters"
        );
        assert_eq!(Host::parse("Node01").unwrap(), Host::Name("node01".into()));
        assert_eq!(
            Host::parse("::1").unwrap().unspecified(),
            "::".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            Host::parse("n1").unwrap().unspecified(),
            "0.0.0.0".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn endpoints_parse_ips_bracketed_ipv6_and_names() {
        let e = Endpoint::parse("[fe80::1]:80").unwrap();
        assert_eq!(
            (e.to_string(), e.socket_addr().is_some()),
            ("[fe80::1]:80".into(), true)
        );
        assert_eq!(Endpoint::parse("n1:7").unwrap().to_string(), "n1:7");
        for bad in [
            "n1",
            "n1:",
            "n1:x",
            ":80",
            "n1:65536",
            "n1:-1",
            "fe80::1:80",
            "n_1:80",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            check_port(0).unwrap_err(),
            "must be a port number from 1 to 65535, got 0"
        );
    }
}
