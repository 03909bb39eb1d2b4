//! tether's test kit (not shipped): real servers and harnesses for the
//! integration tests, the chaos runner and the benchmarks. Everything listens
//! on loopback only.
//!
//! - `store`: the DynamoDB-compatible server under test (dynoxide, or dynalite);
//! - `call_log`: records each role's DynamoDB calls (for the IAM check);
//! - `upstream`: the replaying feed (plain and TLS) and a misbehaving one;
//! - `blaster`: an upstream that sends as fast as the socket takes;
//! - `sink`: the verifying sink, a fault proxy in front of it, a counting sink;
//! - `sink_servers`: kinesalite and nats-server, with read-backs;
//! - `proxy`, `dynamo_proxy`: TCP and DynamoDB fault proxies; `relay`: how
//!   the HTTP proxies hand an answer back;
//! - `fleet`: `tether worker` processes;
//! - `bed`: the one test bed; `fixtures`: specs written once;
//! - `otlp`: an OTLP/HTTP (JSON) trace receiver;
//! - `k8s`: the Kubernetes API emulator and `tether operator` against it;
//! - `kstatus`: the status rules GitOps tools and `kubectl wait` apply;
//! - `chaos`: the seeded chaos runner;
//! - `capacity`: a capacity model of DynamoDB partitions (a metering proxy);
//!   `item_size`: an item's size by DynamoDB's rules, for what it bills;
//! - `sim`: in-process workers with no-op sessions.

pub mod bed;
pub mod blaster;
pub mod call_log;
pub mod capacity;
pub mod chaos;
pub mod dynamo_proxy;
pub mod fixtures;
pub mod item_size;
pub mod k8s;
pub mod kstatus;
pub mod otlp;
pub mod processes;
pub mod proxy;
pub mod relay;
pub mod sim;
pub mod sink;
pub mod sink_servers;
pub mod store;
pub mod upstream;
