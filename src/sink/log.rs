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
            // The newline written on its own: a record is sized exactly.
            out.write_all(&record_json(batch, &m, DataFormat::String))?;
            out.write_all(b"\n")?;
        }
        out.flush()?;
        Ok(())
    }
}
