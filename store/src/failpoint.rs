//! Named failpoints at crash-relevant steps, per store instance (so parallel tests do not
//! interfere): `after_chunks` (chunks written, rank manifest not yet), `before_commit`
//! (manifests checked, commit record not yet), `before_restore` (a rank's restore of a step,
//! before it reads anything), `before_node_commit` (a node commit of the local tier read, not
//! yet written).
//!
//! Processes can set them from the environment: `CKPT_FAILPOINTS=after_chunks=kill` or
//! `...=sleep(500)` or `...=error`, several separated by `;`. A suffix `@N` fires only on the
//! N-th time the point is reached (`after_chunks=kill@2`: the second save dies).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// What a failpoint does when reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailAction {
    /// Return an error.
    Error,
    /// Sleep, then go on.
    Sleep(Duration),
    /// Kill the whole process with SIGKILL, as a crash would.
    Kill,
}

/// A set of armed failpoints.
#[derive(Debug, Clone, Default)]
pub struct Failpoints(Arc<Mutex<HashMap<String, Armed>>>);

#[derive(Debug, Clone)]
struct Armed {
    action: FailAction,
    nth: Option<u64>,
    hits: u64,
}

impl Failpoints {
    /// No failpoints armed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parse `name=action;name=action` (actions: `error`, `kill`, `sleep(MS)`).
    pub fn parse(spec: &str) -> Result<Self> {
        let fp = Failpoints::new();
        for part in spec.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, action) = part.split_once('=').ok_or_else(|| {
                Error::invalid(format!("failpoint {part:?}: expected name=action"))
            })?;
            let (action, nth) = match action.split_once('@') {
                Some((a, n)) => (
                    a,
                    Some(
                        n.trim()
                            .parse::<u64>()
                            .map_err(|_| Error::invalid(format!("failpoint {part:?}: bad @N")))?,
                    ),
                ),
                None => (action, None),
            };
            let action = match action.trim() {
                "error" => FailAction::Error,
                "kill" => FailAction::Kill,
                a if a.starts_with("sleep(") && a.ends_with(')') => {
                    let ms: u64 = a[6..a.len() - 1]
                        .parse()
                        .map_err(|_| Error::invalid(format!("failpoint {part:?}: bad sleep")))?;
                    FailAction::Sleep(Duration::from_millis(ms))
                }
                other => {
                    return Err(Error::invalid(format!(
                        "failpoint {part:?}: unknown action {other:?} (error, kill, sleep(MS))"
                    )));
                }
            };
            fp.set_nth(name.trim(), action, nth);
        }
        Ok(fp)
    }

    /// Arm `name`.
    pub fn set(&self, name: &str, action: FailAction) {
        self.set_nth(name, action, None);
    }

    /// Arm `name` for its `nth` hit only (every hit if `None`).
    pub fn set_nth(&self, name: &str, action: FailAction, nth: Option<u64>) {
        self.0.lock().insert(
            name.to_string(),
            Armed {
                action,
                nth,
                hits: 0,
            },
        );
    }

    /// How often armed failpoint `name` was reached (0 if it is not armed): a test waits on
    /// it to know that an operation in another task got that far.
    pub fn hits(&self, name: &str) -> u64 {
        self.0.lock().get(name).map_or(0, |a| a.hits)
    }

    /// Disarm everything.
    pub fn clear(&self) {
        self.0.lock().clear();
    }

    /// Reach failpoint `name`.
    pub async fn hit(&self, name: &str) -> Result<()> {
        let action = {
            let mut g = self.0.lock();
            match g.get_mut(name) {
                None => None,
                Some(a) => {
                    a.hits += 1;
                    match a.nth {
                        Some(n) if n != a.hits => None,
                        _ => Some(a.action.clone()),
                    }
                }
            }
        };
        match action {
            None => Ok(()),
            Some(FailAction::Error) => Err(Error::new(
                crate::ErrorKind::Backend,
                format!("failpoint {name} fired"),
            )),
            Some(FailAction::Sleep(d)) => {
                // Tests that kill a process mid-save wait for this line on stderr.
                eprintln!("ckpt failpoint {name}: sleeping {} ms", d.as_millis());
                tokio::time::sleep(d).await;
                Ok(())
            }
            Some(FailAction::Kill) => {
                tracing::error!(failpoint = name, "killing the process");
                // SAFETY: plain libc calls on our own process id.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
                std::process::abort()
            }
        }
    }
}
