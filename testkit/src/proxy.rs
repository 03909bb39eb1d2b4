//! A TCP proxy that can cut a worker off from DynamoDB: in `Blackhole` mode
//! established connections are dropped and new ones are accepted but never
//! answered, so requests time out exactly as in a network partition.

use std::net::SocketAddr;
use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    Pass,
    Blackhole,
}

/// A running proxy; stops when dropped.
pub struct FaultProxy {
    pub addr: SocketAddr,
    mode: watch::Sender<ProxyMode>,
    accepted: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (mode, _) = watch::channel(ProxyMode::Pass);
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let task = tokio::spawn({
            let mode = mode.clone();
            let accepted = accepted.clone();
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::spawn(relay(inbound, target, mode.subscribe()));
                }
            }
        });
        Ok(Self {
            addr,
            mode,
            accepted,
            task,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// TCP connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn set_mode(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }
}

async fn relay(mut inbound: TcpStream, target: SocketAddr, mut mode: watch::Receiver<ProxyMode>) {
    // Hold (and ignore) a connection made while cut off; drop it when the cut
    // ends, by when its client has long given up on it.
    if *mode.borrow_and_update() == ProxyMode::Blackhole {
        let _ = mode.changed().await;
        return;
    }
    let Ok(mut outbound) = TcpStream::connect(target).await else {
        return;
    };
    tokio::select! {
        _ = copy_bidirectional(&mut inbound, &mut outbound) => {}
        _ = mode.wait_for(|m| *m == ProxyMode::Blackhole) => {}
    }
}
