//! Human-readable figures and aligned tables.

use std::fmt::Write as _;

/// `1.50 GiB`, `512 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if v >= 100.0 {
        format!("{v:.0} {}", UNITS[u])
    } else if v >= 10.0 {
        format!("{v:.1} {}", UNITS[u])
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// A Unix-milliseconds time as RFC 3339 UTC (`2026-05-01T12:00:03Z`).
pub fn time_ms(ms: i64) -> String {
    use chrono::TimeZone;
    chrono::Utc.timestamp_millis_opt(ms).single().map_or_else(
        || "-".into(),
        |t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
    )
}

/// `512 MiB/s`.
pub fn rate(bytes_: u64, secs: f64) -> String {
    if secs <= 0.0 {
        return "-".into();
    }
    format!("{}/s", bytes((bytes_ as f64 / secs) as u64))
}

/// `3.2 s`, `4m 05s`, `2h 10m`, `3d 4h`.
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "-".into();
    }
    if secs < 10.0 {
        return format!("{secs:.1} s");
    }
    let s = secs.round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        3600..=86399 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86400, (s % 86400) / 3600),
    }
}

/// How long ago: `just now`, `5m ago`, `3h ago`, `12d ago`.
pub fn age(secs: f64) -> String {
    if !secs.is_finite() {
        return "-".into();
    }
    if secs < 0.0 {
        return "in the future".into();
    }
    let s = secs as u64;
    match s {
        0..=9 => "just now".into(),
        10..=59 => format!("{s}s ago"),
        60..=3599 => format!("{}m ago", s / 60),
        3600..=86399 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

/// A name as it may be shown on a terminal: control characters and quotes escaped, so a
/// hostile tensor name cannot move the cursor or fake output.
pub fn name(s: &str) -> String {
    if s.chars()
        .all(|c| !c.is_control() && c != '"' && c != '\\' && !is_bidi(c))
    {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() || is_bidi(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

fn is_bidi(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

/// A shape: `[4096, 1024]`, `[]` for a scalar.
pub fn shape(s: &[u64]) -> String {
    let parts: Vec<String> = s.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

/// Step numbers as compact ranges: `1-5, 8, 10-12`.
pub fn ranges(steps: &[u64]) -> String {
    let mut v = steps.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        if j > i {
            out.push(format!("{}-{}", v[i], v[j]));
        } else {
            out.push(v[i].to_string());
        }
        i = j + 1;
    }
    out.join(", ")
}

/// Column alignment of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers.
    Right,
}

/// A plain text table with a header row, columns padded to their widest cell.
#[derive(Debug, Clone)]
pub struct Table {
    header: Vec<(String, Align)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these columns.
    pub fn new(cols: &[(&str, Align)]) -> Self {
        Table {
            header: cols.iter().map(|(h, a)| (h.to_string(), *a)).collect(),
            rows: Vec::new(),
        }
    }

    /// Add a row (missing cells are blank).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as lines of text.
    pub fn render(&self) -> String {
        let n = self.header.len();
        let mut w: Vec<usize> = self.header.iter().map(|(h, _)| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(n) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        let line = |cells: Vec<&str>, out: &mut String| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let pad = w[i].saturating_sub(c.chars().count());
                let last = i + 1 == n;
                match self.header[i].1 {
                    Align::Left if last => s.push_str(c),
                    Align::Left => {
                        s.push_str(c);
                        s.extend(std::iter::repeat_n(' ', pad));
                    }
                    Align::Right => {
                        s.extend(std::iter::repeat_n(' ', pad));
                        s.push_str(c);
                    }
                }
                if !last {
                    s.push_str("  ");
                }
            }
            out.push_str(s.trim_end());
            out.push('\n');
        };
        line(
            self.header.iter().map(|(h, _)| h.as_str()).collect(),
            &mut out,
        );
        for r in &self.rows {
            let cells: Vec<&str> = (0..n)
                .map(|i| r.get(i).map_or("", String::as_str))
                .collect();
            line(cells, &mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_times() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(2 << 30), "2.00 GiB");
        assert_eq!(bytes(150 << 20), "150 MiB");
        assert_eq!(rate(1 << 30, 2.0), "512 MiB/s");
        assert_eq!(duration(3.25), "3.2 s");
        assert_eq!(duration(125.0), "2m 05s");
        assert_eq!(duration(7300.0), "2h 01m");
        assert_eq!(age(5.0), "just now");
        assert_eq!(age(7200.0), "2h ago");
        assert_eq!(ranges(&[5, 1, 2, 3, 8, 10, 11]), "1-3, 5, 8, 10-11");
    }

    #[test]
    fn hostile_names_are_escaped() {
        assert_eq!(name("layers.0.w"), "layers.0.w");
        assert_eq!(name("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(name("x\ny"), "x\\u{a}y");
        assert_eq!(name("evil\u{202e}gnp"), "evil\\u{202e}gnp");
        assert_eq!(name("../a/b"), "../a/b");
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(&[("name", Align::Left), ("size", Align::Right)]);
        t.row(vec!["a".into(), "1 B".into()]);
        t.row(vec!["long".into(), "10 KiB".into()]);
        assert_eq!(t.render(), "name    size\na        1 B\nlong  10 KiB\n");
    }
}
