//! `ckpt export` split across processes (issue 17.3): `--part I/N` processes running at once
//! against the same store write exactly the files of their part, reading only their tensors'
//! chunks, within `--memory-budget` (a tensor four times the budget streams through); their
//! union with `--write-index` is byte-identical to a one-process export and loads in Python's
//! safetensors; `--jobs N` does the same as N children; a part killed with SIGKILL leaves no
//! file under a final name and a rerun completes it; bad part specs and parts run with
//! different plans fail with errors that say so; and the whole works on a real S3 server.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ckpt_store::testing::{Need, S3Server, det_bytes, find_python};
use ckpt_tests::bin;
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// The largest tensor: four times the budget the parts run with.
const BIG: u64 = 64 * MIB;
const BUDGET: &str = "16MiB";
const SHARD: &str = "8MiB";

/// A tensor to save: name, safetensors dtype, shape, bytes.
type Tensor = (String, &'static str, Vec<u64>, Vec<u8>);

/// Where the store is and what the binary needs to reach it.
struct Env {
    dir: tempfile::TempDir,
    url: String,
    vars: Vec<(&'static str, String)>,
    _s3: Option<S3Server>,
}

impl Env {
    fn local() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let url = dir.path().join("store").to_str().unwrap().to_string();
        Env {
            dir,
            url,
            vars: Vec::new(),
            _s3: None,
        }
    }

    fn s3() -> Env {
        let server = S3Server::start();
        Env {
            dir: tempfile::tempdir().unwrap(),
            url: format!("s3://{}/export", server.bucket),
            vars: server.env(),
            _s3: Some(server),
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin("ckpt", "ckpt"));
        c.args(args)
            .env("CKPT_STORE", &self.url)
            .envs(self.vars.iter().map(|(k, v)| (*k, v.as_str())))
            .env_remove("RUST_LOG")
            .env_remove("CKPT_FAULTS");
        c
    }

    fn ckpt(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("running ckpt")
    }

    /// Run `ckpt ARGS --json`, which must succeed; its report.
    fn ok(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.ckpt(&a);
        json_of(&out, &a)
    }

    /// Run `ckpt ARGS`, which must fail with `code`; its stderr.
    fn fails(&self, args: &[&str], code: i32) -> String {
        let out = self.ckpt(args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(
            out.status.code(),
            Some(code),
            "ckpt {args:?}: want exit {code}\nstdout: {}\nstderr: {err}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(!err.contains("panicked"), "{err}");
        err
    }
}

fn json_of(out: &Output, args: &[&str]) -> Value {
    assert!(
        out.status.success(),
        "ckpt {args:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "ckpt {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The model: one tensor four times the parts' budget, tensors of a few chunks, small ones the
/// store packs, several dtypes and a scalar; every tensor's bytes distinct. (name, dtype,
/// shape, bytes), in name order.
fn model(big: u64) -> Vec<Tensor> {
    let t = |name: &str, dtype: &'static str, shape: &[u64], elem: u64, seed: u64| {
        let n: u64 = shape.iter().product();
        (
            name.to_string(),
            dtype,
            shape.to_vec(),
            det_bytes(seed, (n * elem) as usize),
        )
    };
    vec![
        t("a.embed", "F32", &[1024, 1536], 4, 1),
        t("b.big", "F32", &[big / 4096, 1024], 4, 2),
        t("c.mid1", "F16", &[1024, 2048], 2, 3),
        t("c.mid2", "F32", &[768, 1024], 4, 4),
        t("d.bias", "F16", &[1000], 2, 5),
        t("d.norm", "F32", &[4096], 4, 6),
        t("e.mask", "U8", &[3000], 1, 7),
        t("e.step", "I64", &[], 8, 8),
        t("f.w1", "F32", &[512, 1024], 4, 9),
        t("f.w2", "F32", &[512, 1024], 4, 10),
        t("f.w3", "F32", &[512, 1024], 4, 11),
        t("f.w4", "F32", &[512, 1024], 4, 12),
    ]
}

/// Write `tensors` as a safetensors file (the format's rules: offsets in order, header padded
/// with spaces to a multiple of 8).
fn write_safetensors(path: &Path, tensors: &[Tensor]) {
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + data.len()]}),
        );
        at += data.len();
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    std::fs::write(path, out).unwrap();
}

/// The model saved as `m@1` (through `ckpt import`: one shard per tensor, 4 MiB chunks), and
/// its source file.
fn saved_model(env: &Env, big: u64) -> (PathBuf, Vec<Tensor>) {
    let tensors = model(big);
    let src = env.path("source.safetensors");
    write_safetensors(&src, &tensors);
    env.ok(&["import", s(&src), "--run", "m", "--step", "1"]);
    (src, tensors)
}

/// Every file of a directory (hidden ones too), name to bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_str().unwrap().to_string(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// Two directories hold the same files, byte for byte.
fn assert_same_files(got: &Path, want: &Path) {
    let (g, w) = (files(got), files(want));
    assert_eq!(
        g.keys().collect::<Vec<_>>(),
        w.keys().collect::<Vec<_>>(),
        "{} and {} hold different files",
        got.display(),
        want.display()
    );
    for (name, bytes) in &w {
        assert!(
            g[name] == *bytes,
            "{name} differs between {} and {}",
            got.display(),
            want.display()
        );
    }
}

/// The tensors of a safetensors file: name to data byte length.
fn tensors_in(bytes: &[u8]) -> BTreeMap<String, u64> {
    let hl = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&bytes[8..8 + hl]).unwrap();
    h.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = &v["data_offsets"];
            (k.clone(), o[1].as_u64().unwrap() - o[0].as_u64().unwrap())
        })
        .collect()
}

/// Start part `i` of `n` into `out` (not waiting).
fn start_part(env: &Env, out: &Path, i: usize, n: usize, shard: &str) -> Child {
    env.command(&[
        "export",
        "m@1",
        "--out",
        s(out),
        "--max-shard-size",
        shard,
        "--memory-budget",
        BUDGET,
        "--part",
        &format!("{i}/{n}"),
        "--json",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("starting a part")
}

/// Run every part of `n` at once into `out`; their reports.
fn run_parts(env: &Env, out: &Path, n: usize) -> Vec<Value> {
    let children: Vec<Child> = (0..n).map(|i| start_part(env, out, i, n, SHARD)).collect();
    children
        .into_iter()
        .map(|c| json_of(&c.wait_with_output().unwrap(), &["export", "--part"]))
        .collect()
}

/// A part's report: it wrote its files, read exactly the bytes of its tensors (each chunk of
/// them once, nothing of any other tensor), within its budget.
fn check_part_report(r: &Value, out: &Path, model_bytes: u64) -> BTreeMap<String, u64> {
    let mut mine = BTreeMap::new();
    for f in r["files"].as_array().unwrap() {
        let b = std::fs::read(out.join(f["file"].as_str().unwrap())).unwrap();
        assert_eq!(b.len() as u64, f["bytes"].as_u64().unwrap());
        mine.extend(tensors_in(&b));
    }
    let want: u64 = mine.values().sum();
    assert_eq!(
        r["read"]["raw_bytes"].as_u64().unwrap(),
        want,
        "part {}: read {} raw bytes for {} bytes of its tensors {:?}",
        r["part"],
        r["read"]["raw_bytes"],
        want,
        mine.keys().collect::<Vec<_>>()
    );
    assert!(
        want < model_bytes,
        "a part of several does not hold everything"
    );
    let pipe = &r["pipeline"];
    if !pipe.is_null() {
        assert_eq!(r["memory_budget"].as_u64().unwrap(), 16 * MIB);
        let held = pipe["depth"].as_u64().unwrap()
            * (pipe["block"].as_u64().unwrap()
                + pipe["fetch"].as_u64().unwrap() * 2 * pipe["chunk"].as_u64().unwrap())
            + pipe["stage"].as_u64().unwrap();
        assert!(held <= 16 * MIB, "{pipe}");
    }
    mine
}

#[test]
fn parts_write_the_same_bytes_as_one_process_and_read_only_their_chunks() {
    let env = Env::local();
    let (src, tensors) = saved_model(&env, BIG);
    let model_bytes: u64 = tensors.iter().map(|t| t.3.len() as u64).sum();
    let reference = env.path("one");
    let one = env.ok(&[
        "export",
        "m@1",
        "--out",
        s(&reference),
        "--max-shard-size",
        SHARD,
    ]);
    assert_eq!(one["files"].as_array().unwrap().len(), 4, "{one}");
    assert_eq!(one["read"]["raw_bytes"].as_u64().unwrap(), model_bytes);

    let mut part0_of_2 = Vec::new();
    for n in [2, 3] {
        let out = env.path(&format!("parts{n}"));
        let reports = run_parts(&env, &out, n);
        let mut seen = BTreeMap::new();
        for (i, r) in reports.iter().enumerate() {
            let mine = check_part_report(r, &out, model_bytes);
            if n == 2 && i == 0 {
                part0_of_2 = mine.keys().cloned().collect();
            }
            for (t, len) in mine {
                assert!(seen.insert(t.clone(), len).is_none(), "{t} written twice");
            }
        }
        assert_eq!(seen.len(), tensors.len(), "every tensor written once");
        // The part holding the big tensor streamed it: its memory did not grow with it.
        let big = reports
            .iter()
            .find(|r| r["files"].to_string().contains("00002-of"))
            .expect("a part wrote the big tensor's file");
        let rss = big["peak_rss_bytes"].as_u64().unwrap();
        assert!(
            rss < BIG,
            "peak RSS {} MiB exporting a {} MiB tensor with a {BUDGET} budget",
            rss >> 20,
            BIG >> 20
        );
        assert!(!out.join("model.safetensors.index.json").exists());
        let idx = env.ok(&[
            "export",
            "m@1",
            "--out",
            s(&out),
            "--max-shard-size",
            SHARD,
            "--write-index",
        ]);
        assert_eq!(idx["index"], "model.safetensors.index.json");
        assert_eq!(
            idx["read"]["raw_bytes"], 0,
            "the index reads no tensor data"
        );
        assert_same_files(&out, &reference);
    }

    // Python's safetensors loads the union of the parts, equal to the saved state.
    if ckpt_store::testing::available(Need::Python, "export parts: Python reads the union") {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ckpt/tests/interop_python.py");
        let out = Command::new(find_python().unwrap())
            .arg(script)
            .args([
                "check-index",
                s(&src),
                s(&env.path("parts3/model.safetensors.index.json")),
            ])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.starts_with("OK 12 tensors in 4 files"),
            "{said}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // --jobs 3: the same, as child processes of one command.
    let jobs = env.path("jobs");
    let r = env.ok(&[
        "export",
        "m@1",
        "--out",
        s(&jobs),
        "--max-shard-size",
        SHARD,
        "--memory-budget",
        BUDGET,
        "--jobs",
        "3",
    ]);
    assert_eq!(r["parts"].as_array().unwrap().len(), 3, "{r}");
    assert_eq!(r["files"].as_array().unwrap().len(), 4);
    assert_eq!(r["index"], "model.safetensors.index.json");
    for p in r["parts"].as_array().unwrap() {
        check_part_report(p, &jobs, model_bytes);
    }
    assert_same_files(&jobs, &reference);

    // Reads only its tensors' chunks: with every chunk object of the other parts' tensors
    // deleted from the store, part 0 of 2 still writes its files; part 1 cannot.
    let part0 = part0_of_2;
    assert!(!part0.is_empty());
    let chunk_dir = Path::new(&env.url).join("chunks");
    let mut deleted = 0;
    for (name, _, _, data) in &tensors {
        if part0.contains(name) || data.len() < MIB as usize {
            continue; // part 0's, or packed with others
        }
        for c in data.chunks(4 << 20) {
            let hex = blake3::hash(c).to_hex().to_string();
            let p = chunk_dir.join(&hex[..2]).join(&hex);
            std::fs::remove_file(&p)
                .unwrap_or_else(|e| panic!("chunk of {name} at {}: {e}", p.display()));
            deleted += 1;
        }
    }
    assert!(deleted > 0);
    let only0 = env.path("only0");
    let c = start_part(&env, &only0, 0, 2, SHARD);
    let r = json_of(&c.wait_with_output().unwrap(), &["export", "--part", "0/2"]);
    check_part_report(&r, &only0, model_bytes);
    for (name, bytes) in files(&only0) {
        assert!(
            files(&reference)[&name] == bytes,
            "{name} differs from the one-process export"
        );
    }
    let out = start_part(&env, &env.path("only1"), 1, 2, SHARD)
        .wait_with_output()
        .unwrap();
    assert!(!out.status.success(), "part 1 needs the deleted chunks");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("missing"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_killed_part_leaves_no_final_named_partial_file_and_a_rerun_completes() {
    let env = Env::local();
    saved_model(&env, 16 * MIB);
    let shard = "4MiB";
    let reference = env.path("one");
    env.ok(&[
        "export",
        "m@1",
        "--out",
        s(&reference),
        "--max-shard-size",
        shard,
    ]);
    let want = files(&reference);
    let out = env.path("parts");
    // Part 0 of 2, every store request slowed so it is killed midway: once one of its files
    // is complete and another is being written.
    let mut c = env
        .command(&[
            "export",
            "m@1",
            "--out",
            s(&out),
            "--max-shard-size",
            shard,
            "--memory-budget",
            BUDGET,
            "--part",
            "0/2",
        ])
        .env("CKPT_FAULTS", "rate=1,seed=1,mix=0:0:1,slow_ms=100")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let killed = loop {
        let names: Vec<String> = std::fs::read_dir(&out)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default();
        let done = names.iter().any(|n| !n.starts_with('.'));
        let partial = names.iter().any(|n| n.ends_with(".partial"));
        if done && partial {
            // SIGKILL: no chance to clean up.
            ckpt_tests::signal(c.id(), libc::SIGKILL);
            c.wait().unwrap();
            break true;
        }
        if let Some(st) = c.try_wait().unwrap() {
            panic!("part 0 finished ({st}) before it could be killed midway");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "part 0 made no progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(killed);
    let left = files(&out);
    let mut finished = 0;
    for (name, bytes) in &left {
        if name.starts_with('.') {
            assert!(name.ends_with(".partial"), "{name}");
            continue;
        }
        finished += 1;
        assert!(
            want[name] == *bytes,
            "{name} is under its final name but not complete"
        );
    }
    assert!(finished >= 1 && left.len() > finished, "{:?}", left.keys());

    // The index refuses: part 0 is incomplete and part 1 never ran.
    let err = env.fails(
        &[
            "export",
            "m@1",
            "--out",
            s(&out),
            "--max-shard-size",
            shard,
            "--write-index",
        ],
        1,
    );
    assert!(err.contains("files missing"), "{err}");

    // Running part 0 again keeps what it finished and writes the rest; then part 1.
    let r = json_of(
        &start_part(&env, &out, 0, 2, shard)
            .wait_with_output()
            .unwrap(),
        &["rerun"],
    );
    assert_eq!(r["kept"].as_array().unwrap().len(), finished, "{r}");
    assert!(!r["files"].as_array().unwrap().is_empty(), "{r}");
    json_of(
        &start_part(&env, &out, 1, 2, shard)
            .wait_with_output()
            .unwrap(),
        &["part 1"],
    );
    env.ok(&[
        "export",
        "m@1",
        "--out",
        s(&out),
        "--max-shard-size",
        shard,
        "--write-index",
    ]);
    assert_same_files(&out, &reference);
}

#[test]
fn bad_part_specs_and_mismatched_plans_fail_clearly() {
    let env = Env::local();
    saved_model(&env, 8 * MIB);
    let out = env.path("out");
    let o = s(&out);
    let base = ["export", "m@1", "--out", o, "--max-shard-size", SHARD];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        v
    }
    let err = env.fails(&with(&base, &["--part", "3/3"]), 2);
    assert!(
        err.contains("part index 3 is out of range") && err.contains("0 to 2"),
        "{err}"
    );
    let err = env.fails(&with(&base, &["--part", "1"]), 2);
    assert!(err.contains("expected I/N"), "{err}");
    let err = env.fails(&with(&base, &["--part", "0/0"]), 2);
    assert!(err.contains("at least 1"), "{err}");
    let err = env.fails(&["export", "m@1", "--out", o, "--part", "0/2"], 2);
    assert!(err.contains("--max-shard-size"), "{err}");
    let err = env.fails(&with(&base, &["--part", "0/2", "--jobs", "2"]), 2);
    assert!(err.contains("cannot be used with"), "{err}");
    let err = env.fails(&with(&base, &["--memory-budget", "4MiB"]), 2);
    assert!(
        err.contains("too small") && err.contains("chunks of 4"),
        "{err}"
    );
    assert!(!out.exists() || files(&out).is_empty(), "nothing written");

    // The index with no part run: every file missing, named.
    let err = env.fails(&with(&base, &["--write-index"]), 1);
    assert!(err.contains("4 of 4 files missing"), "{err}");
    assert!(err.contains("model-00001-of-00004.safetensors"), "{err}");

    // Parts run with different --max-shard-size: the index notices.
    let c = env
        .command(&with(&base, &["--part", "0/2"]))
        .output()
        .unwrap();
    assert!(c.status.success());
    let mut other = with(&base, &["--part", "1/2"]);
    other[5] = "6MiB";
    let c = env.command(&other).output().unwrap();
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    let err = env.fails(&with(&base, &["--write-index"]), 1);
    assert!(err.contains("missing"), "{err}");
    assert!(
        err.contains("another plan") && err.contains("-of-0000"),
        "{err}"
    );
    // A file of the same name from another plan: the part refuses to keep or overwrite it.
    let f1 = out.join("model-00001-of-00004.safetensors");
    let mut b = std::fs::read(&f1).unwrap();
    let last = b.len() - 1;
    b.truncate(last);
    std::fs::write(&f1, &b).unwrap();
    let err = env.fails(&with(&base, &["--write-index"]), 1);
    assert!(err.contains("differ from the plan"), "{err}");
    let err = env.fails(&with(&base, &["--part", "0/2"]), 1);
    assert!(
        err.contains("model-00001-of-00004.safetensors")
            && err.contains("is not the file this part would write"),
        "{err}"
    );
    // --force rewrites it.
    let c = env
        .command(&with(&base, &["--part", "0/2", "--force"]))
        .output()
        .unwrap();
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    let err = env.fails(&with(&base, &["--write-index"]), 1);
    assert!(
        err.contains("2 of 4 files missing") && !err.contains("differ"),
        "{err}"
    );
}

#[test]
fn a_parallel_export_on_a_real_s3_server() {
    ckpt_store::require!(Need::S3Server, "a_parallel_export_on_a_real_s3_server");
    let env = Env::s3();
    saved_model(&env, 16 * MIB);
    let reference = env.path("one");
    env.ok(&[
        "export",
        "m@1",
        "--out",
        s(&reference),
        "--max-shard-size",
        SHARD,
    ]);
    let jobs = env.path("jobs");
    let r = env.ok(&[
        "export",
        "m@1",
        "--out",
        s(&jobs),
        "--max-shard-size",
        SHARD,
        "--memory-budget",
        "32MiB",
        "--jobs",
        "2",
    ]);
    assert_eq!(r["parts"].as_array().unwrap().len(), 2, "{r}");
    for p in r["parts"].as_array().unwrap() {
        assert!(p["read"]["stored_bytes"].as_u64().unwrap() > 0, "{p}");
    }
    assert_same_files(&jobs, &reference);
}
