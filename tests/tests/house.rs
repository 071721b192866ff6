//! The house's rules, kept true by a test: ARCHITECTURE.md's "Where things live" table names
//! modules that exist and types defined in them, and no library source file grows past the
//! size a reader can hold (issue 30).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The rows of the table under `## Where things live`: (concern, file, type names).
fn where_things_live(doc: &str) -> Vec<(String, String, Vec<String>)> {
    let start = doc
        .find("\n## Where things live")
        .expect("ARCHITECTURE.md has a section \"## Where things live\"");
    let section = &doc[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |i| i + 3);
    let mut rows = Vec::new();
    for line in section[..end].lines() {
        let cells: Vec<&str> = line
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        if !line.trim_start().starts_with('|') || cells.len() < 3 {
            continue;
        }
        let file = cells[1].trim_matches('`');
        if cells[0] == "concern" || file.chars().all(|c| c == '-' || c == ':') {
            continue;
        }
        let types = cells[2]
            .split(',')
            .map(|t| t.trim().trim_matches('`').to_string())
            .filter(|t| !t.is_empty() && t != "-")
            .collect();
        rows.push((cells[0].to_string(), file.to_string(), types));
    }
    rows
}

#[test]
fn every_module_the_architecture_names_exists_with_its_types() {
    let root = root();
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let rows = where_things_live(&doc);
    assert!(rows.len() >= 20, "the table lists only {} rows", rows.len());
    let mut wrong = Vec::new();
    for (concern, file, types) in rows {
        let path = root.join(&file);
        let Ok(text) = std::fs::read_to_string(&path) else {
            wrong.push(format!("{concern}: {file} does not exist"));
            continue;
        };
        for ty in types {
            let defined = ["struct", "enum", "trait", "type", "fn", "mod"]
                .iter()
                .any(|kw| {
                    text.contains(&format!("{kw} {ty} "))
                        || text.contains(&format!("{kw} {ty}<"))
                        || text.contains(&format!("{kw} {ty}("))
                        || text.contains(&format!("{kw} {ty};"))
                        || text.contains(&format!("{kw} {ty}:"))
                        || text.contains(&format!("{kw} {ty} {{"))
                });
            if !defined {
                wrong.push(format!("{concern}: {file} does not define {ty}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md is out of date:\n{}",
        wrong.join("\n")
    );
}

/// Library sources (not tests, benches or binaries' test drivers) of every crate.
fn library_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source folder") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            library_sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_library_source_file_is_over_a_thousand_lines() {
    let root = root();
    let mut files = Vec::new();
    for krate in [
        "store", "recovery", "trainer", "train", "fuse", "ckpt", "python", "tests",
    ] {
        library_sources(&root.join(krate).join("src"), &mut files);
    }
    assert!(files.len() > 50, "found only {} source files", files.len());
    let mut long = Vec::new();
    for file in files {
        let lines = std::fs::read_to_string(&file)
            .expect("source")
            .lines()
            .count();
        let rel = file
            .strip_prefix(&root)
            .expect("under the root")
            .display()
            .to_string();
        // The benchmark driver is a binary of the test package, not a library.
        let limit = if rel.starts_with("tests/src/bin/") {
            usize::MAX
        } else {
            1000
        };
        if lines > limit {
            long.push(format!("{rel}: {lines} lines"));
        }
    }
    assert!(
        long.is_empty(),
        "files over 1,000 lines (split them by subject):\n{}",
        long.join("\n")
    );
    let manager = root.join("trainer/src/manager/mod.rs");
    let manager_lines = std::fs::read_to_string(&manager)
        .expect("manager")
        .lines()
        .count();
    assert!(
        manager_lines < 800,
        "the CheckpointManager handle is {manager_lines} lines"
    );
}

/// The `impl` blocks of `ty` in the store crate's sources: (file, methods).
fn impls_of(root: &Path, ty: &str) -> Vec<(String, usize)> {
    let mut files = Vec::new();
    library_sources(&root.join("store/src"), &mut files);
    let heads = [format!("impl {ty} {{"), format!("impl crate::gc::{ty} {{")];
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("source");
        let mut inside = false;
        let mut methods = 0;
        let mut found = false;
        for line in text.lines() {
            if heads.iter().any(|h| line == h) {
                inside = true;
                found = true;
            } else if inside && line == "}" {
                inside = false;
            } else if inside {
                let l = line.trim_start_matches("    ");
                if !line.starts_with("        ")
                    && (l.starts_with("pub ")
                        || l.starts_with("pub(")
                        || l.starts_with("fn ")
                        || l.starts_with("async fn "))
                    && l.contains("fn ")
                {
                    methods += 1;
                }
            }
        }
        if found {
            let rel = file.strip_prefix(root).expect("under the root");
            out.push((rel.display().to_string(), methods));
        }
    }
    out.sort();
    out
}

#[test]
fn the_store_is_a_handle_over_its_parts() {
    let root = root();
    // The handle itself: construction and accessors, plus the two operations that use several
    // parts (writing a rank, verifying).
    let store = impls_of(&root, "Store");
    let files: Vec<&str> = store.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(
        files,
        [
            "store/src/store/mod.rs",
            "store/src/verify.rs",
            "store/src/writer.rs"
        ],
        "impl Store blocks: {store:?}"
    );
    let methods: usize = store.iter().map(|(_, n)| n).sum();
    assert!(
        methods <= 40,
        "Store has {methods} methods again: {store:?}"
    );
    // Each part has its own impl, in its own module folder.
    for (ty, under) in [
        ("Objects", "store/src/store/objects.rs"),
        ("Chunks", "store/src/chunks/"),
        ("CommitLog", "store/src/commit/"),
        ("Gc", "store/src/gc/"),
    ] {
        let blocks = impls_of(&root, ty);
        assert!(!blocks.is_empty(), "{ty} has no impl");
        assert!(
            blocks.iter().all(|(f, _)| f.starts_with(under)),
            "{ty} is implemented outside {under}: {blocks:?}"
        );
    }
    let gc: Vec<String> = impls_of(&root, "Gc").into_iter().map(|(f, _)| f).collect();
    assert_eq!(gc, ["store/src/gc/lease.rs", "store/src/gc/mod.rs"]);
}
