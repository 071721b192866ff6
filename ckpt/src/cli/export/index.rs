//! The index of a sharded export (`model.safetensors.index.json`), written once every planned
//! file in `--out` is checked.

use std::path::Path;

use ckpt_store::outfile;
use ckpt_store::{CommitRecord, ReadStats};

use super::plan::{ExportPlan, INDEX_FILE, OnDisk, check_file};
use super::write::{sync_dir, write_atomically};
use crate::cli::{CliError, Result};

/// Check every planned file in `out` (present, regular, the planned size and header) and
/// write the index over them; returns its name. Errors name what is missing or differs.
pub(super) async fn write_index(
    plan: &ExportPlan,
    commit: &CommitRecord,
    out: &Path,
) -> Result<String> {
    let mut missing = Vec::new();
    let mut differ = Vec::new();
    for f in &plan.files {
        match check_file(&out.join(&f.name), &f.view) {
            OnDisk::Matches => {}
            OnDisk::Missing => missing.push(f.name.clone()),
            OnDisk::Differs(why) => differ.push(format!("{}: {why}", f.name)),
        }
    }
    // Shards of another plan (another --max-shard-size, so another count) lying in `out`.
    let planned: std::collections::HashSet<&str> =
        plan.files.iter().map(|f| f.name.as_str()).collect();
    let mut foreign: Vec<String> = std::fs::read_dir(out)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| is_shard_name(n) && !planned.contains(n.as_str()))
                .collect()
        })
        .unwrap_or_default();
    foreign.sort();
    let n = plan.files.len();
    if !missing.is_empty() || !differ.is_empty() {
        let mut msg = format!("cannot write {INDEX_FILE} in {}: ", out.display());
        if !missing.is_empty() {
            msg.push_str(&format!(
                "{} of {n} files missing ({})",
                missing.len(),
                list(&missing)
            ));
        }
        if !differ.is_empty() {
            if !missing.is_empty() {
                msg.push_str("; ");
            }
            msg.push_str(&format!(
                "{} of {n} files differ from the plan ({})",
                differ.len(),
                list(&differ)
            ));
        }
        let mut hint = String::from(
            "run every part (ckpt export ... --part I/N) to the end with the same \
             --max-shard-size, --dtype, --include and --exclude as this command",
        );
        if !foreign.is_empty() {
            hint.push_str(&format!(
                "; {} holds shards of another plan ({}): a part run with another \
                 --max-shard-size?",
                out.display(),
                list(&foreign)
            ));
        }
        return Err(CliError::error(msg).hint(hint));
    }
    if !foreign.is_empty() {
        tracing::warn!(files = %list(&foreign), "shards of another export are in the directory; the index does not name them");
    }
    let text = plan.index_json(&commit.run, commit.step)?;
    let path = out.join(INDEX_FILE);
    outfile::check_replaceable(&path)
        .map_err(|e| CliError::error(e.to_string()).hint("remove it, or choose another --out"))?;
    write_atomically(&path, false, 0, |mut file, tmp| async move {
        file.write(&text)
            .and_then(|()| file.finish())
            .map_err(|e| CliError::error(format!("writing {}: {e}", tmp.display())))?;
        Ok(((text.len() as u64, ReadStats::default()), file.into_file()))
    })
    .await?;
    sync_dir(out);
    Ok(INDEX_FILE.to_string())
}

/// `model-NNNNN-of-MMMMM.safetensors`.
fn is_shard_name(n: &str) -> bool {
    let Some(rest) = n
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let b = rest.as_bytes();
    b.len() == 14 && &rest[5..9] == "-of-" && b[..5].iter().chain(&b[9..]).all(u8::is_ascii_digit)
}

/// The first few of `items`, and how many more.
fn list(items: &[String]) -> String {
    const SHOWN: usize = 4;
    let mut s = items
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > SHOWN {
        s.push_str(&format!(" and {} more", items.len() - SHOWN));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_are_recognized() {
        assert!(is_shard_name("model-00001-of-00004.safetensors"));
        assert!(!is_shard_name("model.safetensors"));
        assert!(!is_shard_name("model-0001-of-00004.safetensors"));
        assert!(!is_shard_name("model-0000a-of-00004.safetensors"));
        assert!(!is_shard_name(".model-00001-of-00004.safetensors.partial"));
    }
}
