//! The log sink: one JSON line per message on standard output.

use super::batch::{Batch, SinkError};
use super::encode::record_json;
use crate::crd::DataFormat;
use std::io::Write;

pub struct LogSink;

impl LogSink {
    pub fn deliver(&self, batch: &Batch<'_>) -> Result<(), SinkError> {
        let mut out = std::io::stdout().lock();
        for m in batch.messages {
            let mut line = record_json(batch, &m, DataFormat::String);
            line.push(b'\n');
            out.write_all(&line)?;
        }
        out.flush()?;
        Ok(())
    }
}
