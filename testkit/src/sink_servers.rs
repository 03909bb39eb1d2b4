//! Real servers for the Kinesis and NATS JetStream sinks, started as processes
//! on loopback: kinesalite (npm) and nats-server with JetStream (Debian's
//! `nats-server`). `scripts/test` installs both; each read-back returns what a
//! consumer of the server would see, as [`Delivered`] records.

use crate::processes::free_port;
use aws_sdk_kinesis::types::ShardIteratorType;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// One record as the sink's consumer received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivered {
    pub connection: String,
    pub worker: String,
    pub token: u64,
    pub seq: u64,
    /// The message's text.
    pub data: String,
    /// It travelled as a JSON value (`json`), not as a string (`data`).
    pub as_json: bool,
}

/// Where the installed servers are (overridable for other layouts).
fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("tether")
}

async fn wait_listening(addr: SocketAddr, what: &str, child: &mut Child) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("{what} exited at start: {status}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{what} did not listen on {addr} within 20 s")
}

/// A kinesalite process with one data stream.
pub struct Kinesalite {
    pub addr: SocketAddr,
    pub stream_name: String,
    client: aws_sdk_kinesis::Client,
    _child: Child,
}

impl Kinesalite {
    /// The kinesalite binary: `$TETHER_KINESALITE`, or where `scripts/test` installs it.
    pub fn binary() -> PathBuf {
        std::env::var_os("TETHER_KINESALITE")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache_dir().join("kinesalite/node_modules/.bin/kinesalite"))
    }

    /// Starts kinesalite and creates `stream_name` with `shards` shards.
    pub async fn start(stream_name: &str, shards: i32) -> anyhow::Result<Self> {
        let bin = Self::binary();
        anyhow::ensure!(
            bin.exists(),
            "kinesalite not found at {} (scripts/test installs it: npm install --prefix ~/.cache/tether/kinesalite kinesalite@3)",
            bin.display()
        );
        let addr = free_port()?;
        let mut child = Command::new(&bin)
            .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
            .args([
                "--createStreamMs",
                "0",
                "--deleteStreamMs",
                "0",
                "--updateStreamMs",
                "0",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        wait_listening(addr, "kinesalite", &mut child).await?;
        let config = aws_sdk_kinesis::Config::builder()
            .behavior_version(aws_sdk_kinesis::config::BehaviorVersion::latest())
            .endpoint_url(format!("http://{addr}"))
            .region(aws_sdk_kinesis::config::Region::new("us-east-1"))
            .credentials_provider(aws_sdk_kinesis::config::Credentials::new(
                "tether-local",
                "tether-local",
                None,
                None,
                "test",
            ))
            .http_client(tether::support::aws_http_client())
            .build();
        let client = aws_sdk_kinesis::Client::from_conf(config);
        client
            .create_stream()
            .stream_name(stream_name)
            .shard_count(shards)
            .send()
            .await?;
        let kinesalite = Self {
            addr,
            stream_name: stream_name.to_string(),
            client,
            _child: child,
        };
        crate::bed::Bed::wait(Duration::from_secs(10), "the stream is ACTIVE", || async {
            kinesalite
                .client
                .describe_stream_summary()
                .stream_name(stream_name)
                .send()
                .await
                .ok()
                .and_then(|d| d.stream_description_summary)
                .is_some_and(|s| s.stream_status.as_str() == "ACTIVE")
        })
        .await?;
        Ok(kinesalite)
    }

    /// Every record of the stream, shard by shard, each shard in its order.
    pub async fn records(&self) -> anyhow::Result<Vec<Delivered>> {
        let shards = self
            .client
            .list_shards()
            .stream_name(&self.stream_name)
            .send()
            .await?;
        let mut out = Vec::new();
        for shard in shards.shards() {
            let mut iterator = self
                .client
                .get_shard_iterator()
                .stream_name(&self.stream_name)
                .shard_id(shard.shard_id())
                .shard_iterator_type(ShardIteratorType::TrimHorizon)
                .send()
                .await?
                .shard_iterator;
            while let Some(it) = iterator {
                let page = self
                    .client
                    .get_records()
                    .shard_iterator(it)
                    .limit(10_000)
                    .send()
                    .await?;
                for record in page.records() {
                    let v: serde_json::Value = serde_json::from_slice(record.data().as_ref())?;
                    anyhow::ensure!(
                        v["connection"].as_str() == record.partition_key(),
                        "partition key is the stream name"
                    );
                    out.push(Delivered {
                        connection: v["connection"].as_str().unwrap_or_default().into(),
                        worker: v["worker"].as_str().unwrap_or_default().into(),
                        token: v["token"].as_u64().unwrap_or_default(),
                        seq: v["seq"].as_u64().unwrap_or_default(),
                        // A string in `data`, or (`dataFormat: json`) the
                        // message itself in `json`, kept as its JSON text.
                        data: match &v["json"] {
                            serde_json::Value::Null => {
                                v["data"].as_str().unwrap_or_default().into()
                            }
                            value => value.to_string(),
                        },
                        as_json: !v["json"].is_null(),
                    });
                }
                if page.records().is_empty() || page.millis_behind_latest() == Some(0) {
                    break;
                }
                iterator = page.next_shard_iterator;
            }
        }
        Ok(out)
    }
}

/// A nats-server process with JetStream and one stream capturing `subject.>`
/// (or `subject` itself), reached with a user and password.
pub struct NatsServer {
    pub addr: SocketAddr,
    pub stream: String,
    pub user: String,
    pub password: String,
    client: async_nats::Client,
    _store: tempfile_dir::TempDir,
    _child: Child,
}

mod tempfile_dir {
    //! A directory removed when dropped (JetStream's store).
    pub struct TempDir(pub std::path::PathBuf);
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl NatsServer {
    /// The nats-server binary: `$TETHER_NATS_SERVER`, then `PATH`, then Debian's place.
    pub fn binary() -> PathBuf {
        if let Some(p) = std::env::var_os("TETHER_NATS_SERVER") {
            return PathBuf::from(p);
        }
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .map(|d| d.join("nats-server"))
            .find(|p| p.exists())
            .unwrap_or_else(|| PathBuf::from("/usr/sbin/nats-server"))
    }

    /// Starts nats-server with JetStream and creates `stream` over `subjects`.
    pub async fn start(stream: &str, subjects: &[&str]) -> anyhow::Result<Self> {
        let bin = Self::binary();
        anyhow::ensure!(
            bin.exists(),
            "nats-server not found at {} (scripts/test installs it: apt-get install nats-server)",
            bin.display()
        );
        let addr = free_port()?;
        let store = tempfile_dir::TempDir(std::env::temp_dir().join(format!(
            "tether-nats-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        )));
        std::fs::create_dir_all(&store.0)?;
        let (user, password) = (
            "tether".to_string(),
            format!("pw-{:08x}", rand::random::<u32>()),
        );
        let mut child = Command::new(&bin)
            .args(["-a", "127.0.0.1", "-p", &addr.port().to_string(), "-js"])
            .arg("-sd")
            .arg(&store.0)
            .args(["--user", &user, "--pass", &password])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        wait_listening(addr, "nats-server", &mut child).await?;
        let client = async_nats::ConnectOptions::new()
            .user_and_password(user.clone(), password.clone())
            .connect(addr.to_string())
            .await?;
        let js = async_nats::jetstream::new(client.clone());
        js.create_stream(async_nats::jetstream::stream::Config {
            name: stream.to_string(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("create stream: {e}"))?;
        Ok(Self {
            addr,
            stream: stream.to_string(),
            user,
            password,
            client,
            _store: store,
            _child: child,
        })
    }

    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// Every message the stream holds, in the stream's order.
    pub async fn records(&self) -> anyhow::Result<Vec<Delivered>> {
        let js = async_nats::jetstream::new(self.client.clone());
        let mut stream = js
            .get_stream(&self.stream)
            .await
            .map_err(|e| anyhow::anyhow!("get stream: {e}"))?;
        let last = stream
            .info()
            .await
            .map_err(|e| anyhow::anyhow!("stream info: {e}"))?
            .state
            .last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            let Ok(m) = stream.get_raw_message(seq).await else {
                continue;
            };
            let header = |name: &str| {
                m.headers
                    .get(name)
                    .map(|v| v.as_str().to_string())
                    .unwrap_or_default()
            };
            out.push(Delivered {
                connection: header(tether::sink::CONNECTION_HEADER),
                worker: header(tether::sink::WORKER_HEADER),
                token: header(tether::sink::TOKEN_HEADER)
                    .parse()
                    .unwrap_or_default(),
                seq: header(tether::sink::SEQ_HEADER).parse().unwrap_or_default(),
                data: String::from_utf8_lossy(&m.payload).into_owned(),
                // The payload is the raw message, whatever it is.
                as_json: false,
            });
            anyhow::ensure!(
                header("Nats-Msg-Id")
                    == format!(
                        "{}:{}",
                        out[out.len() - 1].connection,
                        out[out.len() - 1].seq
                    ),
                "every message carries its de-duplication id"
            );
        }
        Ok(out)
    }

    /// A client of the server, for changing the stream's limits in a test.
    pub fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.client.clone())
    }
}

/// What a consumer checks of one stream's records: no gap from its first
/// sequence number to `until`, first appearances in order, and no record of
/// an older token after a newer one (no stale owner). Returns the problems.
pub fn check_stream(
    records: &[Delivered],
    connection: &str,
    first: u64,
    until: u64,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mine: Vec<&Delivered> = records
        .iter()
        .filter(|r| r.connection == connection)
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    let mut newest_first_seen = None;
    let mut top_token = 0;
    for r in &mine {
        if r.token < top_token {
            problems.push(format!(
                "{connection}: seq {} from token {} after token {top_token} had delivered",
                r.seq, r.token
            ));
        }
        top_token = top_token.max(r.token);
        if seen.insert(r.seq) {
            if let Some(prev) = newest_first_seen
                && r.seq < prev
            {
                problems.push(format!(
                    "{connection}: seq {} first arrived after {prev}",
                    r.seq
                ));
            }
            newest_first_seen = Some(r.seq);
        }
    }
    let missing: Vec<u64> = (first..=until).filter(|s| !seen.contains(s)).collect();
    if !missing.is_empty() {
        problems.push(format!(
            "{connection}: {} sequence numbers missing in {first}..={until}, first {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        ));
    }
    problems
}
