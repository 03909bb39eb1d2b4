//! Delivering a batch to the sink until it is acknowledged, the fence closes,
//! or the session is aborted. Every attempt and every backoff sleep is raced
//! against the fence (itself, as renewals move it), so nothing is sent after
//! it closes (DESIGN property 1b); while a batch is retried nothing is read
//! (backpressure). A request that was sent cannot be unsent: one cut short
//! stays on record in the stream's progress until the sink's timeout has
//! passed, and a voluntary release waits for that.

use super::progress::StreamProgress;
use crate::metrics::WorkerMetrics;
use crate::sink::{Batch, Pending, Sink, SinkError};
use crate::support::RetryPolicy;
use crate::worker::fence::Fence;
use std::time::Duration;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Sink retry backoff: first step and cap (full jitter).
pub(super) const SINK_BACKOFF: RetryPolicy = RetryPolicy {
    first_delay: Duration::from_millis(100),
    max_delay: Duration::from_secs(5),
    deadline: Duration::MAX,
};
/// A failing sink is logged on the first attempt and then every this many.
const LOG_EVERY_ATTEMPTS: u32 = 20;

/// Why a delivery did not complete.
#[derive(Debug, PartialEq, Eq)]
pub enum Undelivered {
    /// The session was aborted.
    Aborted,
    /// The fence closed first.
    Fenced,
    /// The sink said a newer owner exists (the contract's fenced signal).
    SinkFenced,
}

/// Who is delivering, and what for.
pub(super) struct Delivery<'a> {
    pub connection: &'a str,
    pub worker: &'a str,
    pub token: u64,
    pub sink: &'a Sink,
    pub fence: &'a Fence,
    pub progress: &'a StreamProgress,
    pub metrics: &'a WorkerMetrics,
    pub abort: &'a CancellationToken,
}

impl Delivery<'_> {
    /// An empty batch for this sink, stream, worker and token (the HTTP
    /// sink's is written as its body as the messages arrive).
    pub(super) fn new_batch(&self) -> Pending {
        self.sink
            .new_batch(self.connection, self.worker, self.token)
    }

    /// Delivers `batch` until the sink acknowledges it, then advances the
    /// checkpoint and clears the batch.
    pub(super) async fn deliver(&self, batch: &mut Pending) -> Result<(), Undelivered> {
        let Some(last) = batch.last().map(|m| m.seq) else {
            return Ok(());
        };
        let mut attempt = 0u32;
        loop {
            if self.abort.is_cancelled() {
                return Err(Undelivered::Aborted);
            }
            if !self.fence.is_valid() {
                return Err(Undelivered::Fenced);
            }
            // A batch written as its body is finished once, before its
            // first attempt (again after a partial retry changed it).
            batch.seal();
            let payload = Batch {
                connection: self.connection,
                worker: self.worker,
                token: self.token,
                messages: &*batch,
            };
            let sent = Instant::now();
            let span = tracing::info_span!(
                "sink.batch",
                sink = self.sink.kind(),
                messages = batch.len(),
                first_seq = batch.first().map_or(0, |m| m.seq),
                last_seq = last,
                attempt,
                result = tracing::field::Empty,
            );
            let attempt_span = span.clone();
            // Raced against the fence itself, not against its deadline as it
            // stood when the attempt began: renewals move the deadline while a
            // slow sink answers, and an attempt cut at a deadline that has
            // since moved would end a healthy session (and replay its batch)
            // once per fence window.
            // Cut short below (fence, abort) or by the session being dropped,
            // this request stays on record until the sink may no longer
            // apply it, and a release waits for that.
            let in_flight = self
                .sink
                .settle_bound()
                .map(|bound| self.progress.in_flight(sent + bound));
            let result = tokio::select! {
                // An answer that is in is taken: it was sent inside the fence.
                biased;
                // Boxed: the sink client's future only lives during a delivery.
                r = Box::pin(self.sink.deliver(&payload).instrument(attempt_span)) => r,
                () = self.fence.closed() => return Err(Undelivered::Fenced),
                _ = self.abort.cancelled() => return Err(Undelivered::Aborted),
            };
            if let Some(in_flight) = in_flight {
                in_flight.answered();
            }
            self.metrics
                .sink_batch_seconds
                .observe(sent.elapsed().as_secs_f64());
            span.record(
                "result",
                result.as_ref().map_or_else(SinkError::category, |()| "ok"),
            );
            match result {
                Ok(()) => {
                    self.count(batch.len(), "ok");
                    self.progress.ack(last);
                    if attempt > 0 {
                        tracing::info!(
                            stream = self.connection,
                            attempts = attempt + 1,
                            "sink accepted the batch again"
                        );
                        self.progress.update_status(|s| {
                            s.reason = None;
                            s.message = None;
                        });
                    }
                    batch.clear();
                    return Ok(());
                }
                Err(SinkError::Fenced) => {
                    self.count(0, "fenced");
                    return Err(Undelivered::SinkFenced);
                }
                Err(SinkError::Partial { failed, total, .. })
                    if failed.first().is_some_and(|&i| i < batch.len())
                        && failed.len() < total
                        && total == batch.len() =>
                {
                    let accepted = total - failed.len();
                    self.count(accepted, "partial");
                    // The checkpoint passes the accepted prefix only; the
                    // accepted records after a refused one are not counted
                    // again, but a replay after a crash may repeat them.
                    if let Some(prefix_end) = failed[0].checked_sub(1) {
                        self.progress.ack(batch.get(prefix_end).seq);
                    }
                    batch.keep_only(&failed);
                    self.backoff(
                        &mut attempt,
                        &format!("{accepted} of {total} accepted; retrying the rest in order"),
                    )
                    .await?;
                }
                Err(e) => {
                    self.count(0, e.category());
                    self.backoff(&mut attempt, &e.to_string()).await?;
                }
            }
        }
    }

    /// After a failed attempt: says so (status, and a log line now and then)
    /// and sleeps the backoff, ending early at the fence or an abort.
    async fn backoff(&self, attempt: &mut u32, error: &str) -> Result<(), Undelivered> {
        if attempt.is_multiple_of(LOG_EVERY_ATTEMPTS) {
            tracing::warn!(
                stream = self.connection,
                error,
                attempt = *attempt,
                "sink delivery failed; holding the batch and pausing reads"
            );
        }
        self.progress.update_status(|s| {
            s.reason = Some("SinkUnavailable".into());
            s.message = Some(error.to_string());
        });
        let wake = Instant::now() + SINK_BACKOFF.delay(*attempt);
        *attempt = attempt.saturating_add(1);
        tokio::select! {
            _ = sleep_until(wake) => Ok(()),
            // The caller's next turn finds the fence closed and gives up.
            () = self.fence.closed() => Ok(()),
            _ = self.abort.cancelled() => Err(Undelivered::Aborted),
        }
    }

    fn count(&self, messages: usize, result: &'static str) {
        self.metrics
            .sink_batches
            .get_or_create(&[("sink", self.sink.kind()), ("result", result)])
            .inc();
        if messages > 0 {
            self.metrics.messages_delivered.inc_by(messages as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::HttpSinkSpec;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    /// A sink on a real socket that reads every request and never answers.
    async fn silent_sink() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
                });
            }
        });
        format!("http://{addr}/")
    }

    /// The body of the next request on `socket`, once its headers and as
    /// many bytes as their content length says are in; `None` when the
    /// client hung up first.
    async fn read_body(socket: &mut tokio::net::TcpStream) -> Option<Vec<u8>> {
        let mut request = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = socket.read(&mut buf).await.ok().filter(|&n| n > 0)?;
            request.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
            if let Some(end) = text.find("\r\n\r\n") {
                let length = text
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if request.len() >= end + 4 + length {
                    return Some(request[end + 4..end + 4 + length].to_vec());
                }
            }
        }
    }

    /// A sink on a real socket that answers the requests it is sent, in
    /// order, with `failures` and then 200, each `delay` late, and keeps
    /// every body it was sent.
    async fn recording_sink(
        delay: Duration,
        failures: Vec<u16>,
    ) -> (String, std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>) {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = bodies.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (bodies, failures) = (kept.clone(), failures.clone());
                tokio::spawn(async move {
                    while let Some(body) = read_body(&mut socket).await {
                        let status = {
                            let mut bodies = bodies.lock().unwrap();
                            bodies.push(body);
                            failures.get(bodies.len() - 1).copied().unwrap_or(200)
                        };
                        tokio::time::sleep(delay).await;
                        let answer = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n");
                        if socket.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (format!("http://{addr}/"), bodies)
    }

    /// A sink on a real socket that answers every request with 200, `delay` late.
    async fn slow_sink(delay: Duration) -> String {
        recording_sink(delay, Vec::new()).await.0
    }

    /// What one delivery of a one-message batch (sequence `seq`) to the HTTP
    /// sink at `url` ended with: the result, the checkpoint after it, and how
    /// many messages the batch still holds. `overdue` says what it means if
    /// it has not ended within 20 s.
    async fn deliver_one(
        url: String,
        timeout_seconds: u32,
        fence: &Fence,
        seq: u64,
        overdue: &str,
    ) -> (Result<(), Undelivered>, Option<u64>, usize) {
        deliver_batch(url, timeout_seconds, fence, &[(seq, "x")], overdue).await
    }

    /// As [`deliver_one`], for a batch of `messages`, made as a session
    /// makes it (`Delivery::new_batch`).
    async fn deliver_batch(
        url: String,
        timeout_seconds: u32,
        fence: &Fence,
        messages: &[(u64, &str)],
        overdue: &str,
    ) -> (Result<(), Undelivered>, Option<u64>, usize) {
        let spec = HttpSinkSpec {
            url,
            max_batch_messages: 10,
            linger_ms: 0,
            timeout_seconds,
            data_format: Default::default(),
        };
        crate::install_crypto_provider();
        let sink = Sink::Http(crate::sink::HttpSink::new(reqwest::Client::new(), &spec));
        let progress = StreamProgress::new(None, None);
        let metrics = WorkerMetrics::default();
        let abort = CancellationToken::new();
        let delivery = Delivery {
            connection: "ns/s",
            worker: "w",
            token: 1,
            sink: &sink,
            fence,
            progress: &progress,
            metrics: &metrics,
            abort: &abort,
        };
        let mut batch = delivery.new_batch();
        for &(seq, text) in messages {
            batch.push(seq, text);
        }
        let ended = tokio::time::timeout(Duration::from_secs(20), delivery.deliver(&mut batch))
            .await
            .expect(overdue);
        (ended, progress.checkpoint(), batch.len())
    }

    /// The batch a session makes for the HTTP sink is written as its body
    /// while the messages arrive: the sink receives it byte for byte as
    /// `batch_json` writes the same messages, and a retry after a failed
    /// attempt sends the same body again.
    #[tokio::test]
    async fn a_batch_reaches_the_sink_as_batch_json_writes_it_and_the_same_again_on_retry() {
        let fence = Fence::new(Duration::from_secs(60), crate::worker::fence::Sent::now());
        let (url, bodies) = recording_sink(Duration::ZERO, vec![500, 503]).await;
        let messages = [(4, "one"), (5, "t\"wo\n"), (6, r#"{"seq":6,"x":"é"}"#)];
        let (ended, acked, left) =
            deliver_batch(url, 30, &fence, &messages, "the delivery never ended").await;
        assert!(ended.is_ok(), "{ended:?}");
        assert_eq!((acked, left), (Some(6), 0));
        let texts: Pending = messages
            .iter()
            .map(|&(seq, data)| crate::sink::Message { seq, data })
            .collect();
        let expected = crate::sink::batch_json(
            &Batch {
                connection: "ns/s",
                worker: "w",
                token: 1,
                messages: &texts,
            },
            Default::default(),
        );
        let bodies = bodies.lock().unwrap();
        assert_eq!(bodies.len(), 3, "two refused, then accepted");
        for body in bodies.iter() {
            assert_eq!(
                String::from_utf8_lossy(body),
                String::from_utf8_lossy(&expected)
            );
        }
    }

    /// A POST slower than the fence window, while renewals keep the fence
    /// open: the attempt lasts as long as the fence does, not as long as the
    /// deadline did when it was sent.
    #[tokio::test]
    async fn a_slow_post_is_waited_for_while_renewals_keep_the_fence_open() {
        let fence = std::sync::Arc::new(Fence::new(
            Duration::from_millis(300),
            crate::worker::fence::Sent::now(),
        ));
        let renewals = tokio::spawn({
            let fence = fence.clone();
            async move {
                loop {
                    fence.confirm(crate::worker::fence::Sent::now());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
        let url = slow_sink(Duration::from_millis(900)).await;
        let (ended, acked, _) = deliver_one(url, 30, &fence, 7, "the delivery never ended").await;
        renewals.abort();
        assert_eq!(ended, Ok(()), "a renewed fence cut a slow POST short");
        assert_eq!(acked, Some(7));
    }

    #[tokio::test]
    async fn a_post_still_in_flight_when_the_fence_closes_is_abandoned_at_the_fence() {
        let fence = Fence::new(
            Duration::from_millis(300),
            crate::worker::fence::Sent::now(),
        );
        // A timeout far longer than the fence: only the fence can end this POST.
        let (ended, acked, left) = deliver_one(
            silent_sink().await,
            300,
            &fence,
            1,
            "the delivery outlived its fence",
        )
        .await;
        assert_eq!(ended, Err(Undelivered::Fenced));
        assert_eq!(acked, None, "nothing was acknowledged");
        assert_eq!(left, 1, "the batch is kept for the next owner's replay");
    }
}
