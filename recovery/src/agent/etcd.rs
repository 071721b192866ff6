//! The few etcd operations the agent uses, over `etcd-client`, with errors that name the
//! endpoint and the key.

use std::time::{Duration, Instant};

use ckpt_store::{Error, ErrorKind, Result};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, PutOptions, Txn, TxnOp,
    WatchOptions, WatchStream,
};
use serde::Serialize;
use tokio::sync::oneshot;
use tracing::{debug, warn};

/// An etcd error as a store-style error: the backend failed, retrying may help.
pub(crate) fn etcd_error(endpoints: &str, what: &str, e: etcd_client::Error) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("etcd at {endpoints}: {what}: {e}"),
    )
}

/// A client with the agent's lease.
#[derive(Clone)]
pub(crate) struct Session {
    pub client: Client,
    pub endpoints: String,
    pub lease: i64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("endpoints", &self.endpoints)
            .field("lease", &self.lease)
            .finish()
    }
}

/// Connect to etcd (comma-separated endpoints).
pub(crate) async fn connect(endpoints: &str) -> Result<Client> {
    let eps: Vec<&str> = endpoints
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if eps.is_empty() {
        return Err(Error::invalid("no etcd endpoint given (--etcd URL)"));
    }
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(10));
    let mut client = Client::connect(&eps, Some(opts))
        .await
        .map_err(|e| etcd_error(endpoints, "connecting (is etcd running there?)", e))?;
    // `connect` is lazy: make one request so an unreachable server fails here.
    client
        .status()
        .await
        .map_err(|e| etcd_error(endpoints, "connecting (is etcd running there?)", e))?;
    Ok(client)
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("agent messages serialize")
}

impl Session {
    /// Grant a lease of `ttl` (whole seconds, at least 1; etcd may raise it to its minimum).
    pub async fn open(client: Client, endpoints: &str, ttl: Duration) -> Result<Self> {
        let mut c = client.clone();
        let secs = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let lease = c
            .lease_grant(secs, None)
            .await
            .map_err(|e| etcd_error(endpoints, "granting a lease", e))?
            .id();
        Ok(Session {
            client,
            endpoints: endpoints.to_string(),
            lease,
        })
    }

    fn err(&self, what: &str, e: etcd_client::Error) -> Error {
        etcd_error(&self.endpoints, what, e)
    }

    /// Keep the lease alive (every third of `ttl`) until this session's process ends; the
    /// receiver hears why once the lease is lost (expired, or etcd unreachable for `ttl`).
    pub fn keep_alive(&self, ttl: Duration) -> oneshot::Receiver<String> {
        let (tx, rx) = oneshot::channel();
        let mut c = self.client.clone();
        let id = self.lease;
        tokio::spawn(async move {
            let period = ttl / 3;
            let mut last_ok = Instant::now();
            let mut stream = None;
            loop {
                if stream.is_none() {
                    match c.lease_keep_alive(id).await {
                        Ok(s) => stream = Some(s),
                        Err(e) => debug!("lease keep-alive stream: {e}"),
                    }
                }
                if let Some((keeper, responses)) = stream.as_mut() {
                    let r = tokio::time::timeout(period.max(Duration::from_millis(200)), async {
                        keeper.keep_alive().await?;
                        responses.message().await
                    })
                    .await;
                    match r {
                        Ok(Ok(Some(resp))) if resp.ttl() > 0 => last_ok = Instant::now(),
                        Ok(Ok(Some(_))) => {
                            let _ = tx.send(format!("lease {id:x} expired"));
                            return;
                        }
                        Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                            warn!("lease keep-alive failed; retrying");
                            stream = None;
                        }
                    }
                }
                if last_ok.elapsed() > ttl {
                    let _ = tx.send(format!(
                        "etcd did not renew lease {id:x} for {:.1} s",
                        last_ok.elapsed().as_secs_f64()
                    ));
                    return;
                }
                tokio::time::sleep(period).await;
            }
        });
        rx
    }

    /// Give the lease up: every key under it goes at once.
    pub async fn revoke(&mut self) {
        if let Err(e) = self.client.lease_revoke(self.lease).await {
            debug!("revoking the lease: {e}");
        }
    }

    /// Put `value` at `key`, under the lease if `leased`.
    pub async fn put<T: Serialize>(&mut self, key: &str, value: &T, leased: bool) -> Result<()> {
        let opts = leased.then(|| PutOptions::new().with_lease(self.lease));
        self.client
            .put(key, json(value), opts)
            .await
            .map_err(|e| self.err(&format!("writing {key}"), e))?;
        Ok(())
    }

    /// Create `key` with `value` (under the lease if `leased`) if it does not exist. Returns
    /// the revision of the creation, or `None` if the key exists.
    pub async fn create<T: Serialize>(
        &mut self,
        key: &str,
        value: &T,
        leased: bool,
    ) -> Result<Option<i64>> {
        let opts = leased.then(|| PutOptions::new().with_lease(self.lease));
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key, json(value), opts)]);
        let r = self
            .client
            .txn(txn)
            .await
            .map_err(|e| self.err(&format!("creating {key}"), e))?;
        Ok(r.succeeded()
            .then(|| r.header().map_or(0, |h| h.revision())))
    }

    /// Write `puts` in one transaction if `guard` still has create revision `rev` (the
    /// coordinator's key, so a coordinator that lost its role writes nothing). `Fenced` if not.
    pub async fn put_guarded(
        &mut self,
        guard: &str,
        rev: i64,
        puts: Vec<(String, Vec<u8>)>,
        create_only: Option<&str>,
    ) -> Result<()> {
        let mut cmp = vec![Compare::create_revision(guard, CompareOp::Equal, rev)];
        if let Some(k) = create_only {
            cmp.push(Compare::create_revision(k, CompareOp::Equal, 0));
        }
        let ops: Vec<TxnOp> = puts
            .into_iter()
            .map(|(k, v)| TxnOp::put(k, v, None))
            .collect();
        let txn = Txn::new().when(cmp).and_then(ops);
        let r = self
            .client
            .txn(txn)
            .await
            .map_err(|e| self.err("writing as the coordinator", e))?;
        if !r.succeeded() {
            return Err(Error::new(
                ErrorKind::Fenced,
                format!(
                    "no longer the coordinator: {guard} changed{}",
                    create_only.map_or(String::new(), |k| format!(", or {k} exists"))
                ),
            ));
        }
        Ok(())
    }

    /// Every key under `prefix`, with the revision read at.
    pub async fn get_prefix(&mut self, prefix: &str) -> Result<(i64, Vec<KeyValue>)> {
        let mut r = self
            .client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err(&format!("reading {prefix}"), e))?;
        let rev = r.header().map_or(0, |h| h.revision());
        Ok((rev, r.take_kvs()))
    }

    /// One key's value, if it exists.
    pub async fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut r = self
            .client
            .get(key, None)
            .await
            .map_err(|e| self.err(&format!("reading {key}"), e))?;
        Ok(r.take_kvs()
            .into_iter()
            .next()
            .map(|kv| kv.value().to_vec()))
    }

    /// Watch everything under `prefix` from revision `from` (inclusive).
    pub async fn watch(&mut self, prefix: &str, from: i64) -> Result<WatchStream> {
        self.client
            .watch(
                prefix,
                Some(WatchOptions::new().with_prefix().with_start_revision(from)),
            )
            .await
            .map_err(|e| self.err(&format!("watching {prefix}"), e))
    }
}
