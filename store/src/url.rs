//! One URL parser for every backend.
//!
//! | URL | backend |
//! |---|---|
//! | `/path`, `./path`, `file:///path` | local directory ([`DirectFs`]), created if missing |
//! | `memory://` | in-memory, for tests |
//! | `s3://bucket/prefix` | S3 or any S3-compatible server (feature `s3`); endpoint, region and credentials from the usual `AWS_*` environment variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, ...) |
//! | `gs://bucket/prefix` | Google Cloud Storage (feature `gcs`), `GOOGLE_*` variables |
//! | `az://container/prefix`, `abfs://...` | Azure Blob Storage (feature `azure`), `AZURE_*` variables |

use std::path::PathBuf;
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::path::Path;

use crate::direct::DirectFs;
use crate::error::{Error, Result};
use crate::retry::{RetryConfig, RetryStore};
use crate::store::{Store, StoreConfig};
use crate::wrap::{FaultyStore, MetricsStore, RandomFaults, StoreMetrics};

/// A parsed store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A local directory.
    Local(PathBuf),
    /// In memory.
    Memory,
    /// S3: bucket and key prefix.
    S3 {
        /// Bucket.
        bucket: String,
        /// Key prefix (may be empty).
        prefix: String,
    },
    /// Google Cloud Storage: bucket and prefix.
    Gcs {
        /// Bucket.
        bucket: String,
        /// Key prefix.
        prefix: String,
    },
    /// Azure: container and prefix.
    Azure {
        /// The URL as given (the builder parses account and container).
        url: String,
        /// Key prefix.
        prefix: String,
    },
}

impl StoreUrl {
    /// Parse `s`.
    pub fn parse(s: &str) -> Result<StoreUrl> {
        let s = s.trim();
        if s.is_empty() {
            return Err(Error::invalid(
                "no store given: pass --store URL or set CKPT_STORE (a directory, s3://bucket/prefix, ...)",
            ));
        }
        let Some((scheme, rest)) = s.split_once("://") else {
            return Ok(StoreUrl::Local(PathBuf::from(s)));
        };
        let (bucket, prefix) = match rest.split_once('/') {
            Some((b, p)) => (b.to_string(), p.trim_matches('/').to_string()),
            None => (rest.to_string(), String::new()),
        };
        let need_bucket = |what: &str| -> Result<()> {
            if bucket.is_empty() {
                Err(Error::invalid(format!("store URL {s:?} names no {what}")))
            } else {
                Ok(())
            }
        };
        match scheme {
            "file" => {
                let path = url::Url::parse(s)
                    .ok()
                    .and_then(|u| u.to_file_path().ok())
                    .ok_or_else(|| {
                        Error::invalid(format!("store URL {s:?} is not a valid file URL"))
                    })?;
                Ok(StoreUrl::Local(path))
            }
            "memory" => Ok(StoreUrl::Memory),
            "s3" | "s3a" => {
                need_bucket("bucket")?;
                Ok(StoreUrl::S3 { bucket, prefix })
            }
            "gs" => {
                need_bucket("bucket")?;
                Ok(StoreUrl::Gcs { bucket, prefix })
            }
            "az" | "abfs" | "abfss" | "azure" => {
                need_bucket("container")?;
                Ok(StoreUrl::Azure {
                    url: format!("{scheme}://{bucket}"),
                    prefix,
                })
            }
            other => Err(Error::invalid(format!(
                "store URL {s:?}: unknown scheme {other:?} (use a path, file://, s3://, gs://, az:// or memory://)"
            ))),
        }
    }

    /// Whether the backend is a remote object store.
    pub fn is_remote(&self) -> bool {
        !matches!(self, StoreUrl::Local(_) | StoreUrl::Memory)
    }
}

/// The environment variable a binary reads into [`OpenOptions::retry`] (see
/// [`OpenOptions::from_values`]).
pub const RETRY_ENV: &str = "CKPT_STORE_RETRY";
/// The environment variable a binary reads into [`OpenOptions::faults`] (tests and
/// measurements only).
pub const FAULTS_ENV: &str = "CKPT_FAULTS";

/// How [`open_with`] builds a store's request layers. Library code never reads these from the
/// environment: a binary fills them at start-up (from [`RETRY_ENV`] and [`FAULTS_ENV`], see
/// [`OpenOptions::from_values`]) and hands them down.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Retries of transient failures ([`RetryStore`]).
    pub retry: RetryConfig,
    /// Random failures injected below the retries (tests and measurements; `None`: none).
    pub faults: Option<RandomFaults>,
}

impl OpenOptions {
    /// Options from the text of [`RETRY_ENV`] (`attempts=6,min_ms=50,max_ms=5000,
    /// timeout_ms=120000`, see [`RetryConfig::parse`]) and [`FAULTS_ENV`]
    /// (`rate=0.05,seed=7,outage_s=10+5`, see [`RandomFaults::parse`]); unset or empty: the
    /// defaults. An error names the variable whose text is wrong.
    pub fn from_values(retry: Option<&str>, faults: Option<&str>) -> Result<OpenOptions> {
        let set = |v: Option<&str>| v.filter(|s| !s.trim().is_empty()).map(str::to_string);
        let retry = match set(retry) {
            Some(s) => RetryConfig::parse(&s).map_err(|e| e.context(RETRY_ENV))?,
            None => RetryConfig::default(),
        };
        retry.validate().map_err(|e| e.context(RETRY_ENV))?;
        let faults = match set(faults) {
            Some(s) => Some(RandomFaults::parse(&s).map_err(|e| e.context(FAULTS_ENV))?),
            None => None,
        };
        Ok(OpenOptions { retry, faults })
    }
}

/// Open the store at `url` with default settings for its kind, counting requests and
/// retrying transient failures ([`RetryStore`]) with the default [`OpenOptions`].
pub fn open(url: &str) -> Result<Store> {
    open_with(url, &OpenOptions::default())
}

/// [`open`] with these options: retry settings, and random faults injected below the retries
/// (tests and measurements).
pub fn open_with(url: &str, opts: &OpenOptions) -> Result<Store> {
    let retry = opts.retry.clone();
    let faults = opts.faults.clone();
    retry.validate()?;
    let parsed = StoreUrl::parse(url)?;
    let cfg = if parsed.is_remote() {
        StoreConfig::for_remote()
    } else {
        StoreConfig::default()
    };
    let mut local_root = None;
    let (raw, prefix): (Box<dyn ObjectStore>, String) = match parsed {
        StoreUrl::Local(p) => {
            let fs = DirectFs::new(&p)
                .map_err(|e| Error::io("opening the store directory", &p.display(), e))?;
            local_root = Some(fs.root().to_path_buf());
            (Box::new(fs), String::new())
        }
        StoreUrl::Memory => (
            Box::new(object_store::memory::InMemory::new()),
            String::new(),
        ),
        StoreUrl::S3 { bucket, prefix } => (open_s3(&bucket, url)?, prefix),
        StoreUrl::Gcs { bucket, prefix } => (open_gcs(&bucket, url)?, prefix),
        StoreUrl::Azure { url: u, prefix } => (open_azure(&u, url)?, prefix),
    };
    let raw: Box<dyn ObjectStore> = match faults {
        Some(f) => {
            let faulty = FaultyStore::new(raw);
            faulty.handle().set_random(Some(f));
            Box::new(faulty)
        }
        None => raw,
    };
    let metrics = Arc::new(StoreMetrics::default());
    let retried = RetryStore::new(raw, retry, metrics.clone());
    let counted = MetricsStore::sharing(retried, metrics.clone());
    let store = Store::new(Arc::new(counted), Path::from(prefix), url)
        .with_config(cfg)?
        .with_metrics(metrics);
    Ok(match local_root {
        Some(root) => store.with_local_root(root),
        None => store,
    })
}

#[cfg(feature = "s3")]
fn open_s3(bucket: &str, url: &str) -> Result<Box<dyn ObjectStore>> {
    use object_store::aws::AmazonS3Builder;
    let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
    // Object stores follow the AWS SDK's convention and read their AWS_* settings from the
    // environment themselves (as `from_env` above does), so these reads stay here.
    #[allow(
        clippy::disallowed_methods,
        reason = "AWS_* settings come from the environment by the AWS SDK's convention"
    )]
    let endpoint = std::env::var("AWS_ENDPOINT_URL_S3")
        .or_else(|_| std::env::var("AWS_ENDPOINT_URL"))
        .or_else(|_| std::env::var("AWS_ENDPOINT"))
        .ok();
    if let Some(ep) = endpoint {
        b = b
            .with_endpoint(&ep)
            .with_allow_http(ep.starts_with("http://"))
            .with_virtual_hosted_style_request(false);
    }
    #[allow(
        clippy::disallowed_methods,
        reason = "AWS_* settings come from the environment by the AWS SDK's convention"
    )]
    let no_region =
        std::env::var("AWS_REGION").is_err() && std::env::var("AWS_DEFAULT_REGION").is_err();
    if no_region {
        b = b.with_region("us-east-1");
    }
    let s = b
        .build()
        .map_err(|e| Error::invalid(format!("cannot open {url}: {e}")).with_source(e))?;
    Ok(Box::new(s))
}

#[cfg(not(feature = "s3"))]
fn open_s3(_bucket: &str, url: &str) -> Result<Box<dyn ObjectStore>> {
    Err(Error::invalid(format!(
        "cannot open {url}: this build has no S3 support (build ckpt-store with feature \"s3\")"
    )))
}

#[cfg(feature = "gcs")]
fn open_gcs(bucket: &str, url: &str) -> Result<Box<dyn ObjectStore>> {
    let s = object_store::gcp::GoogleCloudStorageBuilder::from_env()
        .with_bucket_name(bucket)
        .build()
        .map_err(|e| Error::invalid(format!("cannot open {url}: {e}")).with_source(e))?;
    Ok(Box::new(s))
}

#[cfg(not(feature = "gcs"))]
fn open_gcs(_bucket: &str, url: &str) -> Result<Box<dyn ObjectStore>> {
    Err(Error::invalid(format!(
        "cannot open {url}: this build has no GCS support (build with feature \"gcs\")"
    )))
}

#[cfg(feature = "azure")]
fn open_azure(container_url: &str, url: &str) -> Result<Box<dyn ObjectStore>> {
    let s = object_store::azure::MicrosoftAzureBuilder::from_env()
        .with_url(container_url)
        .build()
        .map_err(|e| Error::invalid(format!("cannot open {url}: {e}")).with_source(e))?;
    Ok(Box::new(s))
}

#[cfg(not(feature = "azure"))]
fn open_azure(_container_url: &str, url: &str) -> Result<Box<dyn ObjectStore>> {
    Err(Error::invalid(format!(
        "cannot open {url}: this build has no Azure support (build with feature \"azure\")"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_options_come_from_the_text_a_binary_read_and_errors_name_the_variable() {
        let d = OpenOptions::from_values(None, Some("  ")).unwrap();
        assert_eq!(d.retry, RetryConfig::default());
        assert!(d.faults.is_none());
        let o = OpenOptions::from_values(Some("attempts=2"), Some("rate=0.5,seed=3")).unwrap();
        assert_eq!(o.retry.attempts, 2);
        assert_eq!(
            o.faults,
            Some(RandomFaults::parse("rate=0.5,seed=3").unwrap())
        );
        for (retry, faults, var) in [
            (Some("attempts=0"), None, RETRY_ENV),
            (Some("nonsense"), None, RETRY_ENV),
            (None, Some("rate=2"), FAULTS_ENV),
        ] {
            let e = OpenOptions::from_values(retry, faults).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{e}");
            assert!(e.to_string().contains(var), "{e}");
        }
        // The options reach the store: every request fails and none is retried.
        let o =
            OpenOptions::from_values(Some("attempts=1"), Some("rate=1,seed=1,mix=1:0:0")).unwrap();
        let store = open_with("memory://", &o).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        assert!(rt.block_on(store.log().list_runs()).is_err());
        assert!(
            rt.block_on(open("memory://").unwrap().log().list_runs())
                .is_ok()
        );
    }

    #[test]
    fn parse_table() {
        let cases: &[(&str, StoreUrl)] = &[
            ("/tmp/x", StoreUrl::Local("/tmp/x".into())),
            ("rel/dir", StoreUrl::Local("rel/dir".into())),
            ("file:///tmp/y", StoreUrl::Local("/tmp/y".into())),
            ("memory://", StoreUrl::Memory),
            (
                "s3://bkt/a/b/",
                StoreUrl::S3 {
                    bucket: "bkt".into(),
                    prefix: "a/b".into(),
                },
            ),
            (
                "s3://bkt",
                StoreUrl::S3 {
                    bucket: "bkt".into(),
                    prefix: "".into(),
                },
            ),
            (
                "gs://g/p",
                StoreUrl::Gcs {
                    bucket: "g".into(),
                    prefix: "p".into(),
                },
            ),
            (
                "az://c/p",
                StoreUrl::Azure {
                    url: "az://c".into(),
                    prefix: "p".into(),
                },
            ),
        ];
        for (s, want) in cases {
            assert_eq!(&StoreUrl::parse(s).unwrap(), want, "{s}");
        }
        for bad in ["", "s3://", "ftp://x/y", "file://relative"] {
            assert!(StoreUrl::parse(bad).is_err(), "{bad} accepted");
        }
        assert!(
            StoreUrl::parse("ftp://x")
                .unwrap_err()
                .to_string()
                .contains("unknown scheme")
        );
    }
}
