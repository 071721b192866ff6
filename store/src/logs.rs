//! Append-only JSON-lines logs kept with a run in the store (metrics, recovery events),
//! readable while the run goes on.
//!
//! Object stores cannot append, so a log is a set of parts:
//! `runs/<run>/<log>/<writer>-<seq>.jsonl`, each created once with `PutMode::Create`. A writer
//! id is unique per process (name plus start time), so restarted processes never collide.
//! Readers list the parts and merge their records by their `t_ms` field.

use bytes::Bytes;
use object_store::PutMode;
use serde::Serialize;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::keys::validate_run;
use crate::store::Store;

/// Log of per-step training metrics and per-checkpoint figures.
pub const METRICS: &str = "metrics";
/// Log of recovery and monitor events (failures, decisions, restores, rollbacks).
pub const EVENTS: &str = "events";

/// Appends records to one log of one run.
#[derive(Debug)]
pub struct LogWriter {
    store: Store,
    run: String,
    log: String,
    writer: String,
    seq: u64,
    pending: Vec<u8>,
    records: usize,
}

impl LogWriter {
    /// A writer for `log` of `run`; `name` says who writes (e.g. `rank-0`).
    pub fn new(store: &Store, run: &str, log: &str, name: &str) -> Result<Self> {
        validate_run(run)?;
        crate::keys::validate_run(name)
            .map_err(|_| Error::invalid(format!("log writer name {name:?} is not allowed")))?;
        Ok(LogWriter {
            store: store.clone(),
            run: run.to_string(),
            log: log.to_string(),
            writer: format!("{name}-{}", crate::clock::now_ms()),
            seq: 0,
            pending: Vec::new(),
            records: 0,
        })
    }

    /// Buffer a record (written on [`LogWriter::flush`]). A `t_ms` field is added if missing.
    pub fn append<T: Serialize>(&mut self, record: &T) -> Result<()> {
        let mut v = serde_json::to_value(record)
            .map_err(|e| Error::internal(format!("log record: {e}")))?;
        if let Value::Object(m) = &mut v {
            m.entry("t_ms")
                .or_insert_with(|| Value::from(crate::clock::now_ms()));
        }
        serde_json::to_writer(&mut self.pending, &v)
            .map_err(|e| Error::internal(format!("log record: {e}")))?;
        self.pending.push(b'\n');
        self.records += 1;
        Ok(())
    }

    /// Records buffered and not yet written.
    pub fn pending(&self) -> usize {
        self.records
    }

    /// Write the buffered records as one new part.
    pub async fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let path = self
            .store
            .keys()
            .log_part(&self.run, &self.log, &self.writer, self.seq);
        let body = Bytes::from(std::mem::take(&mut self.pending));
        let r = self
            .store
            .objects()
            .put_object(&path, vec![body.clone()], PutMode::Create)
            .await;
        // A failed write keeps its records for the next flush, under the next part name (the
        // failed one may have landed after all: a record is then read twice, never lost).
        self.seq += 1;
        if let Err(e) = r {
            let mut back = body.to_vec();
            back.extend_from_slice(&self.pending);
            self.pending = back;
            return Err(e);
        }
        self.records = 0;
        Ok(())
    }
}

/// Every record of `log` of `run`, ordered by `t_ms` (then by part). Damaged lines are skipped
/// with a warning rather than hiding the rest of the log.
pub async fn read_log(store: &Store, run: &str, log: &str) -> Result<Vec<Value>> {
    validate_run(run)?;
    let dir = store.keys().log_dir(run, log);
    let mut parts: Vec<_> = (store.objects().list_all(&dir).await?.into_iter())
        .map(|m| m.location)
        .collect();
    parts.sort();
    let mut out = Vec::new();
    for p in parts {
        let b = store.objects().get_object(&p).await?;
        for (i, line) in b.split(|&c| c == b'\n').enumerate() {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match serde_json::from_slice::<Value>(line) {
                Ok(v) => out.push(v),
                Err(e) => {
                    tracing::warn!(part = %p, line = i + 1, "skipping a damaged log line: {e}")
                }
            }
        }
    }
    out.sort_by_key(|v| v.get("t_ms").and_then(Value::as_i64).unwrap_or(0));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn parts_merge_in_time_order() {
        let store = Store::memory();
        let mut a = LogWriter::new(&store, "r", METRICS, "rank-0").unwrap();
        let mut b = LogWriter::new(&store, "r", METRICS, "rank-1").unwrap();
        a.append(&serde_json::json!({"step": 1, "t_ms": 10}))
            .unwrap();
        b.append(&serde_json::json!({"step": 2, "t_ms": 5}))
            .unwrap();
        a.flush().await.unwrap();
        b.flush().await.unwrap();
        a.append(&serde_json::json!({"step": 3, "t_ms": 20}))
            .unwrap();
        a.flush().await.unwrap();
        a.flush().await.unwrap(); // nothing pending: no empty part
        let v = read_log(&store, "r", METRICS).await.unwrap();
        let steps: Vec<i64> = v.iter().map(|r| r["step"].as_i64().unwrap()).collect();
        assert_eq!(steps, vec![2, 1, 3]);
        assert!(read_log(&store, "r", EVENTS).await.unwrap().is_empty());
    }
}
