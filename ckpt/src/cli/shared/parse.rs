//! Parsing what people type: `RUN@STEP`, sizes (`2GiB`, `500MB`), durations (`90s`, `1h`),
//! name patterns (`layers.*.weight`). No I/O: resolving a name against a store is
//! [`super::store::resolve`].

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use ckpt_store::validate_run;

use super::error::CliError;

/// Which step of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSel {
    /// The newest committed step.
    Latest,
    /// This step.
    Step(u64),
}

/// A checkpoint name: `RUN@STEP`, `RUN@latest` or `RUN`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CkptRef {
    /// The run.
    pub run: String,
    /// The step.
    pub step: StepSel,
}

impl CkptRef {
    /// A fixed step.
    pub fn at(run: &str, step: u64) -> Self {
        CkptRef {
            run: run.into(),
            step: StepSel::Step(step),
        }
    }

    /// The newest committed step of `run`.
    pub fn latest(run: &str) -> Self {
        CkptRef {
            run: run.into(),
            step: StepSel::Latest,
        }
    }
}

impl FromStr for CkptRef {
    type Err = CliError;
    fn from_str(s: &str) -> Result<Self, CliError> {
        let (run, step) = match s.split_once('@') {
            Some((r, st)) => (r, Some(st)),
            None => (s, None),
        };
        validate_run(run).map_err(|e| CliError::usage(format!("checkpoint {s:?}: {e}")))?;
        let step = match step {
            None | Some("latest") => StepSel::Latest,
            Some(n) => StepSel::Step(n.parse().map_err(|_| {
                CliError::usage(format!(
                    "checkpoint {s:?}: step {n:?} is not a number; write RUN@STEP, RUN@latest or RUN"
                ))
            })?),
        };
        Ok(CkptRef {
            run: run.into(),
            step,
        })
    }
}

impl fmt::Display for CkptRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.step {
            StepSel::Latest => write!(f, "{}@latest", self.run),
            StepSel::Step(s) => write!(f, "{}@{s}", self.run),
        }
    }
}

/// clap value parser for [`CkptRef`].
pub fn ckpt_ref(s: &str) -> Result<CkptRef, String> {
    s.parse().map_err(|e: CliError| e.message().to_string())
}

/// A size: `4096`, `64KiB`, `1.5GB`, `2G` (K/M/G/T; `B` optional; `KB` = 1000, `KiB` and `K`
/// = 1024).
pub fn size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("size {s:?}: expected a number with an optional unit like 2GiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        u => {
            return Err(format!(
                "size {s:?}: unknown unit {u:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ));
        }
    };
    let n = v * mult;
    if !n.is_finite() || n < 0.0 || n > u64::MAX as f64 {
        return Err(format!("size {s:?} is out of range"));
    }
    Ok(n.round() as u64)
}

/// A duration: `0`, `90s`, `15m`, `1h30m`, `2d`, `500ms`.
pub fn duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = 0f64;
    let mut rest = t;
    if rest.is_empty() {
        return Err("empty duration: write e.g. 90s, 15m, 1h, 2d".into());
    }
    while !rest.is_empty() {
        let n_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(n_end);
        let u_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(u_end);
        let v: f64 = num
            .parse()
            .map_err(|_| format!("duration {s:?}: expected e.g. 90s, 15m, 1h30m, 2d"))?;
        let mult = match unit.trim() {
            "ms" => 0.001,
            "s" | "sec" | "secs" => 1.0,
            "m" | "min" | "mins" => 60.0,
            "h" | "hr" | "hours" => 3600.0,
            "d" | "days" => 86400.0,
            "" => {
                return Err(format!(
                    "duration {s:?}: give a unit (ms, s, m, h, d), e.g. {num}s"
                ));
            }
            u => {
                return Err(format!(
                    "duration {s:?}: unknown unit {u:?} (ms, s, m, h, d)"
                ));
            }
        };
        total += v * mult;
        rest = tail;
    }
    Duration::try_from_secs_f64(total).map_err(|_| format!("duration {s:?} is out of range"))
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters (including none)
/// and `?` any one character; everything else matches itself.
pub fn glob(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    let (mut pi, mut ni) = (0usize, 0usize);
    let (mut star, mut mark) = (None::<usize>, 0usize);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

/// Whether a tensor is selected by `--include` (none = all) and not by `--exclude`.
pub fn selected(name: &str, include: &[String], exclude: &[String]) -> bool {
    (include.is_empty() || include.iter().any(|p| glob(p, name)))
        && !exclude.iter().any(|p| glob(p, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs() {
        assert_eq!("a@5".parse::<CkptRef>().unwrap(), CkptRef::at("a", 5));
        assert_eq!("a".parse::<CkptRef>().unwrap(), CkptRef::latest("a"));
        assert_eq!("a@latest".parse::<CkptRef>().unwrap(), CkptRef::latest("a"));
        for bad in ["", "a@", "a@x", "a@-1", "../a@1", "a b@1"] {
            let e = bad.parse::<CkptRef>().unwrap_err();
            assert_eq!(e.exit_code(), 2, "{bad}: {e}");
        }
        assert_eq!(CkptRef::at("r", 7).to_string(), "r@7");
    }

    #[test]
    fn sizes() {
        assert_eq!(size("4096").unwrap(), 4096);
        assert_eq!(size("64KiB").unwrap(), 65536);
        assert_eq!(size("2G").unwrap(), 2 << 30);
        assert_eq!(size("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(size("5GB").unwrap(), 5_000_000_000);
        assert!(size("5XB").is_err());
        assert!(size("lots").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(duration("0").unwrap(), Duration::ZERO);
        assert_eq!(duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(duration("2d").unwrap(), Duration::from_secs(172800));
        assert_eq!(duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(duration("10").is_err());
        assert!(duration("3y").is_err());
    }

    #[test]
    fn globs() {
        assert!(glob("*", "anything"));
        assert!(glob("layers.*.weight", "layers.10.weight"));
        assert!(!glob("layers.*.weight", "layers.10.bias"));
        assert!(glob("a?c", "abc"));
        assert!(glob("*exp_avg*", "opt.exp_avg.l0"));
        assert!(!glob("exp_avg", "opt.exp_avg"));
        assert!(selected("w", &[], &[]));
        assert!(!selected("opt.m", &[], &["opt.*".into()]));
        assert!(selected("w", &["w".into()], &["opt.*".into()]));
    }
}
