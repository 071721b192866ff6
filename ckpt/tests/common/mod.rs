//! Fixtures shared by the CLI tests: stores on a local directory and on a real S3-compatible
//! server, sharded checkpoints saved with recorded placement, and a runner for the real
//! `ckpt` binary.

#![allow(dead_code)]

pub use ckpt_store::model::cut_box as cut;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use bytes::Bytes;
use ckpt_store::placement::{Placement, Stage, TensorSpec, ZeroGroup, place_rank};
use ckpt_store::testing::{S3Server, det_bytes, local_store, tiny_config};
use ckpt_store::{BlobIn, DType, DedupIndex, Layout, NdBox, RankWrite, ShardDesc, ShardIn, Store};

/// A store under test and what keeps it alive.
pub struct Env {
    /// The store (tiny chunks, so kilobytes reach every boundary).
    pub store: Store,
    /// The URL the `ckpt` binary opens.
    pub url: String,
    /// Extra environment for the binary (AWS_* for S3).
    pub vars: Vec<(&'static str, String)>,
    /// Where the objects live on disk (the store directory, or the S3 server's bucket dir).
    pub objects_dir: PathBuf,
    _guard: Guard,
}

enum Guard {
    Dir(#[allow(dead_code)] tempfile::TempDir),
    S3(#[allow(dead_code)] S3Server),
}

/// A local-directory store.
pub fn local() -> Env {
    let (store, dir) = local_store(tiny_config());
    Env {
        url: dir.path().to_str().expect("utf-8").to_string(),
        objects_dir: dir.path().to_path_buf(),
        store,
        vars: Vec::new(),
        _guard: Guard::Dir(dir),
    }
}

/// A store on a real S3-compatible server (`s3s-fs`) on loopback, reached as `s3://ckpt/cli`.
pub fn s3() -> Env {
    let server = S3Server::start();
    let store = server.store("cli", tiny_config());
    Env {
        url: format!("s3://{}/cli", server.bucket),
        objects_dir: server.root.path().join(&server.bucket).join("cli"),
        vars: server.env(),
        store,
        _guard: Guard::S3(server),
    }
}

impl Env {
    /// Run the `ckpt` binary with `--store` from `CKPT_STORE`.
    pub fn ckpt(&self, args: &[&str]) -> Run {
        let out = Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .args(args)
            .env("CKPT_STORE", &self.url)
            .envs(self.vars.iter().map(|(k, v)| (*k, v.as_str())))
            .env_remove("RUST_LOG")
            .output()
            .expect("running ckpt");
        Run::from(out, args)
    }

    /// The file holding an object key below the store's prefix.
    pub fn object_file(&self, key: &str) -> PathBuf {
        let key = key.strip_prefix("cli/").unwrap_or(key);
        self.objects_dir.join(key)
    }
}

/// A finished `ckpt` run.
pub struct Run {
    /// Exit code.
    pub code: i32,
    /// stdout.
    pub out: String,
    /// stderr.
    pub err: String,
    args: String,
}

impl Run {
    fn from(o: Output, args: &[&str]) -> Run {
        let r = Run {
            code: o.status.code().unwrap_or(-1),
            out: String::from_utf8_lossy(&o.stdout).into_owned(),
            err: String::from_utf8_lossy(&o.stderr).into_owned(),
            args: args.join(" "),
        };
        assert!(
            !r.err.contains("panicked"),
            "ckpt {} panicked:\n{}",
            r.args,
            r.err
        );
        r
    }

    /// Assert the exit code; returns self.
    pub fn code(self, want: i32) -> Run {
        assert_eq!(
            self.code, want,
            "ckpt {} exited {} (want {want})\nstdout:\n{}\nstderr:\n{}",
            self.args, self.code, self.out, self.err
        );
        self
    }

    /// stdout as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.out).unwrap_or_else(|e| {
            panic!(
                "ckpt {}: stdout is not JSON ({e}):\n{}",
                self.args, self.out
            )
        })
    }
}

/// The layout the fixtures save under: 2-way data parallel with ZeRO-1, 2-way tensor parallel.
pub fn layout() -> Layout {
    Layout::new(2, 2, 1, 1).unwrap()
}

fn spec(
    name: &str,
    dtype: DType,
    shape: &[u64],
    tp_dim: Option<usize>,
    order: u32,
    zero: bool,
) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        placement: Placement {
            order,
            tp_dim,
            stage: if order == 0 {
                Stage::First
            } else {
                Stage::Layer { index: 0, of: 1 }
            },
            zero: zero.then(|| ZeroGroup {
                group: "exp_avg".into(),
                from_stage: 1,
            }),
        },
    }
}

/// The model: tp column and row splits, a replicated norm, ZeRO-partitioned optimizer state,
/// a scalar, several dtypes. `extra` adds a tensor (to see it appear in diffs).
pub fn specs(extra: bool) -> Vec<TensorSpec> {
    let mut v = vec![
        spec("embed.weight", DType::Bf16, &[64, 32], Some(0), 0, false),
        spec(
            "layers.0.attn.qkv.weight",
            DType::F32,
            &[64, 32],
            Some(0),
            1,
            false,
        ),
        spec(
            "layers.0.attn.proj.weight",
            DType::F32,
            &[32, 64],
            Some(1),
            2,
            false,
        ),
        spec("layers.0.norm.weight", DType::F32, &[32], None, 3, false),
        spec("optim.exp_avg.qkv", DType::F32, &[64, 32], Some(0), 4, true),
        spec("optim.exp_avg.norm", DType::F32, &[32], None, 5, true),
        spec("optim.step", DType::I64, &[], None, 6, false),
    ];
    if extra {
        v.push(spec(
            "layers.0.extra.bias",
            DType::F16,
            &[32],
            None,
            7,
            false,
        ));
    }
    v
}

/// The value of element `i` of tensor `name` at `step`: finite, varied, and only
/// `layers.0.attn.qkv.weight` changes with the step.
pub fn value(name: &str, step: u64, i: u64) -> f64 {
    let salt = name
        .bytes()
        .fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(b as u64));
    let base = ((i.wrapping_mul(7919).wrapping_add(salt)) % 1000) as f64 / 100.0 - 5.0;
    if name == "layers.0.attn.qkv.weight" && i.is_multiple_of(3) {
        base + step as f64 / 8.0
    } else {
        base
    }
}

/// The global tensor's little-endian bytes.
pub fn global(s: &TensorSpec, step: u64) -> Vec<u8> {
    let n = NdBox::full(&s.shape).numel();
    let mut out = Vec::with_capacity(n as usize * s.dtype.size());
    for i in 0..n {
        let v = value(&s.name, step, i);
        match s.dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f64(v).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(step as i64 * 100).to_le_bytes()),
            d => panic!("fixture has no {d}"),
        }
    }
    out
}

/// Save one rank of a step (placement recorded).
pub async fn save_rank(
    store: &Store,
    run: &str,
    step: u64,
    rank: u32,
    extra: bool,
    index: &DedupIndex,
) {
    let specs = specs(extra);
    let l = layout();
    let placed = place_rank(&l, rank, &specs).unwrap();
    let shards = placed
        .iter()
        .map(|p| {
            let s = &specs[p.spec];
            let data = p
                .replica_of
                .is_none()
                .then(|| Bytes::from(cut(&global(s, step), &s.shape, &p.bbox, s.dtype.size())));
            ShardIn {
                shard: ShardDesc::placed(s, p.bbox.clone(), p.replica_of),
                data,
            }
        })
        .collect();
    let blobs = vec![BlobIn {
        name: "rng".into(),
        data: Bytes::from(det_bytes(step * 100 + rank as u64, 200)),
    }];
    let w = RankWrite::new(run, step, rank, l);
    store.write_rank(&w, shards, blobs, index).await.unwrap();
}

/// Save and commit a step on all 4 ranks.
pub async fn save_step(store: &Store, run: &str, step: u64, extra: bool, index: &DedupIndex) {
    for r in 0..layout().world() {
        save_rank(store, run, step, r, extra, index).await;
    }
    store.log().commit_step(run, step).await.unwrap();
}

/// Steps 10 and 20 of run `train` committed (20 adds a tensor and changes qkv), step 30
/// incomplete.
pub async fn two_steps_and_a_pending_one(env: &Env) {
    let index = DedupIndex::new();
    save_step(&env.store, "train", 10, false, &index).await;
    save_step(&env.store, "train", 20, true, &index).await;
    save_rank(&env.store, "train", 30, 0, true, &index).await;
}

/// A temporary directory for files.
pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// Every file below `dir`, relative, sorted.
pub fn files_below(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}
