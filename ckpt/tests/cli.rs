//! Every subcommand on real stores: each case runs on a local directory and on a real
//! S3-compatible server, through the library functions (for exact figures) and through the
//! real `ckpt` binary (for exit codes, text and `--json` output). Export, import, plan and
//! plot are in `cli_export_plan_plot.rs`.

mod common;

use ckpt::cli::diff::{DiffArgs, diff};
use ckpt::cli::gc::{GcArgs, gc};
use ckpt::cli::inspect::{InspectArgs, inspect};
use ckpt::cli::ls::{LsArgs, LsReport, ls};
use ckpt::cli::verify::{VerifyArgs, verify};
use ckpt::cli::{CkptRef, Ui};
use ckpt_store::{ChunkIn, DedupIndex, StepReader};
use common::{
    Env, global, local, s3, save_rank, save_step, specs, tmp, two_steps_and_a_pending_one,
};
use serde_json::Value;

macro_rules! on_both {
    ($($case:ident),* $(,)?) => {
        mod on_local { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { super::$case(super::local()).await } )* }
        mod on_s3 { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $case() { ckpt_store::require!(ckpt_store::testing::Need::S3Server, concat!(stringify!($case), " on S3")); super::$case(super::s3()).await } )* }
    };
}

on_both!(
    ls_lists_runs_and_steps,
    inspect_shows_layout_tensors_and_statistics,
    diff_names_added_and_changed_tensors,
    verify_finds_a_flipped_byte_and_names_the_tensor,
    gc_keeps_what_retention_keeps_and_what_a_pending_save_needs,
    a_closed_pipe_ends_quietly,
    errors_name_what_exists_and_exit_codes_hold,
);

fn q() -> Ui {
    Ui::quiet()
}

fn now() -> chrono::DateTime<chrono::Utc> {
    ckpt_store::clock::system_now()
}

async fn ls_lists_runs_and_steps(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    save_step(&env.store, "other", 5, false, &DedupIndex::new()).await;

    let LsReport::Runs(runs) = ls(&env.store, &LsArgs::default(), now(), &q())
        .await
        .unwrap()
    else {
        panic!("runs listing expected");
    };
    let names: Vec<&str> = runs.runs.iter().map(|r| r.run.as_str()).collect();
    assert_eq!(names, ["other", "train"]);
    let train = &runs.runs[1];
    assert_eq!(
        (train.committed_steps, train.incomplete_steps, train.latest),
        (2, 1, Some(20))
    );
    assert_eq!(train.layout.as_deref(), Some("dp=2,tp=2,pp=1,zero=1"));

    let args = LsArgs {
        run: Some("train".into()),
        quick: false,
        local_tier: None,
    };
    let LsReport::Steps(st) = ls(&env.store, &args, now(), &q()).await.unwrap() else {
        panic!("steps listing expected");
    };
    let rows: Vec<(u64, bool, usize, Option<u32>)> = st
        .steps
        .iter()
        .map(|r| (r.step, r.committed, r.ranks, r.world))
        .collect();
    assert_eq!(
        rows,
        [
            (10, true, 4, Some(4)),
            (20, true, 4, Some(4)),
            (30, false, 1, Some(4))
        ]
    );
    let (s10, s20) = (&st.steps[0], &st.steps[1]);
    let logical10: u64 = specs(false)
        .iter()
        .map(|s| global(s, 10).len() as u64)
        .sum::<u64>()
        + 4 * 200;
    assert_eq!(s10.logical_bytes, Some(logical10));
    assert_eq!(
        s10.new_bytes, s10.stored_bytes,
        "the first step adds everything it references"
    );
    assert!(s20.new_bytes.unwrap() > 0);
    assert!(
        s20.new_bytes.unwrap() < s20.stored_bytes.unwrap() / 2,
        "step 20 changes one tensor and adds a small one: most of it is shared ({:?} of {:?})",
        s20.new_bytes,
        s20.stored_bytes
    );
    assert!(s10.age_s >= 0.0 && s10.age_s < 600.0);

    // The binary: text, JSON shapes, --store before or after the subcommand.
    let r = env.ckpt(&["ls"]).code(0);
    assert!(
        r.out.contains("train") && r.out.contains("other"),
        "{}",
        r.out
    );
    let j = env.ckpt(&["ls", "--json"]).code(0).json();
    assert_eq!(j["runs"][1]["run"], "train");
    assert_eq!(j["runs"][1]["latest"], 20);
    assert_eq!(j["store"], env.url.as_str());
    let r = env.ckpt(&["ls", "train"]).code(0);
    assert!(
        r.out.contains("incomplete") && r.out.contains("1/4"),
        "{}",
        r.out
    );
    let j = env.ckpt(&["--json", "ls", "train"]).code(0).json();
    let steps = j["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 3);
    for key in [
        "step",
        "committed",
        "ranks",
        "layout",
        "logical_bytes",
        "stored_bytes",
        "new_bytes",
        "age_s",
        "time",
    ] {
        assert!(
            steps[0].get(key).is_some(),
            "ls --json step rows have {key}: {}",
            steps[0]
        );
    }
    assert_eq!(steps[2]["committed"], false);
    let after = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["ls", "train", "--store", &env.url, "--json"])
        .envs(env.vars.iter().map(|(k, v)| (*k, v.as_str())))
        .env_remove("CKPT_STORE")
        .output()
        .unwrap();
    assert!(
        after.status.success(),
        "{}",
        String::from_utf8_lossy(&after.stderr)
    );
    assert_eq!(
        serde_json::from_slice::<Value>(&after.stdout).unwrap()["run"],
        "train"
    );
}

async fn inspect_shows_layout_tensors_and_statistics(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let args = InspectArgs {
        tensor: Some("layers.0.attn.qkv.weight".into()),
        ..InspectArgs::new(CkptRef::at("train", 10))
    };
    let r = inspect(&env.store, &args, &q()).await.unwrap();
    assert_eq!(
        (r.layout.as_str(), r.world, r.step),
        ("dp=2,tp=2,pp=1,zero=1", 4, 10)
    );
    assert_eq!(r.tensors.len(), specs(false).len());
    assert_eq!(r.blobs.len(), 4, "one rng blob per rank");
    assert_eq!(r.ranks.len(), 4);
    let norm = r
        .tensors
        .iter()
        .find(|t| t.name == "layers.0.norm.weight")
        .unwrap();
    assert_eq!(
        (norm.shards, norm.replicas),
        (1, 3),
        "replicated: one writer, three replicas"
    );
    let qkv = r
        .tensors
        .iter()
        .find(|t| t.name == "layers.0.attn.qkv.weight")
        .unwrap();
    assert_eq!(qkv.shards, 2, "split in two by tp");
    assert_eq!(qkv.chunks, 2);
    assert!(qkv.placement.is_some());
    assert_eq!(qkv.codecs.values().sum::<u64>(), 2);
    // Statistics against the values the fixture wrote.
    let d = r.tensor.as_ref().unwrap();
    let vals: Vec<f64> = (0..64 * 32)
        .map(|i| common::value("layers.0.attn.qkv.weight", 10, i) as f32 as f64)
        .collect();
    let mean = vals.iter().sum::<f64>() / vals.len() as f64;
    let std =
        (vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / vals.len() as f64).sqrt();
    assert_eq!(d.stats.count, 2048);
    assert_eq!((d.stats.nan, d.stats.inf), (0, 0));
    assert!(
        (d.stats.mean.unwrap() - mean).abs() < 1e-9,
        "{:?} vs {mean}",
        d.stats.mean
    );
    assert!((d.stats.std.unwrap() - std).abs() < 1e-9);
    assert_eq!(d.stats.min, vals.iter().copied().reduce(f64::min));
    assert_eq!(d.stats.max, vals.iter().copied().reduce(f64::max));
    assert_eq!(d.shard_list.len(), 2);
    assert_eq!(
        d.shard_list[0].replicas.len(),
        1,
        "dp=2: the other data-parallel rank holds a replica"
    );

    // ZeRO-partitioned state: more shards than tp alone would make.
    let ea = r
        .tensors
        .iter()
        .find(|t| t.name == "optim.exp_avg.qkv")
        .unwrap();
    assert!(
        ea.shards >= 4,
        "ZeRO-1 splits each tp half across dp: {}",
        ea.shards
    );

    let j = env.ckpt(&["inspect", "train@10", "--json"]).code(0).json();
    for key in [
        "run",
        "step",
        "id",
        "layout",
        "mesh",
        "world",
        "ranks",
        "tensors",
        "blobs",
        "write_stats",
        "stored_bytes",
    ] {
        assert!(j.get(key).is_some(), "inspect --json has {key}");
    }
    assert_eq!(j["mesh"]["tp"], 2);
    assert!(j.get("tensor").is_none());
    let t = &j["tensors"].as_array().unwrap()[0];
    for key in [
        "name",
        "dtype",
        "shape",
        "bytes",
        "shards",
        "chunks",
        "codecs",
        "stored_bytes",
    ] {
        assert!(t.get(key).is_some(), "tensor rows have {key}");
    }
    let j = env
        .ckpt(&["inspect", "train", "--tensor", "optim.step", "--json"])
        .code(0)
        .json();
    assert_eq!(j["step"], 20, "RUN alone means the newest committed step");
    assert_eq!(j["tensor"]["stats"]["max"], 2000.0);
    // The stored documents themselves.
    let j = env.ckpt(&["inspect", "train@10", "--raw"]).code(0).json();
    assert_eq!(j["step"], 10);
    assert_eq!(j["ranks"].as_array().unwrap().len(), 4);
    let j = env
        .ckpt(&["inspect", "train@10", "--raw", "--rank", "3"])
        .code(0)
        .json();
    assert_eq!(j["rank"], 3);
    assert!(
        j["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["box"].is_object())
    );
    env.ckpt(&["inspect", "train@10", "--rank", "3"]).code(2);
    let r = env
        .ckpt(&["inspect", "train@10", "--raw", "--rank", "9"])
        .code(1);
    assert!(r.err.contains("rank 9 is not part of it"), "{}", r.err);
    let r = env.ckpt(&["inspect", "train@10"]).code(0);
    assert!(r.out.contains("dp=2,tp=2,pp=1,zero=1") && r.out.contains("layers.0.attn.qkv.weight"));
    let r = env
        .ckpt(&["inspect", "train@10", "--tensor", "qkv"])
        .code(1);
    assert!(
        r.err.contains("no tensor named \"qkv\"") && r.err.contains("similar names"),
        "{}",
        r.err
    );
}

async fn diff_names_added_and_changed_tensors(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let args = DiffArgs {
        a: CkptRef::at("train", 10),
        b: CkptRef::at("train", 20),
        quick: false,
    };
    let d = diff(&env.store, &args, &q()).await.unwrap();
    let added: Vec<&str> = d.added.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(added, ["layers.0.extra.bias"]);
    assert!(d.removed.is_empty());
    let changed: Vec<&str> = d.changed.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(changed, ["layers.0.attn.qkv.weight", "optim.step"]);
    // Exactly the bytes and elements that differ.
    let s = &specs(false)[1];
    let (a, b) = (global(s, 10), global(s, 20));
    let bytes = a.iter().zip(&b).filter(|(x, y)| x != y).count() as u64;
    let elems = a.chunks(4).zip(b.chunks(4)).filter(|(x, y)| x != y).count() as u64;
    let qkv = &d.changed[0];
    assert_eq!(qkv.bytes_differ, Some(bytes));
    assert_eq!(qkv.elements_differ, Some(elems));
    let max = a
        .chunks(4)
        .zip(b.chunks(4))
        .map(|(x, y)| {
            let (x, y) = (
                f32::from_le_bytes(x.try_into().unwrap()),
                f32::from_le_bytes(y.try_into().unwrap()),
            );
            (x as f64 - y as f64).abs()
        })
        .fold(0.0, f64::max);
    assert_eq!(qkv.max_abs_diff, Some(max));
    assert_eq!(qkv.chunks_shared, 0, "every chunk of qkv changed");
    assert_eq!(d.unchanged, specs(false).len() - 2);
    assert_eq!(d.blobs.changed.len(), 4, "the rng blobs change every step");
    assert!(d.totals.chunks_shared > 0);
    // --quick reads no data: sizes unknown but the same verdicts for aligned shards.
    let dq = diff(
        &env.store,
        &DiffArgs {
            quick: true,
            ..args.clone()
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(dq.changed.len(), 2);
    assert_eq!(dq.changed[0].bytes_differ, None);
    assert_eq!(dq.totals.bytes_read, 0);
    // Same step on both sides: nothing changed, nothing read.
    let same = diff(
        &env.store,
        &DiffArgs {
            b: CkptRef::at("train", 10),
            ..args.clone()
        },
        &q(),
    )
    .await
    .unwrap();
    assert!(same.changed.is_empty() && same.added.is_empty());
    assert_eq!(same.totals.bytes_read, 0);

    let j = env
        .ckpt(&["diff", "train@10", "train@20", "--json"])
        .code(0)
        .json();
    for key in [
        "a",
        "b",
        "added",
        "removed",
        "changed",
        "unchanged",
        "blobs",
        "totals",
    ] {
        assert!(j.get(key).is_some(), "diff --json has {key}");
    }
    assert_eq!(j["changed"][0]["bytes_differ"], bytes);
    let r = env.ckpt(&["diff", "train@10", "train"]).code(0);
    assert!(
        r.out.contains("+") && r.out.contains("layers.0.extra.bias") && r.out.contains("~"),
        "{}",
        r.out
    );
}

async fn verify_finds_a_flipped_byte_and_names_the_tensor(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let out = verify(
        &env.store,
        &VerifyArgs {
            target: Some("train".into()),
        },
        &q(),
    )
    .await
    .unwrap();
    assert!(out.clean, "{:?}", out.report.damaged);
    assert_eq!(out.report.steps, 2);
    assert!(out.report.bytes > 0);
    let r = env.ckpt(&["verify", "train"]).code(0);
    assert!(r.out.contains("OK"), "{}", r.out);

    // Flip the last byte of a chunk object of qkv at step 10 (not shared with step 20).
    let reader = StepReader::open(&env.store, "train", 10).await.unwrap();
    let t = reader
        .commit()
        .tensor("layers.0.attn.qkv.weight")
        .unwrap()
        .clone();
    let m = reader.manifest(t.shards[0].rank).await.unwrap();
    let shard = m.written_shard(&t.name, &t.shards[0].bbox).unwrap();
    let c = &shard.chunks[0];
    assert!(c.pack.is_none(), "a 4 KiB shard is its own chunk object");
    let key = env.store.keys().object_of(c).to_string();
    let file = env.object_file(&key);
    let mut bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    *bytes.last_mut().unwrap() ^= 0x40;
    std::fs::write(&file, bytes).unwrap();

    let out = verify(
        &env.store,
        &VerifyArgs {
            target: Some("train".into()),
        },
        &q(),
    )
    .await
    .unwrap();
    assert!(!out.clean);
    assert_eq!(out.damaged_steps, ["train@10"]);
    assert_eq!(out.report.damaged.len(), 1);
    let dmg = &out.report.damaged[0];
    assert_eq!(dmg.object, key);
    assert!(
        dmg.affects
            .iter()
            .any(|a| a.item == "tensor layers.0.attn.qkv.weight" && a.step == 10)
    );

    let r = env.ckpt(&["verify", "train"]).code(3);
    assert!(
        r.out.contains("DAMAGED") && r.out.contains(&key),
        "{}",
        r.out
    );
    assert!(
        r.out.contains("train@10: tensor layers.0.attn.qkv.weight"),
        "{}",
        r.out
    );
    let j = env.ckpt(&["verify", "--json"]).code(3).json();
    assert_eq!(j["clean"], false);
    assert_eq!(j["scope"], "store");
    assert_eq!(j["damaged"][0]["object"], key.as_str());
    assert_eq!(j["damaged_steps"][0], "train@10");
    // Step 20 does not reference the damaged chunk.
    env.ckpt(&["verify", "train@20"]).code(0);
    env.ckpt(&["verify", "train@latest"]).code(0);
    // Reading the damaged tensor fails with exit code 3 and says what to do.
    let out = tmp();
    let r = env
        .ckpt(&["export", "train@10", "--out", out.path().to_str().unwrap()])
        .code(3);
    assert!(r.err.contains("ckpt verify"), "{}", r.err);
    assert!(
        common::files_below(out.path()).is_empty(),
        "a failed export leaves no file"
    );
}

async fn gc_keeps_what_retention_keeps_and_what_a_pending_save_needs(env: Env) {
    let index = DedupIndex::new();
    for s in [10, 20, 30, 40] {
        save_step(&env.store, "train", s, s >= 30, &index).await;
    }
    // A save in progress: rank 0 of step 50 wrote its manifest, rank 1 only its chunks.
    save_rank(&env.store, "train", 50, 0, true, &index).await;
    let pending: Vec<ChunkIn> = (0..3)
        .map(|i| ChunkIn {
            data: bytes::Bytes::from(ckpt_store::testing::det_bytes(900 + i, 4096)),
            elem: 1,
            base: None,
        })
        .collect();
    let put = env
        .store
        .chunks()
        .put_chunks(futures::stream::iter(pending), &DedupIndex::new())
        .await
        .unwrap();

    // Dry run: names what it would delete, deletes nothing.
    let j = env
        .ckpt(&["gc", "--keep-last", "2", "--dry-run", "--json"])
        .code(0)
        .json();
    assert_eq!(j["dry_run"], true);
    assert_eq!(
        j["steps_deleted"],
        serde_json::json!([["train", 10], ["train", 20]])
    );
    assert_eq!(
        env.store.log().committed_steps("train").await.unwrap(),
        [10, 20, 30, 40]
    );
    // A grace under a minute needs --force.
    let r = env
        .ckpt(&["gc", "--keep-last", "2", "--grace", "10s"])
        .code(2);
    assert!(r.err.contains("--force"), "{}", r.err);

    // Retention keeps the newest two, and a protected step.
    let args = GcArgs {
        keep_last: Some(2),
        protect: vec![CkptRef::at("train", 10)],
        ..GcArgs::default()
    };
    let out = gc(&env.store, &args, now(), &q()).await.unwrap();
    assert_eq!(out.report.steps_deleted, [("train".to_string(), 20)]);
    assert_eq!(
        env.store.log().committed_steps("train").await.unwrap(),
        [10, 30, 40]
    );
    // Everything is young: nothing swept; the pending save keeps its step and its chunks.
    assert_eq!(out.report.objects_deleted, 0);
    assert!(
        out.report.objects_in_grace > 0,
        "step 20's own chunks wait out the grace period"
    );
    assert_eq!(out.report.incomplete_deleted, []);
    assert!(
        env.store
            .log()
            .list_steps("train")
            .await
            .unwrap()
            .iter()
            .any(|s| s.step == 50 && !s.committed)
    );
    for r in &put.refs {
        assert!(
            env.store.chunks().get_chunk(r).await.is_ok(),
            "a pending chunk survived gc"
        );
    }
    // ... and the pending save completes.
    for rank in 1..4 {
        save_rank(&env.store, "train", 50, rank, true, &index).await;
    }
    env.store.log().commit_step("train", 50).await.unwrap();

    // Two hours later (grace 1 h): retention drops 10 and 30, the sweep frees their chunks,
    // step 20's and the loose ones.
    let later = now() + chrono::Duration::hours(2);
    let out = gc(
        &env.store,
        &GcArgs {
            keep_last: Some(2),
            ..GcArgs::default()
        },
        later,
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(
        out.report.steps_deleted,
        [("train".to_string(), 10), ("train".to_string(), 30)]
    );
    assert!(out.report.objects_deleted > 0 && out.report.bytes_freed > 0);
    for r in &put.refs {
        assert!(
            env.store.chunks().get_chunk(r).await.is_err(),
            "an unreferenced old chunk was swept"
        );
    }
    // What remains is intact and readable.
    let v = verify(&env.store, &VerifyArgs { target: None }, &q())
        .await
        .unwrap();
    assert!(v.clean, "{:?}", v.report.damaged);
    for s in [40, 50] {
        let r = StepReader::open(&env.store, "train", s).await.unwrap();
        for spec in specs(true) {
            assert_eq!(
                r.read_tensor(&spec.name).await.unwrap(),
                global(&spec, s),
                "{} at {s}",
                spec.name
            );
        }
    }
    let r = env.ckpt(&["gc", "--keep-last", "1"]).code(0);
    assert!(
        r.out.contains("deleted 1 committed: train@{40}"),
        "{}",
        r.out
    );
    env.ckpt(&["verify", "train"]).code(0);
}

async fn errors_name_what_exists_and_exit_codes_hold(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let r = env.ckpt(&["inspect", "train@15"]).code(1);
    assert!(
        r.err
            .contains("run train has no step 15 (committed steps: 10, 20)"),
        "{}",
        r.err
    );
    let r = env.ckpt(&["inspect", "train@30"]).code(1);
    assert!(
        r.err.contains("step 30 of run train is incomplete"),
        "{}",
        r.err
    );
    let r = env.ckpt(&["inspect", "nope@1"]).code(1);
    assert!(
        r.err.contains("no run named nope (known runs: train)"),
        "{}",
        r.err
    );
    let r = env.ckpt(&["ls", "nope"]).code(1);
    assert!(r.err.contains("known runs: train"), "{}", r.err);
    let r = env.ckpt(&["inspect", "train@ten"]).code(2);
    assert!(r.err.contains("not a number"), "{}", r.err);
    env.ckpt(&["inspect", "../x@1"]).code(2);
    env.ckpt(&["frobnicate"]).code(2);
    env.ckpt(&["export", "train@10"]).code(2); // --out missing
    env.ckpt(&["--help"]).code(0);
    let r = env.ckpt(&["--version"]).code(0);
    assert!(r.out.starts_with("ckpt "));
    // No store at all.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .arg("ls")
        .env_remove("CKPT_STORE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no store given"));
    // An unknown scheme is a usage error naming the choices.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(["--store", "ftp://x/y", "ls"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown scheme"));
    // Mount refuses a mount point that is not a directory, before touching FUSE.
    let r = env
        .ckpt(&["mount", "/nonexistent/dir", "--foreground"])
        .code(2);
    assert!(r.err.contains("is not a directory"), "{}", r.err);
}

/// The store's request layers are set by the binary's environment (`CKPT_STORE_RETRY`,
/// `CKPT_FAULTS`), read at start-up and handed to the library: a wrong value is a usage error
/// naming the variable, and injected faults reach the store the command opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_settings_from_the_environment_reach_the_store() {
    let env = local();
    save_step(&env.store, "train", 10, false, &DedupIndex::new()).await;
    let ckpt = |vars: &[(&str, &str)]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .args(["ls", "train"])
            .env("CKPT_STORE", &env.url)
            .env_remove("CKPT_STORE_RETRY")
            .env_remove("CKPT_FAULTS")
            .envs(vars.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    assert_eq!(ckpt(&[]).0, Some(0));
    assert_eq!(ckpt(&[("CKPT_FAULTS", "")]).0, Some(0), "empty: none");
    for (var, value) in [
        ("CKPT_STORE_RETRY", "attempts=0"),
        ("CKPT_FAULTS", "rate=2"),
    ] {
        let (code, err) = ckpt(&[(var, value)]);
        assert_eq!(code, Some(2), "{var}={value}: {err}");
        assert!(err.contains(var), "{var}={value}: {err}");
    }
    // Every request fails and none is retried: the listing cannot be read.
    let (code, err) = ckpt(&[
        ("CKPT_FAULTS", "rate=1,seed=1,mix=1:0:0"),
        ("CKPT_STORE_RETRY", "attempts=1"),
    ]);
    assert_eq!(code, Some(1), "{err}");
}

/// `ckpt ls --json | head -0`: the reader is gone before the first byte; like any Unix tool,
/// the command exits 0 without a word (it printed "error: writing the output: Broken pipe").
async fn a_closed_pipe_ends_quietly(env: Env) {
    save_step(&env.store, "train", 10, false, &DedupIndex::new()).await;
    for args in [
        &["ls", "--json"][..],
        &["ls", "train"],
        &["inspect", "train@10", "--json"],
        &["inspect", "train@10"],
        &["inspect", "train@latest", "--raw"],
        &["stats", "train"],
        &["verify", "train@10"],
        &["diff", "train@10", "train@10"],
    ] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ckpt"))
            .args(args)
            .env("CKPT_STORE", &env.url)
            .envs(env.vars.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Close the read end before the command can have written anything: it still has to
        // open the store and read the step.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "ckpt {args:?}: {err}");
        assert!(err.is_empty(), "ckpt {args:?} wrote to stderr: {err}");
    }
}

/// A damaged commit record or rank manifest (one bit flipped, at many offsets) on a local
/// store: `verify` exits 3 naming the step every time, and export, inspect, diff and plan
/// refuse the step (exit 3) without writing anything. The decoding is the same on S3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_in_a_commit_record_or_manifest_fails_every_command() {
    let env = local();
    two_steps_and_a_pending_one(&env).await;
    let commit = env.store.keys().commit("train", 10).to_string();
    let manifest = env.store.keys().rank_manifest("train", 10, 1).to_string();
    for key in [commit, manifest] {
        let file = env.object_file(&key);
        let orig = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        // Offsets across the object, and every digit of the first shape (64 -> 65 and so on).
        let mut at: Vec<usize> = (0..10).map(|i| i * orig.len() / 10 + 3).collect();
        let shape = orig
            .windows(9)
            .position(|w| w == b"\"shape\":[")
            .expect("a shape in the object");
        at.extend(shape + 9..shape + 27);
        for (i, &o) in at.iter().enumerate() {
            let mut bad = orig.clone();
            bad[o] ^= 1 << (i % 8);
            std::fs::write(&file, &bad).unwrap();
            let what = format!("bit {} of byte {o} of {key}", i % 8);
            let r = env.ckpt(&["verify", "train@10"]);
            assert_eq!(r.code, 3, "{what}: verify: {}{}", r.out, r.err);
            assert!(r.out.contains("train@10"), "{what}: {}", r.out);
            let out = tmp();
            let r = env.ckpt(&["export", "train@10", "--out", out.path().to_str().unwrap()]);
            assert_eq!(r.code, 3, "{what}: export: {}{}", r.out, r.err);
            assert!(
                r.err.contains("step 10 of run train")
                    || r.err.contains("/steps/00000000000000000010/"),
                "{what}: export does not name the step: {}",
                r.err
            );
            assert!(
                common::files_below(out.path()).is_empty(),
                "{what}: export left files"
            );
            if key.ends_with("COMMIT") {
                for args in [
                    &["inspect", "train@10"][..],
                    &["diff", "train@10", "train@20"],
                    &["plan", "train@10", "--layout", "dp=2"],
                ] {
                    let r = env.ckpt(args);
                    assert_eq!(r.code, 3, "{what}: {args:?}: {}{}", r.out, r.err);
                    assert!(
                        r.err.contains("step 10 of run train"),
                        "{what}: {args:?}: {}",
                        r.err
                    );
                }
            }
            // Step 20 is intact whatever happened to step 10's objects.
            env.ckpt(&["verify", "train@20"]).code(0);
        }
        std::fs::write(&file, &orig).unwrap();
    }
    env.ckpt(&["verify", "train"]).code(0);
}

/// Temporary files a crash left in a local store: `ckpt verify` names them (exit 0: not
/// damage), `ckpt gc` deletes the ones older than the grace period and keeps a young one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reports_and_gc_collects_temp_files_of_interrupted_writes() {
    let env = local();
    save_step(&env.store, "train", 10, false, &DedupIndex::new()).await;
    let plant = |key: &str, age_s: u64| {
        let p = env.objects_dir.join(key);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(4096).unwrap();
        f.set_modified(
            std::time::SystemTime::from(ckpt_store::clock::system_now())
                - std::time::Duration::from_secs(age_s),
        )
        .unwrap();
        p
    };
    let old = plant(&format!("chunks/ab/{}#1", "ab".repeat(32)), 7200);
    let young = plant("runs/train/steps/00000000000000000030/COMMIT#2", 10);
    let r = env.ckpt(&["verify"]).code(0);
    assert!(
        r.out.contains("2 temporary file(s)") && r.out.contains("#1") && r.out.contains("COMMIT#2"),
        "{}",
        r.out
    );
    let j = env.ckpt(&["verify", "--json"]).code(0).json();
    assert_eq!(j["temp_files"].as_array().unwrap().len(), 2, "{j}");
    let r = env.ckpt(&["gc", "--grace", "1h"]).code(0);
    assert!(
        r.out.contains("deleted 1 file(s) interrupted writes left") && r.out.contains("kept 1"),
        "{}",
        r.out
    );
    assert!(!old.exists() && young.exists());
    env.ckpt(&["verify", "train@10"]).code(0);
}
