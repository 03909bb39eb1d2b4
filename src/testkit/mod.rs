//! Real components for tests, the demo and benchmarks: a replaying WebSocket
//! upstream that records every session, an HTTP sink that records every
//! delivery, a fault-injecting TCP proxy, and a harness for worker processes.
//! They listen on loopback only.

pub mod bed;
pub mod chaos;
pub mod dynamo_proxy;
pub mod fleet;
pub mod proxy;
pub mod sink;
pub mod upstream;
