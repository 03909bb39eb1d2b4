//! Which hosts a stream may dial, and which hosts its sink may be sent to.
//! Checked after DNS resolution, against the addresses actually dialled, so a
//! hostname that resolves to the cloud metadata service is refused just like
//! the literal address. The sink's HTTP client resolves every name through
//! [`PolicyResolver`], so a name that changes its answer after the session's
//! first check (DNS rebinding) is still refused.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use thiserror::Error;
use url::{Host, Url};

/// Hostnames of cloud metadata services that resolve to link-local addresses.
const METADATA_HOSTNAMES: &[&str] = &["metadata.google.internal", "metadata", "instance-data"];
/// AWS's IPv6 instance metadata endpoint.
const AWS_METADATA_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254);

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("host '{host}' is not in {flag}")]
    NotAllowed { host: String, flag: &'static str },
    #[error(
        "host '{host}' resolves to {addr}, {why}; list the host in {flag} explicitly to permit it"
    )]
    Forbidden {
        host: String,
        addr: String,
        why: &'static str,
        flag: &'static str,
    },
    #[error("cannot resolve host '{host}': {detail}")]
    Resolve { host: String, detail: String },
    #[error("URL '{url}' has no host")]
    NoHost { url: String },
}

impl PolicyError {
    /// Permanent refusals are not retried; resolution failures are.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, Self::Resolve { .. })
    }
}

/// `--allow-hosts`: `*` (anything not forbidden), `*.example.com` (subdomains),
/// or an exact host name or address. Forbidden unless a host is listed by its
/// exact name: link-local and metadata addresses, and the `--deny-cidrs`
/// networks (in a cluster: the service and pod networks).
#[derive(Clone, Debug)]
pub struct HostPolicy {
    patterns: Vec<String>,
    denied: Vec<ipnet::IpNet>,
    /// The flag that lists these hosts, named in every refusal so the user
    /// knows which list to change.
    flag: &'static str,
}

impl HostPolicy {
    pub fn new(patterns: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            patterns: patterns
                .into_iter()
                .map(|p| p.into().trim().to_ascii_lowercase())
                .filter(|p| !p.is_empty())
                .collect(),
            denied: Vec::new(),
            flag: "--allow-hosts",
        }
    }

    /// Also refuses addresses in `networks` unless the host is listed exactly.
    /// The same policy for sinks: its refusals name `--allow-sink-hosts`.
    pub fn for_sinks(mut self) -> Self {
        self.flag = "--allow-sink-hosts";
        self
    }

    pub fn deny(mut self, networks: &[ipnet::IpNet]) -> Self {
        self.denied.extend_from_slice(networks);
        self
    }

    /// Why this policy refuses `ip` by default, if it does.
    fn refusal(&self, ip: IpAddr) -> Option<&'static str> {
        forbidden(ip).or_else(|| {
            let ip = match ip {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
                v4 => v4,
            };
            self.denied
                .iter()
                .any(|n| n.contains(&ip))
                .then_some("in a network listed in --deny-cidrs")
        })
    }

    fn matches(&self, host: &str) -> bool {
        self.patterns.iter().any(|p| {
            p == "*"
                || p == host
                || p.strip_prefix("*.")
                    .is_some_and(|suffix| host.ends_with(&format!(".{suffix}")))
        })
    }

    /// Listed by exact name: the only way to reach a forbidden address.
    fn explicitly_listed(&self, host: &str) -> bool {
        self.patterns.iter().any(|p| p == host)
    }

    /// Resolves the URL's host and returns the addresses it may dial.
    pub async fn resolve(&self, url: &Url) -> Result<Vec<SocketAddr>, PolicyError> {
        let port = url.port_or_known_default().unwrap_or(80);
        let (name, literal) = match url.host() {
            Some(Host::Domain(d)) => (d.to_ascii_lowercase(), None),
            Some(Host::Ipv4(ip)) => (ip.to_string(), Some(IpAddr::V4(ip))),
            Some(Host::Ipv6(ip)) => (ip.to_string(), Some(IpAddr::V6(ip))),
            None => {
                return Err(PolicyError::NoHost {
                    url: url.to_string(),
                });
            }
        };
        if !self.matches(&name) {
            return Err(PolicyError::NotAllowed {
                host: name,
                flag: self.flag,
            });
        }
        let explicit = self.explicitly_listed(&name);
        if !explicit && METADATA_HOSTNAMES.contains(&name.as_str()) {
            return Err(PolicyError::Forbidden {
                host: name.clone(),
                addr: name,
                why: "a cloud metadata service",
                flag: self.flag,
            });
        }
        let addrs: Vec<SocketAddr> = match literal {
            Some(ip) => vec![SocketAddr::new(ip, port)],
            None => tokio::net::lookup_host((name.as_str(), port))
                .await
                .map_err(|e| PolicyError::Resolve {
                    host: name.clone(),
                    detail: e.to_string(),
                })?
                .collect(),
        };
        let mut refused = None;
        let allowed: Vec<SocketAddr> = addrs
            .into_iter()
            .filter(|a| match self.refusal(a.ip()) {
                Some(why) if !explicit => {
                    refused.get_or_insert((a.ip(), why));
                    false
                }
                _ => true,
            })
            .collect();
        match (allowed.is_empty(), refused) {
            (true, Some((ip, why))) => Err(PolicyError::Forbidden {
                host: name,
                addr: ip.to_string(),
                why,
                flag: self.flag,
            }),
            (true, None) => Err(PolicyError::Resolve {
                host: name,
                detail: "no addresses".into(),
            }),
            _ => Ok(allowed),
        }
    }
}

/// Resolves the sink HTTP client's host names through a [`HostPolicy`].
pub struct PolicyResolver(pub HostPolicy);

impl reqwest::dns::Resolve for PolicyResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.0.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            // The port is reqwest's to choose: it replaces the one given here.
            let url = Url::parse(&format!("http://{host}/"))
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?;
            let addrs = policy.resolve(&url).await.map_err(Box::new)?;
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Why an address is refused by default, if it is.
fn forbidden(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) if v4.is_link_local() => {
            Some("a link-local address (cloud metadata lives there)")
        }
        IpAddr::V4(_) => None,
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return forbidden(IpAddr::V4(v4));
            }
            if v6 == AWS_METADATA_V6 {
                Some("the AWS instance metadata service")
            } else if (v6.segments()[0] & 0xffc0) == 0xfe80 {
                Some("a link-local address")
            } else {
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> Url {
        Url::parse(s).unwrap()
    }

    #[tokio::test]
    async fn denied_networks_are_refused_unless_the_host_is_listed_exactly() {
        let nets: Vec<ipnet::IpNet> = vec!["10.96.0.0/12".parse().unwrap()];
        let policy = HostPolicy::new(["*"]).deny(&nets);
        assert!(matches!(
            policy.resolve(&url("http://10.100.0.1/")).await,
            Err(PolicyError::Forbidden { .. })
        ));
        assert!(matches!(
            policy.resolve(&url("http://[::ffff:10.100.0.1]/")).await,
            Err(PolicyError::Forbidden { .. })
        ));
        assert!(policy.resolve(&url("http://10.200.0.1/")).await.is_ok());
        let listed = HostPolicy::new(["*", "10.100.0.1"]).deny(&nets);
        assert!(listed.resolve(&url("http://10.100.0.1/")).await.is_ok());
    }

    #[tokio::test]
    async fn metadata_addresses_are_refused_by_default() {
        let policy = HostPolicy::new(["*"]);
        for u in [
            "ws://169.254.169.254/latest",
            "ws://[fd00:ec2::254]/",
            "ws://[fe80::1]/",
            "ws://[::ffff:169.254.169.254]/",
            "ws://metadata.google.internal/",
        ] {
            let err = policy.resolve(&url(u)).await.unwrap_err();
            assert!(matches!(err, PolicyError::Forbidden { .. }), "{u}: {err}");
            assert!(err.is_permanent());
        }
        assert!(policy.resolve(&url("ws://127.0.0.1:9/")).await.is_ok());
    }

    #[tokio::test]
    async fn an_explicit_entry_permits_a_forbidden_address() {
        let policy = HostPolicy::new(["169.254.10.10"]);
        assert!(policy.resolve(&url("ws://169.254.10.10/")).await.is_ok());
    }

    #[tokio::test]
    async fn hosts_outside_the_allow_list_are_refused() {
        let policy = HostPolicy::new(["*.example.com", "127.0.0.1"]);
        assert_eq!(
            policy.resolve(&url("wss://evil.test/")).await.unwrap_err(),
            PolicyError::NotAllowed {
                host: "evil.test".into(),
                flag: "--allow-hosts",
            }
        );
        // `*.example.com` matches subdomains only, not the apex or look-alikes.
        assert!(matches!(
            policy.resolve(&url("wss://notexample.com/")).await,
            Err(PolicyError::NotAllowed { .. })
        ));
        assert_eq!(
            policy.resolve(&url("ws://127.0.0.1:8080/")).await.unwrap(),
            vec!["127.0.0.1:8080".parse().unwrap()]
        );
    }

    #[tokio::test]
    async fn a_refusal_names_the_flag_that_governs_the_host() {
        let upstreams = HostPolicy::new(["feed.example"]);
        let sinks = HostPolicy::new(["sink.example"]).for_sinks();
        let refused = |e: PolicyError| e.to_string();
        assert!(
            refused(
                upstreams
                    .resolve(&url("ws://other.example/"))
                    .await
                    .unwrap_err()
            )
            .contains("--allow-hosts")
        );
        let sink = refused(
            sinks
                .resolve(&url("http://other.example/"))
                .await
                .unwrap_err(),
        );
        assert!(sink.contains("--allow-sink-hosts"), "{sink}");
        let metadata = refused(
            HostPolicy::new(["*"])
                .for_sinks()
                .resolve(&url("http://169.254.169.254/"))
                .await
                .unwrap_err(),
        );
        assert!(metadata.contains("--allow-sink-hosts"), "{metadata}");
    }
}
