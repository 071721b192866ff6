//! A value axis: the range of the values, their pixels, round ticks and labels.

/// A y axis: maps values to pixels.
pub(super) struct Axis {
    pub(super) lo: f64,
    pub(super) hi: f64,
    pub(super) log: bool,
    pub(super) top: f32,
    pub(super) bottom: f32,
}

impl Axis {
    pub(super) fn new(vals: impl Iterator<Item = f64>, log: bool, top: f32, bottom: f32) -> Axis {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in vals.filter(|v| v.is_finite() && (!log || *v > 0.0)) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            (lo, hi) = if log { (0.1, 10.0) } else { (0.0, 1.0) };
        }
        if log {
            let (a, b) = (lo.log10().floor(), hi.log10().ceil());
            (lo, hi) = (10f64.powf(a), 10f64.powf(if b > a { b } else { a + 1.0 }));
        } else {
            if hi - lo < 1e-12 * hi.abs().max(1.0) {
                (lo, hi) = (lo - 0.5 * lo.abs().max(1.0), hi + 0.5 * hi.abs().max(1.0));
            }
            let pad = (hi - lo) * 0.06;
            (lo, hi) = (lo - pad, hi + pad);
        }
        Axis {
            lo,
            hi,
            log,
            top,
            bottom,
        }
    }
    pub(super) fn y(&self, v: f64) -> f32 {
        let f = if self.log {
            (v.max(1e-300).log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        self.bottom - (f as f32) * (self.bottom - self.top)
    }
    pub(super) fn ticks(&self) -> Vec<f64> {
        if self.log {
            let (a, b) = (
                self.lo.log10().round() as i32,
                self.hi.log10().round() as i32,
            );
            let mut t: Vec<f64> = (a..=b).map(|e| 10f64.powi(e)).collect();
            if b - a <= 1 {
                let extra: Vec<f64> = t.iter().flat_map(|x| [2.0 * x, 5.0 * x]).collect();
                t.extend(extra.into_iter().filter(|x| *x <= self.hi));
                t.sort_by(f64::total_cmp);
            }
            t
        } else {
            nice_ticks(self.lo, self.hi, 5)
        }
    }
}

/// About `n` round tick values covering `lo..hi` (1, 2, 2.5, 5 times a power of ten).
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater)
        || !lo.is_finite()
        || !hi.is_finite()
    {
        return vec![];
    }
    let raw = (hi - lo) / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let mut t = Vec::new();
    // k * step, rounded to the step's decimals so labels read 2.3, not 2.3000000000000003.
    let decimals = (-(step.log10().floor()) as i32 + 1).max(0);
    let scale = 10f64.powi(decimals);
    let (k0, k1) = ((lo / step).ceil() as i64, (hi / step + 1e-9).floor() as i64);
    for k in k0..=k1 {
        let v = ((k as f64 * step) * scale).round() / scale;
        t.push(if v == 0.0 { 0.0 } else { v });
    }
    t
}

/// Round steps for a time axis spanning `span` seconds, about `n` ticks.
pub fn time_step(span: f64, n: usize) -> f64 {
    const STEPS: [f64; 20] = [
        1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0,
        10800.0, 21600.0, 43200.0, 86400.0, 172800.0, 604800.0,
    ];
    let raw = span / n.max(1) as f64;
    STEPS
        .iter()
        .copied()
        .find(|s| *s >= raw)
        .unwrap_or_else(|| (raw / 604800.0).ceil() * 604800.0)
}

/// `0`, `45s`, `2m`, `1m30s`, `2h`, `1h30m`, `3d`, `1d12h`.
pub fn elapsed_label(secs: f64) -> String {
    let s = secs.round() as u64;
    if s == 0 {
        return "0".into();
    }
    let (d, h, m, sec) = (s / 86400, (s % 86400) / 3600, (s % 3600) / 60, s % 60);
    match (d, h, m, sec) {
        (0, 0, 0, sec) => format!("{sec}s"),
        (0, 0, m, 0) => format!("{m}m"),
        (0, 0, m, sec) => format!("{m}m{sec:02}s"),
        (0, h, 0, _) => format!("{h}h"),
        (0, h, m, _) => format!("{h}h{m:02}m"),
        (d, 0, _, _) => format!("{d}d"),
        (d, h, _, _) => format!("{d}d{h}h"),
    }
}

pub(super) fn value_label(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let a = v.abs();
    if !(1e-3..1e5).contains(&a) {
        // Three significant digits: 2.5e-4 must not read 3e-4.
        let e = format!("{v:.2e}");
        return match e.split_once('e') {
            Some((m, x)) if m.contains('.') => {
                format!("{}e{x}", m.trim_end_matches('0').trim_end_matches('.'))
            }
            _ => e,
        };
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}
