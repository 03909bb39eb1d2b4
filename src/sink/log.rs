//! The log sink: one JSON line per message on standard output.

use super::{Batch, SinkError};
use std::io::Write;

pub struct LogSink;

impl LogSink {
    pub fn deliver(&self, batch: &Batch<'_>) -> Result<(), SinkError> {
        let mut out = std::io::stdout().lock();
        for m in batch.messages {
            let line = serde_json::json!({
                "connection": batch.connection,
                "worker": batch.worker,
                "token": batch.token,
                "seq": m.seq,
                "data": m.data,
            });
            writeln!(out, "{line}")?;
        }
        out.flush()?;
        Ok(())
    }
}
