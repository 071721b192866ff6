//! Reading records back from a log: the ones a reader knows, with their time.

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use ckpt_store::{Result, Store};

use super::LogRecord;

/// A record read back from a log, with its time.
#[derive(Debug, Clone, PartialEq)]
pub struct Logged<T> {
    /// Unix milliseconds when it was written (`t_ms`; 0 if absent).
    pub t_ms: i64,
    /// The record.
    pub record: T,
}

/// The records of `values` (JSON lines of a log, as [`ckpt_store::logs::read_log`] returns them)
/// that `T` reads, in their order. Records of an unknown kind are skipped silently (a newer
/// writer's); a known kind whose fields do not read is skipped with a warning.
pub fn parse_records<T: LogRecord>(values: &[Value]) -> Vec<Logged<T>> {
    let mut out = Vec::with_capacity(values.len());
    for v in values {
        let Some(obj) = v.as_object() else { continue };
        let Some(kind) = obj.get("kind").and_then(Value::as_str) else {
            continue;
        };
        if !T::KINDS.contains(&kind) {
            continue;
        }
        let t_ms = obj.get("t_ms").and_then(Value::as_i64).unwrap_or(0);
        let mut body = obj.clone();
        body.remove("t_ms");
        match T::deserialize(Value::Object(body)) {
            Ok(record) => out.push(Logged { t_ms, record }),
            Err(e) => tracing::warn!(log = T::LOG, kind, "skipping a log record: {e}"),
        }
    }
    out
}

/// Every record of `run`'s log of `T` that `T` reads, in time order ([`parse_records`]).
pub async fn read_records<T: LogRecord>(store: &Store, run: &str) -> Result<Vec<Logged<T>>> {
    let values = ckpt_store::logs::read_log(store, run, T::LOG).await?;
    Ok(parse_records(&values))
}

/// A number, or `None` for anything else (`null` for NaN, or a string an old writer used).
pub(super) fn lenient_f64<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<f64>, D::Error> {
    Ok(Option::<Value>::deserialize(d)?.and_then(|v| v.as_f64()))
}
