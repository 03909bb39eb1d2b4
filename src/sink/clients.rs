//! The clients sinks share across a worker's sessions: one HTTP client, one
//! Kinesis client per region, one NATS connection per server, namespace and
//! set of credential references. Sessions come and go by the thousand in a
//! failover; their sinks must not each open a connection of their own.

use crate::egress::HostPolicy;
use crate::secrets::SecretSource;
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::Mutex;

/// Per-attempt timeout of one Kinesis call; the sink's own timeout bounds the call.
const KINESIS_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a NATS connection attempt may take before it is retried.
const NATS_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// NATS's port when a URL names none.
const NATS_DEFAULT_PORT: u16 = 4222;

/// What sinks are built from.
pub struct SinkClients {
    /// HTTP sinks' client (its resolver applies the sink host policy).
    pub http: reqwest::Client,
    /// Where NATS credential references are resolved.
    pub secrets: SecretSource,
    /// The name NATS connections announce (the worker id).
    pub client_name: String,
    /// The sink host policy, applied to NATS servers before connecting.
    policy: HostPolicy,
    kinesis: Mutex<HashMap<Option<String>, aws_sdk_kinesis::Client>>,
    nats: Mutex<HashMap<String, async_nats::Client>>,
}

/// Resolved NATS credentials; never logged (no `Debug`).
pub enum NatsAuth {
    None,
    Token(String),
    UserPassword(String, String),
}

impl SinkClients {
    pub fn new(
        http: reqwest::Client,
        secrets: SecretSource,
        client_name: String,
        policy: HostPolicy,
    ) -> Self {
        Self {
            http,
            secrets,
            client_name,
            policy,
            kinesis: Mutex::default(),
            nats: Mutex::default(),
        }
    }

    /// The Kinesis client of `region` (`None`: the worker's own), built once
    /// from the standard AWS configuration (`AWS_ENDPOINT_URL_KINESIS`, the
    /// default credential chain) with rustls + ring like the lease store's
    /// client, but the pool's default idle connections (the store's keeps as
    /// many as its stream-write turns: a sink's concurrency is its traffic's).
    pub async fn kinesis(&self, region: Option<&str>) -> aws_sdk_kinesis::Client {
        let key = region.map(str::to_string);
        let mut clients = self.kinesis.lock().await;
        if let Some(client) = clients.get(&key) {
            return client.clone();
        }
        let http = crate::support::aws_http_client();
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .http_client(http)
            // The delivery loop retries with its own backoff, pausing reads.
            .retry_config(aws_config::retry::RetryConfig::disabled())
            .timeout_config(
                aws_config::timeout::TimeoutConfig::builder()
                    .operation_attempt_timeout(KINESIS_ATTEMPT_TIMEOUT)
                    .build(),
            );
        if let Some(region) = region {
            loader = loader.region(aws_config::Region::new(region.to_string()));
        }
        let client = aws_sdk_kinesis::Client::new(&loader.load().await);
        clients.insert(key, client.clone());
        client
    }

    /// A connection to `url` for streams of `namespace` whose credential
    /// references serialise to `refs`, opened once and shared. The connection
    /// retries in the background (`retry_on_initial_connect`), so a server
    /// that is down makes publishes time out, and the delivery loop back off,
    /// instead of holding up the session.
    ///
    /// A plaintext server is given to the client as the addresses the host
    /// policy just checked, not as its name: async-nats would resolve the
    /// name again on every reconnect, after the check, and a tenant who
    /// controls that name's DNS could point a reconnect anywhere (DNS
    /// rebinding). A `tls://` server keeps its name, which the certificate
    /// is verified against before anything is sent. A sink whose deliveries
    /// fail asks again (`NatsSink`), so a server that really moved is found
    /// under its new addresses (a new connection; the key holds them).
    pub async fn nats(
        &self,
        url: &str,
        namespace: &str,
        refs: &str,
        auth: impl std::future::Future<Output = Result<NatsAuth, String>>,
    ) -> Result<async_nats::Client, String> {
        let servers = self.nats_servers(url).await?;
        let key = format!("{}\n{namespace}\n{refs}", servers.join(","));
        let mut clients = self.nats.lock().await;
        if let Some(client) = clients.get(&key) {
            return Ok(client.clone());
        }
        let mut options = async_nats::ConnectOptions::new()
            .name(&self.client_name)
            .connection_timeout(NATS_CONNECT_TIMEOUT)
            // Only the server the spec names, which the host policy checked:
            // servers a NATS server advertises (`connect_urls`) are a tenant's
            // way to point reconnects at addresses the policy never saw.
            .ignore_discovered_servers()
            .retry_on_initial_connect();
        if url.starts_with("tls://") {
            options = options.require_tls(true);
        }
        options = match auth.await? {
            NatsAuth::None => options,
            NatsAuth::Token(token) => options.token(token),
            NatsAuth::UserPassword(user, password) => options.user_and_password(user, password),
        };
        let addrs = servers
            .iter()
            .map(|s| s.parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("NATS {url}: {e}"))?;
        let client = options
            .connect(addrs)
            .await
            .map_err(|e| format!("NATS {url}: {e}"))?;
        clients.insert(key, client.clone());
        Ok(client)
    }

    /// What the NATS client is given for `url`: for `tls://` the URL as it
    /// is; otherwise one URL per address the sink policy allows for its
    /// host, the rest of the URL (credentials in it, port) kept.
    async fn nats_servers(&self, url: &str) -> Result<Vec<String>, String> {
        let parsed = url::Url::parse(url).map_err(|e| format!("NATS {url}: {e}"))?;
        if parsed.scheme() == "tls" {
            return Ok(vec![url.to_string()]);
        }
        let port = parsed.port().unwrap_or(NATS_DEFAULT_PORT);
        let mut with_port = parsed.clone();
        let _ = with_port.set_port(Some(port));
        let addrs = self
            .policy
            .resolve(&with_port)
            .await
            .map_err(|e| format!("NATS {url}: {e}"))?;
        Ok(pinned(&with_port, &addrs))
    }
}

/// `url` once per address, the host replaced by the address (sorted, so
/// the same answer in another order is the same connection).
fn pinned(url: &url::Url, addrs: &[std::net::SocketAddr]) -> Vec<String> {
    let mut ips: Vec<std::net::IpAddr> = addrs.iter().map(std::net::SocketAddr::ip).collect();
    ips.sort();
    ips.dedup();
    ips.into_iter()
        .filter_map(|ip| {
            let mut u = url.clone();
            u.set_ip_host(ip).ok()?;
            Some(u.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    use tokio::net::TcpListener;

    /// Clients of a standalone worker whose sinks are governed by `policy`.
    fn test_clients(policy: HostPolicy) -> SinkClients {
        SinkClients::new(
            reqwest::Client::new(),
            SecretSource::Standalone,
            "test".into(),
            policy,
        )
    }

    /// A NATS server a tenant controls: it advertises `advertised` as another
    /// server of its cluster (`connect_urls`), completes one handshake, and
    /// then goes away for good, so the client must reconnect somewhere.
    async fn advertising_server(advertised: std::net::SocketAddr) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            drop(listener);
            let (read, mut write) = socket.into_split();
            let info = format!(
                "INFO {{\"server_id\":\"tenant\",\"server_name\":\"tenant\",\"version\":\"2.10.0\",\"proto\":1,\"host\":\"127.0.0.1\",\"port\":{},\"max_payload\":1048576,\"connect_urls\":[\"{advertised}\"]}}\r\n",
                addr.port()
            );
            write.write_all(info.as_bytes()).await.unwrap();
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.starts_with("PING") {
                    let _ = write.write_all(b"PONG\r\n").await;
                    break;
                }
            }
            // Hang up: the client reconnects, to what it knows of.
        });
        addr
    }

    #[tokio::test]
    async fn servers_a_nats_server_advertises_are_never_dialled() {
        crate::support::install_crypto_provider();
        let (forbidden_addr, offered) = crate::support::counting_listener().await;
        let server = advertising_server(forbidden_addr).await;
        let clients = test_clients(HostPolicy::new(["*"]).for_sinks());
        let _client = clients
            .nats(&format!("nats://{server}"), "ns", "", async {
                Ok(NatsAuth::None)
            })
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            offered.load(Ordering::SeqCst),
            0,
            "the client reconnected to a server the tenant advertised"
        );
    }

    /// A plaintext server is dialled at the addresses the policy checked,
    /// never by its name again (so nothing the name later resolves to is
    /// reached); the URL's port and credentials stay.
    #[test]
    fn a_plaintext_nats_server_is_pinned_to_the_checked_addresses() {
        let url = url::Url::parse("nats://user:pw@nats.example.com:4223/").unwrap();
        let addrs: Vec<std::net::SocketAddr> = vec![
            "203.0.113.9:4223".parse().unwrap(),
            "[2001:db8::9]:4223".parse().unwrap(),
            "203.0.113.9:4223".parse().unwrap(),
        ];
        assert_eq!(
            pinned(&url, &addrs),
            vec![
                "nats://user:pw@203.0.113.9:4223/".to_string(),
                "nats://user:pw@[2001:db8::9]:4223/".to_string(),
            ]
        );
    }

    /// End to end: a server named by a host name (`localhost`, listed by its
    /// exact name as a platform team would) is reached through the pinned
    /// address, and a name the policy forbids is refused before any dial.
    #[tokio::test]
    async fn a_nats_server_named_by_host_is_reached_at_its_checked_address_and_a_forbidden_one_never()
     {
        crate::support::install_crypto_provider();
        let (listening, offered) = crate::support::counting_listener().await;
        let loopback: [ipnet::IpNet; 2] =
            ["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()];
        let allowed = test_clients(HostPolicy::new(["localhost"]).for_sinks().deny(&loopback));
        let servers = allowed
            .nats_servers(&format!("nats://localhost:{}", listening.port()))
            .await
            .unwrap();
        assert!(
            servers.iter().all(|s| !s.contains("localhost")),
            "{servers:?}"
        );
        let refused = test_clients(HostPolicy::new(["*"]).for_sinks().deny(&loopback));
        let err = refused
            .nats(
                &format!("nats://localhost:{}", listening.port()),
                "ns",
                "",
                async { Ok(NatsAuth::None) },
            )
            .await
            .err()
            .unwrap();
        assert!(err.contains("127.0.0.1") || err.contains("::1"), "{err}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            offered.load(Ordering::SeqCst),
            0,
            "a forbidden server was dialled"
        );
    }
}
