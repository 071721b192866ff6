//! Safe file names for the tensor and blob names of manifests.
//!
//! Names in manifests may hold any character but NUL (`a/b`, `..`, newlines, 4 KiB of text).
//! Each becomes one path component that cannot leave its directory:
//!
//! 1. `%`, `/` and control characters (Unicode `Cc`) are percent-encoded byte by byte
//!    (`a/b` → `a%2Fb`, `50%` → `50%25`, a newline → `%0A`); everything else is kept, so the
//!    usual `model.layers.0.mlp.weight` is its own file name. This step is injective.
//! 2. `.` and `..` become `%2E` and `%2E%2E`.
//! 3. A result longer than [`NAME_MAX`] bytes is cut at a character boundary and ends in `~`
//!    and 16 hex digits of the blake3 of the original name.
//! 4. If two names still map to the same file name (only possible through step 3, or through
//!    a suffix of step 4 itself), the names are sorted and all but the first get `~2`, `~3`, …
//!    (the first free one), so the result depends only on the set of names.
//!
//! [`NameMap`] holds the result for one directory; `COMMIT.json` shows every name that
//! changed.

use std::collections::{HashMap, HashSet};

/// The longest file name Linux accepts (bytes).
pub const NAME_MAX: usize = 255;

/// The file name of `name` before collisions are resolved (steps 1 to 3 of the module docs).
pub fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if c == '%' || c == '/' || c.is_control() {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    if out.is_empty() {
        // Manifests never hold empty names; keep the mapping total anyway.
        out.push_str("%00");
    }
    if out == "." || out == ".." {
        out = out.replace('.', "%2E");
    }
    if out.len() > NAME_MAX {
        let h = blake3::hash(name.as_bytes()).to_hex();
        let suffix = format!("~{}", &h.as_str()[..16]);
        out = fit(&out, &suffix);
    }
    out
}

/// `base` cut to leave room for `suffix` within [`NAME_MAX`] bytes, then `suffix`.
fn fit(base: &str, suffix: &str) -> String {
    let room = NAME_MAX - suffix.len();
    let mut cut = base.len().min(room);
    while !base.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut s = base[..cut].to_string();
    s.push_str(suffix);
    s
}

/// Whether `s` is a file name the mapping can produce: one component, no control characters.
pub fn is_safe(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= NAME_MAX
        && s != "."
        && s != ".."
        && !s.contains('/')
        && !s.chars().any(char::is_control)
}

/// The file names of one directory's worth of names, collisions resolved.
#[derive(Debug, Clone, Default)]
pub struct NameMap {
    files: Vec<String>,
    by_file: HashMap<String, usize>,
}

impl NameMap {
    /// Map `names` (indices are kept: `file(i)` is the file name of `names[i]`).
    pub fn build<'a>(names: impl IntoIterator<Item = &'a str>) -> NameMap {
        let names: Vec<&str> = names.into_iter().collect();
        let mut files: Vec<String> = names.iter().map(|n| escape(n)).collect();
        // Group by candidate file name; the smallest original name keeps it.
        let mut groups: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            groups.entry(f.as_str()).or_default().push(i);
        }
        let mut losers: Vec<usize> = Vec::new();
        for members in groups.values() {
            if members.len() > 1 {
                let mut m = members.clone();
                m.sort_by(|&a, &b| names[a].cmp(names[b]).then(a.cmp(&b)));
                losers.extend_from_slice(&m[1..]);
            }
        }
        if !losers.is_empty() {
            losers.sort_by(|&a, &b| names[a].cmp(names[b]).then(a.cmp(&b)));
            let mut taken: HashSet<String> = files.iter().cloned().collect();
            for i in losers {
                let base = files[i].clone();
                let mut k = 2u64;
                let file = loop {
                    let cand = fit(&base, &format!("~{k}"));
                    if !taken.contains(&cand) {
                        break cand;
                    }
                    k += 1;
                };
                taken.insert(file.clone());
                files[i] = file;
            }
        }
        let by_file = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.clone(), i))
            .collect();
        NameMap { files, by_file }
    }

    /// The file name of entry `i`.
    pub fn file(&self, i: usize) -> &str {
        &self.files[i]
    }

    /// The entry whose file name is `file`.
    pub fn index(&self, file: &str) -> Option<usize> {
        self.by_file.get(file).copied()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// No entries.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_names_are_kept() {
        for n in [
            "model.layers.0.self_attn.q_proj.weight",
            "exp_avg.lm_head",
            "ünïcödé-名前",
            "with space",
            "...",
            ".hidden",
        ] {
            assert_eq!(escape(n), n);
        }
    }

    #[test]
    fn hostile_names_become_one_safe_component() {
        let cases = [
            ("a/b", "a%2Fb"),
            ("../../etc/passwd", "..%2F..%2Fetc%2Fpasswd"),
            ("/abs", "%2Fabs"),
            (".", "%2E"),
            ("..", "%2E%2E"),
            ("line\nbreak", "line%0Abreak"),
            ("tab\t\u{7f}", "tab%09%7F"),
            ("c1\u{85}", "c1%C2%85"),
            ("50%", "50%25"),
            ("", "%00"),
        ];
        for (n, want) in cases {
            assert_eq!(escape(n), want, "{n:?}");
            assert!(is_safe(&escape(n)), "{n:?}");
        }
    }

    #[test]
    fn long_names_are_cut_with_a_hash() {
        let long = "x".repeat(4096);
        let e = escape(&long);
        assert_eq!(e.len(), NAME_MAX);
        assert!(e.starts_with("xxxx") && e.contains('~'));
        // Multi-byte characters are never split.
        let wide = "名".repeat(200);
        let e = escape(&wide);
        assert!(e.len() <= NAME_MAX && is_safe(&e));
        // Two long names that share the kept prefix differ by their hash.
        let a = format!("{}a", "y".repeat(300));
        let b = format!("{}b", "y".repeat(300));
        assert_ne!(escape(&a), escape(&b));
    }

    #[test]
    fn collisions_resolve_deterministically_whatever_the_order() {
        // A long name is cut to `prefix~hash`; a second name that is literally that string
        // collides with it. The smaller original name keeps the file name.
        let long = "a".repeat(300);
        let literal = escape(&long);
        assert_eq!(literal.len(), NAME_MAX);
        let names = vec!["b", "a/b", "a%2Fb", long.as_str(), literal.as_str()];
        let m1 = NameMap::build(names.iter().copied());
        let mut rev = names.clone();
        rev.reverse();
        let m2 = NameMap::build(rev.iter().copied());
        for (i, n) in names.iter().enumerate() {
            let j = rev.iter().position(|x| x == n).unwrap();
            assert_eq!(m1.file(i), m2.file(j), "{n:?}");
        }
        let files: HashSet<&str> = (0..m1.len()).map(|i| m1.file(i)).collect();
        assert_eq!(files.len(), names.len(), "file names are unique");
        assert!(files.iter().all(|f| is_safe(f)));
        assert_eq!(m1.file(1), "a%2Fb");
        assert_eq!(m1.file(2), "a%252Fb");
        assert_eq!(m1.file(3), literal);
        assert_eq!(m1.file(4), format!("{}~2", &literal[..NAME_MAX - 2]));
        assert_eq!(m1.index("a%2Fb"), Some(1));
    }

    #[test]
    fn truncation_collisions_get_suffixes() {
        // Same escaped prefix, and we pretend the hash collides by using identical names
        // at two indices (blob names are unique per rank, but the map must stay total).
        let names = ["dup", "dup", "dup~2"];
        let m = NameMap::build(names);
        let mut got: Vec<&str> = (0..3).map(|i| m.file(i)).collect();
        got.sort();
        assert_eq!(got, vec!["dup", "dup~2", "dup~3"]);
        assert_eq!(m.file(0), "dup");
        assert_eq!(m.file(2), "dup~2");
        assert_eq!(m.file(1), "dup~3");
    }
}
