//! Every subcommand on real stores: each case runs on a local directory and on a real
//! S3-compatible server, through the library functions (for exact figures) and through the
//! real `ckpt` binary (for exit codes, text and `--json` output).

mod common;

use std::collections::HashSet;

use ckpt::cli::diff::{DiffArgs, diff};
use ckpt::cli::export::{ExportArgs, export};
use ckpt::cli::gc::{GcArgs, gc};
use ckpt::cli::import::{ImportArgs, import};
use ckpt::cli::inspect::{InspectArgs, inspect};
use ckpt::cli::ls::{LsArgs, LsReport, ls};
use ckpt::cli::plan::{PlanArgs, plan};
use ckpt::cli::plot::{PlotArgs, plot};
use ckpt::cli::verify::{VerifyArgs, verify};
use ckpt::cli::{CkptRef, Ui};
use ckpt_store::logs::{EVENTS, LogWriter, METRICS};
use ckpt_store::placement::place_rank;
use ckpt_store::{ChunkIn, DedupIndex, SafetensorsView, StepReader};
use common::{Env, global, local, s3, save_rank, save_step, specs, tmp};
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
    export_matches_the_view_and_import_round_trips,
    plan_computes_each_new_ranks_reads,
    plot_draws_png_and_svg,
    a_closed_pipe_ends_quietly,
    errors_name_what_exists_and_exit_codes_hold,
);

fn q() -> Ui {
    Ui::quiet()
}

fn now() -> chrono::DateTime<chrono::Utc> {
    ckpt_store::clock::system_now()
}

/// Steps 10 and 20 committed (20 adds a tensor and changes qkv), step 30 incomplete.
async fn two_steps_and_a_pending_one(env: &Env) {
    let index = DedupIndex::new();
    save_step(&env.store, "train", 10, false, &index).await;
    save_step(&env.store, "train", 20, true, &index).await;
    save_rank(&env.store, "train", 30, 0, true, &index).await;
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
    let key = env.store.object_of(c).to_string();
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
        env.store.committed_steps("train").await.unwrap(),
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
        env.store.committed_steps("train").await.unwrap(),
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
            .list_steps("train")
            .await
            .unwrap()
            .iter()
            .any(|s| s.step == 50 && !s.committed)
    );
    for r in &put.refs {
        assert!(
            env.store.get_chunk(r).await.is_ok(),
            "a pending chunk survived gc"
        );
    }
    // ... and the pending save completes.
    for rank in 1..4 {
        save_rank(&env.store, "train", 50, rank, true, &index).await;
    }
    env.store.commit_step("train", 50).await.unwrap();

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
            env.store.get_chunk(r).await.is_err(),
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

async fn export_matches_the_view_and_import_round_trips(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let dir = tmp();
    let out1 = dir.path().join("one");
    let rep = export(
        &env.store,
        &ExportArgs::new(CkptRef::at("train", 20), &out1),
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(rep.files.len(), 1);
    assert!(rep.index.is_none());
    let file = std::fs::read(out1.join("model.safetensors")).unwrap();
    // Byte-identical to the view the FUSE mount serves.
    let reader = StepReader::open(&env.store, "train", 20).await.unwrap();
    let view = SafetensorsView::new(reader.commit(), None).unwrap();
    let mut want = vec![0u8; view.len() as usize];
    view.read_at(&reader, 0, &mut want).await.unwrap();
    assert!(
        file == want,
        "export differs from the SafetensorsView bytes"
    );
    let st = safetensors::SafeTensors::deserialize(&file).unwrap();
    for s in specs(true) {
        let t = st.tensor(&s.name).unwrap();
        assert_eq!(t.data(), &global(&s, 20)[..], "{}", s.name);
        assert_eq!(
            t.shape(),
            s.shape.iter().map(|&d| d as usize).collect::<Vec<_>>()
        );
    }
    assert_eq!(
        common::files_below(&out1),
        ["model.safetensors"],
        "no temporary file is left"
    );

    // Sharded, Hugging Face style.
    let out2 = dir.path().join("sharded");
    let mut args = ExportArgs::new(CkptRef::at("train", 20), &out2);
    args.max_shard_size = Some(10 << 10);
    let sharded = export(&env.store, &args, &q()).await.unwrap();
    assert!(sharded.files.len() >= 3, "{:?}", sharded.files);
    let index: Value =
        serde_json::from_slice(&std::fs::read(out2.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let total: u64 = specs(true).iter().map(|s| global(s, 20).len() as u64).sum();
    assert_eq!(index["metadata"]["total_size"], total);
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), specs(true).len());
    let mut seen = HashSet::new();
    for f in &sharded.files {
        assert!(f.bytes <= (10 << 10) + 4096 || f.tensors == 1, "{f:?}");
        let b = std::fs::read(out2.join(&f.file)).unwrap();
        for (name, t) in safetensors::SafeTensors::deserialize(&b).unwrap().tensors() {
            assert_eq!(map[&name], f.file.as_str());
            let s = specs(true).into_iter().find(|s| s.name == name).unwrap();
            assert_eq!(t.data(), &global(&s, 20)[..]);
            seen.insert(name);
        }
    }
    assert_eq!(seen.len(), specs(true).len());

    // --dtype bf16: floats convert (round to nearest even), integers keep their dtype.
    let out3 = dir.path().join("bf16");
    let mut args = ExportArgs::new(CkptRef::at("train", 20), &out3);
    args.dtype = Some(ckpt::cli::shared::values::FloatDType::Bf16);
    args.exclude = vec!["optim.exp_avg.*".into()];
    export(&env.store, &args, &q()).await.unwrap();
    let b = std::fs::read(out3.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&b).unwrap();
    assert!(
        st.tensor("optim.exp_avg.qkv").is_err(),
        "--exclude left it out"
    );
    let qkv = st.tensor("layers.0.attn.qkv.weight").unwrap();
    assert_eq!(qkv.dtype(), safetensors::Dtype::BF16);
    let want: Vec<u8> = global(&specs(true)[1], 20)
        .chunks(4)
        .flat_map(|c| half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect();
    assert_eq!(qkv.data(), &want[..]);
    assert_eq!(
        st.tensor("optim.step").unwrap().dtype(),
        safetensors::Dtype::I64
    );

    // Exporting again into the same place needs --force.
    let r = env
        .ckpt(&["export", "train@20", "--out", out1.to_str().unwrap()])
        .code(1);
    assert!(r.err.contains("--force"), "{}", r.err);
    let r = env
        .ckpt(&[
            "export",
            "train@20",
            "--out",
            out1.to_str().unwrap(),
            "--force",
            "--json",
        ])
        .code(0);
    assert_eq!(r.json()["files"][0]["file"], "model.safetensors");
    assert!(std::fs::read(out1.join("model.safetensors")).unwrap() == file);

    // Import: a fine-tuning run starts from the exported file.
    let args = ImportArgs {
        files: vec![out1.join("model.safetensors")],
        run: "ft".into(),
        step: 0,
    };
    let rep = import(&env.store, &args, &q()).await.unwrap();
    assert_eq!(rep.tensors, specs(true).len());
    let ft = StepReader::open(&env.store, "ft", 0).await.unwrap();
    assert_eq!(ft.commit().layout, ckpt_store::Layout::SINGLE);
    for s in specs(true) {
        assert_eq!(
            ft.read_tensor(&s.name).await.unwrap(),
            global(&s, 20),
            "{}",
            s.name
        );
    }
    // Importing the same bytes again costs nothing: every chunk is already stored.
    let rep2 = import(
        &env.store,
        &ImportArgs {
            step: 1,
            ..args.clone()
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(rep2.chunks_skipped, rep2.chunks, "{rep2:?}");
    assert_eq!(rep2.bytes_written, 0);
    assert!(rep2.dedup_chunks_known > 0);
    // The index json of the sharded export imports the same tensors, and writes no chunk.
    let rep3 = import(
        &env.store,
        &ImportArgs {
            files: vec![out2.join("model.safetensors.index.json")],
            run: "ft".into(),
            step: 2,
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(rep3.tensors, specs(true).len());
    assert_eq!(rep3.files.len(), sharded.files.len());
    assert_eq!(
        rep3.bytes_skipped, rep3.logical_bytes,
        "same tensors, same chunks: only the metadata blob (other file names) is new"
    );
    // The binary (which opens the store with its default 4 MiB chunks).
    let r = env
        .ckpt(&[
            "import",
            out2.join("model.safetensors.index.json").to_str().unwrap(),
            "--run",
            "ft",
            "--step",
            "3",
            "--json",
        ])
        .code(0);
    let j = r.json();
    for key in [
        "run",
        "step",
        "files",
        "tensors",
        "logical_bytes",
        "chunks",
        "chunks_skipped",
        "bytes_written",
    ] {
        assert!(j.get(key).is_some(), "import --json has {key}");
    }
    assert_eq!(j["tensors"], specs(true).len());
    // The step exists: refused, and nothing changes.
    let r = env
        .ckpt(&[
            "import",
            out1.join("model.safetensors").to_str().unwrap(),
            "--run",
            "ft",
            "--step",
            "2",
        ])
        .code(1);
    assert!(
        r.err.contains("step 2 of run ft already exists"),
        "{}",
        r.err
    );
    // Values survive across layouts: the sharded original and the single-rank import.
    let d = diff(
        &env.store,
        &DiffArgs {
            a: CkptRef::at("train", 20),
            b: CkptRef::at("ft", 2),
            quick: false,
        },
        &q(),
    )
    .await
    .unwrap();
    assert!(
        d.changed.is_empty() && d.added.is_empty() && d.removed.is_empty(),
        "{d:?}"
    );
    assert_eq!(d.totals.bytes_differ, 0);
    assert!(
        d.totals.bytes_read > 0,
        "different layouts are compared by reading"
    );
    let dq = diff(
        &env.store,
        &DiffArgs {
            a: CkptRef::at("train", 20),
            b: CkptRef::at("ft", 2),
            quick: true,
        },
        &q(),
    )
    .await
    .unwrap();
    assert!(!dq.changed.is_empty());
    assert!(
        dq.changed
            .iter()
            .all(|c| c.what == "unknown" && c.bytes_differ.is_none())
    );
    assert_eq!(dq.totals.bytes_read, 0);
}

async fn plan_computes_each_new_ranks_reads(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let all: u64 = specs(true).iter().map(|s| global(s, 20).len() as u64).sum();
    // One rank reads everything, every fetched byte is used.
    let p = plan(
        &env.store,
        &PlanArgs {
            ckpt: CkptRef::at("train", 20),
            layout: "dp=1".into(),
            zero: None,
            rank: None,
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(p.world, 1);
    assert_eq!(p.ranks[0].bytes_needed, all);
    assert_eq!(p.ranks[0].raw_bytes, all);
    assert_eq!(p.totals.read_amplification, 1.0);
    assert!(p.unplaced.is_empty());

    // dp=4 with ZeRO-1: every rank's needs match the placement rules.
    let new: ckpt_store::Layout = "dp=4,tp=1,pp=1,zero=1".parse().unwrap();
    let p = plan(
        &env.store,
        &PlanArgs {
            ckpt: CkptRef::at("train", 20),
            layout: "dp=4".into(),
            zero: Some(1),
            rank: Some(3),
        },
        &q(),
    )
    .await
    .unwrap();
    assert_eq!(p.to_layout, "dp=4,tp=1,pp=1,zero=1");
    let sp = specs(true);
    for r in 0..4 {
        let want: u64 = place_rank(&new, r, &sp)
            .unwrap()
            .iter()
            .map(|x| x.bbox.numel() * sp[x.spec].dtype.size() as u64)
            .sum();
        assert_eq!(p.ranks[r as usize].bytes_needed, want, "rank {r}");
        assert!(p.ranks[r as usize].raw_bytes >= want);
        assert!(p.ranks[r as usize].objects > 0);
    }
    // The recovery driver's plan (what the recovery log records for a generation) reads the
    // same bytes per rank as `ckpt plan`, ZeRO partitions included.
    let driver = ckpt_recovery::restore_plan(&env.store, "train", 20, &new)
        .await
        .unwrap();
    assert_eq!(driver.len(), 4);
    for (d, c) in driver.iter().zip(&p.ranks) {
        assert_eq!(
            (d.rank, d.bytes_needed),
            (c.rank, c.bytes_needed),
            "rank {}",
            c.rank
        );
    }
    let reader = StepReader::open(&env.store, "train", 20).await.unwrap();
    for read in &p.ranks[3].reads {
        let plan = reader.plan(&read.tensor, &read.bbox).await.unwrap();
        assert_eq!(plan.chunks.len(), read.chunks.len());
    }

    let j = env
        .ckpt(&["plan", "train@20", "--layout", "dp=1,tp=2", "--json"])
        .code(0)
        .json();
    for key in [
        "run",
        "step",
        "from_layout",
        "to_layout",
        "world",
        "unplaced",
        "ranks",
        "totals",
    ] {
        assert!(j.get(key).is_some(), "plan --json has {key}");
    }
    let rank0 = &j["ranks"][0];
    for key in [
        "rank",
        "dp",
        "tp",
        "pp",
        "bytes_needed",
        "chunks",
        "raw_bytes",
        "stored_bytes",
        "objects",
        "reads",
    ] {
        assert!(rank0.get(key).is_some(), "plan ranks have {key}");
    }
    let c = &rank0["reads"][0]["chunks"][0];
    assert!(
        c["object"].as_str().unwrap().contains("chunks/")
            || c["object"].as_str().unwrap().contains("packs/")
    );
    let r = env
        .ckpt(&["plan", "train@20", "--layout", "dp=1,tp=2", "--rank", "1"])
        .code(0);
    assert!(
        r.out.contains("rank 1 reads:") && r.out.contains("chunk "),
        "{}",
        r.out
    );
    // An impossible layout names the tensor; a malformed one is a usage error.
    let r = env.ckpt(&["plan", "train@20", "--layout", "tp=3"]).code(2);
    assert!(r.err.contains("does not divide by tp=3"), "{}", r.err);
    env.ckpt(&["plan", "train@20", "--layout", "xp=2"]).code(2);
    env.ckpt(&["plan", "train@20", "--layout", "dp=2", "--rank", "9"])
        .code(2);

    // An imported step has no placement: every rank reads everything, and the output says so.
    let dir = tmp();
    export(
        &env.store,
        &ExportArgs::new(CkptRef::at("train", 20), dir.path()),
        &q(),
    )
    .await
    .unwrap();
    import(
        &env.store,
        &ImportArgs {
            files: vec![dir.path().join("model.safetensors")],
            run: "ft".into(),
            step: 1,
        },
        &q(),
    )
    .await
    .unwrap();
    let r = env.ckpt(&["plan", "ft@1", "--layout", "dp=2"]).code(0);
    assert!(r.out.contains("no recorded placement"), "{}", r.out);
    let j = env
        .ckpt(&["plan", "ft", "--layout", "dp=2", "--json"])
        .code(0)
        .json();
    assert_eq!(j["unplaced"].as_array().unwrap().len(), specs(true).len());
    assert_eq!(j["ranks"][1]["bytes_needed"], all);
}

#[allow(
    clippy::disallowed_methods,
    reason = "a test reads its knobs and tools from the environment"
)]
async fn plot_draws_png_and_svg(env: Env) {
    two_steps_and_a_pending_one(&env).await;
    let t0 = 1_767_000_000_000i64;
    let mut m = LogWriter::new(&env.store, "train", METRICS, "rank-0").unwrap();
    let mut m1 = LogWriter::new(&env.store, "train", METRICS, "rank-1").unwrap();
    for step in 1..=300u64 {
        let t = if step <= 180 {
            t0 + step as i64 * 1000
        } else {
            t0 + 60_000 + step as i64 * 1000
        };
        let loss =
            4.0 * (-(step as f64) / 120.0).exp() + 1.2 + 0.05 * ((step * 13 % 7) as f64 / 7.0);
        for (w, rank) in [(&mut m, 0), (&mut m1, 1)] {
            w.append(&serde_json::json!({"kind":"step","step":if step <= 180 { step } else { step - 30 },"loss":loss,"grad_norm":1.0 + 3.0 / step as f64,"step_time_s":1.0,"rank":rank,"t_ms":t}))
                .unwrap();
        }
        if step % 50 == 0 {
            m.append(&serde_json::json!({"kind":"checkpoint","step":step,"bytes":1u64<<30,"stall_s":0.2,"persist_s":3.0,"commit_s":0.1,"bytes_written":1u64<<28,"bytes_skipped":0,"t_ms":t + 300}))
                .unwrap();
        }
    }
    m.flush().await.unwrap();
    m1.flush().await.unwrap();
    let mut e = LogWriter::new(&env.store, "train", EVENTS, "supervisor").unwrap();
    e.append(
        &serde_json::json!({"kind":"failure","rank":3,"node":1,"how":"signal","t_ms":t0 + 181_000}),
    )
    .unwrap();
    e.append(&serde_json::json!({"kind":"recovery","generation":1,"layout":"dp=1,tp=2,pp=1","step":150,"steps_lost":30,"t_ms":t0 + 239_000})).unwrap();
    e.append(&serde_json::json!({"kind":"spike","step":260,"loss":3.5,"action":"rollback","t_ms":t0 + 330_000})).unwrap();
    e.append(&serde_json::json!({"kind":"rollback","from_step":260,"to_step":250,"reason":"loss spike","t_ms":t0 + 331_000})).unwrap();
    e.flush().await.unwrap();

    let dir = tmp();
    let png = dir.path().join("loss.png");
    let r = plot(&env.store, &PlotArgs::new("train", &png), &q())
        .await
        .unwrap();
    assert_eq!(r.points, 300, "one rank's loss per step");
    assert_eq!(
        (
            r.checkpoints,
            r.failures,
            r.recoveries,
            r.rollbacks,
            r.spikes
        ),
        (6, 1, 1, 1, 1)
    );
    let b = std::fs::read(&png).unwrap();
    assert_eq!(&b[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(u32::from_be_bytes(b[16..20].try_into().unwrap()), 1200);
    assert_eq!(u32::from_be_bytes(b[20..24].try_into().unwrap()), 720);
    let svg = dir.path().join("loss.svg");
    plot(&env.store, &PlotArgs::new("train", &svg), &q())
        .await
        .unwrap();
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<?xml") && s.trim_end().ends_with("</svg>"));
    for want in [
        "run train",
        "✕ rank 3 signal",
        "recovered dp=1,tp=2,pp=1 @150 (−30 steps)",
        "rollback 260→250",
        "checkpoint",
        "grad norm",
        "<polyline",
    ] {
        assert!(s.contains(want), "the SVG shows {want:?}");
    }
    // Keep a copy for people to look at.
    if let Ok(d) = std::env::var("CKPT_PLOT_SAMPLE_DIR") {
        let _ = std::fs::copy(&png, std::path::Path::new(&d).join("plot-sample.png"));
        let _ = std::fs::copy(&svg, std::path::Path::new(&d).join("plot-sample.svg"));
    }

    let out = dir.path().join("cli.png");
    let j = env
        .ckpt(&["plot", "train", "--out", out.to_str().unwrap(), "--json"])
        .code(0)
        .json();
    assert_eq!(j["format"], "png");
    assert!(out.exists());
    env.ckpt(&[
        "plot",
        "train",
        "--out",
        dir.path().join("x.jpg").to_str().unwrap(),
    ])
    .code(2);
    let r = env
        .ckpt(&["plot", "nosuch", "--out", out.to_str().unwrap()])
        .code(1);
    assert!(r.err.contains("no run named nosuch"), "{}", r.err);
    save_step(&env.store, "quiet", 1, false, &DedupIndex::new()).await;
    let r = env
        .ckpt(&["plot", "quiet", "--out", out.to_str().unwrap()])
        .code(1);
    assert!(
        r.err.contains("nothing to plot") && r.err.contains("no metrics log"),
        "{}",
        r.err
    );
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
