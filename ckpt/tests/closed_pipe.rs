//! A reader that stops early (`ckpt inspect r@latest --raw | head -c 10`): every subcommand
//! ends quietly, as `cat` does, with exit 0 and nothing on stderr, whatever layer of its
//! output the closed pipe surfaces in.

mod common;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};

use bytes::Bytes;
use ckpt_store::{DType, DedupIndex, Layout, NdBox, RankWrite, ShardDesc, ShardIn};
use common::{Env, local};

/// The pipe's capacity in these tests: a command's output is many times this, so the command
/// is still writing when the reader goes away.
const PIPE: usize = 4096;

/// Tensors per step: every listing of a step runs to tens of kilobytes.
const TENSORS: u32 = 200;

/// Steps 1 to `steps` of `run` on one rank: the first and the last of [`TENSORS`] small
/// tensors whose values change with the step, the others of one.
async fn wide_run(env: &Env, run: &str, steps: u64) {
    let index = DedupIndex::new();
    for step in 1..=steps {
        let tensors = if step == 1 || step == steps {
            TENSORS
        } else {
            1
        };
        let shards = (0..tensors)
            .map(|i| ShardIn {
                shard: ShardDesc::boxed(
                    format!("model.layers.{i}.self_attn.q_proj.weight"),
                    DType::F32,
                    vec![4],
                    NdBox::full(&[4]),
                ),
                data: Some(Bytes::from(vec![(step as u8) ^ (i as u8); 16])),
            })
            .collect();
        let w = RankWrite::new(run, step, 0, Layout::SINGLE);
        env.store
            .write_rank(&w, shards, vec![], &index)
            .await
            .unwrap();
        env.store.log().commit_step(run, step).await.unwrap();
    }
}

/// Run `ckpt args` with stdout a pipe of [`PIPE`] bytes, read the first 10 bytes, close the
/// read end; returns the exit code and stderr.
fn read_ten_bytes_and_close(env: &Env, args: &[&str]) -> (Option<i32>, String) {
    let (mut reader, writer) = std::io::pipe().unwrap();
    // SAFETY: fcntl on a pipe descriptor this function owns; F_SETPIPE_SZ takes an int.
    let set = unsafe { libc::fcntl(reader.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE as libc::c_int) };
    assert!(
        set >= PIPE as libc::c_int,
        "F_SETPIPE_SZ: {}",
        std::io::Error::last_os_error()
    );
    let child = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(args)
        .env("CKPT_STORE", &env.url)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 10];
    reader.read_exact(&mut first).unwrap();
    drop(reader);
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_early_ends_every_command_quietly() {
    let env = local();
    wide_run(&env, "wide", 160).await;
    for args in [
        &["inspect", "wide@latest", "--raw"][..],
        &["inspect", "wide@160", "--raw", "--rank", "0"],
        &["inspect", "wide@160"],
        &["--json", "inspect", "wide@160"],
        &["ls", "wide"],
        &["--json", "ls", "wide"],
        &["diff", "wide@1", "wide@160"],
        &["--json", "diff", "wide@1", "wide@160"],
    ] {
        // Whole, the output is pipes full: the command is mid-output when the pipe closes.
        let whole = env.ckpt(args).code(0);
        assert!(
            whole.out.len() > 2 * PIPE,
            "ckpt {args:?} writes only {} bytes",
            whole.out.len()
        );
        let (code, err) = read_ten_bytes_and_close(&env, args);
        assert!(!err.contains("Broken pipe"), "ckpt {args:?}: {err}");
        assert_eq!(code, Some(0), "ckpt {args:?}: {err}");
        assert!(err.is_empty(), "ckpt {args:?} wrote to stderr: {err}");
    }
}
